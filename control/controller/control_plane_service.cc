#include "control/controller/control_plane_service.h"

#include <google/protobuf/util/json_util.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "spdlog/spdlog.h"

#include "control/controller/agent_rollback.h"
#include "rpc/bearer_auth.h"
#include "rpc/counters_proto.h"
#include "rpc/grpc_status.h"
#include "rpc/placement_proto.h"
#include "runtime/placement/default_placement.h"
#include "runtime/placement/migration.h"
#include "runtime/release/evidence.h"
#include "runtime/status.h"

namespace moe {

namespace {

void Fill(const ReleaseRecord& r, v1::Release* out) {
  out->set_release_id(r.release_id);
  out->set_bundle_digest(r.bundle_digest);
  out->set_state(ToProto(r.state));
  out->set_revision(r.revision);
  out->set_placement_version(r.placement_version);
}

void Fill(const StoredTransition& t, v1::TransitionRecord* out) {
  out->set_seq(t.seq);
  out->set_request_id(t.request_id);
  out->set_release_id(t.release_id);
  out->set_from(ToProto(t.from));
  out->set_to(ToProto(t.to));
  out->set_reason(t.reason);
}

PromotionInputs FromProto(const v1::PromotionEvidence& e) {
  PromotionInputs in;
  in.hash_ok = e.hash_ok();
  in.manifest_ok = e.manifest_ok();
  in.faults_ok = e.faults_ok();
  in.rollback_ok = e.rollback_ok();
  in.shadow_samples = e.shadow_samples();
  in.canary_samples = e.canary_samples();
  in.routes_attempted = e.routes_attempted();
  in.routes_dropped = e.routes_dropped();
  in.steps = e.steps();
  in.fallback_steps = e.fallback_steps();
  in.route_mismatches = e.route_mismatches();
  in.stale_accepts = e.stale_accepts();
  in.count_failures = e.count_failures();
  return in;
}

}  // namespace

absl::StatusOr<ReleaseState> FromProto(v1::ReleaseState s, const char* field) {
  switch (s) {
    case v1::RELEASE_STATE_BUILT:
      return ReleaseState::kBuilt;
    case v1::RELEASE_STATE_VERIFIED:
      return ReleaseState::kVerified;
    case v1::RELEASE_STATE_LOADED:
      return ReleaseState::kLoaded;
    case v1::RELEASE_STATE_SHADOW:
      return ReleaseState::kShadow;
    case v1::RELEASE_STATE_CANARY:
      return ReleaseState::kCanary;
    case v1::RELEASE_STATE_ACTIVE:
      return ReleaseState::kActive;
    case v1::RELEASE_STATE_DRAINING:
      return ReleaseState::kDraining;
    case v1::RELEASE_STATE_RETIRED:
      return ReleaseState::kRetired;
    default:
      return absl::InvalidArgumentError(absl::StrCat(field, ": unspecified or unknown release state ", s));
  }
}

v1::ReleaseState ToProto(ReleaseState s) {
  return static_cast<v1::ReleaseState>(static_cast<int>(s) + 1);  // both enums list the states in order
}

ControlPlaneServiceImpl::ControlPlaneServiceImpl(ReleaseStore* store, std::string token, PromotionThresholds thresholds,
                                                 AgentPool* agents, std::optional<Topology> topology,
                                                 absl::Duration drain_timeout, MigrationBudget migration,
                                                 TrialPolicy trial)
    : store_(store),
      token_(std::move(token)),
      thresholds_(thresholds),
      agents_(agents),
      topology_(std::move(topology)),
      drain_timeout_(drain_timeout),
      migration_(migration),
      trial_(trial),
      manager_(store, thresholds, agents, topology_, drain_timeout, migration, trial),
      write_mu_(*manager_.write_mu()) {}

grpc::Status ControlPlaneServiceImpl::Authorize(const grpc::ServerContext* ctx) const {
  return CheckBearer(ctx, token_);
}

absl::StatusOr<std::vector<StoredTransition>> ControlPlaneServiceImpl::Replay(const std::string& request_id,
                                                                              const std::string& release_id,
                                                                              ReleaseState first_to) const {
  if (request_id.empty()) return absl::InvalidArgumentError("request_id: required (requests are idempotent by it)");
  auto recorded = store_->Recorded(request_id);
  if (!recorded.ok()) return recorded.status();
  if (!recorded->empty() && (recorded->front().release_id != release_id || recorded->front().to != first_to)) {
    return absl::AlreadyExistsError(absl::StrCat("request_id: '", request_id, "' was used for another request"));
  }
  return recorded;
}

grpc::Status ControlPlaneServiceImpl::RegisterRelease(grpc::ServerContext* ctx, const v1::RegisterReleaseRequest* req,
                                                      v1::Release* resp) {
  if (grpc::Status s = Authorize(ctx); !s.ok()) return s;
  auto r = manager_.Register(req->request_id(), req->release_id(), req->bundle_digest());
  if (!r.ok()) return ToGrpcStatus(r.status());
  Fill(*r, resp);
  return grpc::Status::OK;
}

grpc::Status ControlPlaneServiceImpl::TransitionRelease(grpc::ServerContext* ctx,
                                                        const v1::TransitionReleaseRequest* req,
                                                        v1::TransitionRecord* resp) {
  if (grpc::Status s = Authorize(ctx); !s.ok()) return s;
  auto to = FromProto(req->to(), "to");
  if (!to.ok()) return ToGrpcStatus(to.status());
  auto t = manager_.Transition(req->request_id(), req->release_id(), *to, req->reason());
  if (!t.ok()) return ToGrpcStatus(t.status());
  Fill(*t, resp);
  return grpc::Status::OK;
}

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
  for (size_t q = 0; manifest != nullptr && q < manifest->slots().size(); ++q) {
    if (manifest->slots()[q].parameter_digest.empty()) {  // the ranks had nothing to check it by
      expect->manifest_problem =
          absl::StrCat("slot ", manifest->slots()[q].name, " of the recorded manifest has no parameter digest");
      manifest = nullptr;
    }
  }
  if (manifest != nullptr) expect->manifest_digest = PlacementDigest(*manifest, topology);
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

v1::PromotionEvidence EvidenceToProto(const GateEvidence& g) {
  const PromotionInputs& in = g.inputs;
  v1::PromotionEvidence e;
  e.set_hash_ok(in.hash_ok);
  e.set_manifest_ok(in.manifest_ok);
  e.set_faults_ok(in.faults_ok);
  e.set_rollback_ok(in.rollback_ok);
  e.set_shadow_samples(in.shadow_samples);
  e.set_canary_samples(in.canary_samples);
  e.set_routes_attempted(in.routes_attempted);
  e.set_routes_dropped(in.routes_dropped);
  e.set_steps(in.steps);
  e.set_fallback_steps(in.fallback_steps);
  e.set_route_mismatches(in.route_mismatches);
  e.set_stale_accepts(in.stale_accepts);
  e.set_count_failures(in.count_failures);
  for (const std::string& f : g.findings) e.add_findings(f);
  return e;
}

}  // namespace

