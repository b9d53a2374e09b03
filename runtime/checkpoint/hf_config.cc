#include "runtime/checkpoint/hf_config.h"

#include <algorithm>
#include <initializer_list>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace moe {

const char* HfFamilyName(HfFamily family) {
  switch (family) {
    case HfFamily::kMixtral:
      return "mixtral";
    case HfFamily::kQwen2Moe:
      return "qwen2_moe";
    case HfFamily::kQwen3Moe:
      return "qwen3_moe";
    case HfFamily::kDeepseekV2:
      return "deepseek_v2";
    case HfFamily::kDeepseekV3:
      return "deepseek_v3";
  }
  return "unknown";
}

namespace {

using nlohmann::json;

absl::Status Bad(const std::string& key, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat("config.json: '", key, "' ", why));
}

// The first of `keys` present in `c` as a positive integer below 2^31.
absl::Status PositiveInt(const json& c, std::initializer_list<const char*> keys, int* out) {
  for (const char* key : keys) {
    auto it = c.find(key);
    if (it == c.end() || it->is_null()) continue;
    if (!it->is_number_integer() || it->get<int64_t>() <= 0 || it->get<int64_t>() > (int64_t{1} << 30)) {
      return Bad(key, "must be a positive integer");
    }
    *out = static_cast<int>(it->get<int64_t>());
    return absl::OkStatus();
  }
  return Bad(*keys.begin(), "is missing");
}

// An optional non-negative integer (`fallback` when absent).
absl::Status OptionalInt(const json& c, const char* key, int fallback, int min, int* out) {
  *out = fallback;
  auto it = c.find(key);
  if (it == c.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_number_integer() || it->get<int64_t>() < min || it->get<int64_t>() > (int64_t{1} << 30)) {
    return Bad(key, absl::StrCat("must be an integer >= ", min));
  }
  *out = static_cast<int>(it->get<int64_t>());
  return absl::OkStatus();
}

absl::StatusOr<HfFamily> FamilyOf(const std::string& model_type) {
  for (HfFamily f :
       {HfFamily::kMixtral, HfFamily::kQwen2Moe, HfFamily::kQwen3Moe, HfFamily::kDeepseekV2, HfFamily::kDeepseekV3}) {
    if (model_type == HfFamilyName(f)) return f;
  }
  return Bad(
      "model_type",
      absl::StrCat("'", model_type, "' is not supported (mixtral, qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3)"));
}

absl::Status MoeLayers(const json& c, HfMoeConfig* out) {
  const int n = out->num_hidden_layers;
  if (out->family == HfFamily::kMixtral) {
    for (int l = 0; l < n; ++l) out->moe_layers.push_back(l);
  } else if (out->family == HfFamily::kQwen2Moe || out->family == HfFamily::kQwen3Moe) {
    int step = 1;
    if (absl::Status s = OptionalInt(c, "decoder_sparse_step", 1, 1, &step); !s.ok()) return s;
    std::vector<bool> dense(n, false);
    auto it = c.find("mlp_only_layers");
    if (it != c.end() && !it->is_null()) {
      if (!it->is_array()) return Bad("mlp_only_layers", "must be a list of layer indices");
      for (const json& v : *it) {
        if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= n) {
          return Bad("mlp_only_layers", absl::StrCat("holds an index outside [0, ", n, ")"));
        }
        dense[static_cast<size_t>(v.get<int64_t>())] = true;
      }
    }
    for (int l = 0; l < n; ++l) {
      if (!dense[l] && (l + 1) % step == 0) out->moe_layers.push_back(l);
    }
  } else {
    int first_dense = 0, freq = 1;
    if (absl::Status s = OptionalInt(c, "first_k_dense_replace", 0, 0, &first_dense); !s.ok()) return s;
    if (absl::Status s = OptionalInt(c, "moe_layer_freq", 1, 1, &freq); !s.ok()) return s;
    for (int l = first_dense; l < n; ++l) {
      if (l % freq == 0) out->moe_layers.push_back(l);
    }
  }
  if (out->moe_layers.empty()) return Bad("num_hidden_layers", "leaves no MoE layer");
  return absl::OkStatus();
}

