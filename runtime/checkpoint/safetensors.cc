#include "runtime/checkpoint/safetensors.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

#include "runtime/checkpoint/mapped_safetensors.h"
#include "runtime/status.h"

namespace moe {
absl::Status WriteSafetensors(const std::string& path, const SafetensorsFile& file) {
  nlohmann::ordered_json header;
  if (!file.metadata.empty()) header["__metadata__"] = file.metadata;
  uint64_t offset = 0;
  for (const auto& [name, t] : file.tensors) {
    uint64_t n = static_cast<uint64_t>(SafetensorsDtypeWidth(t.dtype));
    bool overflow = false;
    for (int64_t dim : t.shape)
      overflow = overflow || dim < 0 || __builtin_mul_overflow(n, static_cast<uint64_t>(dim), &n);
    if (n == 0 || overflow || n != t.data.size()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", name, ": data does not match dtype and shape"));
    }
    header[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  std::string text = header.dump();
  while (text.size() % 8 != 0) text.push_back(' ');  // align the data section
  // Written beside the file and renamed over it: a rank that has the old file mapped keeps
  // reading it intact (truncating it in place would fault the rank's reads).
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return absl::PermissionDeniedError(absl::StrCat(tmp, ": cannot open for writing"));
    const uint64_t len = text.size();
    char lenbuf[8];
    for (int i = 0; i < 8; ++i) lenbuf[i] = static_cast<char>((len >> (8 * i)) & 0xff);
    out.write(lenbuf, 8);
    out.write(text.data(), text.size());
    for (const auto& [name, t] : file.tensors) out.write(t.data.data(), t.data.size());
    out.close();
    if (!out) {
      std::remove(tmp.c_str());
      return absl::DataLossError(absl::StrCat(path, ": write failed"));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    return absl::PermissionDeniedError(absl::StrCat(path, ": rename failed: ", std::strerror(err)));
  }
  return absl::OkStatus();
}

absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path) {
  // One parser for both readers: the mapped file's header checks (regular file, offsets inside
  // the data and not overlapping, checked shape products, string metadata), then a copy.
  ASSIGN_OR_RETURN(std::unique_ptr<MappedSafetensors> mapped, MappedSafetensors::Open(path));
  SafetensorsFile file;
  file.metadata = mapped->metadata();
  for (const auto& [name, t] : mapped->tensors()) {
    TensorBlob& b = file.tensors[name];
    b.dtype = t.dtype;
    b.shape = t.shape;
    b.data.assign(reinterpret_cast<const char*>(t.data), t.bytes);
  }
  return file;
}

}  // namespace moe
