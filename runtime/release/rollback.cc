#include "runtime/release/rollback.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace moe {

absl::StatusOr<RollbackReport> RollBack(GenerationRegistry& registry, PlacementVersion candidate, PlacementVersion prior,
                                        const std::function<void()>& release_graphs, absl::Duration drain_timeout) {
  RollbackReport report;
  auto prior_state = registry.State(prior);
  if (!prior_state.ok()) return prior_state.status();
  if (*prior_state == GenerationState::kRetired) {
    return absl::FailedPreconditionError(absl::StrCat("placement-v", prior.value(), " is RETIRED: nothing to roll back to"));
  }
  auto cand_state = registry.State(candidate);
  if (!cand_state.ok()) return cand_state.status();
  if (*cand_state == GenerationState::kActive) {
    if (absl::Status s = registry.StopDispatch(candidate); !s.ok()) return s;
  }
  report.steps.push_back(absl::StrCat("stop new dispatch on placement-v", candidate.value()));
  if (absl::Status s = registry.Activate(prior); !s.ok()) return s;
  report.steps.push_back(absl::StrCat("activate placement-v", prior.value(), " for new dispatch"));
  const absl::Time deadline = absl::Now() + drain_timeout;
  while (registry.Refcount(candidate) > 0) {
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("placement-v", candidate.value(), " still holds ",
                                                      registry.Refcount(candidate), " handles after ",
                                                      absl::FormatDuration(drain_timeout)));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  report.steps.push_back(absl::StrCat("drain placement-v", candidate.value(), " handles to zero"));
  if (release_graphs) release_graphs();
  report.steps.push_back(absl::StrCat("release placement-v", candidate.value(), " graph resources"));
  if (absl::Status s = registry.Retire(candidate); !s.ok()) return s;
  report.steps.push_back(absl::StrCat("retire placement-v", candidate.value()));
  return report;
}

}  // namespace moe
