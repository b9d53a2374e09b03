#include "runtime/exec/dispatch_handle.h"

#include "absl/strings/str_cat.h"

#include "runtime/plan/combine.h"
#include "runtime/status.h"

namespace moe {

const char* HandleStateName(HandleState s) {
  switch (s) {
    case HandleState::kRouterOutput:
      return "router_output";
    case HandleState::kDispatchMetadataReady:
      return "dispatch_metadata_ready";
    case HandleState::kDispatchInFlight:
      return "dispatch_in_flight";
    case HandleState::kExpertRowsReady:
      return "expert_rows_ready";
    case HandleState::kExpertOutputReady:
      return "expert_output_ready";
    case HandleState::kCombineInFlight:
      return "combine_in_flight";
    case HandleState::kOriginRowsReady:
      return "origin_rows_ready";
    case HandleState::kReleasable:
      return "dispatch_state_releasable";
  }
  return "unknown";
}

absl::StatusOr<std::unique_ptr<DispatchHandle>> DispatchHandle::Acquire(HandleId id, const FrozenHandoff& handoff,
                                                                        GenerationRegistry* registry,
                                                                        const ProcessGroup& group,
                                                                        std::unique_ptr<DispatchHandle> spare) {
  RETURN_IF_ERROR(VerifyFrozen(handoff));
  ASSIGN_OR_RETURN(GenerationLease lease, registry->AcquireActive(id));
  return FromLease(id, handoff, group, std::move(lease), false, std::move(spare));
}

absl::StatusOr<std::unique_ptr<DispatchHandle>> DispatchHandle::AcquireTrial(HandleId id, const FrozenHandoff& handoff,
                                                                             GenerationRegistry* registry,
                                                                             const ProcessGroup& group,
                                                                             PlacementVersion candidate,
                                                                             std::unique_ptr<DispatchHandle> spare) {
  RETURN_IF_ERROR(VerifyFrozen(handoff));
  ASSIGN_OR_RETURN(GenerationLease lease, registry->AcquireTrial(candidate, id));
  return FromLease(id, handoff, group, std::move(lease), true, std::move(spare));
}

void DispatchHandle::Reset() { *this = DispatchHandle(); }

absl::StatusOr<std::unique_ptr<DispatchHandle>> DispatchHandle::FromLease(HandleId id, const FrozenHandoff& handoff,
                                                                          const ProcessGroup& group,
                                                                          GenerationLease lease, bool trial,
                                                                          std::unique_ptr<DispatchHandle> spare) {
  const PlacementManifest& m = *lease.manifest();
  if (m.process_group() != group.id() || m.epoch() != group.epoch()) {
    return absl::FailedPreconditionError(
        absl::StrCat("active ", m.VersionName(), " is bound to ", m.process_group().value(), " epoch ",
                     m.epoch().value(), ", the step runs on ", group.id().value(), " epoch ", group.epoch().value()));
  }
  std::unique_ptr<DispatchHandle> h = std::move(spare);
  if (h == nullptr) {
    h.reset(new DispatchHandle());
  } else {
    h->Reset();  // a spare that was not reset holds no lease past here either
  }
  h->id_ = id;
  h->version_ = m.version();
  h->checkpoint_ = m.checkpoint();
  h->group_ = m.process_group();
  h->epoch_ = m.epoch();
  h->fingerprint_ = handoff.fingerprint;
  h->lease_ = std::move(lease);
  h->trial_ = trial;
  return h;
}

absl::Status DispatchHandle::Advance(HandleState from, HandleState to, const char* what) {
  if (state_ != from) {
    if (state_ == HandleState::kReleasable || static_cast<int>(state_) > static_cast<int>(from)) {
      return absl::FailedPreconditionError(absl::StrCat("handle ", id_.value(), ": ", what, " in state ",
                                                        HandleStateName(state_), " (already past ",
                                                        HandleStateName(from), ")"));
    }
    return absl::FailedPreconditionError(absl::StrCat("handle ", id_.value(), ": ", what, " in state ",
                                                      HandleStateName(state_), ", requires ", HandleStateName(from)));
  }
  state_ = to;
  return absl::OkStatus();
}

absl::Status DispatchHandle::BindPlan(InverseCoordinates inverse) {
  if (inverse.token.size() != inverse.gate.size()) {
    return absl::InvalidArgumentError("inverse coordinates: token and gate lengths differ");
  }
  RETURN_IF_ERROR(Advance(HandleState::kRouterOutput, HandleState::kDispatchMetadataReady, "bind plan"));
  inverse_ = std::move(inverse);
  return absl::OkStatus();
}

absl::Status DispatchHandle::MarkDispatchInFlight() {
  return Advance(HandleState::kDispatchMetadataReady, HandleState::kDispatchInFlight, "dispatch submit");
}

absl::Status DispatchHandle::MarkExpertRowsReady() {
  return Advance(HandleState::kDispatchInFlight, HandleState::kExpertRowsReady, "dispatch completion");
}

absl::Status DispatchHandle::MarkExpertOutputReady() {
  return Advance(HandleState::kExpertRowsReady, HandleState::kExpertOutputReady, "expert output");
}

absl::Status DispatchHandle::BeginCombine(const GenerationRegistry& registry, PlacementVersion executor_version) {
  if (state_ != HandleState::kExpertOutputReady) {
    return Advance(HandleState::kExpertOutputReady, HandleState::kCombineInFlight, "combine");
  }
  if (executor_version != version_) {
    return absl::FailedPreconditionError(absl::StrCat("handle ", id_.value(), " was dispatched under placement-v",
                                                      version_.value(), "; combine under placement-v",
                                                      executor_version.value(), " refused"));
  }
  ASSIGN_OR_RETURN(auto live, trial_ ? registry.RequireTrial(version_) : registry.RequireLive(version_));
  if (live->checkpoint() != checkpoint_ || live->process_group() != group_ || live->epoch() != epoch_) {
    return absl::FailedPreconditionError(absl::StrCat("handle ", id_.value(), ": placement-v", version_.value(),
                                                      " no longer matches the handle's "
                                                      "checkpoint / process group"));
  }
  return Advance(HandleState::kExpertOutputReady, HandleState::kCombineInFlight, "combine");
}

absl::Status DispatchHandle::MarkOriginRowsReady() {
  return Advance(HandleState::kCombineInFlight, HandleState::kOriginRowsReady, "combine completion");
}

absl::Status DispatchHandle::Release() {
  RETURN_IF_ERROR(Advance(HandleState::kOriginRowsReady, HandleState::kReleasable, "release"));
  return lease_.Release();
}

absl::Status DispatchHandle::ReleaseAfterWork() {
  return Advance(HandleState::kOriginRowsReady, HandleState::kReleasable, "release");
}

absl::Status CombineAndRelease(DispatchHandle* handle, const GenerationRegistry& registry,
                               PlacementVersion executor_version, absl::Span<const float> returned_rows, int d,
                               absl::Span<float> out) {
  const InverseCoordinates& inv = handle->inverse();
  if (d <= 0) return absl::InvalidArgumentError("d: must be positive");
  if (returned_rows.size() != inv.token.size() * static_cast<size_t>(d)) {
    return absl::InvalidArgumentError(absl::StrCat("returned rows: ", returned_rows.size(), " values, handle expects ",
                                                   inv.token.size(), " rows of ", d));
  }
  if (out.size() != static_cast<size_t>(inv.num_tokens) * d) {
    return absl::InvalidArgumentError(
        absl::StrCat("output: ", out.size(), " values, handle expects ", inv.num_tokens, " rows of ", d));
  }
  RETURN_IF_ERROR(handle->BeginCombine(registry, executor_version));
  CombineArgs args;
  args.rows = returned_rows.data();
  args.token = inv.token.data();
  args.gate = inv.gate.data();
  args.n = static_cast<int64_t>(inv.token.size());
  args.d = d;
  args.num_tokens = inv.num_tokens;
  args.out = out.data();
  RETURN_IF_ERROR(WeightedScatterAdd(args));
  RETURN_IF_ERROR(handle->MarkOriginRowsReady());
  return handle->Release();
}

}  // namespace moe
