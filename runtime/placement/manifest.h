// Versioned placement manifests and the compatibility predicate (spec 0x02B1, 0x02B2, 0x01D1).
//
// A manifest stores physical slots under one placement generation. The complete key of a
// slot is (placement version, physical slot id); slot ids are dense 0..Q-1 inside a version.
// Manifests are immutable once created and shared as shared_ptr<const PlacementManifest>
// between the registry, plans and dispatch handles; they are safe to read from any thread.
#ifndef MOE_RUNTIME_PLACEMENT_MANIFEST_H_
#define MOE_RUNTIME_PLACEMENT_MANIFEST_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

#include "runtime/ids.h"
#include "runtime/placement/topology.h"

namespace moe {

struct SlotRecord {
  PhysicalSlotId slot;
  std::string name;  // "q1"; unique inside the version
  LogicalExpertId expert;
  ReplicaId replica;         // copy index among the expert's copies
  std::string replica_name;  // "e0-r1"
  Rank rank;                 // destination rank
  TopologyDomainId domain;   // topology domain the manifest claims for the rank
  CheckpointVersion checkpoint;
  ParameterDigest parameter_digest;
  // The expert's digest in each of the manifest's layers (empty, or one per layer).
  std::vector<std::string> layer_digests;
};

// Bounds on what a manifest from the network may size: logical experts in a layer, and layers x
// experts over a layered manifest (DeepSeek-V3: 58 x 256; Qwen3-235B: 94 x 128).
inline constexpr int kMaxLogicalExperts = 65536;
inline constexpr int64_t kMaxLayeredExpertEntries = int64_t{1} << 22;

struct ManifestOptions {
  PlacementVersion version;
  ProcessGroupId process_group;
  ProcessGroupEpoch epoch;
  CheckpointVersion checkpoint;  // the generation's checkpoint: c_v(e) for every logical expert
  int num_experts = 0;
  // The MoE layers served (ascending, distinct, >= 0), each with every slot. Empty: one expert
  // set serves every layer index (single-file checkpoints).
  std::vector<int64_t> layers;
};

class PlacementManifest : public std::enable_shared_from_this<PlacementManifest> {
 public:
  // Structural validation only (dense ids, unique names, experts and ranks in range). Whether
  // each slot is *compatible* is the predicate below; publishing requires VerifyForPublish.
  static absl::StatusOr<std::shared_ptr<const PlacementManifest>> Create(ManifestOptions options,
                                                                         std::vector<SlotRecord> slots,
                                                                         const Topology& topology);
  // A generation whose MoE layers place experts differently (EPLB's phy2log per layer): one slot
  // table per layer of options.layers, in that order. Every table has the same slot ids on the
  // same ranks (a rank holds the same number of slots in every layer); experts, replicas and
  // digests differ. Each slot's parameter_digest is its expert's digest in that layer. The
  // manifest's own slots are the first layer's.
  static absl::StatusOr<std::shared_ptr<const PlacementManifest>> CreateLayered(
      ManifestOptions options, std::vector<std::vector<SlotRecord>> layer_slots, const Topology& topology);

  // This generation bound to a re-formed process group (0x07G: a placement snapshot must not keep
  // an old peer-slot map): the same version, slots, experts, ranks and digests, with the group's
  // id and epoch and each slot's domain taken from `topology` (a rank may come back on another
  // node). Slots on ranks outside `group` (lost, when it re-formed over the survivors) stay and
  // are no route's destination; FAILED_PRECONDITION naming the expert (and layer) when some
  // logical expert has no replica left on a member.
  absl::StatusOr<std::shared_ptr<const PlacementManifest>> Rebound(const ProcessGroup& group,
                                                                   const Topology& topology) const;

  // Whether the layers have slot tables of their own (CreateLayered).
  bool per_layer() const { return !layer_manifests_.empty(); }
  // The slot table a step of `layer` runs on: the layer's own in a per-layer generation, this
  // manifest otherwise (also for a layer it does not serve: check ServesLayer first).
  std::shared_ptr<const PlacementManifest> ForLayer(int64_t layer) const;
  // The slot table of layers()[index] (this manifest when not per-layer).
  const PlacementManifest& LayerAt(int index) const;

  PlacementVersion version() const { return options_.version; }
  std::string VersionName() const;  // "placement-v17"
  const ProcessGroupId& process_group() const { return options_.process_group; }
  ProcessGroupEpoch epoch() const { return options_.epoch; }
  const CheckpointVersion& checkpoint() const { return options_.checkpoint; }
  int num_experts() const { return options_.num_experts; }
  int num_slots() const { return static_cast<int>(slots_.size()); }
  const std::vector<int64_t>& layers() const { return options_.layers; }
  // Whether a step of `layer` can run on this generation.
  bool ServesLayer(int64_t layer) const;
  int num_ranks() const { return static_cast<int>(local_slots_.size()); }

  const SlotRecord& slot(PhysicalSlotId q) const { return slots_[q.value()]; }
  const std::vector<SlotRecord>& slots() const { return slots_; }
  // rho_v(e): the slots holding logical expert e, ordered by (replica id, slot id).
  absl::Span<const PhysicalSlotId> SlotsOf(LogicalExpertId e) const;
  // Explicit local slot order of a rank (slot id order): the expert-offset coordinate.
  absl::Span<const PhysicalSlotId> LocalSlots(Rank r) const;
  // Position of q in LocalSlots(slot(q).rank).
  int LocalIndex(PhysicalSlotId q) const { return local_index_[q.value()]; }
  // Slot id by name, or -1.
  int FindSlot(const std::string& name) const;

 private:
  ManifestOptions options_;
  std::vector<SlotRecord> slots_;
  std::vector<int32_t> expert_begin_;  // E + 1 offsets into expert_slots_
  std::vector<PhysicalSlotId> expert_slots_;
  std::vector<std::vector<PhysicalSlotId>> local_slots_;
  std::vector<int32_t> local_index_;
  std::vector<std::shared_ptr<const PlacementManifest>> layer_manifests_;  // per-layer generations
};

enum class Incompatibility {
  kNone = 0,
  kWrongExpert,       // the slot stores another logical expert
  kStaleCheckpoint,   // the replica's checkpoint differs from c_v(e)
  kRankOutsideGroup,  // the destination rank is not in the pinned communicator
  kDomainMismatch,    // the topology label does not own that rank
};
const char* IncompatibilityName(Incompatibility reason);

// compatible(r, q; v) of 0x01D1 for a route targeting logical expert `e`: all four clauses.
Incompatibility CheckCompatible(LogicalExpertId e, PhysicalSlotId q, const PlacementManifest& manifest,
                                const ProcessGroup& group, const Topology& topology);
inline bool Compatible(LogicalExpertId e, PhysicalSlotId q, const PlacementManifest& manifest,
                       const ProcessGroup& group, const Topology& topology) {
  return CheckCompatible(e, q, manifest, group, topology) == Incompatibility::kNone;
}

// Before a generation may serve: every slot is compatible with its own expert, the manifest
// names this process group and epoch, and all replicas of one logical expert agree on the
// parameter digest (0x02B2), in every layer's slot table. FAILED_PRECONDITION naming the first
// offending slot (and layer) otherwise.
absl::Status VerifyForPublish(const PlacementManifest& manifest, const ProcessGroup& group, const Topology& topology);

}  // namespace moe

#endif  // MOE_RUNTIME_PLACEMENT_MANIFEST_H_