absl::StatusOr<v1::PromotionEvidence> ControlPlaneServiceImpl::EvidenceFromRanks(const ReleaseRecord& candidate) {
  EvidenceExpectation expect;
  expect.candidate_version = candidate.placement_version;
  ExpectRecordedManifest(candidate, *topology_, &expect);
  auto releases = store_->List();
  if (!releases.ok()) return releases.status();
  ExpectPrior(*releases, candidate, &expect);
  std::vector<RankReport> reports;
  int rank = 0;
  for (auto& [status, address] : agents_->Status()) {
    if (!status.ok()) {
      return absl::Status(status.status().code(),
                          absl::StrCat("evidence: rank ", address, ": ", status.status().message()));
    }
    reports.push_back(ReportOf(*status, absl::StrCat("rank ", rank++, " (", address, ")"), candidate.placement_version,
                               expect.prior_version));
  }
  return EvidenceToProto(AggregateRankEvidence(reports, expect));
}

grpc::Status ControlPlaneServiceImpl::Promote(grpc::ServerContext* ctx, const v1::PromoteRequest* req,
                                              v1::PromoteResponse* resp) {
  if (grpc::Status s = Authorize(ctx); !s.ok()) return s;
  const bool drives_ranks = agents_ != nullptr && !agents_->empty();
  v1::PromotionEvidence evidence = req->evidence();
  bool gate = true;
  if (!req->has_evidence()) {
    // Without operator evidence the gate reads the ranks' counters for the candidate's placement
    // (a retry of a committed promotion skips the gate: the store answers it).
    if (!drives_ranks) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "evidence: required (no rank agents)");
    auto recorded = store_->Recorded(req->request_id());
    if (!recorded.ok()) return ToGrpcStatus(recorded.status());
    auto candidate = store_->Get(req->release_id());
    if (!candidate.ok()) return ToGrpcStatus(candidate.status());
    if (recorded->empty()) {
      if (candidate->placement_version <= 0) {
        return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                            absl::StrCat("evidence: ", req->release_id(), " has no placement on the ranks to read"));
      }
      auto from_ranks = EvidenceFromRanks(*candidate);
      if (!from_ranks.ok()) return ToGrpcStatus(from_ranks.status());
      evidence = *from_ranks;
    } else {
      gate = false;  // a retry of a promotion the gate passed and the store committed
    }
  }
  *resp->mutable_evidence() = evidence;
  const PromotionDecision d = gate ? EvaluatePromotion(FromProto(evidence), thresholds_) : PromotionDecision{true, {}};
  if (!d.promote) {
    return grpc::Status(
        grpc::StatusCode::FAILED_PRECONDITION,
        absl::StrCat("evidence: promotion gate failed: ", absl::StrJoin(d.failed, ", "),
                     req->has_evidence() ? "" : " (read from the ranks)", evidence.findings().empty() ? "" : ": ",
                     absl::StrJoin(evidence.findings(), "; ")));
  }
  absl::MutexLock lock(&write_mu_);
  auto applied = Replay(req->request_id(), req->release_id(), ReleaseState::kActive);
  if (!applied.ok()) return ToGrpcStatus(applied.status());
  if (applied->empty()) {
    auto candidate = store_->Get(req->release_id());
    if (!candidate.ok()) return ToGrpcStatus(candidate.status());
    if (candidate->state != ReleaseState::kCanary) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("release_id: ", req->release_id(), " is ", ReleaseStateName(candidate->state),
                                       "; only a CANARY release is promoted"));
    }
    auto releases = store_->List();
    if (!releases.ok()) return ToGrpcStatus(releases.status());
    std::vector<ReleaseStore::Move> moves = {{req->release_id(), ReleaseState::kActive, "promotion gate passed"}};
    for (const ReleaseRecord& r : *releases) {
      if (r.state == ReleaseState::kActive && r.release_id != req->release_id()) {
        moves.push_back({r.release_id, ReleaseState::kDraining, absl::StrCat("replaced by ", req->release_id())});
      }
    }
    applied = store_->Apply(req->request_id(), moves);  // committed before any rank acts on it
    if (!applied.ok()) return ToGrpcStatus(applied.status());
  }
  for (const StoredTransition& t : *applied) {
    if (t.to == ReleaseState::kDraining) resp->set_drained_release_id(t.release_id);
  }
  auto rec = store_->Get(req->release_id());
  if (!rec.ok()) return ToGrpcStatus(rec.status());
  Fill(*rec, resp->mutable_release());
  // Drive the ranks only while the registry still says this release is ACTIVE: a late retry after
  // another promotion or a rollback must not switch the ranks back.
  if (agents_ != nullptr && !agents_->empty() && rec->placement_version > 0 && rec->state == ReleaseState::kActive) {
    absl::Status s = agents_->SetTrial(0, 0, 0);
    if (s.ok()) s = agents_->Activate(rec->placement_version);
    if (!s.ok()) {
      return ToGrpcStatus(absl::Status(s.code(), absl::StrCat(req->release_id(), " is committed ACTIVE but ",
                                                              s.message(), "; retry with the same request_id")));
    }
  }
  return grpc::Status::OK;
}

