#include "runtime/checkpoint/hf_checkpoint.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

#include "kernels/numeric.h"
#include "runtime/checkpoint/sha256.h"
#include "runtime/status.h"

namespace moe {

const char* ExpertNamingName(ExpertNaming naming) {
  switch (naming) {
    case ExpertNaming::kMixtral:
      return "mixtral";
    case ExpertNaming::kProjections:
      return "projections";
    case ExpertNaming::kFused:
      return "fused";
  }
  return "unknown";
}

std::string ExpertDigest(const uint16_t* gate_up, size_t gate_up_elems, const uint16_t* down, size_t down_elems) {
  Sha256Hex h;
  h.Update(gate_up, gate_up_elems * 2);
  h.Update(down, down_elems * 2);
  return h.Finish();
}

namespace {

using nlohmann::json;

absl::StatusOr<std::string> ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool Exists(const std::string& path) { return std::ifstream(path).good(); }

std::string LayerPrefix(int64_t layer) { return absl::StrCat("model.layers.", layer, "."); }

// The three matrices of one expert under a per-expert naming: gate, up, down.
std::array<std::string, 3> ExpertNames(ExpertNaming naming, int64_t layer, int expert) {
  const std::string p = LayerPrefix(layer);
  if (naming == ExpertNaming::kMixtral) {
    const std::string e = absl::StrCat(p, "block_sparse_moe.experts.", expert, ".");
    return {e + "w1.weight", e + "w3.weight", e + "w2.weight"};
  }
  const std::string e = absl::StrCat(p, "mlp.experts.", expert, ".");
  return {e + "gate_proj.weight", e + "up_proj.weight", e + "down_proj.weight"};
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) absl::StrAppend(&s, i ? ", " : "", shape[i]);
  return s + "]";
}

// Converts `n` elements of a BF16 / F16 / F32 source to BF16.
void ToBf16(const std::string& dtype, const uint8_t* src, int64_t n, uint16_t* out) {
  if (dtype == "BF16") {
    std::memcpy(out, src, static_cast<size_t>(n) * 2);
  } else if (dtype == "F32") {
    for (int64_t i = 0; i < n; ++i) {
      float f;
      std::memcpy(&f, src + 4 * i, 4);
      out[i] = kernels::FloatToBf16(f);
    }
  } else {  // F16
    for (int64_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      const uint32_t sign = (h & 0x8000u) << 16;
      uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
      if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
      } else if (exp == 0) {
        if (man == 0) {
          bits = sign;
        } else {  // subnormal: normalize
          int e = -1;
          do {
            ++e;
            man <<= 1;
          } while ((man & 0x400) == 0);
          bits = sign | ((127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
      } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
      }
      float f;
      std::memcpy(&f, &bits, 4);
      out[i] = kernels::FloatToBf16(f);
    }
  }
}

bool Convertible(const std::string& dtype) { return dtype == "BF16" || dtype == "F16" || dtype == "F32"; }

}  // namespace

absl::StatusOr<std::unique_ptr<HfCheckpoint>> HfCheckpoint::Open(const std::string& dir) {
  std::unique_ptr<HfCheckpoint> c(new HfCheckpoint());
  c->dir_ = dir;
  ASSIGN_OR_RETURN(const std::string config_text, ReadText(dir + "/config.json"));
  auto config = ParseHfMoeConfig(config_text);
  if (!config.ok()) {
    return absl::Status(config.status().code(), absl::StrCat(dir, "/", config.status().message()));
  }
  c->config_ = *std::move(config);
  c->layers_.assign(c->config_.moe_layers.begin(), c->config_.moe_layers.end());
  RETURN_IF_ERROR(c->OpenShards());
  RETURN_IF_ERROR(c->DetectNaming());
  RETURN_IF_ERROR(c->ReadSidecar());
  if (c->version_.empty()) {
    Sha256Hex h;
    h.Update(config_text.data(), config_text.size());
    h.Update(c->index_text_.data(), c->index_text_.size());
    c->version_ = "sha256:" + h.Finish().substr(0, 16);
  }
  return c;
}

absl::Status HfCheckpoint::OpenShards() {
  const std::string index_path = dir_ + "/model.safetensors.index.json";
  std::vector<std::string> files;
  std::map<std::string, std::string> weight_map;
  if (Exists(index_path)) {
    ASSIGN_OR_RETURN(index_text_, ReadText(index_path));
    try {
      const json index = json::parse(index_text_);
      for (auto it = index.at("weight_map").begin(); it != index.at("weight_map").end(); ++it) {
        const std::string file = it.value().get<std::string>();
        if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..") {
          return absl::InvalidArgumentError(absl::StrCat(index_path, ": weight_map['", it.key(), "'] names '", file,
                                                         "', not a file in the directory"));
        }
        weight_map[it.key()] = file;
        if (std::find(files.begin(), files.end(), file) == files.end()) files.push_back(file);
      }
    } catch (const json::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": weight_map: ", e.what()));
    }
    std::sort(files.begin(), files.end());
  } else {
    files.push_back("model.safetensors");
  }
  for (const std::string& file : files) {
    ASSIGN_OR_RETURN(std::unique_ptr<MappedSafetensors> shard, MappedSafetensors::Open(dir_ + "/" + file));
    const int idx = static_cast<int>(shards_.size());
    for (const auto& [name, t] : shard->tensors()) {
      auto listed = weight_map.find(name);
      if (!weight_map.empty() && (listed == weight_map.end() || listed->second != file)) continue;
      if (!tensor_shard_.emplace(name, idx).second) {
        return absl::DataLossError(absl::StrCat(dir_, ": tensor ", name, " is in more than one shard"));
      }
    }
    shards_.push_back(std::move(shard));
  }
  for (const auto& [name, file] : weight_map) {
    if (tensor_shard_.count(name) == 0) {
      return absl::DataLossError(absl::StrCat(index_path, ": ", name, " is listed in ", file, " but not stored there"));
    }
  }
  return absl::OkStatus();
}

