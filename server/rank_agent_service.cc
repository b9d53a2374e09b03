#include "server/rank_agent_service.h"

#include <functional>

#include "absl/strings/str_cat.h"
#include "control/placement_proto.h"
#include "runtime/checkpoint/synthetic.h"
#include "server/bearer_auth.h"
#include "server/grpc_status.h"

namespace moe {

namespace {

v1::GenerationState ToProto(GenerationState s) {
  switch (s) {
    case GenerationState::kPrepared:
      return v1::GENERATION_STATE_PREPARED;
    case GenerationState::kActive:
      return v1::GENERATION_STATE_ACTIVE;
    case GenerationState::kDraining:
      return v1::GENERATION_STATE_DRAINING;
    case GenerationState::kRetired:
      return v1::GENERATION_STATE_RETIRED;
  }
  return v1::GENERATION_STATE_UNSPECIFIED;
}

// Same version, same slots: a repeated PrepareGeneration.
bool SameSlots(const PlacementManifest& a, const PlacementManifest& b) {
  if (a.slots().size() != b.slots().size()) return false;
  for (size_t i = 0; i < a.slots().size(); ++i) {
    const SlotRecord &x = a.slots()[i], &y = b.slots()[i];
    if (x.slot != y.slot || x.expert != y.expert || x.rank != y.rank || x.parameter_digest != y.parameter_digest ||
        x.checkpoint != y.checkpoint) {
      return false;
    }
  }
  return true;
}

}  // namespace

grpc::Status RankAgentServiceImpl::Describe(PlacementVersion v, v1::GenerationStatus* out) const {
  for (const GenerationInfo& g : c_.registry->List()) {
    if (g.version != v) continue;
    out->set_version(v.value());
    out->set_state(ToProto(g.state));
    out->set_refcount(g.refcount);
    out->set_local_slots(static_cast<int32_t>(g.manifest->LocalSlots(c_.rank).size()));
    return grpc::Status::OK;
  }
  return grpc::Status(grpc::StatusCode::NOT_FOUND, absl::StrCat("version: placement-v", v.value(), " is unknown here"));
}

grpc::Status RankAgentServiceImpl::PrepareGeneration(grpc::ServerContext* ctx, const v1::PrepareGenerationRequest* req,
                                                     v1::GenerationStatus* resp) {
  if (grpc::Status s = CheckBearer(ctx, c_.token); !s.ok()) return s;
  if (!req->has_manifest()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "manifest: required");
  auto manifest = ManifestFromProto(req->manifest(), c_.topology);
  if (!manifest.ok()) return ToGrpcStatus(manifest.status());
  const PlacementVersion v = (*manifest)->version();
  if (v.value() <= 0) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "manifest.version: must be positive");
  absl::MutexLock lock(&mu_);
  if (c_.registry->State(v).ok()) {
    for (const GenerationInfo& g : c_.registry->List()) {
      if (g.version == v && SameSlots(*g.manifest, **manifest)) return Describe(v, resp);  // repeat
    }
    return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                        absl::StrCat("manifest.version: placement-v", v.value(), " exists with other slots"));
  }
  // Verify and load everything before the registry sees the generation: a failure leaves nothing.
  if (absl::Status s = VerifyForPublish(**manifest, c_.group, c_.topology); !s.ok()) return ToGrpcStatus(s);
  auto local = LoadLocalExperts(*c_.checkpoint, **manifest, c_.rank);
  if (!local.ok()) return ToGrpcStatus(local.status());
  if (absl::Status s = c_.executor->AddGeneration(v, std::make_shared<LocalExperts>(*std::move(local))); !s.ok()) {
    return ToGrpcStatus(s);
  }
  if (absl::Status s = c_.registry->Prepare(*manifest); !s.ok()) {
    c_.executor->DropGeneration(v);
    return ToGrpcStatus(s);
  }
  return Describe(v, resp);
}

grpc::Status RankAgentServiceImpl::Change(
    const grpc::ServerContext* ctx, const v1::GenerationRequest& req, v1::GenerationStatus* resp,
    const std::function<absl::Status(PlacementVersion, GenerationState)>& change) {
  if (grpc::Status s = CheckBearer(ctx, c_.token); !s.ok()) return s;
  if (req.version() <= 0) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "version: must be positive");
  absl::MutexLock lock(&mu_);
  const PlacementVersion v(req.version());
  auto state = c_.registry->State(v);
  if (!state.ok()) return ToGrpcStatus(state.status());
  if (absl::Status s = change(v, *state); !s.ok()) return ToGrpcStatus(s);
  return Describe(v, resp);
}

// Each change is a no-op when the generation is already where it leads (retries are safe).
grpc::Status RankAgentServiceImpl::ActivateGeneration(grpc::ServerContext* ctx, const v1::GenerationRequest* req,
                                                      v1::GenerationStatus* resp) {
  return Change(ctx, *req, resp, [&](PlacementVersion v, GenerationState s) {
    if (c_.executor->Trial().version == v.value()) c_.executor->SetTrial(-1, 0, 0);  // no longer a candidate
    return s == GenerationState::kActive ? absl::OkStatus() : c_.registry->Activate(v);
  });
}

