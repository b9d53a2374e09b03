#include "runtime/checkpoint/hf_writer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>

#include <sys/stat.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"

#include "kernels/numeric.h"
#include "runtime/checkpoint/safetensors.h"
#include "runtime/checkpoint/synthetic.h"
#include "runtime/hash.h"
#include "runtime/status.h"

namespace moe {
namespace {

using nlohmann::ordered_json;

absl::Status WriteText(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    if (!out) return absl::PermissionDeniedError(absl::StrCat(tmp, ": write failed"));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::PermissionDeniedError(absl::StrCat(path, ": rename failed"));
  }
  return absl::OkStatus();
}

ordered_json ConfigJson(const HfModelSpec& s) {
  ordered_json c;
  c["model_type"] = HfFamilyName(s.family);
  c["hidden_size"] = s.hidden_size;
  c["num_hidden_layers"] = s.num_hidden_layers;
  c["num_experts_per_tok"] = s.top_k;
  c["intermediate_size"] = s.family == HfFamily::kMixtral ? s.moe_intermediate_size : 2 * s.moe_intermediate_size;
  switch (s.family) {
    case HfFamily::kMixtral:
      c["architectures"] = {"MixtralForCausalLM"};
      c["num_local_experts"] = s.num_experts;
      break;
    case HfFamily::kQwen2Moe:
    case HfFamily::kQwen3Moe:
      c["architectures"] = {s.family == HfFamily::kQwen2Moe ? "Qwen2MoeForCausalLM" : "Qwen3MoeForCausalLM"};
      c["num_experts"] = s.num_experts;
      c["moe_intermediate_size"] = s.moe_intermediate_size;
      c["decoder_sparse_step"] = 1;
      c["mlp_only_layers"] = s.mlp_only_layers;
      break;
    case HfFamily::kDeepseekV2:
    case HfFamily::kDeepseekV3:
      c["architectures"] = {s.family == HfFamily::kDeepseekV2 ? "DeepseekV2ForCausalLM" : "DeepseekV3ForCausalLM"};
      c["n_routed_experts"] = s.num_experts;
      c["moe_intermediate_size"] = s.moe_intermediate_size;
      c["first_k_dense_replace"] = s.first_k_dense_replace;
      c["moe_layer_freq"] = 1;
      break;
  }
  c["dtype"] = s.dtype == "F32" ? "float32" : s.dtype == "F16" ? "float16" : "bfloat16";
  if (s.dtype == "F8_E4M3") {
    c["quantization_config"] = {
        {"quant_method", "fp8"}, {"fmt", "e4m3"}, {"weight_block_size", {s.fp8_block, s.fp8_block}}};
  }
  return c;
}

std::string Bytes(const void* p, size_t n) { return std::string(static_cast<const char*>(p), n); }

// BF16 [rows, cols] as `dtype`; for F8_E4M3 also the block scales (`scale_inv`).
void Encode(const uint16_t* w, int64_t rows, int64_t cols, const HfModelSpec& s, TensorBlob* out, TensorBlob* scale) {
  out->shape = {rows, cols};
  out->dtype = s.dtype;
  const int64_t n = rows * cols;
  if (s.dtype == "BF16") {
    out->data = Bytes(w, n * 2);
  } else if (s.dtype == "F32" || s.dtype == "F16") {
    std::vector<float> f(n);
    for (int64_t i = 0; i < n; ++i) f[i] = kernels::Bf16ToFloat(w[i]);
    if (s.dtype == "F32") {
      out->data = Bytes(f.data(), n * 4);
    } else {  // F16: BF16's 8 significant bits fit F16's 11 in its normal range; below, nearest subnormal
      std::vector<uint16_t> h(n);
      for (int64_t i = 0; i < n; ++i) {
        uint32_t u;
        std::memcpy(&u, &f[i], 4);
        const uint32_t sign = (u >> 16) & 0x8000u;
        const int exp = static_cast<int>((u >> 23) & 0xff) - 127 + 15;
        if (exp <= 0) {
          h[i] = static_cast<uint16_t>(sign | std::lrint(std::ldexp(std::fabs(f[i]), 24)));
        } else {
          h[i] = static_cast<uint16_t>(sign | (std::min(exp, 30) << 10) | ((u >> 13) & 0x3ff));
        }
      }
      out->data = Bytes(h.data(), n * 2);
    }
  } else {  // F8_E4M3, one scale per fp8_block x fp8_block block
    const int b = s.fp8_block;
    const int64_t sr = (rows + b - 1) / b, sc = (cols + b - 1) / b;
    std::vector<float> scales(sr * sc, 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        float& m = scales[(r / b) * sc + c / b];
        m = std::max(m, std::fabs(kernels::Bf16ToFloat(w[r * cols + c])));
      }
    }
    for (float& m : scales) m = m > 0 ? m / kernels::kFp8E4M3Max : 1.0f;
    std::vector<uint8_t> q(n);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        q[r * cols + c] = kernels::FloatToFp8E4M3(kernels::Bf16ToFloat(w[r * cols + c]) / scales[(r / b) * sc + c / b]);
      }
    }
    out->data = Bytes(q.data(), n);
    scale->dtype = "F32";
    scale->shape = {sr, sc};
    scale->data = Bytes(scales.data(), scales.size() * 4);
  }
}

