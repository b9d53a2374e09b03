#include "runtime/release/rollback.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "runtime/status.h"

namespace moe {

namespace {

// A rank's own registry; `release_graphs` (may be empty) frees the candidate's graph resources.
class RegistryRollback : public RollbackTarget {
 public:
  RegistryRollback(GenerationRegistry& registry, std::function<void()> release_graphs, absl::Duration drain_timeout)
      : registry_(registry), release_graphs_(std::move(release_graphs)), drain_timeout_(drain_timeout) {}

  absl::Status StopDispatch(PlacementVersion candidate) override {
    ASSIGN_OR_RETURN(const GenerationState state, registry_.State(candidate));
    return state == GenerationState::kActive ? registry_.StopDispatch(candidate) : absl::OkStatus();
  }
  absl::Status ActivatePrior(PlacementVersion prior) override { return registry_.Activate(prior); }
  absl::Status AwaitDrained(PlacementVersion candidate) override {
    const absl::Time deadline = absl::Now() + drain_timeout_;
    while (registry_.Refcount(candidate) > 0) {
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat("placement-v", candidate.value(), " still holds ",
                                                        registry_.Refcount(candidate), " handles after ",
                                                        absl::FormatDuration(drain_timeout_)));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return absl::OkStatus();
  }
  absl::Status ReleaseGraphs(PlacementVersion) override {
    if (release_graphs_) release_graphs_();
    return absl::OkStatus();
  }
  absl::Status Retire(PlacementVersion candidate) override { return registry_.Retire(candidate); }

 private:
  GenerationRegistry& registry_;
  std::function<void()> release_graphs_;
  absl::Duration drain_timeout_;
};

}  // namespace

absl::StatusOr<RollbackReport> RollBack(RollbackTarget& target, PlacementVersion candidate, PlacementVersion prior) {
  RollbackReport report;
  const std::string c = absl::StrCat("placement-v", candidate.value());
  RETURN_IF_ERROR(target.StopDispatch(candidate));
  report.steps.push_back(absl::StrCat("stop new dispatch on ", c));
  RETURN_IF_ERROR(target.ActivatePrior(prior));
  report.steps.push_back(absl::StrCat("activate placement-v", prior.value(), " for new dispatch"));
  RETURN_IF_ERROR(target.AwaitDrained(candidate));
  report.steps.push_back(absl::StrCat("drain ", c, " handles to zero"));
  RETURN_IF_ERROR(target.ReleaseGraphs(candidate));
  report.steps.push_back(absl::StrCat("release ", c, " graph resources"));
  RETURN_IF_ERROR(target.Retire(candidate));
  report.steps.push_back(absl::StrCat("retire ", c));
  report.steps.push_back("rollback complete");
  return report;
}

absl::StatusOr<RollbackReport> RollBack(GenerationRegistry& registry, PlacementVersion candidate,
                                        PlacementVersion prior, const std::function<void()>& release_graphs,
                                        absl::Duration drain_timeout) {
  ASSIGN_OR_RETURN(const GenerationState prior_state, registry.State(prior));
  if (prior_state == GenerationState::kRetired) {
    return absl::FailedPreconditionError(
        absl::StrCat("placement-v", prior.value(), " is RETIRED: nothing to roll back to"));
  }
  // 0x0EA: `assert prior.checkpoint_version == candidate.checkpoint_version`. A rollback moves
  // dispatch between placements of one checkpoint; a release that changed the weights is left
  // by rolling forward.
  std::shared_ptr<const PlacementManifest> p, q;
  for (const GenerationInfo& g : registry.List()) {
    if (g.version == prior) p = g.manifest;
    if (g.version == candidate) q = g.manifest;
  }
  if (p != nullptr && q != nullptr && p->checkpoint() != q->checkpoint()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "placement-v", prior.value(), " serves ", p->checkpoint().value(), ", placement-v", candidate.value(),
        " serves ", q->checkpoint().value(), ": a rollback keeps the checkpoint (roll forward instead)"));
  }
  RegistryRollback target(registry, release_graphs, drain_timeout);
  return RollBack(target, candidate, prior);
}

}  // namespace moe
