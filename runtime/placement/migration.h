// Weight migration between two placements (spec 0x08F, 0x08K).
//
// For every target slot, in (target rank, slot id) order, the planner picks the cheapest way
// to materialize the expert's state on the target rank:
//   retain            - the rank already holds a compatible copy in the source placement that no
//                       other target slot has claimed (no transfer);
//   local duplicate   - an earlier target slot on the same rank materializes the expert
//                       (same-GPU copy after that slot);
//   same-node copy    - copy from a source-placement holder on the same node;
//   cross-node copy   - copy from a holder on another node;
//   checkpoint load   - no holder exists: read from the checkpoint.
// Network sources prefer the same node, then the lowest rank, then the lowest slot id, among
// the ranks of the group the copies come from (when one is given).
// Compatible means same logical expert, same checkpoint and same parameter digest.
//
// Peak unique parameter storage during the overlap is resident(from) + resident(to) -
// retained (retained storage is shared by both generation records, never counted twice).
#ifndef MOE_RUNTIME_PLACEMENT_MIGRATION_H_
#define MOE_RUNTIME_PLACEMENT_MIGRATION_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "runtime/placement/manifest.h"
#include "runtime/placement/topology.h"

namespace moe {

enum class MigrationAction { kRetain, kLocalDuplicate, kSameNodeCopy, kCrossNodeCopy, kCheckpointLoad };
const char* MigrationActionName(MigrationAction a);

struct MigrationStep {
  Rank target_rank;
  PhysicalSlotId target_slot;
  LogicalExpertId expert;
  MigrationAction action;
  Rank source_rank;               // -1 for checkpoint loads
  PhysicalSlotId source_slot;     // source placement slot, or the earlier target slot for duplicates
  bool source_is_target = false;  // source_slot names a target-placement slot
  int64_t bytes = 0;
};

struct MigrationPlan {
  std::vector<MigrationStep> steps;
  int64_t retained_copies = 0, retained_bytes = 0;
  int64_t same_node_copies = 0, same_node_bytes = 0;
  int64_t cross_node_copies = 0, cross_node_bytes = 0;
  int64_t local_duplicates = 0, local_bytes = 0;
  int64_t checkpoint_loads = 0, checkpoint_bytes = 0;
  int64_t retired_copies = 0, retired_bytes = 0;  // source copies no target retains
  int64_t resident_from = 0, resident_to = 0;
  // 0x08G's peak: both generations resident, a retained copy's storage shared by them.
  int64_t peak_bytes = 0;
  int64_t reserved_bytes = 0;  // storage to reserve: every non-retained target copy
  // The peak as the ranks materialize a plan today: every target slot gets storage of its own (a
  // retained copy is copied into it in memory, no network), beside the source generation's until
  // it retires, so nothing is shared: resident_from + resident_to. Admission uses this one.
  int64_t materialized_peak_bytes = 0;
};

// `expert_bytes` is the parameter payload of one expert copy (3 d d_ff b_w for SwiGLU).
// `sources`, when given, is the process group the copies come from: a holder on a rank outside
// it (a lost rank whose slots a rebound placement keeps) is never a network source, so such an
// expert is copied from a member or loaded from the checkpoint.
absl::StatusOr<MigrationPlan> PlanMigration(const PlacementManifest& from, const PlacementManifest& to,
                                            const Topology& topology, int64_t expert_bytes,
                                            const ProcessGroup* sources = nullptr);

// The migration of every MoE layer between two generations over the same layers: one plan per
// layer on the layers' slot tables (their own in per-layer generations, else the shared one),
// and the totals. `expert_bytes` is one expert's parameters in one layer. Layers hold disjoint
// storage, so the peak of the whole migration is the sum of the layers' peaks.
struct LayeredMigrationPlan {
  std::vector<int64_t> layers;           // empty: one expert set (single-layer checkpoints)
  std::vector<MigrationPlan> per_layer;  // one per layer (one when `layers` is empty)
  MigrationPlan total;                   // counts and bytes summed over the layers (no steps)
};

// FAILED_PRECONDITION when the generations serve different layers (a new checkpoint: every
// slot loads from it).
absl::StatusOr<LayeredMigrationPlan> PlanLayeredMigration(const PlacementManifest& from, const PlacementManifest& to,
                                                          const Topology& topology, int64_t expert_bytes,
                                                          const ProcessGroup* sources = nullptr);

}  // namespace moe

#endif  // MOE_RUNTIME_PLACEMENT_MIGRATION_H_