namespace {

// A tensor must hold exactly `factors`' product of elements (checked products): the config's sizes
// are then bounded by the files' bytes before anything is allocated from them.
absl::Status ElementsMatch(const std::string& dir, const std::string& name, const TensorRef& t,
                           std::initializer_list<int64_t> factors, const char* expected) {
  int64_t want = 1;
  for (int64_t f : factors) {
    if (__builtin_mul_overflow(want, f, &want)) want = -1;
    if (want < 0) break;
  }
  if (want < 0 || t.elements() != want) {
    return absl::FailedPreconditionError(absl::StrCat(dir, ": ", name, " holds ", t.elements(),
                                                      " elements; config.json's sizes give ", expected, " = ",
                                                      want < 0 ? std::string("(overflow)") : absl::StrCat(want)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status HfCheckpoint::DetectNaming() {
  const int layer = config_.moe_layers.front();
  const MappedSafetensors* shard = nullptr;
  const int64_t d = config_.hidden_size, f = config_.moe_intermediate_size, e = config_.num_experts;
  for (ExpertNaming n : {ExpertNaming::kMixtral, ExpertNaming::kProjections}) {
    const TensorRef* gate = Tensor(ExpertNames(n, layer, 0)[0], &shard);
    if (gate != nullptr) {
      naming_ = n;
      weight_dtype_ = gate->dtype;
      expert_source_bytes_ = 0;
      for (const std::string& name : ExpertNames(n, layer, 0)) {
        const TensorRef* t = Tensor(name, &shard);
        if (t != nullptr) RETURN_IF_ERROR(ElementsMatch(dir_, name, *t, {d, f}, "hidden_size x intermediate size"));
        if (t != nullptr) expert_source_bytes_ += static_cast<int64_t>(t->bytes);
        const TensorRef* s = Tensor(name + "_scale_inv", &shard);
        if (s != nullptr) expert_source_bytes_ += static_cast<int64_t>(s->bytes);
      }
      return absl::OkStatus();
    }
  }
  for (const char* prefix : {"mlp", "block_sparse_moe"}) {
    const TensorRef* gu = Tensor(absl::StrCat(LayerPrefix(layer), prefix, ".experts.gate_up_proj"), &shard);
    const TensorRef* dn = Tensor(absl::StrCat(LayerPrefix(layer), prefix, ".experts.down_proj"), &shard);
    if (gu != nullptr && dn != nullptr) {
      RETURN_IF_ERROR(ElementsMatch(dir_, absl::StrCat(LayerPrefix(layer), prefix, ".experts.gate_up_proj"), *gu,
                                    {e, 2, f, d}, "experts x 2 x intermediate size x hidden_size"));
      RETURN_IF_ERROR(ElementsMatch(dir_, absl::StrCat(LayerPrefix(layer), prefix, ".experts.down_proj"), *dn,
                                    {e, f, d}, "experts x intermediate size x hidden_size"));
      naming_ = ExpertNaming::kFused;
      fused_prefix_ = prefix;
      weight_dtype_ = gu->dtype;
      expert_source_bytes_ = static_cast<int64_t>((gu->bytes + dn->bytes) / std::max(1, config_.num_experts));
      return absl::OkStatus();
    }
  }
  return absl::FailedPreconditionError(absl::StrCat(
      dir_, ": MoE layer ", layer, " holds no routed experts under any known naming (looked for ",
      ExpertNames(ExpertNaming::kMixtral, layer, 0)[0], ", ", ExpertNames(ExpertNaming::kProjections, layer, 0)[0],
      ", ", LayerPrefix(layer), "mlp.experts.gate_up_proj)"));
}

absl::Status HfCheckpoint::ReadSidecar() {
  const std::string path = absl::StrCat(dir_, "/", kCheckpointSidecar);
  if (!Exists(path)) return absl::OkStatus();
  ASSIGN_OR_RETURN(const std::string text, ReadText(path));
  try {
    const json j = json::parse(text);
    version_ = j.value("version", "");
    if (j.contains("digests")) {
      for (auto it = j.at("digests").begin(); it != j.at("digests").end(); ++it) {
        int layer = 0;
        if (!absl::SimpleAtoi(it.key(), &layer) || !IsMoeLayer(layer)) {
          return absl::InvalidArgumentError(absl::StrCat(path, ": digests: '", it.key(), "' is not a MoE layer"));
        }
        const auto digests = it.value().get<std::vector<std::string>>();
        if (static_cast<int>(digests.size()) != config_.num_experts) {
          return absl::InvalidArgumentError(absl::StrCat(path, ": digests[", layer, "]: ", digests.size(),
                                                         " entries for ", config_.num_experts, " experts"));
        }
        for (int e = 0; e < config_.num_experts; ++e) {
          // An empty digest would read as "not recorded" and skip the loader's check.
          if (digests[e].empty()) {
            return absl::InvalidArgumentError(absl::StrCat(path, ": digests[", layer, "][", e, "]: empty"));
          }
          recorded_[{layer, e}] = digests[e];
        }
      }
    }
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", e.what()));
  }
  return absl::OkStatus();
}

uint64_t HfCheckpoint::file_bytes() const {
  uint64_t n = 0;
  for (const auto& s : shards_) n += s->file_bytes();
  return n;
}

std::string HfCheckpoint::Describe() const {
  return absl::StrCat(config_.model_type, " directory ", dir_, " (", layers_.size(), " MoE layers x ",
                      config_.num_experts, " experts, d ", config_.hidden_size, ", d_ff ",
                      config_.moe_intermediate_size, ", ", ExpertNamingName(naming_), " naming, ", weight_dtype_, ", ",
                      shards_.size(), " shard(s))");
}

bool HfCheckpoint::IsMoeLayer(int64_t layer) const {
  return std::binary_search(config_.moe_layers.begin(), config_.moe_layers.end(), layer);
}

std::string HfCheckpoint::RecordedDigest(int64_t layer, int expert) const {
  auto it = recorded_.find({layer, expert});
  return it == recorded_.end() ? "" : it->second;
}

const TensorRef* HfCheckpoint::Tensor(const std::string& name, const MappedSafetensors** shard) const {
  auto it = tensor_shard_.find(name);
  if (it == tensor_shard_.end()) return nullptr;
  *shard = shards_[it->second].get();
  return (*shard)->Find(name);
}

// Rows per converted block: about 256 KiB of output, hashed while it is still in cache.
int64_t BlockRows(int64_t cols) { return std::max<int64_t>(1, (int64_t{128} << 10) / std::max<int64_t>(cols, 1)); }

void Hash(Sha256Hex* hasher, const uint16_t* p, int64_t n) {
  if (hasher != nullptr) hasher->Update(p, static_cast<size_t>(n) * 2);
}

absl::Status HfCheckpoint::ReadMatrix(const std::string& name, int64_t rows, int64_t cols, uint16_t* out,
                                      Sha256Hex* hasher) const {
  const MappedSafetensors* shard = nullptr;
  const TensorRef* t = Tensor(name, &shard);
  if (t == nullptr) return absl::FailedPreconditionError(absl::StrCat(dir_, ": tensor ", name, " is missing"));
  RETURN_IF_ERROR(shard->CheckIntact());  // a shorter file would fault the read (SIGBUS)
  if (t->shape != std::vector<int64_t>{rows, cols}) {
    return absl::FailedPreconditionError(absl::StrCat(dir_, ": tensor ", name, " has shape ", ShapeText(t->shape),
                                                      ", expected [", rows, ", ", cols, "]"));
  }
  const int64_t block = BlockRows(cols);
  if (Convertible(t->dtype)) {
    const int width = SafetensorsDtypeWidth(t->dtype);
    for (int64_t r = 0; r < rows; r += block) {
      const int64_t n = std::min(block, rows - r) * cols;
      ToBf16(t->dtype, t->data + r * cols * width, n, out + r * cols);
      Hash(hasher, out + r * cols, n);
    }
    shard->Release(*t);
    return absl::OkStatus();
  }
  if (t->dtype != "F8_E4M3") {
    return absl::FailedPreconditionError(
        absl::StrCat(dir_, ": tensor ", name, " has dtype ", t->dtype, " (BF16, F16, F32 or block-scaled F8_E4M3)"));
  }
  const int br = config_.fp8_block_rows, bc = config_.fp8_block_cols;
  if (br == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        dir_, ": tensor ", name, " is F8_E4M3 but config.json has no quantization_config.weight_block_size"));
  }
  const std::string scale_name = name + "_scale_inv";
  const MappedSafetensors* scale_shard = nullptr;
  const TensorRef* s = Tensor(scale_name, &scale_shard);
  const int64_t srows = (rows + br - 1) / br, scols = (cols + bc - 1) / bc;
  if (s == nullptr || s->shape != std::vector<int64_t>{srows, scols} || (s->dtype != "F32" && s->dtype != "BF16")) {
    return absl::FailedPreconditionError(absl::StrCat(dir_, ": tensor ", scale_name, " must be F32 [", srows, ", ",
                                                      scols, "] (one scale per ", br, "x", bc, " block of ", name, ")",
                                                      s == nullptr ? ", it is missing" : ""));
  }
  RETURN_IF_ERROR(scale_shard->CheckIntact());
  std::vector<float> scales(static_cast<size_t>(srows * scols));
  for (int64_t i = 0; i < srows * scols; ++i) {
    if (s->dtype == "F32") {
      std::memcpy(&scales[i], s->data + 4 * i, 4);
    } else {
      uint16_t b;
      std::memcpy(&b, s->data + 2 * i, 2);
      scales[i] = kernels::Bf16ToFloat(b);
    }
  }
  float lut[256];
  for (int v = 0; v < 256; ++v) lut[v] = kernels::Fp8E4M3ToFloat(static_cast<uint8_t>(v));
  for (int64_t r0 = 0; r0 < rows; r0 += block) {
    const int64_t r1 = std::min(rows, r0 + block);
    for (int64_t r = r0; r < r1; ++r) {
      const float* srow = scales.data() + (r / br) * scols;
      const uint8_t* src = t->data + r * cols;
      uint16_t* dst = out + r * cols;
      for (int64_t c = 0; c < cols; ++c) dst[c] = kernels::FloatToBf16(lut[src[c]] * srow[c / bc]);
    }
    Hash(hasher, out + r0 * cols, (r1 - r0) * cols);
  }
  shard->Release(*t);
  return absl::OkStatus();
}

absl::Status HfCheckpoint::ReadFusedExpert(const std::string& prefix, int expert, uint16_t* gate_up,
                                           uint16_t* down) const {
  const int64_t d = config_.hidden_size, f = config_.moe_intermediate_size, e_count = config_.num_experts;
  const MappedSafetensors* shard = nullptr;
  const std::array<std::pair<std::string, std::vector<int64_t>>, 2> parts = {
      std::pair<std::string, std::vector<int64_t>>{prefix + "gate_up_proj", {e_count, 2 * f, d}},
      {prefix + "down_proj", {e_count, d, f}}};
  for (int i = 0; i < 2; ++i) {
    const TensorRef* t = Tensor(parts[i].first, &shard);
    if (t == nullptr)
      return absl::FailedPreconditionError(absl::StrCat(dir_, ": tensor ", parts[i].first, " is missing"));
    if (t->shape != parts[i].second || !Convertible(t->dtype)) {
      return absl::FailedPreconditionError(absl::StrCat(dir_, ": tensor ", parts[i].first, " is ", t->dtype, " ",
                                                        ShapeText(t->shape), ", expected BF16/F16/F32 ",
                                                        ShapeText(parts[i].second)));
    }
    RETURN_IF_ERROR(shard->CheckIntact());         // a shorter file would fault the read (SIGBUS)
    const int64_t n = i == 0 ? 2 * f * d : d * f;  // elements of one expert in this part
    const int width = SafetensorsDtypeWidth(t->dtype);
    ToBf16(t->dtype, t->data + static_cast<uint64_t>(expert) * n * width, n, i == 0 ? gate_up : down);
  }
  return absl::OkStatus();
}

absl::Status HfCheckpoint::ReadExpert(int64_t layer, int expert, uint16_t* gate_up, uint16_t* down) const {
  return Read(layer, expert, gate_up, down, nullptr);
}

absl::Status HfCheckpoint::ReadExpertWithDigest(int64_t layer, int expert, uint16_t* gate_up, uint16_t* down,
                                                std::string* digest) const {
  if (naming_ == ExpertNaming::kFused)
    return CheckpointReader::ReadExpertWithDigest(layer, expert, gate_up, down, digest);
  Sha256Hex h;
  RETURN_IF_ERROR(Read(layer, expert, gate_up, down, &h));
  *digest = h.Finish();
  return absl::OkStatus();
}

absl::Status HfCheckpoint::Read(int64_t layer, int expert, uint16_t* gate_up, uint16_t* down, Sha256Hex* hasher) const {
  if (!IsMoeLayer(layer)) {
    return absl::InvalidArgumentError(absl::StrCat("layer: ", layer, " is not a MoE layer of ", dir_));
  }
  if (expert < 0 || expert >= config_.num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert: ", expert, " is outside [0, ", config_.num_experts, ") in ", dir_));
  }
  const int64_t d = config_.hidden_size, f = config_.moe_intermediate_size;
  if (naming_ == ExpertNaming::kFused) {
    return ReadFusedExpert(absl::StrCat(LayerPrefix(layer), fused_prefix_, ".experts."), expert, gate_up, down);
  }
  const auto names = ExpertNames(naming_, layer, expert);
  for (const std::string& name : names) {  // all three read ahead while the first is copied
    const MappedSafetensors* shard = nullptr;
    if (const TensorRef* t = Tensor(name, &shard); t != nullptr) shard->Prefetch(*t);
  }
  RETURN_IF_ERROR(ReadMatrix(names[0], f, d, gate_up, hasher));
  RETURN_IF_ERROR(ReadMatrix(names[1], f, d, gate_up + f * d, hasher));
  return ReadMatrix(names[2], d, f, down, hasher);
}

}  // namespace moe