grpc::Status ControlPlaneServiceImpl::Rollback(grpc::ServerContext* ctx, const v1::RollbackRequest* req,
                                               v1::RollbackResponse* resp) {
  if (grpc::Status s = Authorize(ctx); !s.ok()) return s;
  if (req->prior_release_id().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "prior_release_id: required");
  }
  if (req->prior_release_id() == req->release_id()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "prior_release_id: must differ from release_id");
  }
  const std::string reason = req->reason().empty() ? "rollback" : req->reason();
  absl::MutexLock lock(&write_mu_);
  auto applied = Replay(req->request_id(), req->release_id(), ReleaseState::kDraining);
  if (!applied.ok()) return ToGrpcStatus(applied.status());
  if (applied->empty()) {
    auto prior = store_->Get(req->prior_release_id());
    if (!prior.ok()) return ToGrpcStatus(prior.status());
    if (prior->state != ReleaseState::kDraining) {
      return grpc::Status(
          grpc::StatusCode::FAILED_PRECONDITION,
          absl::StrCat("prior_release_id: ", req->prior_release_id(), " is ", ReleaseStateName(prior->state),
                       "; only a DRAINING (loaded) release is re-activated"));
    }
    // 0x0EA's first two steps, in order and in one commit: stop new candidate dispatch, then
    // activate the prior release.
    applied = store_->Apply(req->request_id(), {{req->release_id(), ReleaseState::kDraining, reason},
                                                {req->prior_release_id(), ReleaseState::kActive, reason}});
    if (!applied.ok()) return ToGrpcStatus(applied.status());
  }
  for (const StoredTransition& t : *applied) Fill(t, resp->add_transitions());
  if (agents_ == nullptr || agents_->empty()) return grpc::Status::OK;
  // On the ranks, 0x0EA's order (RollBack): activate the prior placement (each rank's candidate
  // stops dispatch in the same step), drain the candidate's handles to zero, retire it (each rank
  // frees its resources); then commit the candidate RETIRED.
  auto candidate = store_->Get(req->release_id());
  auto prior = store_->Get(req->prior_release_id());
  if (!candidate.ok()) return ToGrpcStatus(candidate.status());
  if (!prior.ok()) return ToGrpcStatus(prior.status());
  if (candidate->placement_version <= 0 || prior->placement_version <= 0 ||
      candidate->placement_version == prior->placement_version) {
    return grpc::Status::OK;  // nothing placed on the ranks by these releases
  }
  if (prior->state != ReleaseState::kActive) {
    return grpc::Status::OK;  // a late retry: the registry has moved on; the ranks follow it, not this request
  }
  AgentRollback ranks(agents_, drain_timeout_);
  auto rolled =
      RollBack(ranks, PlacementVersion(candidate->placement_version), PlacementVersion(prior->placement_version));
  if (!rolled.ok()) {
    const absl::Status& s = rolled.status();
    return ToGrpcStatus(absl::Status(
        s.code(), absl::StrCat("rollback committed; on the ranks: ", s.message(), "; retry with the same request_id")));
  }
  auto retired =
      store_->Apply(absl::StrCat(req->request_id(), "/retire"),
                    {{req->release_id(), ReleaseState::kRetired, "handles drained and retired on every rank"}});
  if (!retired.ok()) return ToGrpcStatus(retired.status());
  for (const StoredTransition& t : *retired) Fill(t, resp->add_transitions());
  return grpc::Status::OK;
}