absl::Status Validate(const HfModelSpec& s) {
  if (s.hidden_size <= 0 || s.moe_intermediate_size <= 0 || s.num_experts <= 0 || s.num_hidden_layers <= 0) {
    return absl::InvalidArgumentError("spec: hidden_size, moe_intermediate_size, num_experts, layers must be positive");
  }
  if (s.top_k <= 0 || s.top_k > s.num_experts)
    return absl::InvalidArgumentError("spec.top_k: outside [1, num_experts]");
  if (s.dtype != "BF16" && s.dtype != "F32" && s.dtype != "F16" && s.dtype != "F8_E4M3") {
    return absl::InvalidArgumentError(absl::StrCat("spec.dtype: '", s.dtype, "' (BF16, F32, F16, F8_E4M3)"));
  }
  if (s.dtype == "F8_E4M3" && (s.naming != ExpertNaming::kProjections || s.fp8_block <= 0)) {
    return absl::InvalidArgumentError("spec.dtype: F8_E4M3 needs the projections naming and a positive fp8_block");
  }
  if (s.family == HfFamily::kMixtral && s.naming == ExpertNaming::kProjections) {
    return absl::InvalidArgumentError("spec.naming: mixtral writes the mixtral or the fused naming");
  }
  if (s.family != HfFamily::kMixtral && s.naming == ExpertNaming::kMixtral) {
    return absl::InvalidArgumentError("spec.naming: the mixtral naming belongs to the mixtral family");
  }
  return absl::OkStatus();
}

// Layer l's tensors: the router weight and every expert under the spec's naming.
void LayerTensors(const HfModelSpec& s, int l, const ExpertSource& source, std::map<std::string, TensorBlob>* out) {
  const int64_t d = s.hidden_size, f = s.moe_intermediate_size;
  const std::string block =
      absl::StrCat("model.layers.", l, ".", s.family == HfFamily::kMixtral ? "block_sparse_moe" : "mlp", ".");
  std::vector<uint16_t> router(s.num_experts * d);
  for (size_t i = 0; i < router.size(); ++i)
    router[i] = kernels::FloatToBf16(((SplitMix64(l * 7919 + i) % 200) - 100) * 1e-3f);
  (*out)[block + "gate.weight"] = TensorBlob{"BF16", {s.num_experts, d}, Bytes(router.data(), router.size() * 2)};
  std::vector<uint16_t> gu, dn, fused_gu, fused_dn;
  for (int e = 0; e < s.num_experts; ++e) {
    source(l, e, &gu, &dn);
    if (s.naming == ExpertNaming::kFused) {
      fused_gu.insert(fused_gu.end(), gu.begin(), gu.end());
      fused_dn.insert(fused_dn.end(), dn.begin(), dn.end());
      continue;
    }
    const bool mixtral = s.naming == ExpertNaming::kMixtral;
    const std::string p = absl::StrCat(block, "experts.", e, ".");
    const std::string names[3] = {p + (mixtral ? "w1" : "gate_proj") + ".weight",
                                  p + (mixtral ? "w3" : "up_proj") + ".weight",
                                  p + (mixtral ? "w2" : "down_proj") + ".weight"};
    const uint16_t* parts[3] = {gu.data(), gu.data() + f * d, dn.data()};
    const int64_t shapes[3][2] = {{f, d}, {f, d}, {d, f}};
    for (int i = 0; i < 3; ++i) {
      TensorBlob t, scale;
      Encode(parts[i], shapes[i][0], shapes[i][1], s, &t, &scale);
      (*out)[names[i]] = std::move(t);
      if (!scale.data.empty()) (*out)[names[i] + "_scale_inv"] = std::move(scale);
    }
  }
  if (s.naming == ExpertNaming::kFused) {
    TensorBlob a, b, unused;
    Encode(fused_gu.data(), s.num_experts * 2 * f, d, s, &a, &unused);
    Encode(fused_dn.data(), s.num_experts * d, f, s, &b, &unused);
    a.shape = {s.num_experts, 2 * f, d};
    b.shape = {s.num_experts, d, f};
    (*out)[block + "experts.gate_up_proj"] = std::move(a);
    (*out)[block + "experts.down_proj"] = std::move(b);
  }
}

}  // namespace

