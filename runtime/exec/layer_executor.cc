#include "runtime/exec/layer_executor.h"

#include <cmath>
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/numeric.h"
#include "absl/time/clock.h"
#include "runtime/exec/dispatch_handle.h"
#include "runtime/exec/step_exchange.h"
#include "runtime/hash.h"
#include "runtime/status.h"

namespace moe {
namespace {

// The host tables a step's kernels read (index tables, gates), each at a 16-byte aligned offset
// of one block that goes to kernel memory in one copy: with device kernels one host-to-device
// transfer a step instead of one a table. Host kernels read the tables in place.
class StepTables {
 public:
  // Adds `bytes` at `src` (read at Upload); returns the table's handle for Get.
  int Add(const void* src, int64_t bytes) {
    tables_.push_back({src, bytes, total_});
    total_ += (bytes + 15) / 16 * 16;
    return static_cast<int>(tables_.size()) - 1;
  }
  absl::Status Upload(bool device, kernels::ExpertKernels& kern, kernels::KernelBuffer& to, std::vector<uint8_t>& host,
                      kernels::Stream stream) {
    device_ = device;
    if (!device || total_ == 0) return absl::OkStatus();
    host.resize(total_);
    for (const Table& t : tables_) {
      if (t.bytes > 0) std::memcpy(host.data() + t.offset, t.src, t.bytes);
    }
    RETURN_IF_ERROR(to.Reserve(&kern, total_));
    RETURN_IF_ERROR(kern.CopyToKernel(to.data(), host.data(), total_, stream));
    base_ = static_cast<const uint8_t*>(to.data());
    return absl::OkStatus();
  }
  // The table where the kernels read it (nullptr: on the device, and nothing was uploaded).
  template <typename T>
  const T* Get(int table) const {
    const Table& t = tables_[table];
    if (!device_) return static_cast<const T*>(t.src);
    return base_ != nullptr ? reinterpret_cast<const T*>(base_ + t.offset) : nullptr;
  }

 private:
  struct Table {
    const void* src;
    int64_t bytes, offset;
  };
  std::vector<Table> tables_;
  int64_t total_ = 0;
  bool device_ = false;
  const uint8_t* base_ = nullptr;
};

}  // namespace

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
  if (options.kernels->device_resident() && !options.transport->accepts_device_memory()) {
    return absl::FailedPreconditionError(absl::StrCat("executor: kernels '", options.kernels->name(),
                                                      "' keep rows in device memory, transport '",
                                                      options.transport->name(), "' moves host memory only"));
  }
  std::unique_ptr<LayerExecutor> e(new LayerExecutor(std::move(options)));
  e->device_ = e->options_.kernels->device_resident();
  e->graphs_ = e->device_ && e->options_.decode_graphs != nullptr;
  e->selector_ = ReplicaSelector::Create(e->options_.selector);
  return e;
}

// A generation's weights where the kernels read them: the host copy itself for host-memory
// kernels, one upload for device-resident ones (freed when the last step using them ends).
struct LayerExecutor::ResidentExperts {
  std::shared_ptr<const LocalExperts> host;
  kernels::KernelBuffer gate_up, down;
  const uint16_t* w_gate_up = nullptr;
  const uint16_t* w_down = nullptr;
};

