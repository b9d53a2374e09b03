#include "control/controller/release_manager.h"

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>

#include <google/protobuf/util/json_util.h>
#include <google/protobuf/util/message_differencer.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "spdlog/spdlog.h"

#include "control/bundle.h"
#include "control/controller/agent_rollback.h"
#include "rpc/counters_proto.h"
#include "rpc/placement_proto.h"
#include "runtime/placement/default_placement.h"
#include "runtime/placement/migration.h"
#include "runtime/release/lifecycle.h"
#include "runtime/status.h"

namespace moe {

namespace {

// HashOK's reference: the digest of the manifest the store recorded for the release when its
// placement was loaded, computed here, never taken from a rank. Sets expect->manifest_digest, or
// expect->manifest_problem when there is none to compute it from.
void ExpectRecordedManifest(const ReleaseRecord& candidate, const Topology& topology, EvidenceExpectation* expect) {
  if (candidate.placement_manifest.empty()) {
    expect->manifest_problem = absl::StrCat(candidate.release_id, " has no recorded placement manifest");
    return;
  }
  v1::PlacementManifest proto;
  std::shared_ptr<const PlacementManifest> manifest;
  if (!google::protobuf::util::JsonStringToMessage(candidate.placement_manifest, &proto).ok()) {
    expect->manifest_problem = absl::StrCat(candidate.release_id, ": the recorded manifest does not parse");
  } else if (auto m = ManifestFromProto(proto, topology); !m.ok()) {
    expect->manifest_problem = absl::StrCat(candidate.release_id, ": the recorded manifest: ", m.status().message());
  } else {
    manifest = *m;
  }
  // Every layer's table (a per-layer generation has one of its own per layer): a slot with no
  // digest in any of them gave the ranks nothing to check its copy by.
  const int tables = manifest == nullptr ? 0 : std::max<int>(1, static_cast<int>(manifest->layers().size()));
  std::string undigested;
  for (int li = 0; li < tables && undigested.empty(); ++li) {
    for (const SlotRecord& slot : manifest->LayerAt(li).slots()) {
      if (!slot.parameter_digest.empty()) continue;
      undigested = absl::StrCat(
          "slot ", slot.name, " of the recorded manifest",
          manifest->layers().empty() ? std::string() : absl::StrCat(" (layer ", manifest->layers()[li], ")"),
          " has no parameter digest");
      break;
    }
  }
  if (!undigested.empty()) {
    expect->manifest_problem = std::move(undigested);
    manifest = nullptr;
  }
  if (manifest != nullptr) expect->manifest_digest = PlacementDigest(*manifest);
}

// RollbackOK's subject: the release ACTIVE now, which promoting `candidate` would drain. Sets
// expect->prior_version, or expect->prior_problem.
void ExpectPrior(const std::vector<ReleaseRecord>& releases, const ReleaseRecord& candidate,
                 EvidenceExpectation* expect) {
  std::string prior_id;
  for (const ReleaseRecord& r : releases) {
    if (r.state != ReleaseState::kActive || r.release_id == candidate.release_id) continue;
    prior_id = r.release_id;
    if (r.placement_version <= 0 || r.placement_version == candidate.placement_version) {
      expect->prior_problem = absl::StrCat(r.release_id, " (ACTIVE) has no placement of its own on the ranks");
    } else {
      expect->prior_version = r.placement_version;
    }
  }
  if (prior_id.empty()) {
    expect->prior_problem = "no release is ACTIVE (a first release is promoted with operator evidence)";
  }
}

std::optional<GenerationState> GenerationStateFromProto(v1::GenerationState s) {
  switch (s) {
    case v1::GENERATION_STATE_PREPARED:
      return GenerationState::kPrepared;
    case v1::GENERATION_STATE_ACTIVE:
      return GenerationState::kActive;
    case v1::GENERATION_STATE_DRAINING:
      return GenerationState::kDraining;
    case v1::GENERATION_STATE_RETIRED:
      return GenerationState::kRetired;
    default:
      return std::nullopt;
  }
}

// What one rank's status says about the candidate (placement `version`) and the prior placement.
RankReport ReportOf(const v1::AgentStatusResponse& status, std::string name, int64_t version, int64_t prior_version) {
  RankReport r;
  r.name = std::move(name);
  for (const v1::GenerationStatus& g : status.generations()) {
    const std::optional<GenerationState> state = GenerationStateFromProto(g.state());
    if (g.version() == version) {
      r.candidate_state = state;
      r.candidate_digest = g.manifest_digest();
    }
    if (prior_version > 0 && g.version() == prior_version) r.prior_state = state;
  }
  for (const v1::GenerationCounters& c : status.counters()) {
    if (c.version() != version) continue;
    r.counters = GenerationCountersFromProto(c);
  }
  return r;
}

}  // namespace

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

absl::StatusOr<ReleaseRecord> StoreReleaseManager::Get(const std::string& release_id) {
  return store_->Get(release_id);
}

absl::StatusOr<std::vector<ReleaseRecord>> StoreReleaseManager::List() { return store_->List(); }

absl::StatusOr<std::vector<StoredTransition>> StoreReleaseManager::History(const std::string& release_id,
                                                                           int64_t after_seq) {
  return store_->History(release_id, after_seq);
}

RankStatuses StoreReleaseManager::ClusterStatus() {
  if (agents_ == nullptr) return {};
  return agents_->Status();
}

absl::StatusOr<ReleaseRecord> StoreReleaseManager::Register(const std::string& request_id,
                                                            const std::string& release_id,
                                                            const std::string& bundle_digest,
                                                            const std::string& bundle_json) {
  std::string digest = bundle_digest;
  std::string stored;
  if (!bundle_json.empty()) {
    ASSIGN_OR_RETURN(json::Json bundle, json::Parse(bundle_json, "bundle_json"));
    if (!bundle.is_object() || !bundle.contains("release_id") || !bundle["release_id"].is_string() ||
        bundle["release_id"].get<std::string>() != release_id) {
      return absl::InvalidArgumentError(
          absl::StrCat("bundle_json.release_id: the bundle does not describe release '", release_id, "'"));
    }
    const std::string computed = BundleDigest(bundle);
    if (!digest.empty() && digest != computed) {
      return absl::InvalidArgumentError(
          absl::StrCat("bundle_digest: ", digest, " given, the bundle hashes to ", computed));
    }
    digest = computed;
    stored = bundle.dump();
  }
  absl::MutexLock lock(&write_mu_);
  return store_->Register(request_id, release_id, digest, stored);
}

absl::Status StoreReleaseManager::VerifyRegisteredBundle(const std::string& release_id) {
  ASSIGN_OR_RETURN(const std::string text, store_->Bundle(release_id));
  if (text.empty()) return absl::OkStatus();  // registered with a digest only: the operator's claim
  ASSIGN_OR_RETURN(json::Json bundle, json::Parse(text, "bundle"));
  const auto topology = [this](int world) {
    return topology_.has_value() && topology_->num_ranks() == world ? *topology_ : TwoNodeTopology(world);
  };
  if (absl::Status s = VerifyBundle(bundle, topology); !s.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("to: VERIFIED refused for ", release_id, ": its bundle does not verify: ", s.message()));
  }
  ASSIGN_OR_RETURN(const BundleTopology expected, ParseBundleTopology(bundle));  // VerifyBundle parsed it
  if (agents_ != nullptr && !agents_->empty() && expected.world != static_cast<int64_t>(agents_->world())) {
    return absl::FailedPreconditionError(absl::StrCat("to: VERIFIED refused for ", release_id,
                                                      ": bundle topology.world ", expected.world,
                                                      ", the controller drives ", agents_->world(), " rank agents"));
  }
  // The nodes the bundle expects, against the ones the ranks serve on now (each rank checks its
  // own again when the placement is prepared).
  if (!expected.nodes.empty() && agents_ != nullptr && !agents_->empty()) {
    auto group = agents_->ServingGroup();
    if (!group.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "to: VERIFIED refused for ", release_id, ": topology.nodes cannot be checked: ", group.status().message()));
    }
    if (absl::Status s = CheckBundleNodes(expected, group->node_of_rank); !s.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("to: VERIFIED refused for ", release_id, ": ", s.message(),
                                                        " (process-group epoch ", group->epoch, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<StoredTransition> StoreReleaseManager::Transition(const std::string& request_id,
                                                                 const std::string& release_id, ReleaseState to,
                                                                 const std::string& reason) {
  // The request itself first: nothing below drives a rank for one the registry would refuse.
  RETURN_IF_ERROR(RequireRequestId(request_id));
  if (release_id.empty()) return absl::InvalidArgumentError("release_id: required");
  RETURN_IF_ERROR(CheckTransitionReason(reason));
  if (to == ReleaseState::kActive) {
    return absl::FailedPreconditionError("to: ACTIVE is reached through Promote (the 0x0DC gate)");
  }
  if (to == ReleaseState::kLoaded && drives_ranks()) {
    // With rank agents LOADED means every rank prepared the placement: a hand-made LOADED would
    // carry no placement, skip runner parity, and a promotion of it would leave the ranks serving
    // the old one while the registry says otherwise.
    return absl::FailedPreconditionError(
        "to: LOADED is reached through LoadPlacement (`moectl placement load`) when the controller drives rank "
        "agents");
  }
  absl::MutexLock lock(&write_mu_);
  RETURN_IF_ERROR(RefuseIdOfAnotherRequest(request_id));
  // A retry of a committed transition is answered from the record: none of the checks below
  // (which read the ranks or the bundle) runs for it.
  ASSIGN_OR_RETURN(const std::vector<StoredTransition> recorded, store_->Recorded(request_id));
  const bool retry = !recorded.empty();
  if (to == ReleaseState::kVerified && !retry) {
    // VERIFIED is the controller's own finding for a release with a bundle: its digest, every
    // expert re-read from the checkpoint, the placement's digests (control/bundle.h).
    RETURN_IF_ERROR(VerifyRegisteredBundle(release_id));
  }
  if (drives_ranks() && to == ReleaseState::kShadow && !retry) {
    // Each rank runs one candidate's trial at a time (SetTrial replaces it): a second candidate
    // entering SHADOW would silently take the first one's shadow and canary steps while the
    // registry still names the first SHADOW or CANARY (CANARY is entered only from SHADOW, so
    // this one check keeps a single candidate in trial).
    ASSIGN_OR_RETURN(std::vector<ReleaseRecord> releases, store_->List());
    for (const ReleaseRecord& other : releases) {
      if (other.release_id == release_id) continue;
      if (other.state == ReleaseState::kShadow || other.state == ReleaseState::kCanary) {
        return absl::FailedPreconditionError(absl::StrCat(
            "to: ", ReleaseStateName(to), " refused for ", release_id, ": ", other.release_id, " is ",
            ReleaseStateName(other.state), " and the ranks run one candidate's trial at a time; promote or drain ",
            other.release_id, " first"));
      }
    }
  }
  if (drives_ranks() && to == ReleaseState::kCanary) {
    // 0x0E: runner parity differs -> block canary. A candidate whose shadow outputs differ never
    // serves live steps: the transition is refused and the candidate drained.
    RETURN_IF_ERROR(AdmitCanary(request_id, release_id));
  }
  if (drives_ranks() && (to == ReleaseState::kDraining || to == ReleaseState::kRetired)) {
    ASSIGN_OR_RETURN(ReleaseRecord rec, store_->Get(release_id));
    if (!retry && rec.placement_version > 0) {
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
    // Only while the release is still where this transition put it: a late retry of one it has
    // since left (CANARY, then DRAINING) must not start its trials again.
    if (rec.state != t.to) return t;
    absl::Status driven;
    if (rec.placement_version > 0 && t.to == ReleaseState::kShadow) {
      driven = agents_->SetTrial(rec.placement_version, trial_.shadow_every, 0);
    } else if (rec.placement_version > 0 && t.to == ReleaseState::kCanary) {
      driven = agents_->SetTrial(rec.placement_version, trial_.shadow_every, trial_.canary_every);
    } else if ((t.from == ReleaseState::kShadow || t.from == ReleaseState::kCanary) &&
               (t.to == ReleaseState::kDraining || t.to == ReleaseState::kRetired)) {
      driven = rec.placement_version > 0 ? agents_->StopTrial(rec.placement_version) : agents_->SetTrial(0, 0, 0);
    }
    if (!driven.ok()) {
      return absl::Status(driven.code(), absl::StrCat(release_id, " is committed ", ReleaseStateName(t.to), " but ",
                                                      driven.message(), "; retry with the same request_id"));
    }
  }
  return t;
}

absl::Status StoreReleaseManager::RefuseIdOfAnotherRequest(const std::string& request_id) const {
  // A request id committed without transitions (a registration) names another request: refused
  // before any rank is driven for this one (the store would refuse it only after).
  ASSIGN_OR_RETURN(const std::vector<StoredTransition> recorded, store_->Recorded(request_id));
  if (!recorded.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(const bool known, store_->HasRequest(request_id));
  if (known)
    return absl::AlreadyExistsError(absl::StrCat("request_id: '", request_id, "' was used for another request"));
  return absl::OkStatus();
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
    if (blocked.front().release_id != release_id) {
      return absl::AlreadyExistsError(absl::StrCat("request_id: '", request_id, "' was used for another request"));
    }
    // Its own trial only: another candidate's, begun since, goes on.
    ASSIGN_OR_RETURN(const ReleaseRecord drained, store_->Get(release_id));
    const absl::Status stopped =
        drained.placement_version > 0 ? agents_->StopTrial(drained.placement_version) : agents_->SetTrial(0, 0, 0);
    return refusal(blocked.front().reason,
                   stopped.ok() ? "trials stopped on every rank"
                                : absl::StrCat("stopping trials failed: ", stopped.message(), " (retry)"));
  }
  ASSIGN_OR_RETURN(ReleaseRecord rec, store_->Get(id));
  if (rec.state != ReleaseState::kShadow || rec.placement_version <= 0) return absl::OkStatus();
  // Runner parity of the candidate, summed over the ranks (a shadow pass runs on every rank) of
  // the epoch served: a lost rank outside it (the group re-formed on the survivors) ran none.
  int64_t samples = -1, mismatches = 0, failures = 0;
  for (auto& [status, address] : agents_->Status()) {
    if (address.empty()) continue;
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
  if (samples < 0) {
    return absl::UnavailableError(absl::StrCat("to: CANARY needs the shadow counters of placement-v",
                                               rec.placement_version, ": no member of the epoch served answered"));
  }
  if (mismatches + failures <= trial_.max_shadow_mismatches) return absl::OkStatus();
  const std::string reason =
      absl::StrCat("runner parity differs: the ranks counted ", mismatches, " shadow mismatches and ", failures,
                   " failed shadow passes of placement-v", rec.placement_version, " (", std::max<int64_t>(samples, 0),
                   " shadow samples), over --max_shadow_mismatches ", trial_.max_shadow_mismatches);
  RETURN_IF_ERROR(
      store_->Apply(blocked_id, {{id, ReleaseState::kDraining, absl::StrCat("canary blocked: ", reason)}}).status());
  spdlog::warn("{}: SHADOW -> CANARY refused, drained: {}", id, reason);
  const absl::Status stopped = agents_->StopTrial(rec.placement_version);
  return refusal(
      absl::StrCat("canary blocked: ", reason),
      stopped.ok() ? "trials stopped on every rank"
                   : absl::StrCat("stopping trials failed: ", stopped.message(), " (retry with the same request_id)"));
}

absl::StatusOr<std::vector<StoredTransition>> StoreReleaseManager::Replay(const std::string& request_id,
                                                                          const std::string& release_id,
                                                                          ReleaseState first_to) const {
  RETURN_IF_ERROR(RequireRequestId(request_id));
  auto recorded = store_->Recorded(request_id);
  if (!recorded.ok()) return recorded.status();
  if (!recorded->empty() && (recorded->front().release_id != release_id || recorded->front().to != first_to)) {
    return absl::AlreadyExistsError(absl::StrCat("request_id: '", request_id, "' was used for another request"));
  }
  return recorded;
}

absl::StatusOr<GateEvidence> StoreReleaseManager::EvidenceFromRanks(const ReleaseRecord& candidate) {
  EvidenceExpectation expect;
  expect.candidate_version = candidate.placement_version;
  ExpectRecordedManifest(candidate, *topology_, &expect);
  auto releases = store_->List();
  if (!releases.ok()) return releases.status();
  ExpectPrior(*releases, candidate, &expect);
  // From the members of the epoch served: a rank outside it (lost; the group re-formed on the
  // survivors) served no step of the candidate, and its replacement is brought to the ACTIVE
  // placement, its copies verified, by the reconciler.
  std::vector<RankReport> reports;
  int rank = 0;
  for (auto& [status, address] : agents_->Status()) {
    const int r = rank++;
    if (address.empty()) continue;
    if (!status.ok()) {
      return absl::Status(status.status().code(),
                          absl::StrCat("evidence: rank ", address, ": ", status.status().message()));
    }
    reports.push_back(ReportOf(*status, absl::StrCat("rank ", r, " (", address, ")"), candidate.placement_version,
                               expect.prior_version));
  }
  if (reports.empty()) return absl::UnavailableError("evidence: no member of the epoch served answered");
  return AggregateRankEvidence(reports, expect);
}

absl::StatusOr<std::pair<GateEvidence, bool>> StoreReleaseManager::GateInputs(
    const std::string& request_id, const std::string& release_id, const std::optional<GateEvidence>& evidence) {
  if (evidence.has_value()) return std::make_pair(*evidence, true);
  // Without operator evidence the gate reads the ranks' counters for the candidate's placement
  // (a retry of a committed promotion skips the gate: the store answers it).
  if (!drives_ranks()) return absl::InvalidArgumentError("evidence: required (no rank agents)");
  ASSIGN_OR_RETURN(std::vector<StoredTransition> recorded, store_->Recorded(request_id));
  ASSIGN_OR_RETURN(ReleaseRecord candidate, store_->Get(release_id));
  if (!recorded.empty()) {
    return std::make_pair(GateEvidence{}, false);  // a retry of a promotion the gate passed and the store committed
  }
  if (candidate.placement_version <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("evidence: ", release_id, " has no placement on the ranks to read"));
  }
  ASSIGN_OR_RETURN(GateEvidence from_ranks, EvidenceFromRanks(candidate));
  return std::make_pair(std::move(from_ranks), true);
}

absl::StatusOr<std::vector<StoredTransition>> StoreReleaseManager::CommitPromotion(const std::string& request_id,
                                                                                   const std::string& release_id) {
  ASSIGN_OR_RETURN(std::vector<StoredTransition> applied, Replay(request_id, release_id, ReleaseState::kActive));
  if (!applied.empty()) return applied;
  ASSIGN_OR_RETURN(ReleaseRecord candidate, store_->Get(release_id));
  if (candidate.state != ReleaseState::kCanary) {
    return absl::FailedPreconditionError(absl::StrCat(
        "release_id: ", release_id, " is ", ReleaseStateName(candidate.state), "; only a CANARY release is promoted"));
  }
  ASSIGN_OR_RETURN(std::vector<ReleaseRecord> releases, store_->List());
  std::vector<ReleaseStore::Move> moves = {{release_id, ReleaseState::kActive, "promotion gate passed"}};
  for (const ReleaseRecord& r : releases) {
    if (r.state == ReleaseState::kActive && r.release_id != release_id) {
      moves.push_back({r.release_id, ReleaseState::kDraining, absl::StrCat("replaced by ", release_id)});
    }
  }
  return store_->Apply(request_id, moves);  // committed before any rank acts on it
}

absl::StatusOr<Promotion> StoreReleaseManager::Promote(const std::string& request_id, const std::string& release_id,
                                                       const std::optional<GateEvidence>& evidence) {
  Promotion p;
  bool gate = true;
  // The gate reads the prior (RollbackOK) and the candidate under the writer's lock, so no other
  // promotion or rollback changes what it judged before this one commits.
  absl::MutexLock lock(&write_mu_);
  ASSIGN_OR_RETURN(std::tie(p.evidence, gate), GateInputs(request_id, release_id, evidence));
  const PromotionDecision d = gate ? EvaluatePromotion(p.evidence.inputs, thresholds_) : PromotionDecision{true, {}};
  if (!d.promote) {
    return absl::FailedPreconditionError(
        absl::StrCat("evidence: promotion gate failed: ", absl::StrJoin(d.failed, ", "),
                     evidence.has_value() ? "" : " (read from the ranks)", p.evidence.findings.empty() ? "" : ": ",
                     absl::StrJoin(p.evidence.findings, "; ")));
  }
  ASSIGN_OR_RETURN(p.transitions, CommitPromotion(request_id, release_id));
  ASSIGN_OR_RETURN(p.release, store_->Get(release_id));
  const ReleaseRecord& rec = p.release;
  // Drive the ranks only while the registry still says this release is ACTIVE: a late retry after
  // another promotion or a rollback must not switch the ranks back.
  if (drives_ranks() && rec.placement_version > 0 && rec.state == ReleaseState::kActive) {
    absl::Status s = agents_->StopTrial(rec.placement_version);
    if (s.ok()) s = agents_->Activate(rec.placement_version);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat(release_id, " is committed ACTIVE but ", s.message(),
                                                 "; retry with the same request_id"));
    }
  }
  return p;
}

absl::StatusOr<std::vector<StoredTransition>> StoreReleaseManager::CommitRollback(const std::string& request_id,
                                                                                  const std::string& release_id,
                                                                                  const std::string& prior_release_id,
                                                                                  const std::string& reason) {
  ASSIGN_OR_RETURN(std::vector<StoredTransition> applied, Replay(request_id, release_id, ReleaseState::kDraining));
  if (!applied.empty()) return applied;
  ASSIGN_OR_RETURN(ReleaseRecord candidate, store_->Get(release_id));
  ASSIGN_OR_RETURN(ReleaseRecord prior, store_->Get(prior_release_id));
  // 0x0EA rolls the ACTIVE candidate back to the release it replaced. A CANARY candidate is left
  // through DRAINING (the ACTIVE release still serves); rolling it "back" would leave two ACTIVE.
  if (candidate.state != ReleaseState::kActive) {
    return absl::FailedPreconditionError(absl::StrCat("release_id: ", release_id, " is ",
                                                      ReleaseStateName(candidate.state),
                                                      "; only the ACTIVE release is rolled back (a CANARY one "
                                                      "leaves through `release transition ID DRAINING`)"));
  }
  if (prior.state != ReleaseState::kDraining) {
    return absl::FailedPreconditionError(absl::StrCat("prior_release_id: ", prior_release_id, " is ",
                                                      ReleaseStateName(prior.state),
                                                      "; only a DRAINING (loaded) release is re-activated"));
  }
  // The prior must have served: it entered DRAINING from ACTIVE (replaced by a promotion). One that
  // was drained from SHADOW (canary blocked: runner parity differs) or CANARY never passed the
  // 0x0DC gate, and ACTIVE is reached only through it.
  ASSIGN_OR_RETURN(std::vector<StoredTransition> history, store_->History(prior_release_id));
  if (history.empty() || history.back().to != ReleaseState::kDraining || history.back().from != ReleaseState::kActive) {
    return absl::FailedPreconditionError(
        absl::StrCat("prior_release_id: ", prior_release_id, " entered DRAINING from ",
                     history.empty() ? std::string("nowhere") : std::string(ReleaseStateName(history.back().from)),
                     ", not from ACTIVE: it never passed the promotion gate, so it cannot be re-activated"));
  }
  // 0x0EA: the prior and the candidate serve one checkpoint (a release that changed the weights
  // is left by rolling forward), as their recorded manifests say.
  if (!prior.placement_manifest.empty() && !candidate.placement_manifest.empty()) {
    v1::PlacementManifest p, c;
    if (!google::protobuf::util::JsonStringToMessage(prior.placement_manifest, &p).ok() ||
        !google::protobuf::util::JsonStringToMessage(candidate.placement_manifest, &c).ok()) {
      return absl::DataLossError("rollback: a stored placement manifest does not parse");
    }
    if (p.checkpoint_version() != c.checkpoint_version()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "prior_release_id: ", prior_release_id, " serves ", p.checkpoint_version(), ", ", release_id, " serves ",
          c.checkpoint_version(), ": a rollback keeps the checkpoint (0x0EA); roll forward instead"));
    }
  }
  // Every rank must still hold the prior placement: a retirement of the prior that failed on some
  // rank (they retire one by one before the registry records it) freed its weights on the
  // others, and a rollback committed now would leave the registry ACTIVE on a placement no rank
  // can activate.
  if (drives_ranks() && prior.placement_version > 0) {
    for (auto& [status, address] : agents_->Status()) {
      // A rank outside the epoch served (lost; the group re-formed on the survivors) is neither
      // checked nor driven: a rollback is what an operator needs most then. Its replacement is
      // brought to the ACTIVE placement by the reconciler.
      if (address.empty()) continue;
      if (!status.ok()) {
        return absl::UnavailableError(absl::StrCat("prior_release_id: cannot check placement-v",
                                                   prior.placement_version, " on rank ", address, ": ",
                                                   status.status().message()));
      }
      const std::optional<GenerationState> held =
          ReportOf(*status, address, candidate.placement_version, prior.placement_version).prior_state;
      if (!held.has_value() || *held == GenerationState::kRetired) {
        return absl::FailedPreconditionError(
            absl::StrCat("prior_release_id: ", prior_release_id, "'s placement-v", prior.placement_version, " is ",
                         held.has_value() ? "RETIRED" : "not held", " on rank ", address,
                         " (a retirement that did not complete everywhere?); it cannot be re-activated: retire ",
                         prior_release_id, " and roll forward"));
      }
    }
  }
  // 0x0EA's first two steps, in order and in one commit: stop new candidate dispatch, then
  // activate the prior release.
  return store_->Apply(
      request_id, {{release_id, ReleaseState::kDraining, reason}, {prior_release_id, ReleaseState::kActive, reason}});
}