absl::Status Quantization(const json& c, HfMoeConfig* out) {
  auto q = c.find("quantization_config");
  if (q == c.end() || q->is_null()) return absl::OkStatus();
  if (!q->is_object()) return Bad("quantization_config", "must be an object");
  auto m = q->find("quant_method");
  if (m != q->end() && !m->is_string()) return Bad("quantization_config.quant_method", "must be a string");
  const std::string method = m != q->end() ? m->get<std::string>() : std::string();
  if (method != "fp8") {
    return Bad("quantization_config.quant_method", absl::StrCat("'", method, "' is not supported (fp8)"));
  }
  auto block = q->find("weight_block_size");
  if (block == q->end() || !block->is_array() || block->size() != 2 || !(*block)[0].is_number_integer() ||
      !(*block)[1].is_number_integer() || (*block)[0].get<int64_t>() <= 0 || (*block)[1].get<int64_t>() <= 0 ||
      (*block)[0].get<int64_t>() > 65536 || (*block)[1].get<int64_t>() > 65536) {
    return Bad("quantization_config.weight_block_size", "must be two positive integers (block-scaled FP8 only)");
  }
  out->fp8_block_rows = static_cast<int>((*block)[0].get<int64_t>());
  out->fp8_block_cols = static_cast<int>((*block)[1].get<int64_t>());
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<HfMoeConfig> ParseHfMoeConfig(const std::string& json_text) {
  json c;
  try {
    c = json::parse(json_text);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: not JSON: ", e.what()));
  }
  if (!c.is_object()) return absl::InvalidArgumentError("config.json: not a JSON object");
  HfMoeConfig out;
  auto type = c.find("model_type");
  if (type == c.end() || !type->is_string()) return Bad("model_type", "is missing");
  out.model_type = type->get<std::string>();
  auto family = FamilyOf(out.model_type);
  if (!family.ok()) return family.status();
  out.family = *family;
  absl::Status s = PositiveInt(c, {"hidden_size"}, &out.hidden_size);
  if (s.ok()) s = PositiveInt(c, {"num_hidden_layers"}, &out.num_hidden_layers);
  if (s.ok() && out.num_hidden_layers > kMaxHfLayers) {
    s = Bad("num_hidden_layers", absl::StrCat("must be at most ", kMaxHfLayers));
  }
  if (s.ok()) s = PositiveInt(c, {"num_experts_per_tok"}, &out.top_k);
  if (s.ok()) {
    switch (out.family) {
      case HfFamily::kMixtral:
        s = PositiveInt(c, {"num_local_experts"}, &out.num_experts);
        if (s.ok()) s = PositiveInt(c, {"intermediate_size"}, &out.moe_intermediate_size);
        break;
      case HfFamily::kQwen2Moe:
      case HfFamily::kQwen3Moe:
        s = PositiveInt(c, {"num_experts", "num_local_experts"}, &out.num_experts);
        if (s.ok()) s = PositiveInt(c, {"moe_intermediate_size"}, &out.moe_intermediate_size);
        break;
      case HfFamily::kDeepseekV2:
      case HfFamily::kDeepseekV3:
        s = PositiveInt(c, {"n_routed_experts"}, &out.num_experts);
        if (s.ok()) s = PositiveInt(c, {"moe_intermediate_size"}, &out.moe_intermediate_size);
        break;
    }
  }
  // (A placement holds at most kMaxLogicalExperts, runtime/placement/manifest.h: a larger count
  // would size the checkpoint's identity tables before any placement refuses it.)
  constexpr int kMaxHfExperts = 65536;
  if (s.ok() && out.num_experts > kMaxHfExperts) {
    s = Bad("num_experts", absl::StrCat(out.num_experts, " routed experts, at most ", kMaxHfExperts));
  }
  if (s.ok() && out.top_k > out.num_experts) s = Bad("num_experts_per_tok", "exceeds the expert count");
  if (s.ok()) s = MoeLayers(c, &out);
  if (s.ok()) s = Quantization(c, &out);
  if (!s.ok()) return s;
  for (const char* key : {"dtype", "torch_dtype"}) {
    auto it = c.find(key);
    if (it != c.end() && it->is_string()) {
      out.dtype = it->get<std::string>();
      break;
    }
  }
  return out;
}

}  // namespace moe
