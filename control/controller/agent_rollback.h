// The controller's side of the ordered rollback (spec 0x0EA, runtime/release/rollback.h): the
// five steps over every rank agent, each stopping at the first rank that fails (AgentPool).
//
// The rank agents fuse two pairs of steps, so two steps here send nothing:
//   StopDispatch   nothing: a rank stops the candidate's dispatch when it activates the prior
//                  (its registry moves the ACTIVE generation to DRAINING in the same step), and
//                  the store has already committed the candidate DRAINING;
//   ActivatePrior  ActivateGeneration(prior) on every rank;
//   AwaitDrained   polls every rank's status until none holds a handle on the candidate;
//   ReleaseGraphs  nothing: a rank frees the candidate's weights, plan layout and decode graphs
//                  in RetireGeneration, once its registry retired it (no handle is left by then);
//   Retire         RetireGeneration(candidate) on every rank.
// Not thread-safe; the pool is not owned.
#ifndef MOE_CONTROL_CONTROLLER_AGENT_ROLLBACK_H_
#define MOE_CONTROL_CONTROLLER_AGENT_ROLLBACK_H_

#include "absl/time/time.h"

#include "control/controller/agent_pool.h"
#include "runtime/release/rollback.h"

namespace moe {

class AgentRollback : public RollbackTarget {
 public:
  AgentRollback(AgentPool* agents, absl::Duration drain_timeout) : agents_(agents), drain_timeout_(drain_timeout) {}

  absl::Status StopDispatch(PlacementVersion) override { return absl::OkStatus(); }
  absl::Status ActivatePrior(PlacementVersion prior) override { return agents_->Activate(prior.value()); }
  absl::Status AwaitDrained(PlacementVersion candidate) override {
    return agents_->AwaitDrained(candidate.value(), drain_timeout_);
  }
  absl::Status ReleaseGraphs(PlacementVersion) override { return absl::OkStatus(); }
  absl::Status Retire(PlacementVersion candidate) override { return agents_->Retire(candidate.value()); }

 private:
  AgentPool* agents_;
  absl::Duration drain_timeout_;
};

}  // namespace moe

#endif  // MOE_CONTROL_CONTROLLER_AGENT_ROLLBACK_H_
