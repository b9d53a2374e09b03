// `moectl rebalance`: EPLB over the load the ranks observed. Pure planning, no I/O: the current
// placement's per-rank load, the solver's placement, and the balancedness (mean rank load / max
// rank load, 1.0 = perfectly even; EPLB's own figure) and the spec's ideal rank-load ratio
// Gamma_rank (max / mean, 0x08D; 1.0 = even) of both, each expert's load split evenly over its copies.
#ifndef MOE_CONTROL_REBALANCE_H_
#define MOE_CONTROL_REBALANCE_H_

#include <cstdint>
#include <utility>
#include <vector>

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
};

absl::StatusOr<RebalancePlan> PlanRebalance(const RebalanceInput& in);

// mean / max of per-rank loads (1.0 for no load).
double Balancedness(const std::vector<double>& rank_load);
// Gamma_rank = max / mean of per-rank loads (0x08D; 1.0 for no load).
double GammaRank(const std::vector<double>& rank_load);

}  // namespace moe

#endif  // MOE_CONTROL_REBALANCE_H_