absl::StatusOr<std::vector<StoredTransition>> StoreReleaseManager::Rollback(const std::string& request_id,
                                                                            const std::string& release_id,
                                                                            const std::string& prior_release_id,
                                                                            const std::string& reason) {
  if (prior_release_id.empty()) return absl::InvalidArgumentError("prior_release_id: required");
  if (prior_release_id == release_id) {
    return absl::InvalidArgumentError("prior_release_id: must differ from release_id");
  }
  absl::MutexLock lock(&write_mu_);
  ASSIGN_OR_RETURN(std::vector<StoredTransition> transitions,
                   CommitRollback(request_id, release_id, prior_release_id, reason.empty() ? "rollback" : reason));
  // A replay must be the same request: the ranks are driven from the recorded prior, never another.
  if (transitions.size() < 2 || transitions[1].release_id != prior_release_id) {
    return absl::AlreadyExistsError(
        absl::StrCat("request_id: '", request_id, "' was used for a rollback to another prior release"));
  }
  if (!drives_ranks()) return transitions;
  // On the ranks, 0x0EA's order (RollBack): activate the prior placement (each rank's candidate
  // stops dispatch in the same step), drain the candidate's handles to zero, retire it (each rank
  // frees its resources); then commit the candidate RETIRED.
  auto candidate = store_->Get(release_id);
  auto prior = store_->Get(prior_release_id);
  if (!candidate.ok()) return candidate.status();
  if (!prior.ok()) return prior.status();
  if (candidate->placement_version <= 0 || prior->placement_version <= 0 ||
      candidate->placement_version == prior->placement_version) {
    return transitions;  // nothing placed on the ranks by these releases
  }
  if (prior->state != ReleaseState::kActive) {
    return transitions;  // a late retry: the registry has moved on; the ranks follow it, not this request
  }
  AgentRollback ranks(agents_, drain_timeout_);
  auto rolled =
      RollBack(ranks, PlacementVersion(candidate->placement_version), PlacementVersion(prior->placement_version));
  if (!rolled.ok()) {
    const absl::Status& s = rolled.status();
    return absl::Status(
        s.code(), absl::StrCat("rollback committed; on the ranks: ", s.message(), "; retry with the same request_id"));
  }
  ASSIGN_OR_RETURN(std::vector<StoredTransition> retired,
                   store_->Apply(absl::StrCat(request_id, "/retire"),
                                 {{release_id, ReleaseState::kRetired, "handles drained and retired on every rank"}}));
  transitions.insert(transitions.end(), retired.begin(), retired.end());
  return transitions;
}

