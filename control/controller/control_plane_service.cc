#include "control/controller/control_plane_service.h"

#include <initializer_list>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "rpc/bearer_auth.h"
#include "rpc/grpc_status.h"
#include "runtime/release/evidence.h"

namespace moe {

namespace {

// Caller-supplied names and reasons are stored in the registry for good and echoed in histories,
// Watch streams and logs, so they are bounded here, before the manager sees them.
constexpr size_t kMaxIdBytes = 128;       // request ids, release ids, digests
constexpr size_t kMaxReasonBytes = 1024;  // a transition's reason, an evidence finding
constexpr int kMaxFindings = 64;

// INVALID_ARGUMENT naming `field` when `value` is longer than `max` bytes or holds a control
// character (a newline or NUL would forge lines of the logs and the CLI's tables).
grpc::Status CheckText(const char* field, const std::string& value, size_t max) {
  if (value.size() > max) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat(field, ": ", value.size(), " bytes; at most ", max));
  }
  for (size_t i = 0; i < value.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(value[i]);
    if (c < 0x20 || c == 0x7f) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat(field, ": control character 0x", absl::Hex(c), " at byte ", i));
    }
  }
  return grpc::Status::OK;
}

// Every text field of a write request: the first that fails, in the order given.
grpc::Status CheckFields(std::initializer_list<std::pair<const char*, const std::string*>> ids,
                         const std::string* reason = nullptr) {
  for (const auto& [field, value] : ids) {
    if (grpc::Status s = CheckText(field, *value, kMaxIdBytes); !s.ok()) return s;
  }
  if (reason != nullptr) return CheckText("reason", *reason, kMaxReasonBytes);
  return grpc::Status::OK;
}

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

GateEvidence FromProto(const v1::PromotionEvidence& e) {
  GateEvidence g;
  PromotionInputs& in = g.inputs;
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
  g.findings.assign(e.findings().begin(), e.findings().end());
  return g;
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

ControlPlaneServiceImpl::ControlPlaneServiceImpl(ReleaseManager* manager, std::string token, std::string read_token)
    : manager_(manager), token_(std::move(token)), read_token_(std::move(read_token)) {}

grpc::Status ControlPlaneServiceImpl::AuthorizeRead(const grpc::ServerContext* ctx) const {
  if (BearerIs(ctx, read_token_)) return grpc::Status::OK;
  return CheckBearer(ctx, token_);
}

grpc::Status ControlPlaneServiceImpl::AuthorizeWrite(const grpc::ServerContext* ctx, const char* rpc) const {
  grpc::Status s = CheckBearer(ctx, token_);
  if (!s.ok() && BearerIs(ctx, read_token_)) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        absl::StrCat(rpc,
                                     ": the read-only token (--read_token_file) cannot change the registry or the "
                                     "ranks; this call needs the operators' token (--token_file)"));
  }
  return s;
}

grpc::Status ControlPlaneServiceImpl::RegisterRelease(grpc::ServerContext* ctx, const v1::RegisterReleaseRequest* req,
                                                      v1::Release* resp) {
  if (grpc::Status s = AuthorizeWrite(ctx, "RegisterRelease"); !s.ok()) return s;
  if (grpc::Status s = CheckFields({{"request_id", &req->request_id()},
                                    {"release_id", &req->release_id()},
                                    {"bundle_digest", &req->bundle_digest()}});
      !s.ok()) {
    return s;
  }
  auto r = manager_->Register(req->request_id(), req->release_id(), req->bundle_digest(), req->bundle_json());
  if (!r.ok()) return ToGrpcStatus(r.status());
  Fill(*r, resp);
  return grpc::Status::OK;
}

grpc::Status ControlPlaneServiceImpl::TransitionRelease(grpc::ServerContext* ctx,
                                                        const v1::TransitionReleaseRequest* req,
                                                        v1::TransitionRecord* resp) {
  if (grpc::Status s = AuthorizeWrite(ctx, "TransitionRelease"); !s.ok()) return s;
  if (grpc::Status s =
          CheckFields({{"request_id", &req->request_id()}, {"release_id", &req->release_id()}}, &req->reason());
      !s.ok()) {
    return s;
  }
  auto to = FromProto(req->to(), "to");
  if (!to.ok()) return ToGrpcStatus(to.status());
  auto t = manager_->Transition(req->request_id(), req->release_id(), *to, req->reason());
  if (!t.ok()) return ToGrpcStatus(t.status());
  Fill(*t, resp);
  return grpc::Status::OK;
}