grpc::Status RankAgentServiceImpl::StopDispatch(grpc::ServerContext* ctx, const v1::GenerationRequest* req,
                                                v1::GenerationStatus* resp) {
  return Change(ctx, *req, resp, [&](PlacementVersion v, GenerationState s) {
    return s == GenerationState::kActive ? c_.registry->StopDispatch(v) : absl::OkStatus();
  });
}

grpc::Status RankAgentServiceImpl::RetireGeneration(grpc::ServerContext* ctx, const v1::GenerationRequest* req,
                                                    v1::GenerationStatus* resp) {
  return Change(ctx, *req, resp, [&](PlacementVersion v, GenerationState s) {
    if (s == GenerationState::kRetired) return absl::OkStatus();
    if (c_.executor->Trial().version == v.value()) c_.executor->SetTrial(-1, 0, 0);
    absl::Status retired = c_.registry->Retire(v);
    if (retired.ok()) c_.executor->DropGeneration(v);
    return retired;
  });
}

grpc::Status RankAgentServiceImpl::SetTrial(grpc::ServerContext* ctx, const v1::TrialRequest* req,
                                            v1::TrialRequest* resp) {
  if (grpc::Status s = CheckBearer(ctx, c_.token); !s.ok()) return s;
  if (req->version() < 0) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "version: must be >= 0");
  if (req->shadow_every() < 0 || req->canary_every() < 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "shadow_every / canary_every: must be >= 0");
  }
  absl::MutexLock lock(&mu_);
  if (req->version() > 0 && c_.registry->ActiveVersion() == req->version()) {
    c_.executor->SetTrial(-1, 0, 0);  // it already serves here: nothing to try
  } else if (req->version() > 0) {
    auto state = c_.registry->State(PlacementVersion(req->version()));
    if (!state.ok() || *state != GenerationState::kPrepared) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("version: placement-v", req->version(), " is ",
                                       state.ok() ? GenerationStateName(*state) : "unknown",
                                       " on rank ", c_.rank.value(), "; trials run on a PREPARED candidate"));
    }
    c_.executor->SetTrial(req->version(), req->shadow_every(), req->canary_every());
  } else {
    c_.executor->SetTrial(-1, 0, 0);
  }
  const LayerExecutor::TrialConfig t = c_.executor->Trial();
  resp->set_version(std::max<int64_t>(t.version, 0));
  resp->set_shadow_every(t.shadow_every);
  resp->set_canary_every(t.canary_every);
  return grpc::Status::OK;
}

grpc::Status RankAgentServiceImpl::Status(grpc::ServerContext* ctx, const v1::AgentStatusRequest*,
                                          v1::AgentStatusResponse* resp) {
  if (grpc::Status s = CheckBearer(ctx, c_.token); !s.ok()) return s;
  resp->set_rank(c_.rank.value());
  resp->set_active_version(c_.registry->ActiveVersion());
  for (int64_t n : c_.executor->ExpertLoad()) resp->add_expert_routes(n);
  const LayerExecutor::TrialConfig t = c_.executor->Trial();
  resp->mutable_trial()->set_version(std::max<int64_t>(t.version, 0));
  resp->mutable_trial()->set_shadow_every(t.shadow_every);
  resp->mutable_trial()->set_canary_every(t.canary_every);
  for (const auto& [version, c] : c_.executor->Counters()) {
    v1::GenerationCounters* out = resp->add_counters();
    out->set_version(version);
    out->set_steps(c.steps);
    out->set_failed_steps(c.failed_steps);
    out->set_canary_steps(c.canary_steps);
    out->set_decode_steps(c.decode_steps);
    out->set_fallback_steps(c.fallback_steps);
    out->set_routes_attempted(c.routes_attempted);
    out->set_routes_dropped(c.routes_dropped);
    out->set_shadow_samples(c.shadow_samples);
    out->set_shadow_mismatches(c.shadow_mismatches);
    out->set_shadow_failures(c.shadow_failures);
  }
  for (const GenerationInfo& g : c_.registry->List()) {
    v1::GenerationStatus* out = resp->add_generations();
    out->set_version(g.version.value());
    out->set_state(ToProto(g.state));
    out->set_refcount(g.refcount);
    out->set_local_slots(static_cast<int32_t>(g.manifest->LocalSlots(c_.rank).size()));
    if (g.state == GenerationState::kActive) {
      for (PhysicalSlotId q : g.manifest->LocalSlots(c_.rank)) {
        resp->add_active_slot_experts(g.manifest->slot(q).expert.value());
      }
    }
  }
  return grpc::Status::OK;
}

}  // namespace moe