absl::Status LayerExecutor::AddGeneration(PlacementVersion version, std::shared_ptr<const LocalExperts> experts) {
  if (experts == nullptr) return absl::InvalidArgumentError("experts: null");
  auto resident = std::make_shared<ResidentExperts>();
  resident->host = experts;
  resident->w_gate_up = experts->w_gate_up.data();
  resident->w_down = experts->w_down.data();
  if (device_) {
    kernels::ExpertKernels* kern = options_.kernels;
    const int64_t gu = static_cast<int64_t>(experts->w_gate_up.size()) * 2, dn = static_cast<int64_t>(experts->w_down.size()) * 2;
    RETURN_IF_ERROR(resident->gate_up.Reserve(kern, gu));
    RETURN_IF_ERROR(resident->down.Reserve(kern, dn));
    RETURN_IF_ERROR(kern->CopyToKernel(resident->gate_up.data(), experts->w_gate_up.data(), gu, nullptr));
    RETURN_IF_ERROR(kern->CopyToKernel(resident->down.data(), experts->w_down.data(), dn, nullptr));
    RETURN_IF_ERROR(kern->Synchronize(nullptr));
    resident->w_gate_up = resident->gate_up.as<uint16_t>();
    resident->w_down = resident->down.as<uint16_t>();
  }
  absl::MutexLock lock(&generations_mu_);
  experts_[version.value()] = std::move(resident);
  return absl::OkStatus();
}

std::shared_ptr<const LocalExperts> LayerExecutor::HostWeights(PlacementVersion version) const {
  absl::MutexLock lock(&generations_mu_);
  auto it = experts_.find(version.value());
  return it == experts_.end() ? nullptr : it->second->host;
}

std::vector<int64_t> LayerExecutor::ExpertLoad() const {
  absl::MutexLock lock(&generations_mu_);
  return expert_load_;
}

void LayerExecutor::DropGeneration(PlacementVersion version) {
  absl::MutexLock lock(&generations_mu_);
  experts_.erase(version.value());
  layouts_.erase(version.value());
  for (auto it = graphs_by_key_.begin(); it != graphs_by_key_.end();) {
    it = std::get<0>(it->first) == version.value() ? graphs_by_key_.erase(it) : std::next(it);
  }
}

