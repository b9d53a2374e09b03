// A Hugging Face model directory as the ranks read it: config.json (runtime/checkpoint/
// hf_config.h), the shards (`model.safetensors`, or `*.safetensors` listed by
// `model.safetensors.index.json`) mapped read-only, and the routed experts of every MoE layer
// under the family's naming:
//
//   mixtral      model.layers.L.block_sparse_moe.experts.N.{w1 (gate), w3 (up), w2 (down)}.weight
//   projections  model.layers.L.mlp.experts.N.{gate_proj, up_proj, down_proj}.weight
//                (qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3; what transformers 5's
//                save_pretrained writes for every family, Mixtral's being the line above)
//   fused        model.layers.L.{mlp|block_sparse_moe}.experts.gate_up_proj [E, 2f, d] and
//                .down_proj [E, d, f] (transformers 5's in-memory parameters, as a raw
//                state_dict save writes them)
//
// Weights may be BF16, F16 or F32 (rounded to BF16 to nearest even) or, for `projections`,
// FP8 E4M3 with a `weight_scale_inv` FP32 block scale per config's weight_block_size
// (DeepSeek-V3): dequantized to BF16 as bf16(float(w) * scale). A rank holds each expert as
// gate_up [2f, d] (gate rows, then up rows) and down [d, f], BF16; its digest is SHA-256 over
// those bytes (ExpertDigest).
//
// Optional sidecar `moe_checkpoint.json` (written by `moectl checkpoint digest` and by the
// project's own model writer): {"version": "...", "digests": {"<layer>": ["<hex>", ...]}}.
// Without it the version is "sha256:" + 16 hex digits over config.json and the index.
#ifndef MOE_RUNTIME_CHECKPOINT_HF_CHECKPOINT_H_
#define MOE_RUNTIME_CHECKPOINT_HF_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

#include "runtime/checkpoint/checkpoint_reader.h"
#include "runtime/checkpoint/expert_checkpoint.h"
#include "runtime/checkpoint/hf_config.h"
#include "runtime/checkpoint/mapped_safetensors.h"
#include "runtime/checkpoint/sha256.h"

namespace moe {

enum class ExpertNaming { kMixtral, kProjections, kFused };
const char* ExpertNamingName(ExpertNaming naming);

inline constexpr char kCheckpointSidecar[] = "moe_checkpoint.json";

class HfCheckpoint final : public CheckpointReader {
 public:
  // NOT_FOUND when config.json or a shard is missing; INVALID_ARGUMENT / DATA_LOSS naming the
  // file and key when the config, the index or a shard header is wrong, or when the first MoE
  // layer holds no experts under any naming.
  static absl::StatusOr<std::unique_ptr<HfCheckpoint>> Open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const HfMoeConfig& config() const { return config_; }
  ExpertShape shape() const override {
    return {config_.num_experts, config_.hidden_size, config_.moe_intermediate_size};
  }
  const std::vector<int64_t>& layers() const override { return layers_; }
  ExpertNaming naming() const { return naming_; }
  const std::string& version() const override { return version_; }
  std::string Describe() const override;
  const std::string& weight_dtype() const { return weight_dtype_; }  // of the first expert's gate
  int num_shards() const { return static_cast<int>(shards_.size()); }
  uint64_t file_bytes() const;  // all shards
  // Bytes of one expert in the files (what a load reads).
  int64_t expert_source_bytes() const { return expert_source_bytes_; }
  bool IsMoeLayer(int64_t layer) const;

  // Expert `expert` of MoE layer `layer` into gate_up [2f, d] and down [d, f] (BF16).
  // INVALID_ARGUMENT for a layer that is not a MoE layer or an expert out of range;
  // FAILED_PRECONDITION naming the tensor when it is absent, misshapen or of an unsupported dtype.
  // Safe to call from several threads at once.
  absl::Status ReadExpert(int64_t layer, int expert, uint16_t* gate_up, uint16_t* down) const override;
  // Hashes each converted block of rows right after writing it (one pass over memory).
  absl::Status ReadExpertWithDigest(int64_t layer, int expert, uint16_t* gate_up, uint16_t* down,
                                    std::string* digest) const override;

  // The sidecar's digest of (layer, expert), or "" when it records none.
  std::string RecordedDigest(int64_t layer, int expert) const override;
  bool has_recorded_digests() const { return !recorded_.empty(); }

 private:
  HfCheckpoint() = default;
  absl::Status OpenShards();
  absl::Status DetectNaming();
  absl::Status ReadSidecar();
  const TensorRef* Tensor(const std::string& name, const MappedSafetensors** shard) const;
  // `hasher` (may be null) is updated with the converted rows as they are written.
  absl::Status ReadMatrix(const std::string& name, int64_t rows, int64_t cols, uint16_t* out, Sha256Hex* hasher) const;
  absl::Status ReadFusedExpert(const std::string& prefix, int expert, uint16_t* gate_up, uint16_t* down) const;
  absl::Status Read(int64_t layer, int expert, uint16_t* gate_up, uint16_t* down, Sha256Hex* hasher) const;

  std::string dir_;
  HfMoeConfig config_;
  ExpertNaming naming_ = ExpertNaming::kProjections;
  std::string fused_prefix_;  // "mlp" or "block_sparse_moe" (fused naming)
  std::string version_;
  std::string weight_dtype_;
  int64_t expert_source_bytes_ = 0;
  std::string index_text_;
  std::vector<std::unique_ptr<MappedSafetensors>> shards_;
  std::map<std::string, int> tensor_shard_;  // tensor name -> shards_ index
  std::vector<int64_t> layers_;
  std::map<std::pair<int64_t, int>, std::string> recorded_;
};

// Hex SHA-256 over an expert's BF16 gate_up and down bytes (the manifest's parameter digest).
std::string ExpertDigest(const uint16_t* gate_up, size_t gate_up_elems, const uint16_t* down, size_t down_elems);

}  // namespace moe

#endif  // MOE_RUNTIME_CHECKPOINT_HF_CHECKPOINT_H_
