#include "control/placement_report.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace moe {

namespace {

std::string Bytes(int64_t b) {
  if (b >= (int64_t{1} << 30)) return absl::StrFormat("%.2f GiB", b / double(int64_t{1} << 30));
  if (b >= (int64_t{1} << 20)) return absl::StrFormat("%.2f MiB", b / double(int64_t{1} << 20));
  return absl::StrFormat("%d B", b);
}

}  // namespace

std::string RenderManifest(const PlacementManifest& m, const Topology& topology) {
  std::string out = absl::StrFormat("%s: %d slots, %d logical experts, %s, process group %s epoch %d\n",
                                    m.VersionName(), m.num_slots(), m.num_experts(), m.checkpoint().value(),
                                    m.process_group().value(), m.epoch().value());
  absl::StrAppend(&out, absl::StrFormat("%-6s %-7s %-8s %-5s %-7s %s\n", "SLOT", "EXPERT", "REPLICA", "RANK", "NODE",
                                        "PARAMETER DIGEST"));
  for (const SlotRecord& s : m.slots()) {
    absl::StrAppend(
        &out, absl::StrFormat("%-6s %-7d %-8d %-5d %-7s %s\n", s.name, s.expert.value(), s.replica.value(),
                              s.rank.value(), topology.NodeName(s.domain), s.parameter_digest.value().substr(0, 16)));
  }
  return out;
}

std::string RenderMigration(const PlacementManifest& from, const PlacementManifest& to, const MigrationPlan& plan) {
  std::string out = absl::StrFormat("%s -> %s: %d target slots\n", from.VersionName(), to.VersionName(),
                                    static_cast<int>(plan.steps.size()));
  absl::StrAppend(&out, absl::StrFormat("%-5s %-6s %-7s %-24s %s\n", "RANK", "SLOT", "EXPERT", "ACTION", "SOURCE"));
  for (const MigrationStep& s : plan.steps) {
    std::string source = "checkpoint";
    if (s.action != MigrationAction::kCheckpointLoad) {
      const std::string& slot = s.source_is_target ? to.slot(s.source_slot).name : from.slot(s.source_slot).name;
      source = absl::StrCat("rank ", s.source_rank.value(), " ", slot, s.source_is_target ? " (new)" : "");
    }
    absl::StrAppend(&out,
                    absl::StrFormat("%-5d %-6s %-7d %-24s %s\n", s.target_rank.value(), to.slot(s.target_slot).name,
                                    s.expert.value(), MigrationActionName(s.action), source));
  }
  absl::StrAppend(
      &out,
      absl::StrFormat("retained %d (%s), local duplicates %d (%s), same-node copies %d (%s), cross-node copies %d "
                      "(%s), checkpoint loads %d (%s), retired %d (%s)\n",
                      plan.retained_copies, Bytes(plan.retained_bytes), plan.local_duplicates, Bytes(plan.local_bytes),
                      plan.same_node_copies, Bytes(plan.same_node_bytes), plan.cross_node_copies,
                      Bytes(plan.cross_node_bytes), plan.checkpoint_loads, Bytes(plan.checkpoint_bytes),
                      plan.retired_copies, Bytes(plan.retired_bytes)));
  absl::StrAppend(&out, absl::StrFormat("resident before %s, after %s; peak during the overlap %s (reserve %s); as "
                                        "the ranks materialize it (retained copies copied) %s\n",
                                        Bytes(plan.resident_from), Bytes(plan.resident_to), Bytes(plan.peak_bytes),
                                        Bytes(plan.reserved_bytes), Bytes(plan.materialized_peak_bytes)));
  return out;
}

}  // namespace moe