grpc::Status ControlPlaneServiceImpl::Promote(grpc::ServerContext* ctx, const v1::PromoteRequest* req,
                                              v1::PromoteResponse* resp) {
  if (grpc::Status s = AuthorizeWrite(ctx, "Promote"); !s.ok()) return s;
  if (grpc::Status s = CheckFields({{"request_id", &req->request_id()}, {"release_id", &req->release_id()}}); !s.ok()) {
    return s;
  }
  if (req->evidence().findings_size() > kMaxFindings) {
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("evidence.findings: ", req->evidence().findings_size(), " entries; at most ", kMaxFindings));
  }
  for (int i = 0; i < req->evidence().findings_size(); ++i) {
    const std::string field = absl::StrCat("evidence.findings[", i, "]");
    if (grpc::Status s = CheckText(field.c_str(), req->evidence().findings(i), kMaxReasonBytes); !s.ok()) return s;
  }
  std::optional<GateEvidence> evidence;
  if (req->has_evidence()) evidence = FromProto(req->evidence());
  auto promoted = manager_->Promote(req->request_id(), req->release_id(), evidence);
  if (!promoted.ok()) return ToGrpcStatus(promoted.status());
  *resp->mutable_evidence() = EvidenceToProto(promoted->evidence);
  for (const StoredTransition& t : promoted->transitions) {
    if (t.to == ReleaseState::kDraining) resp->set_drained_release_id(t.release_id);
  }
  Fill(promoted->release, resp->mutable_release());
  return grpc::Status::OK;
}

grpc::Status ControlPlaneServiceImpl::Rollback(grpc::ServerContext* ctx, const v1::RollbackRequest* req,
                                               v1::RollbackResponse* resp) {
  if (grpc::Status s = AuthorizeWrite(ctx, "Rollback"); !s.ok()) return s;
  if (grpc::Status s = CheckFields({{"request_id", &req->request_id()},
                                    {"release_id", &req->release_id()},
                                    {"prior_release_id", &req->prior_release_id()}},
                                   &req->reason());
      !s.ok()) {
    return s;
  }
  auto transitions = manager_->Rollback(req->request_id(), req->release_id(), req->prior_release_id(), req->reason());
  if (!transitions.ok()) return ToGrpcStatus(transitions.status());
  for (const StoredTransition& t : *transitions) Fill(t, resp->add_transitions());
  return grpc::Status::OK;
}

grpc::Status ControlPlaneServiceImpl::LoadPlacement(grpc::ServerContext* ctx, const v1::LoadPlacementRequest* req,
                                                    v1::Release* resp) {
  if (grpc::Status s = AuthorizeWrite(ctx, "LoadPlacement"); !s.ok()) return s;
  if (grpc::Status s = CheckFields({{"request_id", &req->request_id()}, {"release_id", &req->release_id()}}); !s.ok()) {
    return s;
  }
  // No manifest: the placement of the release's bundle (INVALID_ARGUMENT from the manager when
  // the release has none).
  auto r = manager_->LoadPlacement(req->request_id(), req->release_id(), req->manifest());
  if (!r.ok()) return ToGrpcStatus(r.status());
  Fill(*r, resp);
  return grpc::Status::OK;
}

grpc::Status ControlPlaneServiceImpl::ClusterStatus(grpc::ServerContext* ctx, const v1::ClusterStatusRequest*,
                                                    v1::ClusterStatusResponse* resp) {
  if (grpc::Status s = AuthorizeRead(ctx); !s.ok()) return s;
  for (auto& [status, address] : manager_->ClusterStatus()) {
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
  if (grpc::Status s = AuthorizeRead(ctx); !s.ok()) return s;
  auto r = manager_->Get(req->release_id());
  if (!r.ok()) return ToGrpcStatus(r.status());
  Fill(*r, resp);
  return grpc::Status::OK;
}

grpc::Status ControlPlaneServiceImpl::ListReleases(grpc::ServerContext* ctx, const v1::ListReleasesRequest*,
                                                   v1::ListReleasesResponse* resp) {
  if (grpc::Status s = AuthorizeRead(ctx); !s.ok()) return s;
  auto releases = manager_->List();
  if (!releases.ok()) return ToGrpcStatus(releases.status());
  for (const ReleaseRecord& r : *releases) Fill(r, resp->add_releases());
  return grpc::Status::OK;
}

grpc::Status ControlPlaneServiceImpl::History(grpc::ServerContext* ctx, const v1::HistoryRequest* req,
                                              v1::HistoryResponse* resp) {
  if (grpc::Status s = AuthorizeRead(ctx); !s.ok()) return s;
  auto history = manager_->History(req->release_id(), 0);
  if (!history.ok()) return ToGrpcStatus(history.status());
  for (const StoredTransition& t : *history) Fill(t, resp->add_transitions());
  return grpc::Status::OK;
}

grpc::Status ControlPlaneServiceImpl::Watch(grpc::ServerContext* ctx, const v1::WatchRequest* req,
                                            grpc::ServerWriter<v1::TransitionRecord>* writer) {
  if (grpc::Status s = AuthorizeRead(ctx); !s.ok()) return s;
  if (req->after_seq() < 0) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "after_seq: must be >= 0");
  int64_t last = req->after_seq();
  // Transitions are committed to SQLite before they are answered, so polling the table sees
  // each one exactly once, in seq order, whichever RPC (or restarted controller) wrote it.
  while (!ctx->IsCancelled()) {
    auto batch = manager_->History(req->release_id(), last);
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
