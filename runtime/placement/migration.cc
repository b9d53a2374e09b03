#include "runtime/placement/migration.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace moe {

const char* MigrationActionName(MigrationAction a) {
  switch (a) {
    case MigrationAction::kRetain:
      return "retain";
    case MigrationAction::kLocalDuplicate:
      return "same-GPU duplicate";
    case MigrationAction::kSameNodeCopy:
      return "same-node network copy";
    case MigrationAction::kCrossNodeCopy:
      return "cross-node network copy";
    case MigrationAction::kCheckpointLoad:
      return "checkpoint load";
  }
  return "unknown";
}

namespace {
bool SameState(const SlotRecord& a, const PlacementManifest& am, const SlotRecord& b, const PlacementManifest& bm) {
  return a.expert == b.expert && a.checkpoint == b.checkpoint && am.checkpoint() == bm.checkpoint() &&
         a.parameter_digest == b.parameter_digest;
}

// An unclaimed compatible copy of target slot `t` already resident on rank r, or -1.
int FindRetainable(const PlacementManifest& from, const PlacementManifest& to, const SlotRecord& t, int r,
                   const std::vector<bool>& claimed) {
  for (PhysicalSlotId s : from.LocalSlots(Rank(r))) {
    if (!claimed[s.value()] && SameState(from.slot(s), from, t, to)) return s.value();
  }
  return -1;
}

// The nearest compatible holder of `t` in the source placement for rank r, or -1: the same node
// first, then the lowest rank, then the lowest slot id.
int FindNearestHolder(const PlacementManifest& from, const PlacementManifest& to, const SlotRecord& t, int r,
                      const Topology& topology, const ProcessGroup* sources) {
  int best = -1;
  for (PhysicalSlotId s : from.SlotsOf(t.expert)) {
    const SlotRecord& c = from.slot(s);
    if (!SameState(c, from, t, to) || !topology.HasRank(c.rank)) continue;
    if (sources != nullptr && !sources->Contains(c.rank)) continue;  // a lost rank serves no copy
    if (best < 0) {
      best = s.value();
      continue;
    }
    const SlotRecord& b = from.slot(PhysicalSlotId(best));
    const bool c_near = topology.NodeOf(c.rank) == topology.NodeOf(Rank(r));
    const bool b_near = topology.NodeOf(b.rank) == topology.NodeOf(Rank(r));
    if (c_near != b_near ? c_near : (c.rank != b.rank ? c.rank < b.rank : c.slot < b.slot)) best = s.value();
  }
  return best;
}

// Picks the action (and source) for `step`, whose target is slot q on rank r. `first` is the
// first target slot on rank r that materialized the expert, or -1.
void ChooseSource(const PlacementManifest& from, const PlacementManifest& to, const Topology& topology,
                  const ProcessGroup* sources, int r, PhysicalSlotId q, int32_t first, std::vector<bool>& claimed,
                  MigrationStep& step) {
  const SlotRecord& t = to.slot(q);
  const int retain = FindRetainable(from, to, t, r, claimed);
  if (retain >= 0) {
    claimed[retain] = true;
    step.action = MigrationAction::kRetain;
    step.source_rank = Rank(r);
    step.source_slot = PhysicalSlotId(retain);
    return;
  }
  if (first >= 0) {
    step.action = MigrationAction::kLocalDuplicate;
    step.source_rank = Rank(r);
    step.source_slot = PhysicalSlotId(first);
    step.source_is_target = true;
    return;
  }
  const int best = FindNearestHolder(from, to, t, r, topology, sources);
  if (best < 0) {
    step.action = MigrationAction::kCheckpointLoad;
    return;
  }
  const SlotRecord& b = from.slot(PhysicalSlotId(best));
  step.action = topology.NodeOf(b.rank) == topology.NodeOf(Rank(r)) ? MigrationAction::kSameNodeCopy
                                                                    : MigrationAction::kCrossNodeCopy;
  step.source_rank = b.rank;
  step.source_slot = b.slot;
}

// Adds one step of `action` to the plan's per-action totals.
void CountAction(MigrationAction action, int64_t expert_bytes, MigrationPlan& plan) {
  switch (action) {
    case MigrationAction::kRetain:
      ++plan.retained_copies;
      plan.retained_bytes += expert_bytes;
      break;
    case MigrationAction::kLocalDuplicate:
      ++plan.local_duplicates;
      plan.local_bytes += expert_bytes;
      break;
    case MigrationAction::kSameNodeCopy:
      ++plan.same_node_copies;
      plan.same_node_bytes += expert_bytes;
      break;
    case MigrationAction::kCrossNodeCopy:
      ++plan.cross_node_copies;
      plan.cross_node_bytes += expert_bytes;
      break;
    case MigrationAction::kCheckpointLoad:
      ++plan.checkpoint_loads;
      plan.checkpoint_bytes += expert_bytes;
      break;
  }
}
}  // namespace

