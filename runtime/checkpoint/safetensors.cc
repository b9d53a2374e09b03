#include "runtime/checkpoint/safetensors.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace moe {
namespace {
int DtypeWidth(const std::string& dtype) {
  if (dtype == "BF16" || dtype == "F16" || dtype == "I16") return 2;
  if (dtype == "F32" || dtype == "I32") return 4;
  if (dtype == "F64" || dtype == "I64") return 8;
  if (dtype == "U8" || dtype == "I8" || dtype == "F8_E4M3" || dtype == "BOOL") return 1;
  return 0;
}
}  // namespace

absl::Status WriteSafetensors(const std::string& path, const SafetensorsFile& file) {
  nlohmann::ordered_json header;
  if (!file.metadata.empty()) header["__metadata__"] = file.metadata;
  uint64_t offset = 0;
  for (const auto& [name, t] : file.tensors) {
    int64_t n = 1;
    for (int64_t dim : t.shape) n *= dim;
    if (DtypeWidth(t.dtype) == 0 || static_cast<uint64_t>(n) * DtypeWidth(t.dtype) != t.data.size()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", name, ": data does not match dtype and shape"));
    }
    header[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  std::string text = header.dump();
  while (text.size() % 8 != 0) text.push_back(' ');  // align the data section
  std::ofstream out(path, std::ios::binary);
  if (!out) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot open for writing"));
  const uint64_t len = text.size();
  char lenbuf[8];
  for (int i = 0; i < 8; ++i) lenbuf[i] = static_cast<char>((len >> (8 * i)) & 0xff);
  out.write(lenbuf, 8);
  out.write(text.data(), text.size());
  for (const auto& [name, t] : file.tensors) out.write(t.data.data(), t.data.size());
  if (!out) return absl::DataLossError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string bytes = ss.str();
  if (bytes.size() < 8) return absl::DataLossError(absl::StrCat(path, ": shorter than the header length"));
  uint64_t len = 0;
  for (int i = 0; i < 8; ++i) len |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
  if (len > bytes.size() - 8) return absl::DataLossError(absl::StrCat(path, ": header length past the end of file"));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.substr(8, len));
  } catch (const nlohmann::json::exception& e) {
    return absl::DataLossError(absl::StrCat(path, ": malformed header: ", e.what()));
  }
  const uint64_t data_start = 8 + len;
  const uint64_t data_size = bytes.size() - data_start;
  SafetensorsFile file;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      for (auto m = it.value().begin(); m != it.value().end(); ++m)
        file.metadata[m.key()] = m.value().get<std::string>();
      continue;
    }
    const auto& v = it.value();
    TensorBlob t;
    try {
      t.dtype = v.at("dtype").get<std::string>();
      t.shape = v.at("shape").get<std::vector<int64_t>>();
      const auto off = v.at("data_offsets").get<std::vector<uint64_t>>();
      if (off.size() != 2 || off[0] > off[1] || off[1] > data_size) {
        return absl::DataLossError(absl::StrCat(path, ": tensor ", it.key(), ": data_offsets outside the data"));
      }
      int64_t n = 1;
      for (int64_t dim : t.shape) n *= dim;
      if (DtypeWidth(t.dtype) == 0 || static_cast<uint64_t>(n) * DtypeWidth(t.dtype) != off[1] - off[0]) {
        return absl::DataLossError(absl::StrCat(path, ": tensor ", it.key(), ": ", off[1] - off[0],
                                                " bytes do not match ", t.dtype, " of its shape"));
      }
      t.data = bytes.substr(data_start + off[0], off[1] - off[0]);
    } catch (const nlohmann::json::exception& e) {
      return absl::DataLossError(absl::StrCat(path, ": tensor ", it.key(), ": ", e.what()));
    }
    file.tensors[it.key()] = std::move(t);
  }
  return file;
}

}  // namespace moe