absl::StatusOr<std::optional<StoreReleaseManager::StoredBundle>> StoreReleaseManager::ReadStoredBundle(
    const std::string& release_id) const {
  ASSIGN_OR_RETURN(const std::string text, store_->Bundle(release_id));
  if (text.empty()) return std::nullopt;
  ASSIGN_OR_RETURN(const json::Json bundle, json::Parse(text, "bundle"));
  StoredBundle out;
  if (!bundle.contains("placement") ||
      !google::protobuf::util::JsonStringToMessage(bundle.at("placement").dump(), &out.placement).ok()) {
    return absl::InternalError(absl::StrCat(release_id, ": the stored bundle's placement does not parse"));
  }
  ASSIGN_OR_RETURN(const BundleRuntime r, ParseBundleRuntime(bundle));
  out.runtime.set_decode_runner(r.decode_runner);
  out.runtime.set_decode_bucket_tokens(r.decode_bucket_tokens);
  out.runtime.set_decode_bucket_slot_routes(r.decode_bucket_slot_routes);
  out.runtime.set_dtype(r.dtype);
  out.runtime.set_kernel_build(r.kernel_build);
  ASSIGN_OR_RETURN(const BundleTopology t, ParseBundleTopology(bundle));
  for (const std::string& node : t.nodes) out.runtime.add_nodes(node);
  return out;
}

