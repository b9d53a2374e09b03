// `moectl rebalance`: EPLB over the load the ranks observed. Pure planning, no I/O: the current
// placement's per-rank load, the solver's placement, and the balancedness (mean rank load / max
// rank load, 1.0 = perfectly even; EPLB's own figure) and the spec's ideal rank-load ratio
// Gamma_rank (max / mean, 0x08D; 1.0 = even) of both, each expert's load split evenly over its copies.
#ifndef MOE_CONTROL_REBALANCE_H_
#define MOE_CONTROL_REBALANCE_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moe {

struct RebalanceInput {
  std::vector<int64_t> expert_load;                    // [E] routes per logical expert
  std::vector<std::vector<int>> current_slot_experts;  // per rank: logical expert of each slot
  int num_replicas = 0;  // physical slots of the new placement; 0: current slots rounded up to a multiple of ranks
  int num_groups = 1;
  int num_nodes = 1;
};

struct RebalancePlan {
  int num_replicas = 0;
  std::vector<double> rank_load_before, rank_load_after;
  double balancedness_before = 0, balancedness_after = 0;
  double gamma_before = 0, gamma_after = 0;      // Gamma_rank = max / mean rank load (0x08D)
  std::vector<int> copies_before, copies_after;  // [E]
  std::vector<std::pair<int, int>> expert_rank;  // new placement: (expert, rank) per slot, slot order
  std::vector<int> replica_rank;  // ... and each slot's rank among its expert's copies (EPLB's phyrank, 0x08C3)
  // Which of EPLB's policies solved it: hierarchical (groups packed to nodes first) when the
  // groups divide by the nodes, else the global one (0x08D: different contracts).
  bool hierarchical = false;
};

absl::StatusOr<RebalancePlan> PlanRebalance(const RebalanceInput& in);

// The hierarchical policy's nodes are contiguous blocks of num_gpus / num_nodes ranks (solver GPU
// g is rank g, node n holds ranks [n*R/N, (n+1)*R/N)). With num_nodes > 1 the ranks' reported
// nodes (`node_of_rank`, one per rank in rank order) must be exactly that layout: num_nodes
// distinct names, each over one such block. FAILED_PRECONDITION naming the first rank that is
// not (a packing on fictional nodes would be called node-local while it crosses them, 0x07I).
absl::Status CheckRebalanceNodes(const std::vector<std::string>& node_of_rank, int num_nodes);

// What one rank says its routes per expert were counted on (AgentStatusResponse), in rank order.
struct RankLoadSource {
  std::string address;
  std::string checkpoint_version;
  std::string node;
  int64_t active_version = 0;
  int64_t process_group_epoch = 0;
};

// The ranks' loads are one EPLB input only when every rank counted them on the same checkpoint
// (0x08A: demand has provenance), serves the same placement generation in the same process-group
// epoch (mid-switch, their slots belong to different generations, which no single current
// placement explains), and their nodes are the solver's (CheckRebalanceNodes).
// FAILED_PRECONDITION naming the first rank that differs from rank 0.
absl::Status CheckOneLoadSignal(const std::vector<RankLoadSource>& ranks, int num_nodes);

// One rank's route counters at one read (AgentStatusResponse.expert_routes and the layers'),
// which run from the daemon's start.
struct RankLoadCounts {
  RankLoadSource source;
  std::vector<int64_t> routes;                                   // [E]
  std::vector<std::pair<int64_t, std::vector<int64_t>>> layers;  // (layer, [E])
};

// `rebalance --window_s`: the routes counted between two reads of the same ranks, after - before.
// FAILED_PRECONDITION naming the rank where the two reads are not one window of one signal: other
// ranks (or another order), another checkpoint, active generation or epoch in the second read
// (the slots changed within the window), other experts or layers, or a counter lower than before
// (the daemon restarted within the window); and when no route at all was counted in it.
absl::StatusOr<std::vector<RankLoadCounts>> LoadOverWindow(const std::vector<RankLoadCounts>& before,
                                                           const std::vector<RankLoadCounts>& after);

// mean / max of per-rank loads (1.0 for no load).
double Balancedness(const std::vector<double>& rank_load);
// Gamma_rank = max / mean of per-rank loads (0x08D; 1.0 for no load).
double GammaRank(const std::vector<double>& rank_load);

}  // namespace moe

#endif  // MOE_CONTROL_REBALANCE_H_
