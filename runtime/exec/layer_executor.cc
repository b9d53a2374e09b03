#include "runtime/exec/layer_executor.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "runtime/exec/dispatch_handle.h"
#include "runtime/exec/step_exchange.h"
#include "runtime/status.h"

namespace moe {

absl::StatusOr<std::unique_ptr<LayerExecutor>> LayerExecutor::Create(LayerExecutorOptions options) {
  if (!options.topology || !options.group) return absl::InvalidArgumentError("executor: topology and group required");
  if (options.registry == nullptr || options.transport == nullptr || options.kernels == nullptr) {
    return absl::InvalidArgumentError("executor: registry, transport and kernels required");
  }
  if (!options.group->Contains(options.rank)) {
    return absl::InvalidArgumentError(absl::StrCat("executor: rank ", options.rank.value(), " is not in the group"));
  }
  if (options.transport->slot() != options.group->SlotOf(options.rank).value() ||
      options.transport->size() != options.group->size()) {
    return absl::FailedPreconditionError("executor: transport slot / size disagree with the process group");
  }
  std::unique_ptr<LayerExecutor> e(new LayerExecutor(std::move(options)));
  e->selector_ = ReplicaSelector::Create(e->options_.selector);
  return e;
}

absl::Status LayerExecutor::AddGeneration(PlacementVersion version, std::shared_ptr<const LocalExperts> experts) {
  if (experts == nullptr) return absl::InvalidArgumentError("experts: null");
  absl::MutexLock lock(&generations_mu_);
  experts_[version.value()] = std::move(experts);
  return absl::OkStatus();
}

std::vector<int64_t> LayerExecutor::ExpertLoad() const {
  absl::MutexLock lock(&generations_mu_);
  return expert_load_;
}

void LayerExecutor::DropGeneration(PlacementVersion version) {
  absl::MutexLock lock(&generations_mu_);
  experts_.erase(version.value());
  layouts_.erase(version.value());
}

absl::Status LayerExecutor::Validate(const LayerStepInput& in, int num_experts) const {
  if (in.tokens < 0) return absl::InvalidArgumentError("hidden: negative token count");
  if (in.k <= 0) return absl::InvalidArgumentError("topk_ids: k must be positive");
  if (in.d <= 0) return absl::InvalidArgumentError("hidden: d must be positive");
  if (in.tokens > 0 && (in.hidden == nullptr || in.topk_ids == nullptr || in.topk_weights == nullptr)) {
    return absl::InvalidArgumentError("hidden / topk_ids / topk_weights: missing");
  }
  for (int64_t i = 0; i < in.tokens * in.k; ++i) {
    if (in.admitted != nullptr && in.admitted[i] == 0) continue;
    const int32_t e = in.topk_ids[i];
    if (e < 0 || e >= num_experts) {
      return absl::InvalidArgumentError(absl::StrCat("topk_ids[", i / in.k, "][", i % in.k, "]: expert ", e,
                                                     " outside [0, ", num_experts, ")"));
    }
    const float g = in.topk_weights[i];
    if (!std::isfinite(g) || g < 0) {
      return absl::InvalidArgumentError(absl::StrCat("topk_weights[", i / in.k, "][", i % in.k, "]: ", g,
                                                     " is NaN, infinite or negative"));
    }
  }
  return absl::OkStatus();
}

absl::Status LayerExecutor::Reject(uint64_t step_id, int64_t layer, absl::Status why) {
  const int64_t active = options_.registry->ActiveVersion();
  StepHeader h{step_id, layer, active, options_.group->epoch().value(), 1};
  const std::vector<int64_t> zeros(options_.group->size(), 0);
  // The agreement record has one slot count per physical slot of the active generation, as the
  // peers' records do (all-gathers need equal sizes).
  auto manifest = options_.registry->RequireLive(PlacementVersion(active));
  const std::vector<int64_t> slot_zeros(manifest.ok() ? (*manifest)->num_slots() : 0, 0);
  AgreeOnStep(*options_.transport, h, zeros, options_.timeout, slot_zeros).IgnoreError();
  return why;
}

absl::StatusOr<LayerStepResult> LayerExecutor::Execute(const LayerStepInput& in) {
  const absl::Time started = absl::Now();
  const Topology& topo = *options_.topology;
  const ProcessGroup& group = *options_.group;
  const int p = group.size();
  const int me = group.SlotOf(options_.rank).value();
  kernels::ExpertKernels& kern = *options_.kernels;

  // A member that cannot run the step still joins the agreement with the abort flag set, so its
  // peers abort at once (they get ABORTED) instead of waiting out the timeout; the member itself
  // answers its engine with the original error.
  auto reject = [&](absl::Status why) { return Reject(in.step_id, in.layer, std::move(why)); };

  // Phase: the semantic handoff of this rank's routes, sealed before any physical decision.
  const int64_t active = options_.registry->ActiveVersion();
  if (active < 0) return reject(absl::UnavailableError("no ACTIVE placement generation"));
  auto active_manifest = options_.registry->RequireLive(PlacementVersion(active));
  if (!active_manifest.ok()) return reject(active_manifest.status());
  if (absl::Status v = Validate(in, (*active_manifest)->num_experts()); !v.ok()) return reject(v);
  SemanticHandoff h;
  h.scope = ExecutionScopeId(static_cast<int64_t>(in.step_id));
  h.num_experts = (*active_manifest)->num_experts();
  h.top_k = in.k;
  h.num_partitions = topo.num_ranks();
  h.Reserve(in.tokens * in.k);
  {
    // The load signal for rebalancing: routes this rank's tokens chose, per logical expert.
    absl::MutexLock lock(&generations_mu_);
    if (expert_load_.size() < static_cast<size_t>(h.num_experts)) expert_load_.resize(h.num_experts, 0);
    for (int64_t i = 0; i < in.tokens * in.k; ++i) {
      if (in.admitted == nullptr || in.admitted[i] != 0) ++expert_load_[in.topk_ids[i]];
    }
  }
  for (int64_t t = 0; t < in.tokens; ++t) {
    for (int j = 0; j < in.k; ++j) {
      const int64_t i = t * in.k + j;
      const bool admitted = in.admitted == nullptr || in.admitted[i] != 0;
      h.Add(options_.rank, static_cast<int32_t>(t), j, LogicalExpertId(admitted ? in.topk_ids[i] : 0),
            admitted ? in.topk_weights[i] : 0.0f, admitted);
    }
  }
  auto frozen_or = Freeze(std::move(h));
  if (!frozen_or.ok()) return reject(frozen_or.status());
  const FrozenHandoff& frozen = *frozen_or;

  // Phase: pin the generation for this step's whole lifetime.
  auto handle_or = DispatchHandle::Acquire(HandleId(static_cast<int64_t>(in.step_id)), frozen, options_.registry, group);
  if (!handle_or.ok()) return reject(handle_or.status());
  std::unique_ptr<DispatchHandle> handle = *std::move(handle_or);
  const PlacementVersion version = handle->placement_version();
  if (in.expected_generation >= 0 && in.expected_generation != version.value()) {
    return reject(absl::FailedPreconditionError(absl::StrCat("expected_generation: engine expects placement-v",
                                                             in.expected_generation, ", active is placement-v",
                                                             version.value())));
  }
  std::shared_ptr<const LocalExperts> weights_ptr;
  std::shared_ptr<const PlanLayout> layout_ptr;
  {
    absl::MutexLock lock(&generations_mu_);
    auto it = experts_.find(version.value());
    if (it != experts_.end()) weights_ptr = it->second;
    auto lit = layouts_.find(version.value());
    if (lit != layouts_.end()) layout_ptr = lit->second;
  }
  if (weights_ptr == nullptr) {
    return reject(absl::FailedPreconditionError(absl::StrCat("placement-v", version.value(),
                                                             ": no weights loaded on rank ", options_.rank.value())));
  }
  const LocalExperts& weights = *weights_ptr;
  if (weights.d != in.d) {
    return reject(absl::InvalidArgumentError(absl::StrCat("hidden: d = ", in.d, ", the experts have d = ", weights.d)));
  }
  if (layout_ptr == nullptr) {
    auto layout = PlanLayout::Create(handle->manifest(), group);
    if (!layout.ok()) return reject(layout.status());
    layout_ptr = std::make_shared<const PlanLayout>(*std::move(layout));
    absl::MutexLock lock(&generations_mu_);
    layouts_[version.value()] = layout_ptr;
  }
  const PlanLayout& layout = *layout_ptr;
  const PlacementManifest& m = *handle->manifest();

  // Phase: replica selection and the source plan (accepted routes only, semantic order).
  const SemanticHandoff& routes = frozen.routes;
  std::vector<PhysicalSlotId>& slots = buf_.slots;
  slots.resize(routes.size());
  if (absl::Status sel = selector_->Select(routes, m, group, topo, {}, absl::MakeSpan(slots)); !sel.ok()) {
    return reject(sel);
  }
  std::vector<int32_t>& accepted_ids = buf_.accepted_ids;
  std::vector<PhysicalSlotId>& accepted_slots = buf_.accepted_slots;
  accepted_ids.clear();
  accepted_slots.clear();
  for (int32_t r = 0; r < routes.size(); ++r) {
    if (!routes.admitted[r]) continue;
    accepted_ids.push_back(r);
    accepted_slots.push_back(slots[r]);
  }
  SourcePlan& source = buf_.source;
  if (absl::Status planned = PlanSource(layout, accepted_slots, &source); !planned.ok()) return reject(planned);
  const int64_t n_send = static_cast<int64_t>(accepted_ids.size());

  // Phase: agreement before any payload moves (header, counts, tokens, routes per slot).
  std::vector<int64_t>& slot_counts = buf_.slot_counts;
  slot_counts.assign(m.num_slots(), 0);
  for (PhysicalSlotId q : accepted_slots) ++slot_counts[q.value()];
  StepHeader header{in.step_id, in.layer, version.value(), group.epoch().value(), 0, in.tokens};
  ASSIGN_OR_RETURN(StepAgreement agreement,
                   AgreeOnStep(*options_.transport, header, source.send_splits, options_.timeout, slot_counts));

  // Phase: decode-graph admission, evaluated identically on every member over agreed counts.
  LayerStepResult result;
  if (in.phase == Phase::kDecode) {
    DecodeGraph bucket;
    bucket.graph_id = absl::StrCat("decode.bucket", options_.decode_rank_tokens, ".v", version.value());
    bucket.key.process_group = group.id().value();
    bucket.key.placement_version = version.value();
    bucket.key.checkpoint = m.checkpoint().value();
    bucket.key.d = in.d;
    bucket.key.k = in.k;
    bucket.key.rank_token_capacity.assign(p, options_.decode_rank_tokens);
    bucket.key.slot_route_capacity.assign(m.num_slots(), options_.decode_slot_routes);
    bucket.stable_buffers_ready = options_.graphs_available;
    AdmissionStep step;
    step.decode = true;
    step.key = bucket.key;
    step.rank_tokens = agreement.rank_tokens;
    step.slot_routes = agreement.slot_routes;
    const Admission admission = AdmitDecodeGraph(step, &bucket);
    result.record.graph_replay = admission.replay;
    if (!admission.replay) result.record.fallback_reason = FallbackReasonName(admission.reason);
  }

  // Phase: the handle binds the inverse coordinates (origin token and gate per send position).
  const int d = in.d;
  InverseCoordinates inverse;
  inverse.token.resize(n_send);
  inverse.gate.resize(n_send);
  inverse.num_tokens = in.tokens;
  std::vector<int32_t>& send_meta = buf_.send_meta;
  send_meta.resize(n_send);
  for (int64_t pos = 0; pos < n_send; ++pos) {
    const int32_t r = accepted_ids[source.send_order[pos]];
    inverse.token[pos] = routes.token[r];
    inverse.gate[pos] = routes.gate[r];
    send_meta[pos] = source.send_slots[pos].value();
  }
  RETURN_IF_ERROR(handle->BindPlan(std::move(inverse)));
  const std::vector<int32_t>& send_token = handle->inverse().token;
  std::vector<uint16_t>& send_rows = buf_.send_rows;
  send_rows.resize(static_cast<size_t>(n_send) * d);
  kernels::GatherParams pack;
  pack.d = d;
  pack.in = in.hidden;
  pack.in_rows = in.tokens;
  pack.index = send_token.data();
  pack.n = n_send;
  pack.out = send_rows.data();
  if (n_send > 0) RETURN_IF_ERROR(kern.Gather(pack, nullptr));
  int64_t n_recv = 0;
  for (int64_t c : agreement.recv_counts) n_recv += c;
  std::vector<int64_t> send_bytes(p), recv_bytes(p), send_meta_bytes(p), recv_meta_bytes(p);
  for (int i = 0; i < p; ++i) {
    send_bytes[i] = source.send_splits[i] * d * 2;
    recv_bytes[i] = agreement.recv_counts[i] * d * 2;
    send_meta_bytes[i] = source.send_splits[i] * 4;
    recv_meta_bytes[i] = agreement.recv_counts[i] * 4;
  }
  std::vector<uint16_t>& recv_rows = buf_.recv_rows;
  recv_rows.resize(static_cast<size_t>(n_recv) * d);
  std::vector<int32_t>& recv_meta = buf_.recv_meta;
  recv_meta.resize(n_recv);
  RETURN_IF_ERROR(handle->MarkDispatchInFlight());
  RETURN_IF_ERROR(options_.transport->AllToAllV(in.step_id * 4 + 1, send_meta.data(), send_meta_bytes, recv_meta.data(),
                                                recv_meta_bytes, options_.timeout));
  RETURN_IF_ERROR(options_.transport->AllToAllV(in.step_id * 4 + 2, send_rows.data(), send_bytes, recv_rows.data(),
                                                recv_bytes, options_.timeout));
  RETURN_IF_ERROR(handle->MarkExpertRowsReady());

  // Phase: receive repack by (local slot, source, send position), experts, inverse repack.
  std::vector<PhysicalSlotId>& received = buf_.received;
  received.resize(n_recv);
  for (int64_t i = 0; i < n_recv; ++i) received[i] = PhysicalSlotId(recv_meta[i]);
  DestinationPlan& dest = buf_.dest;
  RETURN_IF_ERROR(PlanDestination(layout, options_.rank, agreement.recv_counts, received, &dest));
  std::vector<uint16_t>& expert_in = buf_.expert_in;
  std::vector<uint16_t>& expert_out = buf_.expert_out;
  expert_in.resize(static_cast<size_t>(n_recv) * d);
  expert_out.resize(expert_in.size());
  kernels::GatherParams repack;
  repack.d = d;
  repack.in = recv_rows.data();
  repack.in_rows = n_recv;
  repack.index = dest.expert_order.data();
  repack.n = n_recv;
  repack.out = expert_in.data();
  if (n_recv > 0) RETURN_IF_ERROR(kern.Gather(repack, nullptr));
  const int local_slots = static_cast<int>(dest.expert_counts.size());
  if (n_recv > 0) {
    if (static_cast<int64_t>(weights.w_down.size()) != static_cast<int64_t>(local_slots) * d * weights.d_ff) {
      return absl::FailedPreconditionError(absl::StrCat("rank ", options_.rank.value(), " holds weights for a different",
                                                        " number of local slots than placement-v", version.value()));
    }
    kernels::SwigluParams sw;
    sw.weights = {weights.w_gate_up.data(), weights.w_down.data(), local_slots, d, weights.d_ff};
    sw.x = expert_in.data();
    sw.rows = n_recv;
    sw.host_offsets = dest.expert_offsets.data();
    sw.y = expert_out.data();
    RETURN_IF_ERROR(kern.Swiglu(sw, nullptr));
  }
  RETURN_IF_ERROR(handle->MarkExpertOutputReady());
  std::vector<uint16_t>& back_rows = buf_.back_rows;
  std::vector<uint16_t>& returned = buf_.returned;
  back_rows.resize(expert_out.size());
  returned.resize(send_rows.size());
  kernels::GatherParams unpack = repack;
  unpack.in = expert_out.data();
  unpack.index = dest.expert_position.data();
  unpack.out = back_rows.data();
  if (n_recv > 0) RETURN_IF_ERROR(kern.Gather(unpack, nullptr));

  // Phase: return exchange (splits reversed), then combine over the semantic key.
  RETURN_IF_ERROR(handle->BeginCombine(*options_.registry, version));
  RETURN_IF_ERROR(options_.transport->AllToAllV(in.step_id * 4 + 3, back_rows.data(), recv_bytes, returned.data(),
                                                send_bytes, options_.timeout));
  // Token-major view of the handle's coordinates for the kernel: route (t, j) -> send position.
  std::vector<int32_t>& row_of_route = buf_.row_of_route;
  std::vector<float>& gates = buf_.gates;
  row_of_route.assign(in.tokens * in.k, -1);
  gates.assign(in.tokens * in.k, 0.0f);
  for (int64_t i = 0; i < n_send; ++i) {
    const int32_t r = accepted_ids[i];
    const int32_t pos = source.send_position[i];
    row_of_route[r] = pos;
    gates[r] = handle->inverse().gate[pos];
  }
  result.output.assign(static_cast<size_t>(in.tokens) * d, 0);
  if (in.tokens > 0) {
    kernels::CombineParams c{returned.data(), n_send, d, row_of_route.data(), gates.data(), in.tokens, in.k, nullptr,
                             result.output.data()};
    RETURN_IF_ERROR(kern.Combine(c, nullptr));
  }
  RETURN_IF_ERROR(handle->MarkOriginRowsReady());
  RETURN_IF_ERROR(handle->Release());

  StepRecord& rec = result.record;
  rec.placement_version = version.value();
  rec.routes_attempted = in.tokens * in.k;
  rec.routes_accepted = n_send;
  rec.routes_dropped = rec.routes_attempted - n_send;
  for (int64_t i = 0; i < n_send; ++i) {
    const Rank dst = m.slot(accepted_slots[i]).rank;
    if (dst != options_.rank) ++rec.routes_remote;
    if (topo.NodeOf(dst) != topo.NodeOf(options_.rank)) ++rec.routes_inter_node;
  }
  for (int i = 0; i < p; ++i) {
    if (i != me) rec.bytes_sent += send_bytes[i] + recv_bytes[i];
  }
  rec.execute_us = absl::ToDoubleMicroseconds(absl::Now() - started);
  return result;
}

}  // namespace moe
