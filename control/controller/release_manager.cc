#include "control/controller/release_manager.h"

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

#include "runtime/status.h"

namespace moe {

StoreReleaseManager::StoreReleaseManager(ReleaseStore* store, PromotionThresholds thresholds, AgentPool* agents,
                                         std::optional<Topology> topology, absl::Duration drain_timeout,
                                         MigrationBudget migration, TrialPolicy trial)
    : store_(store),
      thresholds_(thresholds),
      agents_(agents),
      topology_(std::move(topology)),
      drain_timeout_(drain_timeout),
      migration_(migration),
      trial_(trial) {
  MOE_CHECK(agents_ == nullptr || agents_->empty() ||
                (topology_.has_value() && topology_->num_ranks() == static_cast<int>(agents_->addresses().size())),
            "the rank agents need their topology, one rank per agent");
}

absl::StatusOr<ReleaseRecord> StoreReleaseManager::Register(const std::string& request_id,
                                                            const std::string& release_id,
                                                            const std::string& bundle_digest) {
  absl::MutexLock lock(&write_mu_);
  return store_->Register(request_id, release_id, bundle_digest);
}

absl::StatusOr<StoredTransition> StoreReleaseManager::Transition(const std::string& request_id,
                                                                 const std::string& release_id, ReleaseState to,
                                                                 const std::string& reason) {
  if (to == ReleaseState::kActive) {
    return absl::FailedPreconditionError("to: ACTIVE is reached through Promote (the 0x0DC gate)");
  }
  absl::MutexLock lock(&write_mu_);
  if (drives_ranks() && to == ReleaseState::kCanary) {
    // 0x0E: runner parity differs -> block canary. A candidate whose shadow outputs differ never
    // serves live steps: the transition is refused and the candidate drained.
    RETURN_IF_ERROR(AdmitCanary(request_id, release_id));
  }
  if (drives_ranks() && (to == ReleaseState::kDraining || to == ReleaseState::kRetired)) {
    ASSIGN_OR_RETURN(std::vector<StoredTransition> recorded, store_->Recorded(request_id));
    ASSIGN_OR_RETURN(ReleaseRecord rec, store_->Get(release_id));
    if (recorded.empty() && rec.placement_version > 0) {
      if (to == ReleaseState::kDraining && rec.state == ReleaseState::kActive) {
        return absl::FailedPreconditionError(
            absl::StrCat("to: ", release_id, " serves placement-v", rec.placement_version,
                         " on the ranks; leave ACTIVE through Promote of another release or Rollback"));
      }
      if (to == ReleaseState::kRetired && LegalTransition(rec.state, to)) {
        // The ranks retire first, each refusing while a handle still holds the generation; only
        // then is the release recorded RETIRED (a retry re-drives the ranks).
        RETURN_IF_ERROR(agents_->Retire(rec.placement_version));
      }
    }
  }
  ASSIGN_OR_RETURN(StoredTransition t, store_->Transition(request_id, release_id, to, reason));
  // Trials follow the committed state (a retry with the same request id re-drives the ranks):
  // SHADOW starts shadow steps of the release's placement, CANARY adds canary steps, leaving
  // either for DRAINING or RETIRED stops them.
  if (drives_ranks()) {
    ASSIGN_OR_RETURN(ReleaseRecord rec, store_->Get(release_id));
    absl::Status driven;
    if (rec.placement_version > 0 && t.to == ReleaseState::kShadow) {
      driven = agents_->SetTrial(rec.placement_version, trial_.shadow_every, 0);
    } else if (rec.placement_version > 0 && t.to == ReleaseState::kCanary) {
      driven = agents_->SetTrial(rec.placement_version, trial_.shadow_every, trial_.canary_every);
    } else if ((t.from == ReleaseState::kShadow || t.from == ReleaseState::kCanary) &&
               (t.to == ReleaseState::kDraining || t.to == ReleaseState::kRetired)) {
      driven = agents_->SetTrial(0, 0, 0);
    }
    if (!driven.ok()) {
      return absl::Status(driven.code(), absl::StrCat(release_id, " is committed ", ReleaseStateName(t.to), " but ",
                                                      driven.message(), "; retry with the same request_id"));
    }
  }
  return t;
}

absl::Status StoreReleaseManager::AdmitCanary(const std::string& request_id, const std::string& release_id) {
  const std::string& id = release_id;
  const std::string blocked_id = absl::StrCat(request_id, "/blocked");
  auto refusal = [&](const std::string& reason, const std::string& trials) {
    return absl::FailedPreconditionError(absl::StrCat("to: CANARY refused for ", id, ": ", reason,
                                                      "; the candidate was drained (SHADOW -> "
                                                      "DRAINING) and never served a canary step, ",
                                                      trials, "; retire it with `moectl drain ", id, "`"));
  };
  ASSIGN_OR_RETURN(std::vector<StoredTransition> recorded, store_->Recorded(request_id));
  if (!recorded.empty()) return absl::OkStatus();  // a retry of a committed transition: the store answers it
  ASSIGN_OR_RETURN(std::vector<StoredTransition> blocked, store_->Recorded(blocked_id));
  if (!blocked.empty()) {  // a retry of a refused one: the same answer, the ranks re-driven
    const absl::Status stopped = agents_->SetTrial(0, 0, 0);
    return refusal(blocked.front().reason,
                   stopped.ok() ? "trials stopped on every rank"
                                : absl::StrCat("stopping trials failed: ", stopped.message(), " (retry)"));
  }
  ASSIGN_OR_RETURN(ReleaseRecord rec, store_->Get(id));
  if (rec.state != ReleaseState::kShadow || rec.placement_version <= 0) return absl::OkStatus();
  // Runner parity of the candidate, summed over the ranks (a shadow pass runs on every rank).
  int64_t samples = -1, mismatches = 0, failures = 0;
  for (auto& [status, address] : agents_->Status()) {
    if (!status.ok()) {
      return absl::UnavailableError(absl::StrCat("to: CANARY needs every rank's shadow counters of placement-v",
                                                 rec.placement_version, ": rank ", address, ": ",
                                                 status.status().message()));
    }
    int64_t n = 0;
    for (const v1::GenerationCounters& c : status->counters()) {
      if (c.version() != rec.placement_version) continue;
      n = c.shadow_samples();
      mismatches += c.shadow_mismatches();
      failures += c.shadow_failures();
    }
    samples = samples < 0 ? n : std::min(samples, n);
  }
  if (mismatches + failures <= trial_.max_shadow_mismatches) return absl::OkStatus();
  const std::string reason =
      absl::StrCat("runner parity differs: the ranks counted ", mismatches, " shadow mismatches and ", failures,
                   " failed shadow passes of placement-v", rec.placement_version, " (", std::max<int64_t>(samples, 0),
                   " shadow samples), over --max_shadow_mismatches ", trial_.max_shadow_mismatches);
  RETURN_IF_ERROR(
      store_->Apply(blocked_id, {{id, ReleaseState::kDraining, absl::StrCat("canary blocked: ", reason)}}).status());
  spdlog::warn("{}: SHADOW -> CANARY refused, drained: {}", id, reason);
  const absl::Status stopped = agents_->SetTrial(0, 0, 0);
  return refusal(
      absl::StrCat("canary blocked: ", reason),
      stopped.ok() ? "trials stopped on every rank"
                   : absl::StrCat("stopping trials failed: ", stopped.message(), " (retry with the same request_id)"));
}

}  // namespace moe
