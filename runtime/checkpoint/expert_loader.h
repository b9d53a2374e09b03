// Loads a rank's experts for a placement generation: every MoE layer the generation serves,
// this rank's physical slots in local order, read through a CheckpointReader by a few threads
// (each copy goes straight into its place; nothing else of the checkpoint is kept), each
// expert's digest computed and checked against the manifest's (per layer, and the slot's
// combined digest). A load that would not fit the budget fails before it reads a byte.
#ifndef MOE_RUNTIME_CHECKPOINT_EXPERT_LOADER_H_
#define MOE_RUNTIME_CHECKPOINT_EXPERT_LOADER_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "runtime/checkpoint/checkpoint_reader.h"
#include "runtime/checkpoint/safetensors.h"
#include "runtime/exec/layer_executor.h"
#include "runtime/placement/manifest.h"

namespace moe {

struct LoadProgress {
  int layers_done = 0;
  int layers_total = 0;
  int64_t bytes_done = 0;  // BF16 bytes placed
  int64_t bytes_total = 0;
  double seconds = 0;
};

struct LoadOptions {
  int threads = 4;
  // > 0: RESOURCE_EXHAUSTED naming both numbers, before anything is read or allocated, when the
  // rank's experts (layers x local slots x expert bytes) exceed it.
  int64_t max_bytes = 0;
  // Called after each layer completes (from a loader thread, one call at a time).
  std::function<void(const LoadProgress&)> progress;
};

// Host memory a load may use: MemAvailable of /proc/meminfo (0 when unknown: no limit).
int64_t AvailableHostBytes();

// BF16 bytes of `rank`'s experts under `manifest` (every layer); INVALID_ARGUMENT on overflow.
absl::StatusOr<int64_t> LocalExpertBytes(const CheckpointReader& checkpoint, const PlacementManifest& manifest,
                                         Rank rank);

// FAILED_PRECONDITION when the manifest's layers are not the checkpoint's, or naming the slot
// and layer whose weights do not match the manifest's digest.
absl::StatusOr<LocalExperts> LoadLocalExperts(const CheckpointReader& checkpoint, const PlacementManifest& manifest,
                                              Rank rank, const LoadOptions& options = {});

// The single-file synthetic checkpoint (one expert set).
absl::StatusOr<LocalExperts> LoadLocalExperts(const SafetensorsFile& checkpoint, const PlacementManifest& manifest,
                                              Rank rank);

// The digest `m` expects for the copy of slot q in its layer index li ("" when it records
// none): the slot's own in a per-layer generation's table for that layer, its per-layer digest in
// a shared table, the expert digest of a single-layer checkpoint.
std::string ExpectedLayerDigest(const PlacementManifest& m, PhysicalSlotId q, int li);

// Checks the digests computed for every layer's copy of slot q (`computed[li]`, how each copy
// came in `how[li]`, e.g. "checkpoint load", "cross-node copy") against ExpectedLayerDigest, and a
// shared multi-layer table's combined digest against their CombinedDigest. FAILED_PRECONDITION
// naming the slot, its expert, the layer and how the copy came. The loader and the rank agent
// verify every copy with it, however it was materialized (0x08F).
absl::Status CheckSlotDigests(const PlacementManifest& m, PhysicalSlotId q, const std::vector<std::string>& computed,
                              const std::vector<std::string>& how);

// Before a rank materializes slot q of a generation it was sent (0x08F, 0x08K: no copy publishes
// unverified): the manifest must expect a digest for each of its `num_layers` layer copies, or a
// shared multi-layer table a combined one for them all. FAILED_PRECONDITION naming the slot, its expert and the layer
// otherwise. (A rank's start-up placement, loaded from its own checkpoint, may carry none: CheckSlotDigests skips
// those.)
absl::Status RequireSlotDigests(const PlacementManifest& m, PhysicalSlotId q, int num_layers);

}  // namespace moe

#endif  // MOE_RUNTIME_CHECKPOINT_EXPERT_LOADER_H_
