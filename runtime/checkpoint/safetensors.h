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

// Writes `path` beside itself (`path`.tmp) and renames it into place: a reader that has the old
// file mapped keeps reading it intact.
absl::Status WriteSafetensors(const std::string& path, const SafetensorsFile& file);
// The whole file in memory, with MappedSafetensors::Open's checks: a regular file, the header a JSON
// object, offsets inside the data and not overlapping, sizes = prod(shape) * dtype width without
// overflow, string metadata (DATA_LOSS naming the file and the tensor).
absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path);

}  // namespace moe

#endif  // MOE_RUNTIME_CHECKPOINT_SAFETENSORS_H_
