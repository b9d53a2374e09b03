// What a rank reads its experts from, whatever the layout: a Hugging Face model directory
// (hf_checkpoint.h) or the project's single-file synthetic checkpoint (expert_checkpoint.h,
// one expert set that serves every layer index). The loader, the rank agent's checkpoint
// loads, the default placement and moectl read through this interface only.
#ifndef MOE_RUNTIME_CHECKPOINT_CHECKPOINT_READER_H_
#define MOE_RUNTIME_CHECKPOINT_CHECKPOINT_READER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "runtime/checkpoint/expert_checkpoint.h"
#include "runtime/checkpoint/safetensors.h"

namespace moe {

// What a placement records about a checkpoint: its version, its MoE layers and each expert's
// digest per layer ("" where none is recorded).
struct CheckpointIdentity {
  std::string version;
  std::vector<int64_t> layers;                    // empty: one expert set for every layer
  std::vector<std::vector<std::string>> digests;  // [expert][layer] (one column when layers is empty)
};

class CheckpointReader {
 public:
  virtual ~CheckpointReader() = default;
  virtual const std::string& version() const = 0;
  virtual ExpertShape shape() const = 0;
  // The MoE layers (decoder layer indices, ascending) with routed experts. Empty: one expert
  // set that serves every layer index (the single-file synthetic checkpoint).
  virtual const std::vector<int64_t>& layers() const = 0;
  // Expert `expert` of `layer` (any index when layers() is empty) as BF16 gate_up [2f, d]
  // (gate rows, then up rows) and down [d, f]. Safe to call from several threads at once.
  virtual absl::Status ReadExpert(int64_t layer, int expert, uint16_t* gate_up, uint16_t* down) const = 0;
  // ReadExpert and the expert's digest (ExpertDigest over what it wrote); readers may hash while
  // they convert, while the bytes are still in cache.
  virtual absl::Status ReadExpertWithDigest(int64_t layer, int expert, uint16_t* gate_up, uint16_t* down,
                                            std::string* digest) const;
  // The digest recorded for (layer, expert) beside the weights, or "" when none is.
  virtual std::string RecordedDigest(int64_t layer, int expert) const = 0;
  // A line for logs: "qwen3_moe directory /m (projections, BF16)".
  virtual std::string Describe() const = 0;

  int64_t expert_bytes() const;  // BF16 bytes of one expert in one layer as a rank holds it
  CheckpointIdentity Identity() const;
  int num_layers() const { return layers().empty() ? 1 : static_cast<int>(layers().size()); }
};

// The single-file synthetic checkpoint as a reader (`file` must outlive it).
absl::StatusOr<std::unique_ptr<CheckpointReader>> SingleFileReader(const SafetensorsFile& file);

// Opens `path`: a directory is read as a Hugging Face model, a file as the single-file
// checkpoint (kept in `*storage`, which must outlive the reader).
absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenCheckpoint(const std::string& path,
                                                                 std::unique_ptr<SafetensorsFile>* storage);

// SHA-256 (hex) over the per-layer digests of one expert, in layer order: the slot's parameter
// digest of a multi-layer checkpoint ("" when any layer's digest is unknown).
std::string CombinedDigest(const std::vector<std::string>& layer_digests);

}  // namespace moe

#endif  // MOE_RUNTIME_CHECKPOINT_CHECKPOINT_READER_H_
