// Writes a model directory in Hugging Face layout (config.json, safetensors shards, the index
// when there is more than one shard, and the moe_checkpoint.json sidecar with every expert's
// digest): the project's own producer of small real-layout models for tests, the local cluster
// and benchmarks. Only the routed experts are written (plus each MoE layer's router weight, so
// the files look like a model's); attention and dense layers are the engine's.
#ifndef MOE_RUNTIME_CHECKPOINT_HF_WRITER_H_
#define MOE_RUNTIME_CHECKPOINT_HF_WRITER_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"

#include "runtime/checkpoint/hf_checkpoint.h"

namespace moe {

struct HfModelSpec {
  HfFamily family = HfFamily::kQwen3Moe;
  int hidden_size = 64;
  int moe_intermediate_size = 32;
  int num_experts = 8;
  int top_k = 2;
  int num_hidden_layers = 2;
  int first_k_dense_replace = 0;                     // deepseek_v2 / v3
  std::vector<int> mlp_only_layers;                  // qwen2_moe / qwen3_moe
  ExpertNaming naming = ExpertNaming::kProjections;  // kMixtral is implied by the mixtral family
  std::string dtype = "BF16";                        // BF16, F32, F16, or F8_E4M3 (block-scaled, projections only)
  int fp8_block = 128;                               // block edge for F8_E4M3
  int64_t max_shard_bytes = 0;                       // > 0: split the tensors into shards of at most this size
  std::string version;                               // the sidecar's version ("" writes no sidecar)
};

// gate_up [2f, d] (gate rows, then up rows) and down [d, f] of (layer, expert), BF16 bits.
using ExpertSource =
    std::function<void(int layer, int expert, std::vector<uint16_t>* gate_up, std::vector<uint16_t>* down)>;

// Deterministic weights (the synthetic checkpoint's generator, seeded per layer).
ExpertSource SyntheticExpertSource(int hidden_size, int moe_intermediate_size, uint64_t seed);

// INVALID_ARGUMENT naming the field for an impossible spec; the directory is created if needed.
absl::Status WriteHfModel(const std::string& dir, const HfModelSpec& spec, const ExpertSource& source);

// Reads every expert of `dir` and writes moe_checkpoint.json with `version` and their digests
// (what `moectl checkpoint digest` does to a downloaded model).
absl::Status WriteCheckpointSidecar(const std::string& dir, const std::string& version);

}  // namespace moe

#endif  // MOE_RUNTIME_CHECKPOINT_HF_WRITER_H_
