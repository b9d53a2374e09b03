// Ordered rollback (spec 0x0EA):
//   stop new candidate dispatch -> activate the prior generation for new dispatch -> drain the
//   candidate's handles to zero -> release its graph resources -> retire it.
// Retiring first would be use-after-free; draining before activating the prior would be an
// outage. The order is written once, in RollBack over a RollbackTarget; a rank's registry
// (below) and the controller's rank agents (control/controller/agent_rollback.h) are targets.
// Each completed step is reported in order; the first failure stops the rollback as it is.
#ifndef MOE_RUNTIME_RELEASE_ROLLBACK_H_
#define MOE_RUNTIME_RELEASE_ROLLBACK_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "runtime/ids.h"
#include "runtime/placement/registry.h"

namespace moe {

struct RollbackReport {
  std::vector<std::string> steps;  // in the order performed
};

// What holds the candidate and the prior generation: the five steps of 0x0EA, each synchronous.
// A target whose mechanism fuses two steps does the work in the later one and returns OK from
// the earlier (the rank agents stop a candidate's dispatch by activating the prior).
class RollbackTarget {
 public:
  virtual ~RollbackTarget() = default;
  virtual absl::Status StopDispatch(PlacementVersion candidate) = 0;
  virtual absl::Status ActivatePrior(PlacementVersion prior) = 0;
  // Returns once no dispatch handle holds `candidate`; DEADLINE_EXCEEDED when the target's
  // timeout passes first (then nothing is released or retired).
  virtual absl::Status AwaitDrained(PlacementVersion candidate) = 0;
  virtual absl::Status ReleaseGraphs(PlacementVersion candidate) = 0;
  virtual absl::Status Retire(PlacementVersion candidate) = 0;
};

// Runs the five steps on `target` in order, then reports "rollback complete"; a failing step's
// status is returned unchanged.
absl::StatusOr<RollbackReport> RollBack(RollbackTarget& target, PlacementVersion candidate, PlacementVersion prior);

// On one rank's registry. FAILED_PRECONDITION when the prior is RETIRED or serves another
// checkpoint than the candidate (0x0EA; nothing changed).
// Blocks (polling the refcount) until the candidate drained or `drain_timeout` passed
// (DEADLINE_EXCEEDED: the candidate stays DRAINING, the prior stays ACTIVE; nothing retired).
absl::StatusOr<RollbackReport> RollBack(GenerationRegistry& registry, PlacementVersion candidate,
                                        PlacementVersion prior, const std::function<void()>& release_graphs,
                                        absl::Duration drain_timeout);

}  // namespace moe

#endif  // MOE_RUNTIME_RELEASE_ROLLBACK_H_
