#include "runtime/release/lifecycle.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace moe {

namespace {
constexpr ReleaseState kAll[] = {ReleaseState::kBuilt,    ReleaseState::kVerified, ReleaseState::kLoaded,
                                 ReleaseState::kShadow,   ReleaseState::kCanary,   ReleaseState::kActive,
                                 ReleaseState::kDraining, ReleaseState::kRetired};

struct Edge {
  ReleaseState from, to;
};
// The legal transitions, all in one place.
constexpr Edge kEdges[] = {
    {ReleaseState::kBuilt, ReleaseState::kVerified},    // digests and manifests check out
    {ReleaseState::kVerified, ReleaseState::kLoaded},   // weights materialized on every rank
    {ReleaseState::kLoaded, ReleaseState::kShadow},     // runs beside the active release on samples
    {ReleaseState::kShadow, ReleaseState::kCanary},     // serves a share of real traffic
    {ReleaseState::kCanary, ReleaseState::kActive},     // promoted (the 0x0DC gate)
    {ReleaseState::kActive, ReleaseState::kDraining},   // replaced or rolled back: no new dispatch
    {ReleaseState::kCanary, ReleaseState::kDraining},   // canary blocked / rolled back
    {ReleaseState::kShadow, ReleaseState::kDraining},   // shadow parity failed
    {ReleaseState::kDraining, ReleaseState::kActive},   // the prior release re-activated (rollback)
    {ReleaseState::kDraining, ReleaseState::kRetired},  // refcount reached zero
    {ReleaseState::kBuilt, ReleaseState::kRetired},     // rejected build
    {ReleaseState::kVerified, ReleaseState::kRetired},  // rejected load
    {ReleaseState::kLoaded, ReleaseState::kRetired},    // abandoned before serving
};
}  // namespace

const char* ReleaseStateName(ReleaseState s) {
  switch (s) {
    case ReleaseState::kBuilt:
      return "BUILT";
    case ReleaseState::kVerified:
      return "VERIFIED";
    case ReleaseState::kLoaded:
      return "LOADED";
    case ReleaseState::kShadow:
      return "SHADOW";
    case ReleaseState::kCanary:
      return "CANARY";
    case ReleaseState::kActive:
      return "ACTIVE";
    case ReleaseState::kDraining:
      return "DRAINING";
    case ReleaseState::kRetired:
      return "RETIRED";
  }
  return "UNKNOWN";
}

absl::StatusOr<ReleaseState> ParseReleaseState(const std::string& name) {
  for (ReleaseState s : kAll) {
    if (name == ReleaseStateName(s)) return s;
  }
  return absl::InvalidArgumentError(absl::StrCat("state: unknown release state '", name, "'"));
}

bool LegalTransition(ReleaseState from, ReleaseState to) {
  for (const Edge& e : kEdges) {
    if (e.from == from && e.to == to) return true;
  }
  return false;
}

absl::Status CheckTransitionReason(const std::string& reason) {
  if (reason.empty()) return absl::InvalidArgumentError("reason: every transition needs one");
  return absl::OkStatus();
}

absl::Status CheckTransition(const std::string& release_id, ReleaseState from, ReleaseState to,
                             const std::string& reason) {
  if (absl::Status s = CheckTransitionReason(reason); !s.ok()) return s;
  if (!LegalTransition(from, to)) {
    return absl::FailedPreconditionError(absl::StrCat(release_id, ": ", ReleaseStateName(from), " -> ",
                                                      ReleaseStateName(to), " is not a legal transition"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Transition> ReleaseLifecycle::Propose(ReleaseState to, const std::string& reason) {
  if (absl::Status s = CheckTransition(release_id_, state_, to, reason); !s.ok()) return s;
  return Transition{release_id_, state_, to, reason};
}

absl::Status ReleaseLifecycle::Apply(const Transition& t) {
  if (t.release_id != release_id_ || t.from != state_ || !LegalTransition(t.from, t.to)) {
    return absl::FailedPreconditionError(absl::StrCat(release_id_, ": cannot apply ", ReleaseStateName(t.from), " -> ",
                                                      ReleaseStateName(t.to), " in state ", ReleaseStateName(state_)));
  }
  state_ = t.to;
  history_.push_back(t);
  return absl::OkStatus();
}

absl::Status ReleaseLifecycle::TransitionTo(ReleaseState to, const std::string& reason) {
  auto t = Propose(to, reason);
  if (!t.ok()) return t.status();
  return Apply(*t);
}

PromotionDecision EvaluatePromotion(const PromotionInputs& in, const PromotionThresholds& t) {
  PromotionDecision d;
  auto clause = [&](bool ok, const std::string& name) {
    if (!ok) d.failed.push_back(name);
  };
  clause(in.hash_ok, "HashOK");
  clause(in.manifest_ok, "ManifestOK");
  clause(in.faults_ok, "FaultsOK");
  clause(in.rollback_ok, "RollbackOK");
  clause(in.shadow_samples >= t.min_shadow, absl::StrCat("N_shadow >= ", t.min_shadow));
  clause(in.canary_samples >= t.min_canary, absl::StrCat("N_canary >= ", t.min_canary));
  const double drop = in.routes_attempted == 0 ? 0 : static_cast<double>(in.routes_dropped) / in.routes_attempted;
  const double fallback = in.steps == 0 ? 0 : static_cast<double>(in.fallback_steps) / in.steps;
  clause(in.routes_attempted > 0 && drop <= t.max_drop_ratio, absl::StrCat("r_drop <= ", t.max_drop_ratio));
  clause(in.steps > 0 && fallback <= t.max_fallback_ratio, absl::StrCat("r_fallback <= ", t.max_fallback_ratio));
  clause(in.route_mismatches == 0, "N_route_mismatch = 0");
  clause(in.stale_accepts == 0, "N_stale_accept = 0");
  clause(in.count_failures == 0, "N_count_failure = 0");
  d.promote = d.failed.empty();
  return d;
}

EvaluationRatios Ratios(const std::vector<EvaluationCell>& cells) {
  EvaluationCell sum;
  for (const EvaluationCell& c : cells) {
    sum.steps += c.steps;
    sum.attempted += c.attempted;
    sum.accepted += c.accepted;
    sum.dropped += c.dropped;
    sum.remote += c.remote;
    sum.inter_node += c.inter_node;
    sum.replays += c.replays;
    sum.fallbacks += c.fallbacks;
  }
  auto div = [](int64_t a, int64_t b) { return b == 0 ? 0.0 : static_cast<double>(a) / b; };
  EvaluationRatios r;
  r.drop = div(sum.dropped, sum.attempted);
  r.remote = div(sum.remote, sum.accepted);
  r.inter_node = div(sum.inter_node, sum.accepted);
  r.graph_replay = div(sum.replays, sum.replays + sum.fallbacks);
  r.fallback_step = div(sum.fallbacks, sum.steps);
  return r;
}

}  // namespace moe