ExpertSource SyntheticExpertSource(int hidden_size, int moe_intermediate_size, uint64_t seed) {
  const ExpertShape shape{0, hidden_size, moe_intermediate_size};
  return [shape, seed](int layer, int expert, std::vector<uint16_t>* gu, std::vector<uint16_t>* dn) {
    SyntheticExpert(expert, shape, SplitMix64(seed + 0x51ed * static_cast<uint64_t>(layer + 1)), gu, dn);
  };
}

absl::Status WriteHfModel(const std::string& dir, const HfModelSpec& spec, const ExpertSource& source) {
  RETURN_IF_ERROR(Validate(spec));
  ::mkdir(dir.c_str(), 0755);
  const std::string config_text = ConfigJson(spec).dump(2);
  ASSIGN_OR_RETURN(const HfMoeConfig config, ParseHfMoeConfig(config_text));
  std::vector<std::map<std::string, TensorBlob>> shards(1);
  int64_t shard_bytes = 0, total = 0;
  for (int l : config.moe_layers) {
    std::map<std::string, TensorBlob> layer;
    LayerTensors(spec, l, source, &layer);
    for (auto& [name, t] : layer) {
      const int64_t n = static_cast<int64_t>(t.data.size());
      if (spec.max_shard_bytes > 0 && shard_bytes > 0 && shard_bytes + n > spec.max_shard_bytes) {
        shards.emplace_back();
        shard_bytes = 0;
      }
      shard_bytes += n;
      total += n;
      shards.back()[name] = std::move(t);
    }
  }
  RETURN_IF_ERROR(WriteText(dir + "/config.json", config_text));
  ordered_json weight_map = ordered_json::object();
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string file = shards.size() == 1
                                 ? "model.safetensors"
                                 : absl::StrFormat("model-%05d-of-%05d.safetensors", static_cast<int>(i + 1),
                                                   static_cast<int>(shards.size()));
    SafetensorsFile f;
    f.metadata["format"] = "pt";
    for (auto& [name, t] : shards[i]) weight_map[name] = file;
    f.tensors = std::move(shards[i]);
    RETURN_IF_ERROR(WriteSafetensors(dir + "/" + file, f));
  }
  if (shards.size() > 1) {
    ordered_json index;
    index["metadata"] = {{"total_size", total}};
    index["weight_map"] = weight_map;
    RETURN_IF_ERROR(WriteText(dir + "/model.safetensors.index.json", index.dump(2)));
  }
  if (!spec.version.empty()) return WriteCheckpointSidecar(dir, spec.version);
  return absl::OkStatus();
}

absl::Status WriteCheckpointSidecar(const std::string& dir, const std::string& version) {
  std::remove((dir + "/" + kCheckpointSidecar).c_str());  // a stale sidecar would be read as the truth
  ASSIGN_OR_RETURN(std::unique_ptr<HfCheckpoint> ckpt, HfCheckpoint::Open(dir));
  const ExpertShape shape = ckpt->shape();
  std::vector<uint16_t> gu(2 * static_cast<size_t>(shape.d_ff) * shape.d),
      dn(static_cast<size_t>(shape.d) * shape.d_ff);
  ordered_json digests = ordered_json::object();
  for (int l : ckpt->config().moe_layers) {
    ordered_json layer = ordered_json::array();
    for (int e = 0; e < shape.num_experts; ++e) {
      std::string digest;
      RETURN_IF_ERROR(ckpt->ReadExpertWithDigest(l, e, gu.data(), dn.data(), &digest));
      layer.push_back(digest);
    }
    digests[absl::StrCat(l)] = std::move(layer);
  }
  ordered_json sidecar;
  sidecar["version"] = version;
  sidecar["digests"] = std::move(digests);
  return WriteText(dir + "/" + kCheckpointSidecar, sidecar.dump(1));
}

}  // namespace moe
