// The MoE part of a Hugging Face config.json: which family, the expert shape and which decoder
// layers are MoE layers. Families and the keys each one uses:
//
//   mixtral                 num_local_experts, num_experts_per_tok, intermediate_size; every layer
//   qwen2_moe, qwen3_moe    num_experts (transformers 5 writes num_local_experts for qwen3_moe),
//                           num_experts_per_tok, moe_intermediate_size; layer l is MoE unless it is
//                           in mlp_only_layers, and when (l + 1) % decoder_sparse_step == 0
//   deepseek_v2, deepseek_v3
//                           n_routed_experts, num_experts_per_tok, moe_intermediate_size; layer l
//                           is MoE when l >= first_k_dense_replace and l % moe_layer_freq == 0
//
// quantization_config {quant_method: "fp8", weight_block_size: [r, c]} (DeepSeek-V3) marks
// FP8 E4M3 weights with one FP32 `weight_scale_inv` per r x c block. Shared experts, the
// router and dense layers stay with the engine: the ranks serve routed experts only.
#ifndef MOE_RUNTIME_CHECKPOINT_HF_CONFIG_H_
#define MOE_RUNTIME_CHECKPOINT_HF_CONFIG_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moe {

enum class HfFamily { kMixtral, kQwen2Moe, kQwen3Moe, kDeepseekV2, kDeepseekV3 };
const char* HfFamilyName(HfFamily family);  // the model_type

struct HfMoeConfig {
  HfFamily family = HfFamily::kMixtral;
  std::string model_type;
  int hidden_size = 0;
  int num_experts = 0;  // routed experts per MoE layer
  int top_k = 0;
  int moe_intermediate_size = 0;
  int num_hidden_layers = 0;
  std::vector<int> moe_layers;  // decoder layer indices with routed experts, ascending
  std::string dtype;            // "bfloat16", "float32", ... ("" when config.json names none)
  int fp8_block_rows = 0;       // > 0: FP8 weights with block scales of this shape
  int fp8_block_cols = 0;
};

// INVALID_ARGUMENT naming the key: not JSON, an unsupported model_type, a missing or
// non-positive size, a layer list out of range, or no MoE layer at all.
// The most decoder layers a config may declare (the largest MoE models have ~100).
inline constexpr int kMaxHfLayers = 4096;
absl::StatusOr<HfMoeConfig> ParseHfMoeConfig(const std::string& json_text);

}  // namespace moe

#endif  // MOE_RUNTIME_CHECKPOINT_HF_CONFIG_H_
