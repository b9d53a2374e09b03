// Release lifecycle (spec 0x0C, 0x0EA; conventions 8): BUILT -> VERIFIED -> LOADED -> SHADOW ->
// CANARY -> ACTIVE -> DRAINING -> RETIRED, the legal transitions in one table, a reason on every
// transition, and the promotion gate of 0x0DC as a conjunction with named failing clauses.
#ifndef MOE_RUNTIME_RELEASE_LIFECYCLE_H_
#define MOE_RUNTIME_RELEASE_LIFECYCLE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "runtime/quantile.h"

namespace moe {

enum class ReleaseState { kBuilt, kVerified, kLoaded, kShadow, kCanary, kActive, kDraining, kRetired };
const char* ReleaseStateName(ReleaseState s);
absl::StatusOr<ReleaseState> ParseReleaseState(const std::string& name);

// The one table of legal transitions. Rollback paths: CANARY/SHADOW/ACTIVE -> DRAINING (stop new
// dispatch); a prior release goes DRAINING -> ACTIVE when it is re-activated.
bool LegalTransition(ReleaseState from, ReleaseState to);

// The check every transition of `release_id` passes, wherever releases are kept (a
// ReleaseLifecycle here, the controller's store): INVALID_ARGUMENT without a reason
// (CheckTransitionReason), FAILED_PRECONDITION naming both states when the table has no such edge.
absl::Status CheckTransition(const std::string& release_id, ReleaseState from, ReleaseState to,
                             const std::string& reason);
// CheckTransition's first half, for a caller that refuses a reasonless request before it reads
// any state (the store checks a whole batch's reasons before its transaction).
absl::Status CheckTransitionReason(const std::string& reason);

struct Transition {
  std::string release_id;
  ReleaseState from;
  ReleaseState to;
  std::string reason;
};

// One release's state machine. Transition() refuses illegal moves (FAILED_PRECONDITION naming
// both states) and a missing reason (INVALID_ARGUMENT).
class ReleaseLifecycle {
 public:
  explicit ReleaseLifecycle(std::string release_id, ReleaseState initial = ReleaseState::kBuilt)
      : release_id_(std::move(release_id)), state_(initial) {}
  ReleaseState state() const { return state_; }
  const std::string& release_id() const { return release_id_; }
  const std::vector<Transition>& history() const { return history_; }
  // Checks and builds the transition without applying it.
  absl::StatusOr<Transition> Propose(ReleaseState to, const std::string& reason);
  absl::Status Apply(const Transition& t);
  absl::Status TransitionTo(ReleaseState to, const std::string& reason);

 private:
  std::string release_id_;
  ReleaseState state_;
  std::vector<Transition> history_;
};

// 0x0DC promotion inputs, read from the ranks' counters (runtime/release/evidence.h) or given by
// an operator. Every field is evidence: no clause is true by construction.
struct PromotionInputs {
  bool hash_ok = false;
  bool manifest_ok = false;
  bool faults_ok = false;
  bool rollback_ok = false;
  int64_t shadow_samples = 0;
  int64_t canary_samples = 0;
  int64_t routes_attempted = 0;  // r_drop = routes_dropped / routes_attempted
  int64_t routes_dropped = 0;
  int64_t steps = 0;  // ALL steps: r_fallback = fallback_steps / steps (0x0D)
  int64_t fallback_steps = 0;
  int64_t route_mismatches = 0;
  int64_t stale_accepts = 0;
  int64_t count_failures = 0;
};

struct PromotionThresholds {
  int64_t min_shadow = 100;
  int64_t min_canary = 200;
  double max_drop_ratio = 0.005;
  double max_fallback_ratio = 0.15;
};

struct PromotionDecision {
  bool promote = false;
  std::vector<std::string> failed;  // the clauses that are false, in the gate's order
};

PromotionDecision EvaluatePromotion(const PromotionInputs& in, const PromotionThresholds& t = {});

// 0x0D evaluation ratios with their declared denominators.
struct EvaluationCell {
  int64_t steps = 0, attempted = 0, accepted = 0, dropped = 0, remote = 0, inter_node = 0;
  int64_t replays = 0, fallbacks = 0;
};
struct EvaluationRatios {
  double drop = 0, remote = 0, inter_node = 0, graph_replay = 0, fallback_step = 0;
};
EvaluationRatios Ratios(const std::vector<EvaluationCell>& cells);

// (0x0DA's nearest-rank quantile, NearestRank, is runtime/quantile.h.)

}  // namespace moe

#endif  // MOE_RUNTIME_RELEASE_LIFECYCLE_H_
