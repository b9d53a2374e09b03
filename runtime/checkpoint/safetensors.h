// safetensors files (the ecosystem's checkpoint format): 8-byte little-endian header length,
// a JSON header {name: {dtype, shape, data_offsets: [begin, end)}, "__metadata__": {...}},
// then the raw little-endian tensor bytes. Read and written by the project; no library.
#ifndef MOE_RUNTIME_CHECKPOINT_SAFETENSORS_H_
#define MOE_RUNTIME_CHECKPOINT_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moe {

struct TensorBlob {
  std::string dtype;  // "BF16", "F32", ...
  std::vector<int64_t> shape;
  std::string data;  // raw bytes
};

struct SafetensorsFile {
  std::map<std::string, TensorBlob> tensors;
  std::map<std::string, std::string> metadata;
};

absl::Status WriteSafetensors(const std::string& path, const SafetensorsFile& file);
// Validates the header: offsets inside the file, contiguous, sizes = prod(shape) * dtype width.
absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path);

}  // namespace moe

#endif  // MOE_RUNTIME_CHECKPOINT_SAFETENSORS_H_