absl::Status StoreReleaseManager::LoadNew(const std::string& request_id, const std::string& release_id,
                                          const v1::PlacementManifest& manifest,
                                          const std::optional<StoredBundle>& bundle) {
  const int64_t version = manifest.version();
  ASSIGN_OR_RETURN(ReleaseRecord rec, store_->Get(release_id));
  if (rec.state != ReleaseState::kVerified) {
    return absl::FailedPreconditionError(absl::StrCat("release_id: ", release_id, " is ", ReleaseStateName(rec.state),
                                                      "; a placement is loaded for a VERIFIED release"));
  }
  ASSIGN_OR_RETURN(std::vector<ReleaseRecord> releases, store_->List());
  for (const ReleaseRecord& r : releases) {
    if (r.placement_version == version && r.release_id != release_id) {
      return absl::AlreadyExistsError(
          absl::StrCat("manifest.version: placement-v", version, " belongs to ", r.release_id));
    }
  }
  std::string reason = absl::StrCat("placement-v", version, " prepared on ", agents_->addresses().size(), " ranks");
  // Admission: the migration from the ACTIVE release's placement must fit the memory budget.
  if (migration_.budget_bytes > 0) {
    ASSIGN_OR_RETURN(int64_t peak, MigrationPeak(releases, manifest));
    if (peak > migration_.budget_bytes) {
      return absl::FailedPreconditionError(absl::StrCat("manifest: the migration to placement-v", version, " peaks at ",
                                                        peak, " bytes of expert weights, over the budget of ",
                                                        migration_.budget_bytes));
    }
    absl::StrAppend(&reason, ", migration peak ", peak, " bytes");
  }
  // A release with a bundle loads the bundle's placement, and every rank checks the bundle's
  // runtime coordinates against its own (0x0CB).
  if (bundle.has_value()) {
    if (!google::protobuf::util::MessageDifferencer::Equals(bundle->placement, manifest)) {
      return absl::FailedPreconditionError(
          absl::StrCat("manifest: differs from the placement in ", release_id, "'s bundle"));
    }
    absl::StrAppend(&reason, ", bundle ", rec.bundle_digest.substr(0, 19), " runtime coordinates checked");
  }
  // Every rank has the generation prepared before the release is recorded LOADED. Where a rank
  // refused or failed, the ranks that had prepared it forget it again (no release records the
  // version: it was checked above), so that nothing stays allocated for a load that did not
  // happen and the version may be loaded again, with other slots too.
  // `failed` (the load's error) once every rank was asked to discard the version, saying whether
  // each did.
  auto discarded_after = [&](const absl::Status& failed) {
    const absl::Status discarded = agents_->Discard(version);
    if (!discarded.ok()) {
      spdlog::warn("load of placement-v{} failed; {}", version, std::string(discarded.message()));
    }
    return absl::Status(
        failed.code(),
        absl::StrCat(failed.message(), discarded.ok()
                                           ? "; no rank holds it now (each was asked to discard it)"
                                           : absl::StrCat("; not discarded everywhere (", discarded.message(), ")")));
  };
  if (absl::Status prepared = agents_->Prepare(manifest, bundle.has_value() ? &bundle->runtime : nullptr);
      !prepared.ok()) {
    return discarded_after(prepared);
  }
  std::string manifest_json;
  (void)google::protobuf::util::MessageToJsonString(manifest, &manifest_json);
  // Prepared everywhere but recorded nowhere: forgotten everywhere too.
  const absl::Status recorded =
      store_->Apply(request_id, {{release_id, ReleaseState::kLoaded, reason, version, manifest_json}}).status();
  return recorded.ok() ? recorded : discarded_after(recorded);
}

