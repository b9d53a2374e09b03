// A safetensors file mapped read-only (mmap): the header is parsed and checked, the tensor
// bytes stay in the page cache until a caller copies what it needs. A rank reads only its own
// experts out of a checkpoint shard this way, never the whole file into its heap.
//
// Thread-safety: immutable after Open; safe to read from any thread.
#ifndef MOE_RUNTIME_CHECKPOINT_MAPPED_SAFETENSORS_H_
#define MOE_RUNTIME_CHECKPOINT_MAPPED_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moe {

// Bytes per element of a safetensors dtype ("BF16", "F32", "F8_E4M3", ...); 0 when unknown.
int SafetensorsDtypeWidth(const std::string& dtype);

struct TensorRef {
  std::string dtype;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // inside the mapping
  uint64_t bytes = 0;
  int64_t elements() const;
};

class MappedSafetensors {
 public:
  // NOT_FOUND when the file cannot be opened, FAILED_PRECONDITION when it is no regular file
  // (a device or FIFO); DATA_LOSS naming the file (and the tensor) when
  // the header is malformed: length past the end, offsets outside the data or overlapping a
  // neighbour's, a shape whose element count overflows or does not match the bytes.
  // A header past kMaxHeaderBytes is refused as DATA_LOSS too (its JSON tree would cost many
  // times its length in memory).
  static absl::StatusOr<std::unique_ptr<MappedSafetensors>> Open(const std::string& path);
  static constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;
  ~MappedSafetensors();
  MappedSafetensors(const MappedSafetensors&) = delete;
  MappedSafetensors& operator=(const MappedSafetensors&) = delete;

  const std::string& path() const { return path_; }
  uint64_t file_bytes() const { return size_; }
  const TensorRef* Find(const std::string& name) const;
  const std::map<std::string, TensorRef>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // DATA_LOSS naming the file when it is now shorter than when it was opened (truncated or
  // rewritten in place): a read of the mapping past its new end would raise SIGBUS and end the
  // process. Readers call it before they read a tensor (a file replaced by rename keeps the
  // mapped one intact). It cannot stop a truncation during the read itself.
  absl::Status CheckIntact() const;
  // Tells the kernel the caller is done with [data, data + bytes) of a tensor (MADV_DONTNEED on
  // the whole pages inside it), so a long load does not keep every shard's pages resident.
  void Release(const TensorRef& t) const;
  // Asks the kernel to read a tensor's pages ahead (MADV_WILLNEED) before the caller copies it.
  void Prefetch(const TensorRef& t) const;

 private:
  MappedSafetensors() = default;
  std::string path_;
  const uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  int fd_ = -1;  // kept open for CheckIntact
  std::map<std::string, TensorRef> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace moe

#endif  // MOE_RUNTIME_CHECKPOINT_MAPPED_SAFETENSORS_H_
