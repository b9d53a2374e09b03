// Expert-parallel load balancer (spec 0x08C-0x08E): a C++ port of the pinned EPLB solver
// (deepseek-ai/EPLB @ d52c72d), same algorithm, same FP32 arithmetic, same tie rules:
//   - balanced packing sorts items by descending weight, equal weights keeping index order, and
//     puts each item on the lightest pack that still has room (first such pack on ties); with
//     one item per pack it keeps item i on pack i;
//   - replication repeatedly adds a copy to argmax_e W_e / m_e (first index on ties);
//   - hierarchical policy (groups -> nodes, replicate inside nodes, copies -> GPUs) when the
//     number of groups divides by the number of nodes, otherwise the same routine with one group
//     and one node (global policy).
// Outputs are layer-major: phy2log [L, Q], phyrank [L, Q], logcnt [L, E] and the padded inverse
// log2phy [L, E, max count] (-1 = padding; index it only below logcnt).
//
// Thread-safety: pure functions.
#ifndef MOE_RUNTIME_PLACEMENT_EPLB_H_
#define MOE_RUNTIME_PLACEMENT_EPLB_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace moe {

struct EplbProblem {
  int layers = 0;
  int experts = 0;
  std::vector<float> weight;  // [layers, experts], non-negative load
  int num_replicas = 0;
  int num_groups = 1;
  int num_nodes = 1;
  int num_gpus = 1;
};

struct EplbSolution {
  int layers = 0;
  int experts = 0;
  int replicas = 0;
  int max_count = 0;
  bool hierarchical = false;
  std::vector<int64_t> phy2log;  // [L, Q]
  std::vector<int64_t> phyrank;  // [L, Q]
  std::vector<int64_t> logcnt;   // [L, E]
  std::vector<int64_t> log2phy;  // [L, E, max_count]
};

// INVALID_ARGUMENT naming the field for shapes or sizes the solver cannot take.
absl::StatusOr<EplbSolution> RebalanceExperts(const EplbProblem& problem);

// Ideal per-GPU load of one layer: sum over the GPU's copies of W_e / logcnt_e (0x08C3).
std::vector<double> IdealGpuLoads(const EplbProblem& problem, const EplbSolution& solution, int layer);
// Gamma_rank = max / mean of the ideal GPU loads (1 = perfectly balanced) (0x08D).
double Imbalance(const std::vector<double>& loads);

// Building blocks, exposed for tests of the tie rules. `weight` is [rows, n] row-major.
void BalancedPacking(const std::vector<float>& weight, int rows, int n, int num_packs, std::vector<int64_t>* pack_index,
                     std::vector<int64_t>* rank_in_pack);
void ReplicateExperts(const std::vector<float>& weight, int rows, int num_log, int num_phy,
                      std::vector<int64_t>* phy2log, std::vector<int64_t>* rank, std::vector<int64_t>* logcnt);

}  // namespace moe

#endif  // MOE_RUNTIME_PLACEMENT_EPLB_H_