absl::StatusOr<ReleaseRecord> StoreReleaseManager::LoadPlacement(const std::string& request_id,
                                                                 const std::string& release_id,
                                                                 const v1::PlacementManifest& given) {
  // Without a manifest, a release with a bundle loads the bundle's placement.
  ASSIGN_OR_RETURN(const std::optional<StoredBundle> bundle, ReadStoredBundle(release_id));
  v1::PlacementManifest manifest = given;
  if (manifest.ByteSizeLong() == 0) {  // none given
    if (!bundle.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("manifest: required (", release_id, " was registered without a release bundle)"));
    }
    manifest = bundle->placement;
  }
  if (manifest.version() <= 0) return absl::InvalidArgumentError("manifest.version: must be positive");
  if (!drives_ranks())
    return absl::FailedPreconditionError("no rank agents: start moe-controller with --ranks or --world");
  absl::MutexLock lock(&write_mu_);
  RETURN_IF_ERROR(RefuseIdOfAnotherRequest(request_id));
  ASSIGN_OR_RETURN(std::vector<StoredTransition> applied, Replay(request_id, release_id, ReleaseState::kLoaded));
  if (applied.empty()) {
    RETURN_IF_ERROR(LoadNew(request_id, release_id, manifest, bundle));
    return store_->Get(release_id);
  }
  // A replay must be the same request: the manifest recorded with it, not another.
  ASSIGN_OR_RETURN(ReleaseRecord rec, store_->Get(release_id));
  std::string manifest_json;
  (void)google::protobuf::util::MessageToJsonString(manifest, &manifest_json);
  if (rec.placement_version != manifest.version() || rec.placement_manifest != manifest_json) {
    return absl::AlreadyExistsError(absl::StrCat("request_id: '", request_id, "' loaded placement-v",
                                                 rec.placement_version, " with another manifest"));
  }
  return rec;
}

