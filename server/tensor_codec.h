// Proto tensors <-> BF16 rows, with the checks the API promises: INVALID_ARGUMENT naming the
// field when the shape is negative, its byte count overflows, the bytes do not match dtype x
// shape, or a value is NaN or infinite (in every dtype alike).
#ifndef MOE_SERVER_TENSOR_CODEC_H_
#define MOE_SERVER_TENSOR_CODEC_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"

#include "proto/moe/v1/expert_layer.pb.h"

namespace moe {

// Bytes per element of a wire dtype (0 for an unsupported one).
int WireWidth(v1::DType dtype);
// rows x cols x width of `t`, computed with overflow checks; INVALID_ARGUMENT naming `field` for
// a negative or empty shape, an unsupported dtype or a product beyond 64 bits.
absl::StatusOr<int64_t> WireBytes(const v1::Tensor& t, const char* field);
// INVALID_ARGUMENT naming `field`.data[i] for the first NaN or infinite value of `n` BF16 values.
absl::Status CheckFiniteBf16(const uint16_t* rows, int64_t n, const char* field);

// CheckFiniteBf16 on worker threads beside the caller: Start splits the rows over the pool and
// returns at once; Await returns what CheckFiniteBf16 would (the same message). A step ring's
// prefill rows are checked while the executor validates and plans the step (its first phases).
// Thread-safe; checks started by several callers share the workers.
class FiniteCheckPool {
 public:
  explicit FiniteCheckPool(int threads);
  ~FiniteCheckPool();  // waits for the workers (every started check must have been awaited)

  class Check {
   public:
    // Blocks until every part is checked; idempotent. The rows must stay valid until it returns.
    absl::Status Await();

   private:
    friend class FiniteCheckPool;
    absl::Mutex mu_;
    int pending_ ABSL_GUARDED_BY(mu_) = 0;
    bool bad_ ABSL_GUARDED_BY(mu_) = false;
    const uint16_t* rows_ = nullptr;
    int64_t n_ = 0;
    const char* field_ = "";
  };
  // Rows under kMinValues are checked here, in the caller (their Check is already done).
  std::shared_ptr<Check> Start(const uint16_t* rows, int64_t n, const char* field);
  static constexpr int64_t kMinValues = int64_t{1} << 18;

 private:
  void Work();
  struct Part {
    std::shared_ptr<Check> check;
    int64_t begin, end;
  };
  absl::Mutex mu_;
  std::deque<Part> parts_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

// Rows described by `t` (dtype, rows, cols) whose bytes are `data` (t.data() or a shared region).
absl::StatusOr<std::vector<uint16_t>> DecodeToBf16(const v1::Tensor& t, const char* data, size_t size,
                                                   const char* field);
inline absl::StatusOr<std::vector<uint16_t>> DecodeToBf16(const v1::Tensor& t, const char* field) {
  return DecodeToBf16(t, t.data().data(), t.data().size(), field);
}

// The same rows for a reader that only needs them while `data` lives: a view of the wire bytes
// when they already are BF16 (2-byte aligned), else a converted copy it owns. A prefill step's
// megabyte of rows is then not copied (nor its pages faulted in) before the executor reads it.
class Bf16Rows {
 public:
  const uint16_t* data() const { return view_ != nullptr ? view_ : owned_.data(); }
  bool is_view() const { return view_ != nullptr; }

 private:
  friend absl::StatusOr<Bf16Rows> ReadBf16(const v1::Tensor& t, const char* data, size_t size, const char* field);
  const uint16_t* view_ = nullptr;
  std::vector<uint16_t> owned_;
};
absl::StatusOr<Bf16Rows> ReadBf16(const v1::Tensor& t, const char* data, size_t size, const char* field);
// Writes rows as `dtype` into `out` (rows * d * width bytes).
void EncodeBytes(absl::Span<const uint16_t> rows, v1::DType dtype, char* out);
void EncodeFromBf16(absl::Span<const uint16_t> rows, int64_t n, int64_t d, v1::DType dtype, v1::Tensor* out);

}  // namespace moe

#endif  // MOE_SERVER_TENSOR_CODEC_H_