absl::StatusOr<MigrationPlan> PlanMigration(const PlacementManifest& from, const PlacementManifest& to,
                                            const Topology& topology, int64_t expert_bytes,
                                            const ProcessGroup* sources) {
  if (expert_bytes <= 0) return absl::InvalidArgumentError("expert_bytes: must be positive");
  if (from.num_experts() != to.num_experts()) {
    return absl::FailedPreconditionError(
        absl::StrCat(from.VersionName(), " and ", to.VersionName(), " disagree on the number of logical experts"));
  }
  MigrationPlan plan;
  std::vector<bool> claimed(from.num_slots(), false);
  // Per (rank, expert): the first target slot that materialized the expert there.
  std::vector<int32_t> materialized(static_cast<size_t>(topology.num_ranks()) * to.num_experts(), -1);

  for (int r = 0; r < topology.num_ranks(); ++r) {
    for (PhysicalSlotId q : to.LocalSlots(Rank(r))) {
      const SlotRecord& t = to.slot(q);
      MigrationStep step;
      step.target_rank = Rank(r);
      step.target_slot = q;
      step.expert = t.expert;
      step.bytes = expert_bytes;
      step.source_rank = Rank(-1);
      step.source_slot = PhysicalSlotId(-1);
      int32_t& first = materialized[static_cast<size_t>(r) * to.num_experts() + t.expert.value()];
      ChooseSource(from, to, topology, sources, r, q, first, claimed, step);
      if (first < 0) first = q.value();
      CountAction(step.action, expert_bytes, plan);
      plan.steps.push_back(step);
    }
  }
  for (int s = 0; s < from.num_slots(); ++s) {
    if (!claimed[s]) {
      ++plan.retired_copies;
      plan.retired_bytes += expert_bytes;
    }
  }
  plan.resident_from = static_cast<int64_t>(from.num_slots()) * expert_bytes;
  plan.resident_to = static_cast<int64_t>(to.num_slots()) * expert_bytes;
  plan.peak_bytes = plan.resident_from + plan.resident_to - plan.retained_bytes;
  plan.reserved_bytes = plan.resident_to - plan.retained_bytes;
  plan.materialized_peak_bytes = plan.resident_from + plan.resident_to;
  return plan;
}

namespace {

// Layer i's slot table with each slot's digest in that layer: a per-layer generation's own; for a
// shared table, its slots with their per-layer digests in place of the combined one (so that a
// copy compares equal with the same expert's copy in a per-layer table).
absl::StatusOr<std::shared_ptr<const PlacementManifest>> LayerTable(const PlacementManifest& m, int i,
                                                                    const Topology& topology) {
  if (m.layers().empty()) return m.shared_from_this();
  if (m.per_layer()) return m.ForLayer(m.layers()[i]);
  std::vector<SlotRecord> slots = m.slots();
  for (SlotRecord& s : slots) {
    s.parameter_digest = ParameterDigest(i < static_cast<int>(s.layer_digests.size()) ? s.layer_digests[i] : "");
    s.layer_digests.clear();
  }
  ManifestOptions o;
  o.version = m.version();
  o.process_group = m.process_group();
  o.epoch = m.epoch();
  o.checkpoint = m.checkpoint();
  o.num_experts = m.num_experts();
  o.layers = {m.layers()[i]};
  return PlacementManifest::Create(o, std::move(slots), topology);
}

}  // namespace

absl::StatusOr<LayeredMigrationPlan> PlanLayeredMigration(const PlacementManifest& from, const PlacementManifest& to,
                                                          const Topology& topology, int64_t expert_bytes,
                                                          const ProcessGroup* sources) {
  if (from.layers() != to.layers()) {
    return absl::FailedPreconditionError(absl::StrCat(from.VersionName(), " and ", to.VersionName(),
                                                      " serve different layers: nothing migrates between them"));
  }
  LayeredMigrationPlan out;
  out.layers = to.layers();
  const int n = out.layers.empty() ? 1 : static_cast<int>(out.layers.size());
  for (int i = 0; i < n; ++i) {
    if (i > 0 && !from.per_layer() && !to.per_layer()) {
      out.per_layer.push_back(out.per_layer.front());  // one shared slot table: the same plan
    } else {
      absl::StatusOr<MigrationPlan> plan = absl::UnknownError("");
      auto a = LayerTable(from, i, topology);
      auto b = LayerTable(to, i, topology);
      plan = !a.ok() ? a.status() : !b.ok() ? b.status() : PlanMigration(**a, **b, topology, expert_bytes, sources);
      if (!plan.ok()) {
        return out.layers.empty() ? plan.status()
                                  : absl::Status(plan.status().code(),
                                                 absl::StrCat("layer ", out.layers[i], ": ", plan.status().message()));
      }
      out.per_layer.push_back(*std::move(plan));
    }
    const MigrationPlan& p = out.per_layer.back();
    MigrationPlan& t = out.total;
    t.retained_copies += p.retained_copies;
    t.retained_bytes += p.retained_bytes;
    t.same_node_copies += p.same_node_copies;
    t.same_node_bytes += p.same_node_bytes;
    t.cross_node_copies += p.cross_node_copies;
    t.cross_node_bytes += p.cross_node_bytes;
    t.local_duplicates += p.local_duplicates;
    t.local_bytes += p.local_bytes;
    t.checkpoint_loads += p.checkpoint_loads;
    t.checkpoint_bytes += p.checkpoint_bytes;
    t.retired_copies += p.retired_copies;
    t.retired_bytes += p.retired_bytes;
    t.resident_from += p.resident_from;
    t.resident_to += p.resident_to;
    t.peak_bytes += p.peak_bytes;
    t.reserved_bytes += p.reserved_bytes;
    t.materialized_peak_bytes += p.materialized_peak_bytes;
  }
  return out;
}

}  // namespace moe