absl::StatusOr<int64_t> StoreReleaseManager::MigrationPeak(const std::vector<ReleaseRecord>& releases,
                                                           const v1::PlacementManifest& to) const {
  const Topology& topology = *topology_;
  auto target = ManifestFromProto(to, topology);
  if (!target.ok()) return target.status();
  for (const ReleaseRecord& r : releases) {
    if (r.state != ReleaseState::kActive || r.placement_manifest.empty()) continue;
    v1::PlacementManifest proto;
    if (!google::protobuf::util::JsonStringToMessage(r.placement_manifest, &proto).ok()) {
      return absl::InternalError(absl::StrCat(r.release_id, ": stored placement manifest does not parse"));
    }
    auto from = ManifestFromProto(proto, topology);
    if (!from.ok()) return from.status();
    auto plan = PlanLayeredMigration(**from, **target, topology, migration_.expert_bytes);
    if (!plan.ok()) return plan.status();
    // What the ranks will hold at once: they copy retained slots too (materialized_peak_bytes),
    // so 0x08G's shared-storage peak would undercount.
    return plan->total.materialized_peak_bytes;
  }
  // Nothing active with a placement: every copy of every layer is loaded while nothing else is
  // resident.
  const int64_t layers = std::max<int64_t>(1, static_cast<int64_t>((*target)->layers().size()));
  return static_cast<int64_t>((*target)->num_slots()) * layers * migration_.expert_bytes;
}