grpc::Status ControlPlaneServiceImpl::LoadPlacement(grpc::ServerContext* ctx, const v1::LoadPlacementRequest* req,
                                                    v1::Release* resp) {
  if (grpc::Status s = Authorize(ctx); !s.ok()) return s;
  if (!req->has_manifest()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "manifest: required");
  const int64_t version = req->manifest().version();
  if (version <= 0) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "manifest.version: must be positive");
  if (agents_ == nullptr || agents_->empty()) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "no rank agents: start moe-controller with --ranks");
  }
  absl::MutexLock lock(&write_mu_);
  auto applied = Replay(req->request_id(), req->release_id(), ReleaseState::kLoaded);
  if (!applied.ok()) return ToGrpcStatus(applied.status());
  if (applied->empty()) {
    auto rec = store_->Get(req->release_id());
    if (!rec.ok()) return ToGrpcStatus(rec.status());
    if (rec->state != ReleaseState::kVerified) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("release_id: ", req->release_id(), " is ", ReleaseStateName(rec->state),
                                       "; a placement is loaded for a VERIFIED release"));
    }
    auto releases = store_->List();
    if (!releases.ok()) return ToGrpcStatus(releases.status());
    for (const ReleaseRecord& r : *releases) {
      if (r.placement_version == version && r.release_id != req->release_id()) {
        return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                            absl::StrCat("manifest.version: placement-v", version, " belongs to ", r.release_id));
      }
    }
    std::string reason = absl::StrCat("placement-v", version, " prepared on ", agents_->addresses().size(), " ranks");
    // Admission: the migration from the ACTIVE release's placement must fit the memory budget.
    if (migration_.budget_bytes > 0) {
      auto peak = MigrationPeak(*releases, req->manifest());
      if (!peak.ok()) return ToGrpcStatus(peak.status());
      if (*peak > migration_.budget_bytes) {
        return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                            absl::StrCat("manifest: the migration to placement-v", version, " peaks at ", *peak,
                                         " bytes of expert weights, over the budget of ", migration_.budget_bytes));
      }
      absl::StrAppend(&reason, ", migration peak ", *peak, " bytes");
    }
    // Every rank has the generation prepared before the release is recorded LOADED.
    if (absl::Status s = agents_->Prepare(req->manifest()); !s.ok()) return ToGrpcStatus(s);
    std::string manifest_json;
    (void)google::protobuf::util::MessageToJsonString(req->manifest(), &manifest_json);
    applied =
        store_->Apply(req->request_id(), {{req->release_id(), ReleaseState::kLoaded, reason, version, manifest_json}});
    if (!applied.ok()) return ToGrpcStatus(applied.status());
  }
  auto rec = store_->Get(req->release_id());
  if (!rec.ok()) return ToGrpcStatus(rec.status());
  Fill(*rec, resp);
  return grpc::Status::OK;
}

