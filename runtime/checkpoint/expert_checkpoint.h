// The one place that spells a checkpoint's keys: a typed view over a safetensors file holding
// every logical expert's SwiGLU weights (the layout runtime/checkpoint/synthetic.h writes):
//
//   tensors   experts.<e>.w_gate_up  BF16 [2 d_ff, d]
//             experts.<e>.w_down     BF16 [d, d_ff]
//   metadata  checkpoint (the version), num_experts, d, d_ff, seed, digest.<e> (hex SHA-256
//             over both of expert e's tensors: the manifest's parameter digest)
//
// Everything else (rankd, the rank agent, moectl, the placement builders) reads through here.
#ifndef MOE_RUNTIME_CHECKPOINT_EXPERT_CHECKPOINT_H_
#define MOE_RUNTIME_CHECKPOINT_EXPERT_CHECKPOINT_H_

#include <string>

#include "absl/status/statusor.h"

#include "runtime/checkpoint/safetensors.h"

namespace moe {

struct ExpertShape {
  int num_experts = 0;
  int d = 0;
  int d_ff = 0;
};

namespace checkpoint_keys {
inline constexpr char kVersion[] = "checkpoint";
inline constexpr char kNumExperts[] = "num_experts";
inline constexpr char kD[] = "d";
inline constexpr char kDff[] = "d_ff";
inline constexpr char kSeed[] = "seed";
std::string GateUp(int expert);  // "experts.<e>.w_gate_up"
std::string Down(int expert);    // "experts.<e>.w_down"
std::string Digest(int expert);  // "digest.<e>"
}  // namespace checkpoint_keys

class ExpertCheckpoint {
 public:
  // DATA_LOSS naming the key when the version is missing or num_experts, d or d_ff is missing
  // or not a positive integer. `file` must outlive the view.
  static absl::StatusOr<ExpertCheckpoint> Open(const SafetensorsFile& file);

  const std::string& version() const { return version_; }
  const ExpertShape& shape() const { return shape_; }
  int num_experts() const { return shape_.num_experts; }
  int d() const { return shape_.d; }
  int d_ff() const { return shape_.d_ff; }
  const SafetensorsFile& file() const { return *file_; }

  // Expert e's digest. FAILED_PRECONDITION naming the expert when it has none.
  absl::StatusOr<std::string> Digest(int expert) const;
  struct Tensors {
    const TensorBlob* gate_up;  // [2 d_ff, d]
    const TensorBlob* down;     // [d, d_ff]
  };
  // Expert e's tensors. FAILED_PRECONDITION naming the expert when either is absent or its byte
  // size is not the shape's.
  absl::StatusOr<Tensors> Expert(int expert) const;

 private:
  const SafetensorsFile* file_ = nullptr;
  std::string version_;
  ExpertShape shape_;
};

}  // namespace moe

#endif  // MOE_RUNTIME_CHECKPOINT_EXPERT_CHECKPOINT_H_