absl::Status StoreReleaseManager::RollBackAFaultingRelease() {
  ASSIGN_OR_RETURN(std::vector<ReleaseRecord> releases, store_->List());
  for (const ReleaseRecord& r : releases) {
    if (r.state != ReleaseState::kActive || r.placement_version <= 0) continue;
    int64_t faults = 0;
    for (auto& [status, address] : agents_->Status()) {
      if (address.empty() || !status.ok()) continue;  // a lost rank's faults are the group's to re-form
      for (const v1::GenerationCounters& c : status->counters()) {
        if (c.version() == r.placement_version) faults += c.failed_steps() + c.count_failures() + c.stale_accepts();
      }
    }
    if (faults < trial_.auto_rollback_faults) return absl::OkStatus();
    // The prior: the release the promotion drained (committed under the same request id).
    ASSIGN_OR_RETURN(std::vector<StoredTransition> history, store_->History(r.release_id));
    std::string promotion, prior;
    for (const StoredTransition& t : history) {
      // Its last activation, if a promotion (from CANARY): one by a rollback (from DRAINING) drained
      // the faulting release, which must never be rolled back to.
      if (t.to == ReleaseState::kActive) promotion = t.from == ReleaseState::kCanary ? t.request_id : std::string();
    }
    if (!promotion.empty()) {
      ASSIGN_OR_RETURN(std::vector<StoredTransition> committed, store_->Recorded(promotion));
      for (const StoredTransition& t : committed) {
        if (t.release_id != r.release_id && t.from == ReleaseState::kActive && t.to == ReleaseState::kDraining) {
          prior = t.release_id;
        }
      }
    }
    if (prior.empty()) {
      absl::MutexLock lock(&auto_rollback_mu_);
      if (auto_rollback_warned_ != r.release_id) {  // once, not every reconcile
        spdlog::warn(
            "{}: {} faults of placement-v{} on the ranks, and no release its promotion drained to roll "
            "back to",
            r.release_id, faults, r.placement_version);
        auto_rollback_warned_ = r.release_id;
      }
      return absl::OkStatus();
    }
    const std::string reason =
        absl::StrCat("auto rollback: the ranks counted ", faults, " faults of placement-v", r.placement_version,
                     " (--auto_rollback_faults ", trial_.auto_rollback_faults, ")");
    spdlog::warn("{}: {}; rolling back to {}", r.release_id, reason, prior);
    auto rolled = Rollback(absl::StrCat("auto-rollback:", r.release_id), r.release_id, prior, reason);
    if (!rolled.ok()) {
      return absl::Status(rolled.status().code(), absl::StrCat("auto rollback of ", r.release_id, " to ", prior, ": ",
                                                               rolled.status().message()));
    }
    return absl::OkStatus();
  }
  return absl::OkStatus();
}

