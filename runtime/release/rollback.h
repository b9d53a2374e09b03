// Ordered rollback (spec 0x0EA) on a rank's generation registry:
//   stop new candidate dispatch -> activate the prior generation for new dispatch -> drain the
//   candidate's handles to zero -> release its graph resources -> retire it.
// Retiring first would be use-after-free; draining before activating the prior would be an
// outage. Each completed step is reported in order.
#ifndef MOE_RUNTIME_RELEASE_ROLLBACK_H_
#define MOE_RUNTIME_RELEASE_ROLLBACK_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "runtime/placement/registry.h"

namespace moe {

struct RollbackReport {
  std::vector<std::string> steps;  // in the order performed
};

// Blocks (polling the refcount) until the candidate drained or `drain_timeout` passed
// (DEADLINE_EXCEEDED: the candidate stays DRAINING, the prior stays ACTIVE; nothing retired).
absl::StatusOr<RollbackReport> RollBack(GenerationRegistry& registry, PlacementVersion candidate, PlacementVersion prior,
                                        const std::function<void()>& release_graphs, absl::Duration drain_timeout);

}  // namespace moe

#endif  // MOE_RUNTIME_RELEASE_ROLLBACK_H_