absl::StatusOr<int64_t> ControlPlaneServiceImpl::MigrationPeak(const std::vector<ReleaseRecord>& releases,
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
    auto plan = PlanMigration(**from, **target, topology, migration_.expert_bytes);
    if (!plan.ok()) return plan.status();
    return plan->peak_bytes;
  }
  // Nothing active with a placement: every copy is loaded while nothing else is resident.
  return static_cast<int64_t>((*target)->num_slots()) * migration_.expert_bytes;
}

absl::Status ControlPlaneServiceImpl::Reconcile() {
  if (agents_ == nullptr || agents_->empty()) return absl::OkStatus();
  absl::MutexLock lock(&write_mu_);
  auto releases = store_->List();
  if (!releases.ok()) return releases.status();
  for (const ReleaseRecord& r : *releases) {
    if (r.state != ReleaseState::kActive || r.placement_version <= 0) continue;
    // Drive only ranks that disagree (this runs periodically): a restarted moe-rankd comes back
    // serving its boot placement without the release's; it gets the placement prepared (from
    // the manifest the store recorded, slots copied from its peers) and activated again.
    bool agree = true;
    for (auto& [status, address] : agents_->Status()) {
      agree = agree && status.ok() && status->active_version() == r.placement_version;
    }
    if (agree) return absl::OkStatus();
    if (!r.placement_manifest.empty()) {
      v1::PlacementManifest proto;
      if (!google::protobuf::util::JsonStringToMessage(r.placement_manifest, &proto).ok()) {
        return absl::DataLossError(absl::StrCat(r.release_id, ": stored placement manifest does not parse"));
      }
      RETURN_IF_ERROR(agents_->Prepare(proto));  // a no-op where the rank already holds it
    }
    RETURN_IF_ERROR(agents_->Activate(r.placement_version));
    spdlog::info("reconcile: every rank serves placement-v{} of {} again", r.placement_version, r.release_id);
    return absl::OkStatus();
  }
  return absl::OkStatus();
}