absl::Status StoreReleaseManager::Reconcile() {
  if (!drives_ranks()) return absl::OkStatus();
  if (trial_.auto_rollback_faults > 0) {
    // A rollback that fails (a rank down, its prior not held everywhere) is retried at the next
    // reconcile; meanwhile the ranks are still brought to the ACTIVE placement below, so a
    // restarted rank or a new epoch's members are not left out by it.
    if (absl::Status rolled = RollBackAFaultingRelease(); !rolled.ok()) {
      absl::MutexLock lock(&auto_rollback_mu_);
      if (auto_rollback_failed_ != rolled.message()) {  // once per distinct failure
        spdlog::warn("reconcile: {}; the ranks are still brought to the ACTIVE placement", rolled.ToString());
        auto_rollback_failed_ = std::string(rolled.message());
      }
    }
  }
  absl::MutexLock lock(&write_mu_);
  ASSIGN_OR_RETURN(std::vector<ReleaseRecord> releases, store_->List());
  for (const ReleaseRecord& r : releases) {
    if (r.state != ReleaseState::kActive || r.placement_version <= 0) continue;
    // Drive only ranks that disagree (this runs periodically): a restarted moe-rankd comes back
    // serving its boot placement without the release's; it gets the placement prepared (from
    // the manifest the store recorded, slots copied from its peers) and activated again.
    bool agree = true;
    for (auto& [status, address] : agents_->Status()) {
      if (address.empty()) continue;  // not a member of the epoch served
      agree = agree && status.ok() && status->active_version() == r.placement_version;
    }
    if (agree) return absl::OkStatus();
    if (!r.placement_manifest.empty()) {
      v1::PlacementManifest proto;
      if (!google::protobuf::util::JsonStringToMessage(r.placement_manifest, &proto).ok()) {
        return absl::DataLossError(absl::StrCat(r.release_id, ": stored placement manifest does not parse"));
      }
      // Bound to the epoch now served; a no-op where the rank already holds it. With the release
      // bundle's runtime coordinates, as at its load (0x0CB): a rank restarted with another
      // decode runner, precision, kernel build or node refuses the placement.
      ASSIGN_OR_RETURN(const std::optional<StoredBundle> bundle, ReadStoredBundle(r.release_id));
      RETURN_IF_ERROR(agents_->Prepare(proto, bundle.has_value() ? &bundle->runtime : nullptr, /*rebind=*/true));
    }
    RETURN_IF_ERROR(agents_->Activate(r.placement_version));
    spdlog::info("reconcile: every rank serves placement-v{} of {} again", r.placement_version, r.release_id);
    return absl::OkStatus();
  }
  return absl::OkStatus();
}

}  // namespace moe
