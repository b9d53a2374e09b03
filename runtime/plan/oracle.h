// CPU oracle of one layer step with scalar teaching experts E_e(x) = s_e x (spec 0x03C3, 0x04F).
//
// PhysicalOutputs moves real rows through the plan: pack each source in send order, exchange
// (source-major receive), repack expert-major, run the chosen runner layout (padding poisoned),
// invert the repack, return to the origin's send positions and combine over the semantic key.
// SemanticOutputs computes y_t = sum_e g_te s_e h_t directly. The two must agree exactly up to
// FP32 rounding; wrong-expert execution is observable because scales differ per expert.
#ifndef MOE_RUNTIME_PLAN_ORACLE_H_
#define MOE_RUNTIME_PLAN_ORACLE_H_

#include <vector>

#include "absl/status/statusor.h"

#include "runtime/exec/runner_layout.h"
#include "runtime/plan/route_plan.h"

namespace moe {

// hidden[p] holds partition p's rows, T_p x d, row-major FP32.
using PartitionRows = std::vector<std::vector<float>>;

absl::StatusOr<PartitionRows> SemanticOutputs(const SemanticHandoff& routes, const PartitionRows& hidden, int d,
                                              const std::vector<float>& expert_scale);

absl::StatusOr<PartitionRows> PhysicalOutputs(const ClusterPlan& plan, const FrozenHandoff& handoff,
                                              const PlacementManifest& manifest, const PartitionRows& hidden, int d,
                                              const std::vector<float>& expert_scale, const RunnerLayoutParams& runner);

}  // namespace moe

#endif  // MOE_RUNTIME_PLAN_ORACLE_H_