absl::Status LayerExecutor::ReplayDecode(const LayerStepInput& in, PlacementVersion version, int64_t total_slots,
                                         const std::shared_ptr<const ResidentExperts>& weights,
                                         const SourcePlan& source, const DestinationPlan& dest,
                                         const std::vector<int32_t>& send_token,
                                         const std::vector<int32_t>& row_of_route, const std::vector<float>& gates,
                                         std::vector<uint16_t>* out) {
  const int p = options_.group->size();
  const int local_slots = static_cast<int>(dest.expert_counts.size());
  const int64_t tokens_cap = options_.decode_rank_tokens, slot_cap = options_.decode_slot_routes;
  const int64_t seg = tokens_cap * in.k;  // bounds any rank's routes to one peer
  const auto key = std::make_tuple(version.value(), in.d, in.k);
  std::shared_ptr<DecodeStepGraph> graph;
  {
    absl::MutexLock lock(&generations_mu_);
    auto it = graphs_by_key_.find(key);
    if (it != graphs_by_key_.end()) graph = it->second.graph;
  }
  if (graph == nullptr) {
    // Every member reaches this at the same step: admission is decided over agreed counts.
    DecodeGraphShape shape;
    shape.peers = p;
    shape.segment_rows = seg;
    shape.local_slots = local_slots;
    shape.slot_routes = slot_cap;
    shape.rank_tokens = tokens_cap;
    shape.d = in.d;
    shape.d_ff = weights->host->d_ff;
    shape.k = in.k;
    shape.padded_runner = ChoosePaddedRunner(options_.decode_runner, p, tokens_cap, in.k, total_slots);
    shape.w_gate_up = weights->w_gate_up;
    shape.w_down = weights->w_down;
    shape.warmup_timeout = options_.timeout;
    ASSIGN_OR_RETURN(std::unique_ptr<DecodeStepGraph> made, options_.decode_graphs(shape));
    graph = std::move(made);
    absl::MutexLock lock(&generations_mu_);
    graphs_by_key_[key] = Graph{weights, graph};
  }

  // Tables in bucket shape: compact send / receive positions -> padded peer segments.
  Buffers& b = buf_;
  const int64_t n_send = source.send_offsets[p], n_recv = dest.recv_offsets[p];
  b.pad_of_send.resize(n_send);
  b.pad_of_recv.resize(n_recv);
  b.g_send_index.assign(p * seg, -1);
  for (int j = 0; j < p; ++j) {
    if (source.send_splits[j] > seg || dest.recv_splits[j] > seg) {
      return absl::InternalError("decode graph: a peer segment exceeds the bucket (admission let it through)");
    }
    for (int64_t i = 0; i < source.send_splits[j]; ++i) {
      const int64_t pos = source.send_offsets[j] + i;
      b.pad_of_send[pos] = static_cast<int32_t>(j * seg + i);
      b.g_send_index[j * seg + i] = send_token[pos];
    }
    for (int64_t i = 0; i < dest.recv_splits[j]; ++i) b.pad_of_recv[dest.recv_offsets[j] + i] = static_cast<int32_t>(j * seg + i);
  }
  if (dest.expert_offsets[local_slots] > local_slots * slot_cap) {
    return absl::InternalError("decode graph: received routes exceed the bucket (admission let them through)");
  }
  b.g_expert_rows.assign(local_slots * slot_cap, 0);
  for (int64_t r = 0; r < dest.expert_offsets[local_slots]; ++r) b.g_expert_rows[r] = b.pad_of_recv[dest.expert_order[r]];
  b.g_layout_row.assign(p * seg, -1);
  for (int64_t c = 0; c < n_recv; ++c) b.g_layout_row[b.pad_of_recv[c]] = dest.expert_position[c];
  b.g_row_of_route.assign(tokens_cap * in.k, -1);
  b.g_gates.assign(tokens_cap * in.k, 0.0f);
  for (int64_t r = 0; r < in.tokens * in.k; ++r) {
    if (row_of_route[r] < 0) continue;
    b.g_row_of_route[r] = b.pad_of_send[row_of_route[r]];
    b.g_gates[r] = gates[r];
  }
  DecodeGraphTables t;
  t.hidden = in.hidden;
  t.tokens = in.tokens;
  t.send_index = b.g_send_index.data();
  t.expert_rows = b.g_expert_rows.data();
  t.expert_offsets = dest.expert_offsets.data();
  t.layout_row = b.g_layout_row.data();
  t.row_of_route = b.g_row_of_route.data();
  t.gates = b.g_gates.data();
  return graph->Replay(in.step_id * 4 + 2, t, out->data(), options_.timeout);
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

void LayerExecutor::SetTrial(int64_t version, int64_t shadow_every, int64_t canary_every) {
  absl::MutexLock lock(&generations_mu_);
  trial_ = {version, version >= 0 ? shadow_every : 0, version >= 0 ? canary_every : 0};
}

LayerExecutor::TrialConfig LayerExecutor::Trial() const {
  absl::MutexLock lock(&generations_mu_);
  return trial_;
}

std::map<int64_t, GenerationCounters> LayerExecutor::Counters() const {
  absl::MutexLock lock(&generations_mu_);
  return counters_;
}

void LayerExecutor::Count(const absl::StatusOr<LayerStepResult>& r, const LayerStepInput& in, bool canary) {
  if (!r.ok()) {
    // A failed step counts against the generation it would have run on. ABORTED is the ranks'
    // agreement refusing the step before any payload moved (another rank rejected its input,
    // proposed another generation while a trial or a switch reaches the ranks one by one, or was
    // in another step): not a fault of that generation, and the engine retries it.
    const int64_t v = canary ? Trial().version : options_.registry->ActiveVersion();
    absl::MutexLock lock(&generations_mu_);
    if (r.status().code() == absl::StatusCode::kAborted) {
      ++counters_[v].aborted_steps;
    } else {
      ++counters_[v].failed_steps;
    }
    return;
  }
  const StepRecord& rec = r->record;
  // Stale accept (0x0DB): the step was answered by a generation it should not have used. The
  // engine named one (non-canary steps), or a canary step's candidate was no longer on trial.
  bool stale = !canary && in.expected_generation >= 0 && rec.placement_version != in.expected_generation;
  if (canary) {
    auto state = options_.registry->State(PlacementVersion(rec.placement_version));
    stale = !state.ok() || (*state != GenerationState::kPrepared && *state != GenerationState::kActive);
  }
  absl::MutexLock lock(&generations_mu_);
  GenerationCounters& c = counters_[rec.placement_version];
  ++c.steps;
  if (canary) ++c.canary_steps;
  if (stale) ++c.stale_accepts;
  if (in.phase == Phase::kDecode) {
    ++c.decode_steps;
    if (!rec.graph_replay) ++c.fallback_steps;
  }
  // The gate's drop ratio is about routes the runtime fails to deliver: routes the engine's router
  // dropped are its own choice, and an admitted route is never dropped here (a step that does not
  // fit a bucket runs eagerly, one that cannot run fails whole), so routes_dropped stays 0.
  c.routes_attempted += rec.routes_accepted;
}

absl::StatusOr<LayerStepResult> LayerExecutor::Execute(const LayerStepInput& in) {
  TrialConfig t = Trial();
  if (t.version >= 0) {
    auto state = options_.registry->State(PlacementVersion(t.version));
    if (!state.ok() || *state != GenerationState::kPrepared) t = TrialConfig{};  // promoted or retired meanwhile
  }
  // Canary: every canary_every-th step is served by the candidate (a PREPARED generation). All
  // ranks decide alike from the step id; a rank still without the setting proposes the active
  // generation, the header agreement aborts the step everywhere, and the engine retries it.
  if (t.version >= 0 && t.canary_every > 0 && in.step_id % static_cast<uint64_t>(t.canary_every) == 0 &&
      in.expected_generation < 0) {
    PassOptions po;
    po.trial_version = t.version;
    auto r = RunPass(in, po, nullptr);
    if (r.ok()) r->record.canary = true;
    Count(r, in, true);
    return r;
  }
  PassOptions po;
  if (t.version >= 0 && t.shadow_every > 0) {
    po.shadow_version = t.version;
    po.shadow_every = t.shadow_every;
  }
  int64_t shadow = -1;
  auto r = RunPass(in, po, &shadow);
  Count(r, in, false);
  if (shadow < 0) return r;
  // Shadow: every member agreed to run this step on the candidate too (same proposal, sampled
  // step), so every member runs the pass, whatever its own active result was. The engine gets
  // the active result; the candidate's output is only compared with it (runner parity).
  LayerStepInput sin = in;
  sin.step_id = in.step_id + kShadowStepOffset;
  sin.expected_generation = -1;
  PassOptions spo;
  spo.trial_version = shadow;
  spo.shadow_pass = true;
  auto s = RunPass(sin, spo, nullptr);
  bool mismatch = false;
  if (s.ok() && r.ok()) {
    double num = 0, den = 0;
    mismatch = s->output.size() != r->output.size();
    for (size_t i = 0; !mismatch && i < r->output.size(); ++i) {
      const double a = kernels::Bf16ToFloat(r->output[i]), b = kernels::Bf16ToFloat(s->output[i]);
      num += (a - b) * (a - b);
      den += a * a;
    }
    mismatch = mismatch || std::sqrt(num / std::max(den, 1e-30)) > kShadowTolerance;
  }
  absl::MutexLock lock(&generations_mu_);
  GenerationCounters& c = counters_[shadow];
  ++c.shadow_samples;
  if (!s.ok()) ++c.shadow_failures;
  if (mismatch) ++c.shadow_mismatches;
  return r;
}

absl::StatusOr<LayerStepResult> LayerExecutor::RunPass(const LayerStepInput& in, const PassOptions& po,
                                                       int64_t* agreed_shadow) {
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
  const bool trial = po.trial_version >= 0;
  const int64_t active = trial ? po.trial_version : options_.registry->ActiveVersion();
  if (active < 0) return reject(absl::UnavailableError("no ACTIVE placement generation"));
  auto active_manifest = trial ? options_.registry->RequireTrial(PlacementVersion(active))
                               : options_.registry->RequireLive(PlacementVersion(active));
  if (!active_manifest.ok()) return reject(active_manifest.status());
  if (absl::Status v = Validate(in, (*active_manifest)->num_experts()); !v.ok()) return reject(v);
  SemanticHandoff h;
  h.scope = ExecutionScopeId(static_cast<int64_t>(in.step_id));
  h.num_experts = (*active_manifest)->num_experts();
  h.top_k = in.k;
  h.num_partitions = topo.num_ranks();
  h.Reserve(in.tokens * in.k);
  if (!po.shadow_pass) {
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
  auto handle_or = trial ? DispatchHandle::AcquireTrial(HandleId(static_cast<int64_t>(in.step_id)), frozen,
                                                        options_.registry, group, PlacementVersion(active))
                         : DispatchHandle::Acquire(HandleId(static_cast<int64_t>(in.step_id)), frozen, options_.registry,
                                                   group);
  if (!handle_or.ok()) return reject(handle_or.status());
  std::unique_ptr<DispatchHandle> handle = *std::move(handle_or);
  const PlacementVersion version = handle->placement_version();
  if (!trial && in.expected_generation >= 0 && in.expected_generation != version.value()) {
    return reject(absl::FailedPreconditionError(absl::StrCat("expected_generation: engine expects placement-v",
                                                             in.expected_generation, ", active is placement-v",
                                                             version.value())));
  }
  std::shared_ptr<const ResidentExperts> weights_ptr;
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
  const ResidentExperts& weights = *weights_ptr;
  if (weights.host->d != in.d) {
    return reject(absl::InvalidArgumentError(absl::StrCat("hidden: d = ", in.d, ", the experts have d = ", weights.host->d)));
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
  // This member's graph manifest (bucket, whether it captures graphs, runner): members that
  // differ serve decode steps eagerly.
  uint64_t manifest = SplitMix64(static_cast<uint64_t>(options_.decode_rank_tokens));
  manifest = SplitMix64(manifest ^ static_cast<uint64_t>(options_.decode_slot_routes));
  manifest = SplitMix64(manifest ^ (graphs_ ? 1u : 0u));
  manifest = SplitMix64(manifest ^ static_cast<uint64_t>(options_.decode_runner));
  StepHeader header{in.step_id,        in.layer,        version.value(), group.epoch().value(), 0, in.tokens,
                    po.shadow_version, po.shadow_every, static_cast<int64_t>(manifest)};
  // The slot of every send position (for the expert ranks' receive plans) goes with the
  // agreement when it fits the agreement's record (decode-sized steps): one collective.
  std::vector<int32_t>& send_meta = buf_.send_meta;
  send_meta.resize(n_send);
  for (int64_t pos = 0; pos < n_send; ++pos) send_meta[pos] = source.send_slots[pos].value();
  ASSIGN_OR_RETURN(StepAgreement agreement, AgreeOnStep(*options_.transport, header, source.send_splits,
                                                        options_.timeout, slot_counts, &send_meta));
  if (agreed_shadow != nullptr) *agreed_shadow = agreement.shadow_version;

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
    bucket.stable_buffers_ready = graphs_;
    AdmissionStep step;
    step.decode = true;
    step.key = bucket.key;
    step.rank_tokens = agreement.rank_tokens;
    step.slot_routes = agreement.slot_routes;
    // Members with different graph manifests all serve eagerly: no member replays alone.
    const Admission admission = agreement.graph_keys_agree
                                    ? AdmitDecodeGraph(step, &bucket)
                                    : Admission{false, FallbackReason::kGraphKeyMismatch, ""};
    result.record.graph_replay = admission.replay;
    if (!admission.replay) result.record.fallback_reason = FallbackReasonName(admission.reason);
  }

  // Phase: the handle binds the inverse coordinates (origin token and gate per send position).
  const int d = in.d;
  const int64_t row_bytes = static_cast<int64_t>(d) * 2;
  InverseCoordinates inverse;
  inverse.token.resize(n_send);
  inverse.gate.resize(n_send);
  inverse.num_tokens = in.tokens;
  for (int64_t pos = 0; pos < n_send; ++pos) {
    const int32_t r = accepted_ids[source.send_order[pos]];
    inverse.token[pos] = routes.token[r];
    inverse.gate[pos] = routes.gate[r];
  }
  RETURN_IF_ERROR(handle->BindPlan(std::move(inverse)));
  const std::vector<int32_t>& send_token = handle->inverse().token;

  int64_t n_recv = 0;
  for (int64_t c : agreement.recv_counts) n_recv += c;
  std::vector<int64_t> send_bytes(p), recv_bytes(p), send_meta_bytes(p), recv_meta_bytes(p);
  for (int i = 0; i < p; ++i) {
    send_bytes[i] = source.send_splits[i] * row_bytes;
    recv_bytes[i] = agreement.recv_counts[i] * row_bytes;
    send_meta_bytes[i] = source.send_splits[i] * 4;
    recv_meta_bytes[i] = agreement.recv_counts[i] * 4;
  }

  // Phase: slot metadata to the expert ranks (host memory; with the agreement when it fitted),
  // then the receive-side plan.
  std::vector<int32_t>& recv_meta = buf_.recv_meta;
  RETURN_IF_ERROR(handle->MarkDispatchInFlight());
  if (agreement.meta_received) {
    recv_meta.assign(agreement.recv_meta.begin(), agreement.recv_meta.end());
  } else {
    recv_meta.resize(n_recv);
    RETURN_IF_ERROR(options_.transport->AllToAllV(in.step_id * 4 + 1, send_meta.data(), send_meta_bytes,
                                                  recv_meta.data(), recv_meta_bytes, options_.timeout));
  }
  if (static_cast<int64_t>(recv_meta.size()) != n_recv) return absl::InternalError("slot metadata: wrong entry count");
  std::vector<PhysicalSlotId>& received = buf_.received;
  received.resize(n_recv);
  for (int64_t i = 0; i < n_recv; ++i) received[i] = PhysicalSlotId(recv_meta[i]);
  DestinationPlan& dest = buf_.dest;
  RETURN_IF_ERROR(PlanDestination(layout, options_.rank, agreement.recv_counts, received, &dest));
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

  // Phase: payload. Eager: pack, exchange, experts, return, combine as separate calls sized by
  // this step. Replay (admitted decode step): the bucket's captured graph does all of it.
  auto eager = [&]() -> absl::Status {
    // Row payloads live where the kernels run (device memory for CUDA kernels, which the NCCL
    // transport moves directly); plans and slot metadata stay on the host.
    Buffers& b = buf_;
    const kernels::Stream stream = nullptr;
    const int local_slots = static_cast<int>(dest.expert_counts.size());
    if (n_recv > 0 &&
        static_cast<int64_t>(weights.host->w_down.size()) != static_cast<int64_t>(local_slots) * d * weights.host->d_ff) {
      return absl::FailedPreconditionError(absl::StrCat("rank ", options_.rank.value(), " holds weights for a different",
                                                        " number of local slots than placement-v", version.value()));
    }
    const int64_t routes_n = in.tokens * in.k;
    const void* hidden = in.hidden;
    if (device_ && in.tokens > 0) {
      RETURN_IF_ERROR(b.hidden.Reserve(&kern, in.tokens * row_bytes));
      RETURN_IF_ERROR(kern.CopyToKernel(b.hidden.data(), in.hidden, in.tokens * row_bytes, stream));
      hidden = b.hidden.data();
    }
    // The combined rows: written in kernel memory, then copied out.
    auto output = [&]() -> absl::StatusOr<uint16_t*> {
      if (!device_) return result.output.data();
      RETURN_IF_ERROR(b.output.Reserve(&kern, in.tokens * row_bytes));
      return b.output.as<uint16_t>();
    };
    auto copy_out = [&](const uint16_t* out) -> absl::Status {
      return device_ ? kern.CopyToHost(result.output.data(), out, in.tokens * row_bytes, stream) : absl::OkStatus();
    };
    StepTables tables;
    if (p == 1 && in.phase == Phase::kDecode) {
      // A lone member holds every slot: a decode step's route, experts and combine are one
      // kernels call on the tokens as they are (LocalLayer: the decode kernels, at one token
      // fused), with no exchange, packs or repacks. Prefill steps keep the grouped GEMMs below.
      RETURN_IF_ERROR(handle->MarkExpertRowsReady());
      RETURN_IF_ERROR(handle->MarkExpertOutputReady());
      RETURN_IF_ERROR(handle->BeginCombine(*options_.registry, version));
      if (in.tokens == 0) return absl::OkStatus();
      std::vector<int32_t>& local_ids = b.local_ids;
      local_ids.assign(routes_n, -1);  // dropped routes add nothing
      std::vector<int64_t>& slot_routes = b.local_slot_routes;
      slot_routes.assign(local_slots, 0);
      for (int64_t i = 0; i < n_send; ++i) {
        const int32_t local = m.LocalIndex(accepted_slots[i]);
        local_ids[accepted_ids[i]] = local;
        ++slot_routes[local];
      }
      const int t_ids = tables.Add(local_ids.data(), routes_n * 4);
      const int t_gates = tables.Add(gates.data(), routes_n * 4);
      RETURN_IF_ERROR(tables.Upload(device_, kern, b.tables, b.tables_host, stream));
      kernels::LocalLayerParams layer;
      layer.weights = {weights.w_gate_up, weights.w_down, local_slots, d, weights.host->d_ff};
      layer.x = static_cast<const uint16_t*>(hidden);
      layer.topk = tables.Get<int32_t>(t_ids);
      layer.gate = tables.Get<float>(t_gates);
      layer.num_tokens = in.tokens;
      layer.k = in.k;
      // The runner, with every slot's routes known here: the padded GEMMs at the largest count
      // (forced, or where they pay), else the decode kernels.
      const int64_t most = slot_routes.empty() ? 0 : *std::max_element(slot_routes.begin(), slot_routes.end());
      switch (options_.decode_runner) {
        case DecodeRunner::kKernels:
          break;
        case DecodeRunner::kPadded:
          layer.padded_capacity = most;
          break;
        case DecodeRunner::kAuto:
          layer.padded_capacity = kernels::PaddedDecodeCapacity(slot_routes, d, weights.host->d_ff);
          break;
      }
      ASSIGN_OR_RETURN(layer.out_bf16, output());
      RETURN_IF_ERROR(kern.LocalLayer(layer, stream));
      return copy_out(layer.out_bf16);
    }
    const int t_send = tables.Add(send_token.data(), n_send * 4);
    const int t_order = tables.Add(dest.expert_order.data(), n_recv * 4);
    const int t_position = tables.Add(dest.expert_position.data(), n_recv * 4);
    const int t_rows_of = tables.Add(row_of_route.data(), routes_n * 4);
    const int t_gates = tables.Add(gates.data(), routes_n * 4);
    RETURN_IF_ERROR(tables.Upload(device_, kern, b.tables, b.tables_host, stream));
    RETURN_IF_ERROR(b.send_rows.Reserve(&kern, n_send * row_bytes));
    if (n_send > 0) {
      kernels::GatherParams pack;
      pack.d = d;
      pack.in = hidden;
      pack.in_rows = in.tokens;
      pack.index = tables.Get<int32_t>(t_send);
      pack.n = n_send;
      pack.out = b.send_rows.data();
      RETURN_IF_ERROR(kern.Gather(pack, stream));
    }
    RETURN_IF_ERROR(b.recv_rows.Reserve(&kern, n_recv * row_bytes));
    RETURN_IF_ERROR(kern.Synchronize(stream));  // the transport reads the packed rows on its own stream
    RETURN_IF_ERROR(options_.transport->AllToAllV(in.step_id * 4 + 2, b.send_rows.data(), send_bytes, b.recv_rows.data(),
                                                  recv_bytes, options_.timeout));
    RETURN_IF_ERROR(handle->MarkExpertRowsReady());

    // Phase: receive repack by (local slot, source, send position), experts, inverse repack.
    RETURN_IF_ERROR(b.expert_in.Reserve(&kern, n_recv * row_bytes));
    RETURN_IF_ERROR(b.expert_out.Reserve(&kern, n_recv * row_bytes));
    RETURN_IF_ERROR(b.back_rows.Reserve(&kern, n_recv * row_bytes));
    RETURN_IF_ERROR(b.returned.Reserve(&kern, n_send * row_bytes));
    if (n_recv > 0) {
      kernels::GatherParams repack;
      repack.d = d;
      repack.in = b.recv_rows.data();
      repack.in_rows = n_recv;
      repack.index = tables.Get<int32_t>(t_order);
      repack.n = n_recv;
      repack.out = b.expert_in.data();
      RETURN_IF_ERROR(kern.Gather(repack, stream));
      kernels::SwigluParams sw;
      sw.weights = {weights.w_gate_up, weights.w_down, local_slots, d, weights.host->d_ff};
      sw.x = b.expert_in.as<uint16_t>();
      sw.rows = n_recv;
      sw.host_offsets = dest.expert_offsets.data();
      sw.y = b.expert_out.as<uint16_t>();
      RETURN_IF_ERROR(kern.Swiglu(sw, stream));
      kernels::GatherParams unpack = repack;
      unpack.in = b.expert_out.data();
      unpack.index = tables.Get<int32_t>(t_position);
      unpack.out = b.back_rows.data();
      RETURN_IF_ERROR(kern.Gather(unpack, stream));
      RETURN_IF_ERROR(kern.Synchronize(stream));
    }
    RETURN_IF_ERROR(handle->MarkExpertOutputReady());

    // Phase: return exchange (splits reversed), then combine over the semantic key.
    RETURN_IF_ERROR(handle->BeginCombine(*options_.registry, version));
    RETURN_IF_ERROR(options_.transport->AllToAllV(in.step_id * 4 + 3, b.back_rows.data(), recv_bytes, b.returned.data(),
                                                  send_bytes, options_.timeout));
    if (in.tokens > 0) {
      ASSIGN_OR_RETURN(uint16_t* out, output());
      kernels::CombineParams c{b.returned.as<uint16_t>(), n_send, d, tables.Get<int32_t>(t_rows_of),
                               tables.Get<float>(t_gates), in.tokens, in.k, nullptr, out};
      RETURN_IF_ERROR(kern.Combine(c, stream));
      RETURN_IF_ERROR(copy_out(out));
    }
    return absl::OkStatus();
  };
  auto replay = [&]() -> absl::Status {
    RETURN_IF_ERROR(handle->MarkExpertRowsReady());
    RETURN_IF_ERROR(handle->MarkExpertOutputReady());
    RETURN_IF_ERROR(handle->BeginCombine(*options_.registry, version));
    return ReplayDecode(in, version, m.num_slots(), weights_ptr, source, dest, send_token, row_of_route, gates, &result.output);
  };
  RETURN_IF_ERROR(result.record.graph_replay ? replay() : eager());
  if (trial && options_.fault_trial_output_scale != 1.0f) {
    for (uint16_t& v : result.output) v = kernels::FloatToBf16(kernels::Bf16ToFloat(v) * options_.fault_trial_output_scale);
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