grpc::Status ControlPlaneServiceImpl::ClusterStatus(grpc::ServerContext* ctx, const v1::ClusterStatusRequest*,
                                                    v1::ClusterStatusResponse* resp) {
  if (grpc::Status s = Authorize(ctx); !s.ok()) return s;
  if (agents_ == nullptr) return grpc::Status::OK;
  for (auto& [status, address] : agents_->Status()) {
    v1::RankAgentReport* r = resp->add_ranks();
    r->set_address(address);
    if (status.ok()) {
      *r->mutable_status() = *status;
    } else {
      r->set_error(std::string(status.status().message()));
    }
  }
  return grpc::Status::OK;
}

grpc::Status ControlPlaneServiceImpl::GetRelease(grpc::ServerContext* ctx, const v1::GetReleaseRequest* req,
                                                 v1::Release* resp) {
  if (grpc::Status s = Authorize(ctx); !s.ok()) return s;
  auto r = store_->Get(req->release_id());
  if (!r.ok()) return ToGrpcStatus(r.status());
  Fill(*r, resp);
  return grpc::Status::OK;
}

grpc::Status ControlPlaneServiceImpl::ListReleases(grpc::ServerContext* ctx, const v1::ListReleasesRequest*,
                                                   v1::ListReleasesResponse* resp) {
  if (grpc::Status s = Authorize(ctx); !s.ok()) return s;
  auto releases = store_->List();
  if (!releases.ok()) return ToGrpcStatus(releases.status());
  for (const ReleaseRecord& r : *releases) Fill(r, resp->add_releases());
  return grpc::Status::OK;
}

grpc::Status ControlPlaneServiceImpl::History(grpc::ServerContext* ctx, const v1::HistoryRequest* req,
                                              v1::HistoryResponse* resp) {
  if (grpc::Status s = Authorize(ctx); !s.ok()) return s;
  auto history = store_->History(req->release_id());
  if (!history.ok()) return ToGrpcStatus(history.status());
  for (const StoredTransition& t : *history) Fill(t, resp->add_transitions());
  return grpc::Status::OK;
}

grpc::Status ControlPlaneServiceImpl::Watch(grpc::ServerContext* ctx, const v1::WatchRequest* req,
                                            grpc::ServerWriter<v1::TransitionRecord>* writer) {
  if (grpc::Status s = Authorize(ctx); !s.ok()) return s;
  if (req->after_seq() < 0) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "after_seq: must be >= 0");
  int64_t last = req->after_seq();
  // Transitions are committed to SQLite before they are answered, so polling the table sees
  // each one exactly once, in seq order, whichever RPC (or restarted controller) wrote it.
  while (!ctx->IsCancelled()) {
    auto batch = store_->History(req->release_id(), last);
    if (!batch.ok()) return ToGrpcStatus(batch.status());
    for (const StoredTransition& t : *batch) {
      v1::TransitionRecord r;
      Fill(t, &r);
      if (!writer->Write(r)) return grpc::Status::OK;  // the client went away
      last = t.seq;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  return grpc::Status::OK;
}

}  // namespace moe
