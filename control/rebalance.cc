#include "control/rebalance.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "runtime/placement/eplb.h"
#include "runtime/status.h"

namespace moe {

namespace {

// Each expert's load split evenly over its copies, summed per rank.
std::vector<double> RankLoad(const std::vector<int64_t>& load, const std::vector<std::vector<int>>& slot_experts,
                             std::vector<int>* copies) {
  copies->assign(load.size(), 0);
  for (const auto& rank : slot_experts) {
    for (int e : rank) ++(*copies)[e];
  }
  std::vector<double> out;
  for (const auto& rank : slot_experts) {
    double sum = 0;
    for (int e : rank) sum += static_cast<double>(load[e]) / (*copies)[e];
    out.push_back(sum);
  }
  return out;
}

}  // namespace

double Balancedness(const std::vector<double>& rank_load) {
  if (rank_load.empty()) return 1.0;
  const double max = *std::max_element(rank_load.begin(), rank_load.end());
  if (max <= 0) return 1.0;
  return std::accumulate(rank_load.begin(), rank_load.end(), 0.0) / rank_load.size() / max;
}

double GammaRank(const std::vector<double>& rank_load) {
  const double b = Balancedness(rank_load);
  return b > 0 ? 1.0 / b : 1.0;
}

absl::StatusOr<RebalancePlan> PlanRebalance(const RebalanceInput& in) {
  const int experts = static_cast<int>(in.expert_load.size());
  const int ranks = static_cast<int>(in.current_slot_experts.size());
  if (experts == 0) return absl::FailedPreconditionError("expert_routes: the ranks reported no load yet");
  if (ranks == 0) return absl::FailedPreconditionError("ranks: none reported a placement");
  int current_slots = 0;
  for (const auto& rank : in.current_slot_experts) {
    for (int e : rank) {
      if (e < 0 || e >= experts) return absl::InvalidArgumentError(absl::StrCat("active_slot_experts: expert ", e));
    }
    current_slots += static_cast<int>(rank.size());
  }
  RebalancePlan plan;
  plan.num_replicas = in.num_replicas > 0 ? in.num_replicas : (current_slots + ranks - 1) / ranks * ranks;
  if (plan.num_replicas % ranks != 0 || plan.num_replicas < experts) {
    return absl::InvalidArgumentError(absl::StrCat("--num_replicas: ", plan.num_replicas, " must be a multiple of the ",
                                                   ranks, " ranks and at least the ", experts, " experts"));
  }
  std::vector<int> copies;
  plan.rank_load_before = RankLoad(in.expert_load, in.current_slot_experts, &copies);
  for (int e = 0; e < experts; ++e) {
    if (copies[e] == 0)
      return absl::FailedPreconditionError(absl::StrCat("current placement: expert ", e, " has no slot"));
  }
  plan.copies_before = copies;
  plan.balancedness_before = Balancedness(plan.rank_load_before);
  plan.gamma_before = GammaRank(plan.rank_load_before);

  EplbProblem p;
  p.layers = 1;
  p.experts = experts;
  for (int64_t w : in.expert_load) p.weight.push_back(static_cast<float>(w));
  p.num_replicas = plan.num_replicas;
  p.num_groups = in.num_groups;
  p.num_nodes = in.num_nodes;
  p.num_gpus = ranks;
  auto solution = RebalanceExperts(p);
  if (!solution.ok()) return solution.status();
  plan.hierarchical = solution->hierarchical;
  const int per_rank = plan.num_replicas / ranks;
  std::vector<std::vector<int>> after(ranks);
  for (int q = 0; q < plan.num_replicas; ++q) {
    const int e = static_cast<int>(solution->phy2log[q]);
    after[q / per_rank].push_back(e);
    plan.expert_rank.emplace_back(e, q / per_rank);
    plan.replica_rank.push_back(static_cast<int>(solution->phyrank[q]));
  }
  plan.rank_load_after = RankLoad(in.expert_load, after, &plan.copies_after);
  plan.balancedness_after = Balancedness(plan.rank_load_after);
  plan.gamma_after = GammaRank(plan.rank_load_after);
  return plan;
}

absl::Status CheckRebalanceNodes(const std::vector<std::string>& node_of_rank, int num_nodes) {
  if (num_nodes <= 1) return absl::OkStatus();
  const int ranks = static_cast<int>(node_of_rank.size());
  if (ranks % num_nodes != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--num_nodes: ", num_nodes, " nodes do not divide the ", ranks, " ranks"));
  }
  const int per_node = ranks / num_nodes;
  for (int r = 0; r < ranks; ++r) {
    const std::string& first = node_of_rank[r - r % per_node];  // the block's node
    const bool starts_block = r % per_node == 0;
    const bool seen_before = starts_block && std::find(node_of_rank.begin(), node_of_rank.begin() + r,
                                                       node_of_rank[r]) != node_of_rank.begin() + r;
    if (node_of_rank[r].empty() || node_of_rank[r] != first || seen_before) {
      return absl::FailedPreconditionError(
          absl::StrCat("--num_nodes ", num_nodes, ": the solver's node ", r / per_node, " is ranks ", r - r % per_node,
                       "..", r - r % per_node + per_node - 1, ", but rank ", r, " is on node '", node_of_rank[r],
                       "' (the ranks' nodes, in rank order: ", absl::StrJoin(node_of_rank, ","), ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckOneLoadSignal(const std::vector<RankLoadSource>& ranks, int num_nodes) {
  std::vector<std::string> nodes;
  for (const RankLoadSource& r : ranks) {
    const RankLoadSource& first = ranks.front();
    if (r.checkpoint_version != first.checkpoint_version) {
      return absl::FailedPreconditionError(absl::StrCat("rank ", r.address, " serves checkpoint '",
                                                        r.checkpoint_version, "', rank ", first.address, " '",
                                                        first.checkpoint_version, "': their loads are not one signal"));
    }
    if (r.active_version != first.active_version || r.process_group_epoch != first.process_group_epoch) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", r.address, " serves placement-v", r.active_version, " in process-group epoch ",
                       r.process_group_epoch, ", rank ", first.address, " placement-v", first.active_version,
                       " in epoch ", first.process_group_epoch, ": a switch under way? (try again)"));
    }
    nodes.push_back(r.node);
  }
  return CheckRebalanceNodes(nodes, num_nodes);
}

namespace {

// after - before of one counter table, or FAILED_PRECONDITION naming the rank and what went back.
absl::Status Subtract(const std::string& rank, const std::string& what, const std::vector<int64_t>& before,
                      std::vector<int64_t>* after) {
  if (before.size() != after->size()) {
    return absl::FailedPreconditionError(absl::StrCat("rank ", rank, ": ", what, "counts ", before.size(),
                                                      " experts in the first read, ", after->size(), " in the second"));
  }
  for (size_t e = 0; e < before.size(); ++e) {
    if ((*after)[e] < before[e]) {
      return absl::FailedPreconditionError(absl::StrCat("rank ", rank, ": ", what, "expert ", e, "'s routes went from ",
                                                        before[e], " to ", (*after)[e],
                                                        ": the daemon restarted within the window (try again)"));
    }
    (*after)[e] -= before[e];
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<RankLoadCounts>> LoadOverWindow(const std::vector<RankLoadCounts>& before,
                                                           const std::vector<RankLoadCounts>& after) {
  if (before.size() != after.size()) {
    return absl::FailedPreconditionError(absl::StrCat("the first read lists ", before.size(), " ranks, the second ",
                                                      after.size(), ": the group changed within the window"));
  }
  std::vector<RankLoadCounts> out = after;
  int64_t total = 0;
  for (size_t r = 0; r < after.size(); ++r) {
    const RankLoadSource &a = before[r].source, &b = after[r].source;
    if (a.address != b.address) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", r, " is ", a.address, " in the first read, ", b.address, " in the second"));
    }
    if (a.checkpoint_version != b.checkpoint_version || a.active_version != b.active_version ||
        a.process_group_epoch != b.process_group_epoch) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", b.address, " served checkpoint '", a.checkpoint_version, "' placement-v", a.active_version,
          " epoch ", a.process_group_epoch, " at the window's start and '", b.checkpoint_version, "' placement-v",
          b.active_version, " epoch ", b.process_group_epoch, " at its end: its slots changed within the window"));
    }
    RETURN_IF_ERROR(Subtract(b.address, "", before[r].routes, &out[r].routes));
    if (before[r].layers.size() != after[r].layers.size()) {
      return absl::FailedPreconditionError(absl::StrCat("rank ", b.address, " reports ", before[r].layers.size(),
                                                        " layers in the first read, ", after[r].layers.size(),
                                                        " in the second"));
    }
    for (size_t i = 0; i < after[r].layers.size(); ++i) {
      if (before[r].layers[i].first != after[r].layers[i].first) {
        return absl::FailedPreconditionError(absl::StrCat("rank ", b.address, ": layer ", after[r].layers[i].first,
                                                          " where the first read had ", before[r].layers[i].first));
      }
      RETURN_IF_ERROR(Subtract(b.address, absl::StrCat("layer ", after[r].layers[i].first, " "),
                               before[r].layers[i].second, &out[r].layers[i].second));
    }
    for (int64_t n : out[r].routes) total += n;
  }
  if (total == 0) {
    return absl::FailedPreconditionError("no routes were counted within the window: the ranks served no steps");
  }
  return out;
}

}  // namespace moe
