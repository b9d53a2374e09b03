#include "runtime/exec/layer_executor.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

#include "kernels/numeric.h"
#include "runtime/exec/dispatch_handle.h"
#include "runtime/exec/step_exchange.h"
#include "runtime/exec/step_phases.h"
#include "runtime/hash.h"
#include "runtime/status.h"

namespace moe {
namespace {

// The key of a step's layer in the executor's per-layer tables where the generation gives every
// layer one entry: the engine's layer values then cannot grow those tables (layers in a
// manifest are >= 0).
constexpr int64_t kEveryLayer = -1;

// The device plan's tables are per layer only where the layers have slot tables of their own.
int64_t TableLayer(const PlacementManifest& generation, int64_t layer) {
  return generation.per_layer() ? layer : kEveryLayer;
}

// The load signal is per layer where the generation names its layers (a step of any other is
// refused); one that serves every layer counts them together.
int64_t LoadLayer(const PlacementManifest& generation, int64_t layer) {
  return generation.layers().empty() ? kEveryLayer : layer;
}

}  // namespace
absl::StatusOr<std::unique_ptr<LayerExecutor>> LayerExecutor::Create(LayerExecutorOptions options) {
  if (options.registry == nullptr || options.kernels == nullptr) {
    return absl::InvalidArgumentError("executor: registry and kernels required");
  }
  if (options.lone_decode_recordings < 1 || options.lone_decode_recordings > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("executor: lone_decode_recordings ", options.lone_decode_recordings, " outside [1, 65536]"));
  }
  const bool bound = options.transport != nullptr || options.topology.has_value() || options.group.has_value();
  std::unique_ptr<LayerExecutor> e(new LayerExecutor(std::move(options)));
  e->device_ = e->options_.kernels->device_resident();
  e->event_kernels_ = e->options_.kernels;
  e->answered_timeout_ = e->options_.timeout;
  e->graphs_ = e->device_ && e->options_.decode_graphs != nullptr;
  e->selector_ = ReplicaSelector::Create(e->options_.selector);
  if (bound) {
    RETURN_IF_ERROR(e->CheckBinding(e->options_));
  }
  absl::MutexLock lock(&e->gate_mu_);
  e->bound_ = bound;
  e->open_ = bound;
  e->unbound_why_ = absl::StrCat("rank ", e->options_.rank.value(), " has not joined its process group yet");
  return e;
}

absl::Status LayerExecutor::CheckBinding(const LayerExecutorOptions& o) const {
  if (!o.topology || !o.group || o.transport == nullptr) {
    return absl::InvalidArgumentError("executor: topology, group and transport go together");
  }
  if (!o.group->Contains(o.rank)) {
    return absl::InvalidArgumentError(absl::StrCat("executor: rank ", o.rank.value(), " is not in the group"));
  }
  if (o.transport->slot() != o.group->SlotOf(o.rank).value() || o.transport->size() != o.group->size()) {
    return absl::FailedPreconditionError("executor: transport slot / size disagree with the process group");
  }
  if (o.kernels->device_resident() && !o.transport->accepts_device_memory()) {
    return absl::FailedPreconditionError(absl::StrCat("executor: kernels '", o.kernels->name(),
                                                      "' keep rows in device memory, transport '", o.transport->name(),
                                                      "' moves host memory only"));
  }
  return absl::OkStatus();
}

void LayerExecutor::Unbind(const std::string& why) {
  Transport* transport = nullptr;
  {
    absl::MutexLock lock(&gate_mu_);
    unbound_why_ = why;
    if (!bound_) return;
    bound_ = false;
    open_ = false;
    transport = options_.transport;
  }
  if (transport != nullptr) transport->Interrupt();
  gate_mu_.LockWhen(absl::Condition(
      +[](int* n) { return *n == 0; }, &in_flight_));
  gate_mu_.Unlock();
  // The graphs captured the old communicator: they go before the transport does.
  absl::MutexLock lock(&generations_mu_);
  graphs_by_key_.clear();
  layouts_.clear();
  device_tables_.clear();
}

absl::Status LayerExecutor::Bind(Transport* transport, const Topology& topology, const ProcessGroup& group,
                                 DecodeGraphFactory decode_graphs, bool open) {
  LayerExecutorOptions next = options_;
  next.transport = transport;
  next.topology = topology;
  next.group = group;
  next.decode_graphs = std::move(decode_graphs);
  RETURN_IF_ERROR(CheckBinding(next));
  const auto unbound = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(gate_mu_) {
    return bound_ || in_flight_ > 0 ? absl::FailedPreconditionError("executor: Bind while bound (Unbind first)")
                                    : absl::OkStatus();
  };
  {
    absl::MutexLock gate(&gate_mu_);
    RETURN_IF_ERROR(unbound());
  }
  // Rebind needs every lease returned. Waited for outside the gate (steps are refused while
  // unbound, so no answered work is added), which Execute and Membership take meanwhile.
  if (absl::Status s = AwaitAnsweredWork(); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("executor: Bind: ", s.message()));
  }
  absl::MutexLock gate(&gate_mu_);
  RETURN_IF_ERROR(unbound());
  RETURN_IF_ERROR(options_.registry->Rebind(group, topology));
  {
    absl::MutexLock lock(&generations_mu_);
    graphs_by_key_.clear();
    layouts_.clear();
    device_tables_.clear();
  }
  options_ = std::move(next);
  graphs_ = device_ && options_.decode_graphs != nullptr;
  bound_ = true;
  open_ = open;
  if (!open) {
    unbound_why_ = absl::StrCat("rank ", options_.rank.value(), ": epoch ", options_.group->epoch().value(),
                                " is bound here, not yet on every member; retry the step");
  }
  fault_reported_ = false;
  return absl::OkStatus();
}

bool LayerExecutor::Open(int64_t epoch) {
  absl::MutexLock lock(&gate_mu_);
  if (!bound_ || options_.group->epoch().value() != epoch) return false;
  open_ = true;
  return true;
}

void LayerExecutor::SetEpochFaultListener(EpochFaultListener listener) {
  absl::MutexLock lock(&gate_mu_);
  fault_listener_ = std::move(listener);
}

std::optional<std::pair<Topology, ProcessGroup>> LayerExecutor::Membership() const {
  absl::MutexLock lock(&gate_mu_);
  if (!bound_) return std::nullopt;
  return std::make_pair(*options_.topology, *options_.group);
}

// A generation's weights where the kernels read them: the host copy itself for host-memory
// kernels, one upload for device-resident ones (freed when the last step using them ends).
struct LayerExecutor::ResidentExperts {
  std::shared_ptr<const LocalExperts> host;
  kernels::KernelBuffer gate_up, down;
  const uint16_t* w_gate_up = nullptr;  // every layer's slots, layer after layer (null: FP8 only)
  const uint16_t* w_down = nullptr;
  // ExpertDtype::kFp8: every layer's E4M3 weights and 128 x 128 block scales, layer after layer,
  // where the kernels read them.
  bool fp8 = false;
  kernels::KernelBuffer q_gate_up, q_down, s_gate_up, s_down;
  // Layer `index`'s weights (LocalExperts::LayerIndex).
  const uint16_t* LayerGateUp(int index) const { return w_gate_up + index * host->layer_gate_up_elems(); }
  const uint16_t* LayerDown(int index) const { return w_down + index * host->layer_down_elems(); }
  int slots() const { return static_cast<int>(host->layer_down_elems() / (static_cast<size_t>(host->d) * host->d_ff)); }
  // Scales of one layer's gate_up ([slots * 2 d_ff / 128, d / 128]) and down ([slots * d / 128,
  // d_ff / 128]).
  int64_t gate_up_scales() const { return static_cast<int64_t>(slots()) * (2 * host->d_ff / 128) * (host->d / 128); }
  int64_t down_scales() const { return static_cast<int64_t>(slots()) * (host->d / 128) * (host->d_ff / 128); }
  kernels::Fp8ExpertWeights Fp8Layer(int index) const {
    kernels::Fp8ExpertWeights w;
    w.w_gate_up = q_gate_up.as<uint8_t>() + index * host->layer_gate_up_elems();
    w.gate_up_scales = s_gate_up.as<float>() + index * gate_up_scales();
    w.w_down = q_down.as<uint8_t>() + index * host->layer_down_elems();
    w.down_scales = s_down.as<float>() + index * down_scales();
    w.num_experts = slots();
    w.d = host->d;
    w.d_ff = host->d_ff;
    return w;
  }
};

absl::StatusOr<ExpertDtype> ParseExpertDtype(const std::string& text, const char* field) {
  if (text == "bf16") return ExpertDtype::kBf16;
  if (text == "fp8") return ExpertDtype::kFp8;
  return absl::InvalidArgumentError(absl::StrCat(field, ": '", text, "' is not an expert precision (bf16, fp8)"));
}

const char* ExpertDtypeName(ExpertDtype dtype) { return dtype == ExpertDtype::kFp8 ? "fp8" : "bf16"; }

// The FP8 copy of a generation's weights (LayerExecutorOptions::expert_dtype): each layer's
// gate/up and down matrices quantized in 128 x 128 blocks by the kernels, from BF16 staged
// through a bounded buffer (128-row multiples: blocks never straddle a chunk or an expert,
// whose 2 d_ff and d rows are multiples of 128).
absl::Status LayerExecutor::QuantizeGeneration(PlacementVersion version, ResidentExperts* r) {
  kernels::ExpertKernels* kern = options_.kernels;
  const LocalExperts& host = *r->host;
  const int d = host.d, f = host.d_ff;
  if (d <= 0 || f <= 0 || d % 128 != 0 || f % 128 != 0) {
    return absl::FailedPreconditionError(absl::StrCat("expert_dtype fp8: placement-v", version.value(),
                                                      "'s experts (d=", d, ", d_ff=", f,
                                                      ") need d and d_ff multiples of 128"));
  }
  const int layers = host.num_layers();
  const int64_t gu = static_cast<int64_t>(host.layer_gate_up_elems()),
                dn = static_cast<int64_t>(host.layer_down_elems());
  const int64_t gu_s = r->gate_up_scales(), dn_s = r->down_scales();
  const int64_t widest = std::max(d, f);
  const int64_t chunk_rows = std::max<int64_t>(128, ((int64_t{64} << 20) / (widest * 2)) / 128 * 128);
  const int64_t staging = std::min<int64_t>(chunk_rows, std::max(gu / d, dn / f)) * widest * 2;
  const int64_t need = layers * (gu + dn + 4 * (gu_s + dn_s)) + staging;
  if (const int64_t free = kern->AvailableBytes(); free >= 0 && need > free) {
    return absl::ResourceExhaustedError(absl::StrCat("placement-v", version.value(), ": the FP8 experts need ", need,
                                                     " bytes of kernel memory, ", free, " are free on ", kern->name()));
  }
  RETURN_IF_ERROR(r->q_gate_up.Reserve(kern, layers * gu));
  RETURN_IF_ERROR(r->q_down.Reserve(kern, layers * dn));
  RETURN_IF_ERROR(r->s_gate_up.Reserve(kern, layers * gu_s * 4));
  RETURN_IF_ERROR(r->s_down.Reserve(kern, layers * dn_s * 4));
  kernels::KernelBuffer stage;
  RETURN_IF_ERROR(stage.Reserve(kern, staging));
  // [rows, cols] BF16 at `src` (host) -> E4M3 at `q`, block scales at `scales`.
  auto quantize = [&](const uint16_t* src, int64_t rows, int cols, uint8_t* q, float* scales) -> absl::Status {
    const int64_t block_cols = cols / 128;
    for (int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
      const int64_t n = std::min(chunk_rows, rows - r0);
      RETURN_IF_ERROR(kern->CopyToKernel(stage.data(), src + r0 * cols, n * cols * 2, nullptr));
      kernels::QuantizeParams p;
      p.x = stage.as<uint16_t>();
      p.rows = n;
      p.d = cols;
      p.granularity = kernels::ScaleGranularity::kBlock128x128;
      p.q = q + r0 * cols;
      p.scales = scales + (r0 / 128) * block_cols;
      p.scale_count = kernels::ScaleCount(p.granularity, n, cols);
      RETURN_IF_ERROR(kern->Quantize(p, nullptr));
      RETURN_IF_ERROR(kern->Synchronize(nullptr));  // the staging buffer is refilled next
    }
    return absl::OkStatus();
  };
  for (int l = 0; l < layers; ++l) {
    RETURN_IF_ERROR(quantize(host.w_gate_up.data() + l * gu, gu / d, d, r->q_gate_up.as<uint8_t>() + l * gu,
                             r->s_gate_up.as<float>() + l * gu_s));
    RETURN_IF_ERROR(quantize(host.w_down.data() + l * dn, dn / f, f, r->q_down.as<uint8_t>() + l * dn,
                             r->s_down.as<float>() + l * dn_s));
  }
  r->fp8 = true;
  if (r->slots() == 0) return absl::OkStatus();  // a rank holding no slot runs no expert
  // Whether these kernels take the shape: a call with no rows is checked as a step's would be
  // (CUDA: the Hopper kernels' d and d_ff), before the generation can serve.
  const std::vector<int64_t> offsets(r->slots() + 1, 0);
  kernels::SwigluFp8Params probe;
  probe.weights = r->Fp8Layer(0);
  probe.offsets = offsets.data();
  if (absl::Status s = kern->SwigluFp8(probe, nullptr); !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("expert_dtype fp8: placement-v", version.value(), ": ",
                                                      kern->name(), " cannot run these FP8 experts: ", s.message()));
  }
  return absl::OkStatus();
}

absl::Status LayerExecutor::AddGeneration(PlacementVersion version, std::shared_ptr<const LocalExperts> experts) {
  if (experts == nullptr) return absl::InvalidArgumentError("experts: null");
  auto resident = std::make_shared<ResidentExperts>();
  resident->host = experts;
  resident->w_gate_up = experts->w_gate_up.data();
  resident->w_down = experts->w_down.data();
  if (options_.expert_dtype == ExpertDtype::kFp8) {
    RETURN_IF_ERROR(QuantizeGeneration(version, resident.get()));
    if (device_) {  // the BF16 copy stays on the host only
      resident->w_gate_up = nullptr;
      resident->w_down = nullptr;
    }
  } else if (device_) {
    kernels::ExpertKernels* kern = options_.kernels;
    const int64_t gu = static_cast<int64_t>(experts->w_gate_up.size()) * 2,
                  dn = static_cast<int64_t>(experts->w_down.size()) * 2;
    // Refused before anything is allocated when the weights cannot fit.
    if (const int64_t free = kern->AvailableBytes(); free >= 0 && gu + dn > free) {
      return absl::ResourceExhaustedError(absl::StrCat("placement-v", version.value(), ": the experts need ", gu + dn,
                                                       " bytes of device memory, ", free, " are free on ",
                                                       kern->name()));
    }
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
  std::vector<int64_t> total;
  for (const auto& [layer, load] : layer_load_) {
    if (total.size() < load.size()) total.resize(load.size(), 0);
    for (size_t e = 0; e < load.size(); ++e) total[e] += load[e];
  }
  return total;
}

absl::Status LayerExecutor::RegisterHostMemory(void* p, int64_t bytes) {
  if (!device_) return absl::OkStatus();
  return options_.kernels->RegisterHostMemory(p, bytes);
}

void LayerExecutor::UnregisterHostMemory(void* p) {
  if (device_) options_.kernels->UnregisterHostMemory(p);
}

absl::StatusOr<kernels::ExpertKernels::IpcMapping> LayerExecutor::OpenDeviceRows(const std::string& ipc_handle) {
  if (!device_) {
    return absl::FailedPreconditionError(
        absl::StrCat("device_rows: rows in an engine's GPU memory need device kernels; rank ", options_.rank.value(),
                     " runs ", options_.kernels->name()));
  }
  return options_.kernels->OpenIpcMemory(ipc_handle);
}

void LayerExecutor::CloseDeviceRows(void* base) {
  if (device_) options_.kernels->CloseIpcMemory(base);
}

absl::StatusOr<void*> LayerExecutor::OpenReadyEvent(const std::string& ipc_handle) {
  if (!device_) {
    return absl::FailedPreconditionError(absl::StrCat("device_rows.ready_event: events need device kernels; rank ",
                                                      options_.rank.value(), " runs ", options_.kernels->name()));
  }
  return options_.kernels->OpenIpcEvent(ipc_handle);
}

void LayerExecutor::CloseReadyEvent(void* event) {
  if (!device_) return;
  // A done event's answered steps first: their leases name it (past the timeout they are
  // returned anyway, and the event goes).
  AwaitDoneEvent(event).IgnoreError();
  options_.kernels->CloseIpcEvent(event);
}

absl::Status LayerExecutor::WaitReadyEvent(void* event) {
  if (!device_) return absl::FailedPreconditionError("ready_event: the rank's kernels are not device-resident");
  return WaitEvent(event, "device_rows.ready_event: the engine's GPU work before it");
}

// The engine records its ready event before it submits, so it has nearly always fired by now:
// the first query answers. Otherwise spin briefly, then poll every 20 us up to the timeout.
absl::Status LayerExecutor::WaitEvent(void* event, absl::string_view work) {
  // (The members Bind never assigns: an engine's ready event is waited for outside any step.)
  const absl::Time start = absl::Now(), deadline = start + answered_timeout_;
  for (;;) {
    ASSIGN_OR_RETURN(const bool done, event_kernels_->EventDone(event));
    if (done) return absl::OkStatus();
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(work, " did not finish within ", absl::FormatDuration(answered_timeout_)));
    }
    if (now - start > absl::Microseconds(200)) absl::SleepFor(absl::Microseconds(20));
  }
}

void LayerExecutor::HoldUntilDone(void* done_event, GenerationLease lease) {
  int held;
  {
    absl::MutexLock lock(&answered_mu_);
    answered_.push_back(AnsweredWork{done_event, std::move(lease)});
    held = static_cast<int>(answered_.size());
    answered_count_.store(held, std::memory_order_relaxed);
  }
  // An engine that never waits on its events cannot pile up leases: past a bound the step waits
  // for the oldest work like a step without a done event would (counted: AnsweredWorkStats).
  if (held <= kMaxAnswered) return;
  cap_waits_.fetch_add(1, std::memory_order_relaxed);
  const absl::Time deadline = absl::Now() + answered_timeout_;
  while (ReleaseFinishedWork() > kMaxAnswered) {
    if (absl::Now() >= deadline) {
      cap_timeouts_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    absl::SleepFor(absl::Microseconds(20));
  }
}

int LayerExecutor::ReleaseFinishedWork() {
  if (answered_count_.load(std::memory_order_relaxed) == 0) return 0;
  // The leases go back under the lock: the registry's own lock is a leaf, and a vector to carry
  // them out would allocate a step.
  absl::MutexLock lock(&answered_mu_);
  auto keep = answered_.begin();
  for (AnsweredWork& w : answered_) {
    // A query that fails (a device error) leaves no work running that could still read.
    absl::StatusOr<bool> done = event_kernels_->EventDone(w.done_event);
    if (!done.ok() || *done) {
      GenerationLease returned = std::move(w.lease);  // released here
    } else {
      *keep++ = std::move(w);
    }
  }
  answered_.erase(keep, answered_.end());
  const int held = static_cast<int>(answered_.size());
  answered_count_.store(held, std::memory_order_relaxed);
  return held;
}

absl::Status LayerExecutor::AwaitAnswered(absl::FunctionRef<bool(const AnsweredWork&)> which, bool return_at_timeout) {
  const absl::Time deadline = absl::Now() + answered_timeout_;
  for (;;) {
    if (ReleaseFinishedWork() == 0) return absl::OkStatus();
    int running = 0;
    {
      absl::MutexLock lock(&answered_mu_);
      const bool timed_out = absl::Now() >= deadline;
      auto keep = answered_.begin();
      for (AnsweredWork& w : answered_) {
        if (!which(w)) {
          *keep++ = std::move(w);
          continue;
        }
        ++running;
        if (timed_out && return_at_timeout) {
          GenerationLease returned = std::move(w.lease);  // released here
        } else {
          *keep++ = std::move(w);
        }
      }
      answered_.erase(keep, answered_.end());
      answered_count_.store(static_cast<int>(answered_.size()), std::memory_order_relaxed);
      if (running == 0) return absl::OkStatus();
      if (timed_out) {
        return absl::DeadlineExceededError(absl::StrCat(
            running, " answered steps' GPU work did not finish within ", absl::FormatDuration(answered_timeout_),
            return_at_timeout ? "; their leases are returned as their event closes" : "; their leases stay held"));
      }
    }
    absl::SleepFor(absl::Microseconds(20));
  }
}

absl::Status LayerExecutor::AwaitAnsweredWork() {
  return AwaitAnswered([](const AnsweredWork&) { return true; }, false);
}

absl::Status LayerExecutor::AwaitAnsweredStep(HandleId id) {
  return AwaitAnswered([id](const AnsweredWork& w) { return w.lease.handle() == id; }, false);
}

absl::Status LayerExecutor::AwaitAnsweredGeneration(PlacementVersion version) {
  return AwaitAnswered([version](const AnsweredWork& w) { return w.lease.version() == version; }, false);
}

absl::Status LayerExecutor::AwaitDoneEvents(absl::Span<void* const> events) {
  return AwaitAnswered(
      [events](const AnsweredWork& w) { return std::find(events.begin(), events.end(), w.done_event) != events.end(); },
      false);
}

absl::Status LayerExecutor::AwaitDoneEvent(void* event) {
  return AwaitAnswered([event](const AnsweredWork& w) { return w.done_event == event; }, true);
}

LayerExecutor::~LayerExecutor() {
  // Work still running at the timeout is past waiting for: the leases go with the executor.
  AwaitAnsweredWork().IgnoreError();
  absl::MutexLock lock(&answered_mu_);
  answered_.clear();
}

absl::StatusOr<void*> LayerExecutor::CreateDoneEvent(std::string* handle) {
  if (!device_) {
    return absl::FailedPreconditionError(absl::StrCat("device_rows.done_events: events need device kernels; rank ",
                                                      options_.rank.value(), " runs ", options_.kernels->name()));
  }
  return options_.kernels->CreateIpcEvent(handle);
}

absl::Status LayerExecutor::StartDeviceRowCheck(const uint16_t* x, int64_t n, kernels::Stream stream) {
  if (!device_) return absl::FailedPreconditionError("hidden: the rank's kernels are not device-resident");
  return options_.kernels->StartFindNonFiniteBf16(x, n, stream);
}

absl::StatusOr<int64_t> LayerExecutor::FinishDeviceRowCheck() {
  if (!device_) return absl::FailedPreconditionError("hidden: the rank's kernels are not device-resident");
  return options_.kernels->FinishFindNonFiniteBf16();
}

void LayerExecutor::RecycleOutput(RowBuffer buffer) {
  absl::MutexLock lock(&generations_mu_);
  if (buffer.capacity() > spare_output_.capacity()) spare_output_ = std::move(buffer);
}

std::map<int64_t, std::vector<int64_t>> LayerExecutor::LayerExpertLoad() const {
  absl::MutexLock lock(&generations_mu_);
  return layer_load_;
}

void LayerExecutor::DropGeneration(PlacementVersion version) {
  absl::MutexLock lock(&generations_mu_);
  experts_.erase(version.value());
  for (auto it = layouts_.begin(); it != layouts_.end();) {
    it = it->first.first == version.value() ? layouts_.erase(it) : std::next(it);
  }
  for (auto it = device_tables_.begin(); it != device_tables_.end();) {
    it = it->first.first == version.value() ? device_tables_.erase(it) : std::next(it);
  }
  for (auto it = graphs_by_key_.begin(); it != graphs_by_key_.end();) {
    it = std::get<0>(it->first) == version.value() ? graphs_by_key_.erase(it) : std::next(it);
  }
}

void LayerExecutor::DiscardGeneration(PlacementVersion version) {
  DropGeneration(version);
  absl::MutexLock lock(&generations_mu_);
  counters_.erase(version.value());
}

// The bucket's graph for (version, layer, d, k), captured on first use. Every member reaches the
// capture at the same step: admission is decided over agreed counts.
absl::StatusOr<std::shared_ptr<DecodeStepGraph>> LayerExecutor::BucketGraph(
    const LayerStepInput& in, PlacementVersion version, int64_t total_slots, int local_slots,
    const std::shared_ptr<const ResidentExperts>& weights, int layer_index) {
  const auto key = std::make_tuple(version.value(), layer_index, in.d, in.k);
  {
    absl::MutexLock lock(&generations_mu_);
    auto it = graphs_by_key_.find(key);
    if (it != graphs_by_key_.end()) return it->second.graph;
  }
  const int p = options_.group->size();
  const int64_t tokens_cap = options_.decode_rank_tokens;
  DecodeGraphShape shape;
  shape.peers = p;
  shape.segment_rows = tokens_cap * in.k;
  shape.local_slots = local_slots;
  shape.slot_routes = options_.decode_slot_routes;
  shape.rank_tokens = tokens_cap;
  shape.d = in.d;
  shape.d_ff = weights->host->d_ff;
  shape.k = in.k;
  // The graph's expert call covers local_slots x slot_routes rows (cuda_decode_graph.cc): the
  // kernels decide on those, so the runner choice asks about the same.
  if (weights->fp8) {  // the grouped layout (SwigluFp8 has no padded runner)
    const kernels::Fp8ExpertWeights w = weights->Fp8Layer(layer_index);
    shape.fp8_gate_up = w.w_gate_up;
    shape.fp8_gate_up_scales = w.gate_up_scales;
    shape.fp8_down = w.w_down;
    shape.fp8_down_scales = w.down_scales;
  } else {
    shape.padded_runner = ChoosePaddedRunner(
        options_.decode_runner, p, tokens_cap, in.k, total_slots,
        options_.kernels->DecodeGemmBeatsPadded(local_slots, in.d, shape.d_ff, local_slots * shape.slot_routes));
    shape.w_gate_up = weights->LayerGateUp(layer_index);
    shape.w_down = weights->LayerDown(layer_index);
  }
  shape.warmup_timeout = options_.timeout;
  ASSIGN_OR_RETURN(std::unique_ptr<DecodeStepGraph> made, options_.decode_graphs(shape));
  std::shared_ptr<DecodeStepGraph> graph = std::move(made);
  absl::MutexLock lock(&generations_mu_);
  graphs_by_key_[key] = Graph{weights, graph};
  return graph;
}

absl::Status LayerExecutor::ReplayDecode(const LayerStepInput& in, PlacementVersion version, int64_t total_slots,
                                         const std::shared_ptr<const ResidentExperts>& weights, int layer_index,
                                         const SourcePlan& source, const DestinationPlan& dest,
                                         const std::vector<int32_t>& send_token,
                                         const std::vector<int32_t>& row_of_route, const std::vector<float>& gates,
                                         uint16_t* out) {
  const int p = options_.group->size();
  const int local_slots = static_cast<int>(dest.expert_counts.size());
  const int64_t tokens_cap = options_.decode_rank_tokens, slot_cap = options_.decode_slot_routes;
  const int64_t seg = tokens_cap * in.k;  // bounds any rank's routes to one peer
  ASSIGN_OR_RETURN(std::shared_ptr<DecodeStepGraph> graph,
                   BucketGraph(in, version, total_slots, local_slots, weights, layer_index));

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
    for (int64_t i = 0; i < dest.recv_splits[j]; ++i)
      b.pad_of_recv[dest.recv_offsets[j] + i] = static_cast<int32_t>(j * seg + i);
  }
  if (dest.expert_offsets[local_slots] > local_slots * slot_cap) {
    return absl::InternalError("decode graph: received routes exceed the bucket (admission let them through)");
  }
  b.g_expert_rows.assign(local_slots * slot_cap, 0);
  for (int64_t r = 0; r < dest.expert_offsets[local_slots]; ++r)
    b.g_expert_rows[r] = b.pad_of_recv[dest.expert_order[r]];
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
  t.rows_on_device = in.rows_on_device;
  t.done_event = in.rows_on_device ? in.done_event : nullptr;
  t.tokens = in.tokens;
  t.send_index = b.g_send_index.data();
  t.expert_rows = b.g_expert_rows.data();
  t.expert_offsets = dest.expert_offsets.data();
  t.layout_row = b.g_layout_row.data();
  t.row_of_route = b.g_row_of_route.data();
  t.gates = b.g_gates.data();
  return graph->Replay(in.step_id * 4 + 2, t, out, options_.timeout);
}

absl::Status LayerExecutor::Reject(uint64_t step_id, int64_t layer, absl::Status why) {
  {
    absl::MutexLock lock(&gate_mu_);
    if (!open_) {
      // Bound but not open: the members that opened the epoch drop the step at once.
      if (bound_) options_.transport->AbandonStep(step_id);
      return why;
    }
    ++in_flight_;
  }
  struct Leave {
    LayerExecutor* e;
    ~Leave() {
      absl::MutexLock lock(&e->gate_mu_);
      --e->in_flight_;
    }
  } leave{this};
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

std::map<int64_t, int64_t> LayerExecutor::CountConservationFailures() const {
  absl::MutexLock lock(&generations_mu_);
  return conservation_by_epoch_;
}

void LayerExecutor::Count(const absl::StatusOr<LayerStepResult>& r, const LayerStepInput& in, bool canary,
                          bool input_refused) {
  if (!r.ok()) {
    // A failed step counts against the generation it would have run on. ABORTED is the ranks'
    // agreement refusing the step before any payload moved (another rank rejected its input,
    // proposed another generation while a trial or a switch reaches the ranks one by one, or was
    // in another step): not a fault of that generation, and the engine retries it. Neither is
    // input this rank's checks refused: a canary step with a bad expert id would otherwise count
    // against the candidate and block its promotion.
    const int64_t v = canary ? Trial().version : options_.registry->ActiveVersion();
    absl::MutexLock lock(&generations_mu_);
    if (input_refused) {
      ++counters_[v].rejected_steps;
    } else if (r.status().code() == absl::StatusCode::kAborted) {
      ++counters_[v].aborted_steps;
      if (IsCountConservationFailure(r.status())) {
        ++counters_[v].count_failures;
        ++conservation_by_epoch_[options_.group->epoch().value()];
      }
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
    if (!rec.fallback_reason.empty()) ++c.fallback_steps;  // set only where the graph did not admit it
  }
  // The gate's drop ratio is about routes the runtime fails to deliver: routes the engine's router
  // dropped are its own choice, and an admitted route is never dropped here (a step that does not
  // fit a bucket runs eagerly, one that cannot run fails whole), so routes_dropped stays 0.
  c.routes_attempted += rec.routes_accepted;
}

absl::StatusOr<LayerStepResult> LayerExecutor::Execute(const LayerStepInput& in) {
  {
    absl::MutexLock lock(&gate_mu_);
    if (!open_) {
      // Bound but not open: the members that opened the epoch drop the step at once.
      if (bound_) options_.transport->AbandonStep(in.step_id);
      return absl::UnavailableError(unbound_why_);
    }
    ++in_flight_;
  }
  absl::StatusOr<LayerStepResult> r = ExecuteBound(in);
  // Still in flight, so the transport is the bound epoch's and this thread drives it.
  const bool broken = !r.ok() && options_.transport->failed() && !options_.transport->interrupted();
  EpochFaultListener report;
  int64_t epoch = 0;
  {
    absl::MutexLock lock(&gate_mu_);
    if (broken && !fault_reported_ && fault_listener_) {
      fault_reported_ = true;
      report = fault_listener_;
      epoch = options_.group->epoch().value();
    }
    --in_flight_;
  }
  if (report) report(epoch, std::string(r.status().message()));
  return r;
}

absl::StatusOr<LayerStepResult> LayerExecutor::ExecuteBound(const LayerStepInput& in) {
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
    PassOutcome outcome;
    auto r = RunPass(in, po, &outcome);
    if (r.ok()) r->record.canary = true;
    Count(r, in, true, outcome.input_refused);
    return r;
  }
  PassOptions po;
  if (t.version >= 0 && t.shadow_every > 0) {
    po.shadow_version = t.version;
    po.shadow_every = t.shadow_every;
  }
  // A step the members may sample for the shadow (the agreement samples step ids that are
  // multiples of shadow_every): the served pass and the shadow read one private copy of its rows
  // and routing, and the served rows are compared before they are written to the caller's
  // memory. That memory may be a step ring's slot or the engine's GPU buffers, which the engine
  // can rewrite at any time: it must not be able to force mismatches (which block a candidate's
  // canary) by changing them between the two passes. Rows and routing on the device are copied
  // to the host for such a step, which is then served as a step with host rows.
  const bool sampled = ShadowSamples(po.shadow_version, po.shadow_every, in.step_id) && in.hidden != nullptr &&
                       in.tokens > 0 && in.d > 0 && in.k > 0;
  ShadowCopies copies;
  const LayerStepInput& served_in = sampled ? CopyForShadow(in, &copies) : in;
  PassOutcome outcome;
  auto r = RunPass(served_in, po, &outcome);
  Count(r, in, false, outcome.input_refused);
  if (outcome.agreed_shadow >= 0) RunShadow(served_in, outcome.agreed_shadow, r);
  if (r.ok() && !copies.output.empty()) {
    if (absl::Status written = WriteServedRows(in, copies.output); !written.ok()) return written;
  }
  return r;
}

const LayerStepInput& LayerExecutor::CopyForShadow(const LayerStepInput& in, ShadowCopies* c) {
  c->in = in;
  // The caller's sizes, checked before the pass validates them: a product that overflows, or
  // whose byte count could, is left to the pass to refuse.
  constexpr int64_t kMaxValues = int64_t{1} << 40;
  int64_t n64 = 0, routes64 = 0;
  if (__builtin_mul_overflow(in.tokens, static_cast<int64_t>(in.d), &n64) ||
      __builtin_mul_overflow(in.tokens, static_cast<int64_t>(in.k), &routes64) || n64 > kMaxValues ||
      routes64 > kMaxValues) {
    return in;
  }
  const size_t n = static_cast<size_t>(n64), routes = static_cast<size_t>(routes64);
  c->rows.resize(n);
  c->ids.resize(routes);
  c->weights.resize(routes);
  if (in.rows_on_device) {
    if (!options_.kernels->CopyToHost(c->rows.data(), in.hidden, static_cast<int64_t>(n) * 2, nullptr).ok()) return in;
  } else {
    std::copy(in.hidden, in.hidden + n, c->rows.begin());
  }
  if (in.routing_on_device) {
    if (!options_.kernels->CopyToHost(c->ids.data(), in.topk_ids, static_cast<int64_t>(routes) * 4, nullptr).ok() ||
        !options_.kernels->CopyToHost(c->weights.data(), in.topk_weights, static_cast<int64_t>(routes) * 4, nullptr)
             .ok()) {
      return in;
    }
  } else if (in.topk_ids != nullptr && in.topk_weights != nullptr) {
    std::copy(in.topk_ids, in.topk_ids + routes, c->ids.begin());
    std::copy(in.topk_weights, in.topk_weights + routes, c->weights.begin());
  } else {
    return in;  // refused by the pass as it is
  }
  c->in.hidden = c->rows.data();
  c->in.topk_ids = c->ids.data();
  c->in.topk_weights = c->weights.data();
  c->in.rows_on_device = false;
  c->in.routing_on_device = false;
  c->in.done_event = nullptr;
  if (in.output != nullptr || in.rows_on_device) {
    c->output.resize(n);
    c->in.output = c->output.data();
  }
  return c->in;
}

absl::Status LayerExecutor::WriteServedRows(const LayerStepInput& in, const RowBuffer& rows) {
  if (!in.rows_on_device) {
    std::copy(rows.begin(), rows.end(), in.output);
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(
      options_.kernels->CopyToKernel(in.output, rows.data(), static_cast<int64_t>(rows.size()) * 2, nullptr));
  if (in.done_event != nullptr) return options_.kernels->RecordEvent(in.done_event, nullptr);
  return options_.kernels->Synchronize(nullptr);
}

void LayerExecutor::RunShadow(const LayerStepInput& in, int64_t shadow, const absl::StatusOr<LayerStepResult>& r) {
  // Shadow: every member agreed to run this step on the candidate too (same proposal, sampled
  // step), so every member runs the pass, whatever its own active result was. The engine gets
  // the active result; the candidate's output is only compared with it (runner parity).
  LayerStepInput sin = in;
  sin.step_id = in.step_id + kShadowStepOffset;
  sin.output = nullptr;  // the shadow's rows are only compared, never handed out
  sin.expected_generation = -1;
  sin.start_input_check = nullptr;  // started by the served pass; the shadow awaits its answer
  if (in.rows_on_device && in.tokens > 0) {
    // The served step's rows are still the engine's: CopyForShadow, which serves a sampled step
    // from host copies, could not copy them. The shadow gets none, so its pass fails, counted as
    // a shadow failure (nothing is compared).
    sin.hidden = nullptr;
    sin.rows_on_device = false;
  }
  PassOptions spo;
  spo.trial_version = shadow;
  spo.shadow_pass = true;
  PassOutcome shadow_outcome;
  auto s = RunPass(sin, spo, &shadow_outcome);
  // Outputs of different sizes give NaN, which is a mismatch too.
  absl::Span<const uint16_t> served;  // (rows on the device are not read: see above)
  if (in.output != nullptr && !in.rows_on_device) {
    served = absl::MakeConstSpan(in.output, static_cast<size_t>(in.tokens) * in.d);
  } else if (in.output == nullptr && r.ok()) {
    served = r->output;
  }
  const bool mismatch = s.ok() && r.ok() && !(kernels::RelativeL2Bf16(s->output, served) <= kShadowTolerance);
  absl::MutexLock lock(&generations_mu_);
  GenerationCounters& c = counters_[shadow];
  ++c.shadow_samples;
  if (!s.ok()) ++c.shadow_failures;
  if (mismatch) ++c.shadow_mismatches;
}

// What one pass's phases hand each other. Buffers reused across steps stay in buf_.
struct LayerExecutor::Pass {
  Pass(const LayerStepInput& input, const PassOptions& options)
      : input_(input), po(options), trial(options.trial_version >= 0), clock(&result.record.phase_us) {}

 private:
  LayerStepInput input_;  // the caller's, but for routing copied to the host (HostRouting)

 public:
  const LayerStepInput& in = input_;
  // The step's routing now read from these host tables instead of the caller's kernel memory.
  void HostRouting(const int32_t* ids, const float* weights) {
    input_.topk_ids = ids;
    input_.topk_weights = weights;
    input_.routing_on_device = false;
  }
  const PassOptions& po;
  const bool trial;
  const absl::Time started = absl::Now();
  LayerStepResult result;
  PhaseClock clock;  // after `result`, whose record it writes
  int64_t num_experts = 0;
  std::optional<FrozenHandoff> frozen;           // validate
  std::unique_ptr<DispatchHandle> handle;        // acquire
  std::unique_ptr<DispatchHandle> spare_handle;  // the last pass's, Reset, for acquire to refill
  PlacementVersion version{0};
  std::shared_ptr<const ResidentExperts> weights;
  int layer_index = 0;     // the step's layer in `weights`
  int64_t load_layer = 0;  // ... in layer_load_ (acquire: LoadLayer)
  std::shared_ptr<const PlanLayout> layout;
  const PlacementManifest* manifest = nullptr;
  int64_t n_send = 0;                  // plan
  StepAgreement agreement;             // agree
  AgreementScratch agreement_scratch;  // ... its records
  int64_t n_recv = 0;                  // dispatch
  ByteSplits bytes;
  InverseCoordinates inverse;  // the host plan's, until bound into the handle
  StepTables tables;           // eager payload: the kernels' index tables
  // Where the kernels read the step's index tables: the host plan's uploaded tables or the
  // device plan's (kernel memory either way).
  const int32_t* expert_order = nullptr;     // expert position -> receive position
  const int32_t* expert_position = nullptr;  // receive position -> expert position
  const int32_t* row_of_route = nullptr;     // route (t, j) -> send position, -1: not sent
  const float* gates = nullptr;              // route (t, j) -> gate, 0: not sent
  const int64_t* expert_offsets = nullptr;   // FP8 experts: the local slots' offsets in kernel memory
  bool device_plan = false;                  // planned by the kernels (validate decides)
  bool lone_decode = false;                  // ... as a lone member's decode step (LoneDecodePhase)
  bool check_in_recording = false;           // LoneDecodeSteps starts the caller's input check (start_input_check)
  bool input_refused = false;                // the engine's input failed its checks (PassOutcome)
  // `s`, a check of the engine's input: refused, it is the engine's fault (input_refused).
  absl::Status InputCheck(absl::Status s) {
    if (!s.ok()) input_refused = true;
    return s;
  }
  bool load_pending = false;    // buf_.step_load holds this pass's routes (StepLoad)
  absl::Status combine_tables;  // CheckCombineTables of the host plan's tables (dispatch)
  std::shared_ptr<const DevicePlanTables> dtables;
  const int64_t* recv_status = nullptr;  // the receive ranking's status (kernel memory)
  const void* hidden = nullptr;          // the engine's rows where the kernels read them
  bool rows_staged = false;              // ... copied (or being copied) to kernel memory by StageRows
  // The step's combined rows on the host: the caller's (in.output) or the result's.
  uint16_t* host_out() { return in.output != nullptr ? in.output : result.output.data(); }
};

absl::StatusOr<LayerStepResult> LayerExecutor::RunPass(const LayerStepInput& in, const PassOptions& po,
                                                       PassOutcome* outcome) {
  Pass pass(in, po);
  {  // the last pass's agreement, records and byte splits, to refill
    absl::MutexLock lock(&generations_mu_);
    pass.agreement = std::move(spare_pass_.agreement);
    pass.agreement_scratch = std::move(spare_pass_.scratch);
    pass.bytes = std::move(spare_pass_.bytes);
    pass.inverse = std::move(spare_pass_.inverse);
    pass.spare_handle = std::move(spare_pass_.handle);
  }
  // However the pass ends, its handoff's columns, agreement, records and byte splits go back for
  // the next step to refill.
  struct Recycle {
    LayerExecutor* e;
    Pass& pass;
    ~Recycle() {
      // The host plan's inverse coordinates went into the handle; a device-planned step bound
      // empty ones, so the larger of the two is kept. The handle's lease is released here, where
      // its destruction released it, outside the executor's lock (the registry takes its own).
      InverseCoordinates bound = pass.handle != nullptr ? pass.handle->ReleaseInverse() : InverseCoordinates{};
      if (pass.handle != nullptr && e->AnswersBeforeWork(pass.in)) {
        // Its GPU work (enqueued, maybe not finished, whether or not the step succeeded) may
        // still read the generation: the lease is returned once the done event has fired.
        GenerationLease lease = pass.handle->TakeLease();
        if (lease.held()) e->HoldUntilDone(pass.in.done_event, std::move(lease));
      }
      if (pass.handle != nullptr) pass.handle->Reset();
      absl::MutexLock lock(&e->generations_mu_);
      e->spare_pass_.agreement = std::move(pass.agreement);
      e->spare_pass_.scratch = std::move(pass.agreement_scratch);
      e->spare_pass_.bytes = std::move(pass.bytes);
      InverseCoordinates& keep = bound.token.capacity() >= pass.inverse.token.capacity() ? bound : pass.inverse;
      e->spare_pass_.inverse = std::move(keep);
      if (pass.handle != nullptr) e->spare_pass_.handle = std::move(pass.handle);
      if (!pass.frozen.has_value()) return;
      if (pass.frozen->routes.origin.capacity() > e->spare_handoff_.origin.capacity()) {
        e->spare_handoff_ = std::move(pass.frozen->routes);
      }
    }
  } recycle{this, pass};
  // A member that cannot run the step still joins the agreement with the abort flag set, so its
  // peers abort at once (they get ABORTED) instead of waiting out the timeout; the member itself
  // answers its engine with the original error.
  // The caller's input check starts as the pass does, unless the step may be a lone decode step
  // whose recorded work takes it in (LoneDecodeSteps).
  const bool check_may_be_recorded = in.start_input_check && device_ && options_.lone_decode_graphs &&
                                     options_.device_plan && LoneDecodeEligible(in, po) && !pass.trial &&
                                     !po.shadow_pass;
  absl::Status check_started = absl::OkStatus();
  if (in.start_input_check && !check_may_be_recorded) check_started = in.start_input_check(nullptr);
  absl::Status before_agreement = ValidatePhase(pass);
  pass.check_in_recording = check_may_be_recorded && pass.lone_decode;
  if (check_may_be_recorded && !pass.check_in_recording) check_started = in.start_input_check(nullptr);
  // (A check that cannot start is this rank's failure, not the input's: its verdict, awaited
  // below, is the input's.)
  if (before_agreement.ok()) before_agreement = std::move(check_started);
  if (before_agreement.ok()) before_agreement = StageRows(pass);
  if (before_agreement.ok()) before_agreement = AcquirePhase(pass);
  // A failed step answers its engine only once the staged rows' copy (or a kernel reading rows in
  // the engine's device memory) no longer reads its memory.
  const auto settled = [&](absl::Status s) {
    if (pass.rows_staged || in.rows_on_device || in.routing_on_device) {
      options_.kernels->Synchronize(nullptr).IgnoreError();
    }
    return s;
  };
  if (before_agreement.ok() && pass.lone_decode) {
    // Its GPU work is enqueued before the step's checks come back; a step they refuse is
    // rejected once that work has settled, as any step refused before its agreement.
    before_agreement = LoneDecodePhase(pass);
    if (!before_agreement.ok()) {
      outcome->input_refused = pass.input_refused;
      settled(absl::OkStatus()).IgnoreError();
      return Reject(in.step_id, in.layer, std::move(before_agreement));
    }
    RETURN_IF_ERROR(ReleasePhase(pass));
    CommitLoad(pass);
    return std::move(pass.result);
  }
  if (before_agreement.ok()) before_agreement = PlanPhase(pass);
  if (in.await_input_check) {
    absl::Status checked = in.await_input_check();
    if (before_agreement.ok()) before_agreement = pass.InputCheck(std::move(checked));
  }
  if (!before_agreement.ok()) {
    outcome->input_refused = pass.input_refused;
    settled(absl::OkStatus()).IgnoreError();
    return Reject(in.step_id, in.layer, std::move(before_agreement));
  }
  if (absl::Status s = AgreePhase(pass, &outcome->agreed_shadow); !s.ok()) return settled(std::move(s));
  if (absl::Status s = DispatchPlanPhase(pass); !s.ok()) return settled(std::move(s));
  if (pass.result.record.graph_replay) {
    // Replay (admitted decode step): the bucket's captured graph does dispatch through combine.
    pass.clock.Enter(StepPhase::kExperts);
    RETURN_IF_ERROR(HandleThroughOneCall(pass));
    RETURN_IF_ERROR(ReplayDecode(in, pass.version, pass.manifest->num_slots(), pass.weights, pass.layer_index,
                                 buf_.source, buf_.dest, pass.handle->inverse().token, buf_.row_of_route, buf_.gates,
                                 pass.host_out()));
  } else if (absl::Status s = EagerPayload(pass); !s.ok()) {
    return settled(std::move(s));
  }
  // (A replayed graph combined already; its step is answered with the error all the same.)
  if (!pass.combine_tables.ok()) return settled(std::move(pass.combine_tables));
  RETURN_IF_ERROR(ReleasePhase(pass));
  CommitLoad(pass);
  return std::move(pass.result);
}

std::vector<int64_t>& LayerExecutor::StepLoad(Pass& pass) {
  pass.load_pending = true;
  buf_.step_load.assign(pass.num_experts, 0);
  return buf_.step_load;
}

void LayerExecutor::CommitLoad(const Pass& pass) {
  if (!pass.load_pending) return;
  absl::MutexLock lock(&generations_mu_);
  std::vector<int64_t>& load = layer_load_[pass.load_layer];
  if (load.size() < buf_.step_load.size()) load.resize(buf_.step_load.size(), 0);
  for (size_t e = 0; e < buf_.step_load.size(); ++e) load[e] += buf_.step_load[e];
}

bool LayerExecutor::LoneDecodeEligible(const LayerStepInput& in, const PassOptions& po) const {
  return options_.lone_decode_on_kernels && in.phase == Phase::kDecode && LoneMember() && in.routing_on_device &&
         !options_.lone_member_graphs && po.shadow_version < 0;
}

absl::Status LayerExecutor::ValidatePhase(Pass& pass) {
  pass.clock.Enter(StepPhase::kValidate);
  const LayerStepInput& in = pass.in;
  const int64_t active = pass.trial ? pass.po.trial_version : options_.registry->ActiveVersion();
  if (active < 0) return absl::UnavailableError("no ACTIVE placement generation");
  pass.version = PlacementVersion(active);
  auto manifest =
      pass.trial ? options_.registry->RequireTrial(pass.version) : options_.registry->RequireLive(pass.version);
  if (!manifest.ok()) return manifest.status();
  pass.num_experts = (*manifest)->num_experts();
  if (in.rows_on_device && !device_) {
    return absl::FailedPreconditionError(absl::StrCat("hidden: rows in device memory need device kernels; rank ",
                                                      options_.rank.value(), " runs ", options_.kernels->name()));
  }
  // A lone member's decode step with its routing in kernel memory is planned there too, with no
  // shadow sampled (LoneDecodePhase).
  const bool lone_decode = LoneDecodeEligible(in, pass.po);
  if (options_.device_plan && (in.phase == Phase::kPrefill || lone_decode) && !pass.trial && !pass.po.shadow_pass &&
      in.tokens > 0 && (*manifest)->ServesLayer(in.layer)) {
    pass.dtables = DeviceTablesFor(pass.version, TableLayer(**manifest, in.layer), (*manifest)->ForLayer(in.layer));
  }
  pass.device_plan = pass.dtables != nullptr;
  pass.lone_decode = pass.device_plan && in.phase == Phase::kDecode;
  if (pass.device_plan) {
    // The handoff's scalars are sealed here; its routes are keyed and checked by the kernels in
    // the plan phase (SealRoutes), into kernel memory that only this step writes.
    RETURN_IF_ERROR(pass.InputCheck(ValidateStepShape(in)));
    SemanticHandoff scalars;
    scalars.scope = ExecutionScopeId(static_cast<int64_t>(in.step_id));
    scalars.num_experts = static_cast<int>(pass.num_experts);
    scalars.top_k = in.k;
    scalars.num_partitions = options_.topology->num_ranks();
    ASSIGN_OR_RETURN(FrozenHandoff frozen, Freeze(std::move(scalars)));
    pass.frozen.emplace(std::move(frozen));
    return absl::OkStatus();
  }
  if (in.routing_on_device) RETURN_IF_ERROR(RoutingToHost(pass));
  RETURN_IF_ERROR(pass.InputCheck(ValidateStepInput(in, static_cast<int>(pass.num_experts))));
  SemanticHandoff columns;  // an earlier step's, when one was handed back (no allocation per step)
  {
    absl::MutexLock lock(&generations_mu_);
    columns = std::move(spare_handoff_);
    spare_handoff_ = SemanticHandoff();
  }
  ASSIGN_OR_RETURN(FrozenHandoff frozen, SealRoutes(in, options_.rank, static_cast<int>(pass.num_experts),
                                                    options_.topology->num_ranks(), &columns));
  pass.frozen.emplace(std::move(frozen));
  return absl::OkStatus();
}

// A step planned on the host whose routing is in kernel memory: the routing copied to buf_'s
// registered host memory (both tables, one wait), which the pass then reads instead.
absl::Status LayerExecutor::RoutingToHost(Pass& pass) {
  const LayerStepInput& in = pass.in;
  RETURN_IF_ERROR(pass.InputCheck(ValidateStepShape(in)));
  int64_t routes = 0;
  if (__builtin_mul_overflow(in.tokens, static_cast<int64_t>(in.k), &routes) || routes > (int64_t{1} << 36)) {
    return pass.InputCheck(
        absl::InvalidArgumentError(absl::StrCat("topk_ids: ", in.tokens, " tokens x k = ", in.k, " is too large")));
  }
  if (routes == 0) {
    pass.HostRouting(in.topk_ids, in.topk_weights);  // nothing to read
    return absl::OkStatus();
  }
  const int64_t table = routes * 4;
  // Both tables into registered host memory, ordered on the kernels' stream, one wait for both.
  kernels::ExpertKernels& kern = *options_.kernels;
  RETURN_IF_ERROR(buf_.routing_host.Reserve(&kern, 2 * table));
  int32_t* host = buf_.routing_host.as<int32_t>();
  RETURN_IF_ERROR(kern.CopyToHostAsync(host, in.topk_ids, table, nullptr));
  RETURN_IF_ERROR(kern.CopyToHostAsync(host + routes, in.topk_weights, table, nullptr));
  RETURN_IF_ERROR(kern.Synchronize(nullptr));
  pass.HostRouting(host, reinterpret_cast<const float*>(host + routes));
  return absl::OkStatus();
}

// A prefill step's rows start their copy to kernel memory as soon as the input is valid: on the
// kernels' stream, which the dispatch's pack kernel follows, so the copy (8 MiB at 2048 tokens of
// d 2048) overlaps the host's acquire, plan and agreement instead of opening the dispatch. Rows
// in registered memory (a step ring's slot) copy asynchronously; pageable rows as before.
absl::Status LayerExecutor::StageRows(Pass& pass) {
  const LayerStepInput& in = pass.in;
  if (in.rows_on_device) {
    pass.hidden = in.hidden;  // read in place
    return absl::OkStatus();
  }
  if (!device_ || in.tokens == 0 || in.phase != Phase::kPrefill) return absl::OkStatus();
  const int64_t bytes = in.tokens * static_cast<int64_t>(in.d) * 2;
  RETURN_IF_ERROR(buf_.hidden.Reserve(options_.kernels, bytes));
  RETURN_IF_ERROR(options_.kernels->CopyToKernel(buf_.hidden.data(), in.hidden, bytes, nullptr));
  pass.hidden = buf_.hidden.data();
  pass.rows_staged = true;
  return absl::OkStatus();
}

absl::Status LayerExecutor::AcquirePhase(Pass& pass) {
  pass.clock.Enter(StepPhase::kAcquire);
  const HandleId id(static_cast<int64_t>(pass.in.step_id));
  // Earlier answered steps' leases go back where their work has finished, and one of this id
  // that still holds its lease under the id is waited for.
  RETURN_IF_ERROR(AwaitAnsweredStep(id));
  ASSIGN_OR_RETURN(pass.handle, pass.trial
                                    ? DispatchHandle::AcquireTrial(id, *pass.frozen, options_.registry, *options_.group,
                                                                   pass.version, std::move(pass.spare_handle))
                                    : DispatchHandle::Acquire(id, *pass.frozen, options_.registry, *options_.group,
                                                              std::move(pass.spare_handle)));
  const PlacementVersion version = pass.handle->placement_version();
  pass.version = version;
  if (!pass.trial && pass.in.expected_generation >= 0 && pass.in.expected_generation != version.value()) {
    return absl::FailedPreconditionError(absl::StrCat("expected_generation: engine expects placement-v",
                                                      pass.in.expected_generation, ", active is placement-v",
                                                      version.value()));
  }
  const std::shared_ptr<const PlacementManifest>& generation = pass.handle->manifest();
  {
    absl::MutexLock lock(&generations_mu_);
    auto it = experts_.find(version.value());
    if (it != experts_.end()) pass.weights = it->second;
  }
  if (pass.weights == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("placement-v", version.value(), ": no weights loaded on rank ", options_.rank.value()));
  }
  pass.layer_index = pass.weights->host->LayerIndex(pass.in.layer);
  if (pass.layer_index < 0 || !generation->ServesLayer(pass.in.layer)) {
    return absl::InvalidArgumentError(absl::StrCat("layer: ", pass.in.layer, " is not a MoE layer of placement-v",
                                                   version.value(), " (it serves layers ",
                                                   absl::StrJoin(generation->layers(), ","), ")"));
  }
  if (pass.weights->host->d != pass.in.d) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden: d = ", pass.in.d, ", the experts have d = ", pass.weights->host->d));
  }
  // Weights for another slot count than the generation puts here (every layer's table has the
  // same slots on the same ranks) fail this rank's step before the agreement, so its peers abort
  // at once instead of waiting out the timeout on an exchange it would not finish.
  const LocalExperts& host = *pass.weights->host;
  const int64_t local_slots = static_cast<int64_t>(generation->LocalSlots(options_.rank).size());
  if (static_cast<int64_t>(host.layer_down_elems()) != local_slots * host.d * host.d_ff) {
    return absl::FailedPreconditionError(absl::StrCat("rank ", options_.rank.value(), " holds weights for a different",
                                                      " number of local slots than placement-v", version.value(),
                                                      " puts here (", local_slots, ")"));
  }
  // The load signal for rebalancing: routes this rank's tokens chose, per logical expert, per
  // layer. Keyed once the layer is known to be served, and by LoadLayer, so that the engine's
  // layer values cannot grow the table.
  pass.load_layer = LoadLayer(*generation, pass.in.layer);
  if (!pass.po.shadow_pass && !pass.device_plan) {  // (the device plan counts per slot instead)
    std::vector<int64_t>& load = StepLoad(pass);
    for (int64_t i = 0; i < pass.in.tokens * pass.in.k; ++i) {
      if (pass.in.admitted == nullptr || pass.in.admitted[i] != 0) ++load[pass.in.topk_ids[i]];
    }
  }
  // The layer's slot table: its own in a per-layer generation.
  const std::shared_ptr<const PlacementManifest> table = generation->ForLayer(pass.in.layer);
  const std::pair<int64_t, int> layout_key(version.value(), generation->per_layer() ? pass.layer_index : -1);
  {
    absl::MutexLock lock(&generations_mu_);
    auto lit = layouts_.find(layout_key);
    if (lit != layouts_.end()) pass.layout = lit->second;
  }
  if (pass.layout == nullptr) {
    ASSIGN_OR_RETURN(PlanLayout layout, PlanLayout::Create(table, *options_.group));
    pass.layout = std::make_shared<const PlanLayout>(std::move(layout));
    absl::MutexLock lock(&generations_mu_);
    layouts_[layout_key] = pass.layout;
  }
  pass.manifest = table.get();  // the generation (held by the handle's lease) owns its tables
  return absl::OkStatus();
}

absl::Status LayerExecutor::PlanPhase(Pass& pass) {
  pass.clock.Enter(StepPhase::kPlan);
  if (pass.device_plan) return DevicePlanPhase(pass);
  const SemanticHandoff& routes = pass.frozen->routes;
  buf_.slots.resize(routes.size());
  RETURN_IF_ERROR(
      selector_->Select(routes, *pass.manifest, *options_.group, *options_.topology, {}, absl::MakeSpan(buf_.slots)));
  AcceptRoutes(routes, buf_.slots, &buf_.accepted_ids, &buf_.accepted_slots);
  RETURN_IF_ERROR(PlanSource(*pass.layout, buf_.accepted_slots, &buf_.source));
  pass.n_send = static_cast<int64_t>(buf_.accepted_ids.size());
  return absl::OkStatus();
}

absl::Status LayerExecutor::AgreePhase(Pass& pass, int64_t* agreed_shadow) {
  pass.clock.Enter(StepPhase::kAgree);
  const LayerStepInput& in = pass.in;
  const PlacementManifest& m = *pass.manifest;
  // Agreement before any payload moves: header, counts, tokens, routes per slot.
  std::vector<int64_t>& slot_counts = buf_.slot_counts;  // the device plan counted them
  if (!pass.device_plan) {
    slot_counts.assign(m.num_slots(), 0);
    for (PhysicalSlotId q : buf_.accepted_slots) ++slot_counts[q.value()];
  }
  // This member's graph manifest (bucket, whether it captures graphs, runner) and the step's
  // k and d: members that differ serve decode steps eagerly.
  const uint64_t manifest = GraphManifestWord(options_.decode_rank_tokens, options_.decode_slot_routes, graphs_,
                                              options_.decode_runner, in.k, in.d);
  StepHeader header{in.step_id,
                    in.layer,
                    pass.version.value(),
                    options_.group->epoch().value(),
                    0,
                    in.tokens,
                    pass.po.shadow_version,
                    pass.po.shadow_every,
                    static_cast<int64_t>(manifest),
                    pass.weights->fp8 ? 1 : 0};
  // The slot of every send position (for the expert ranks' receive plans) goes with the
  // agreement when it fits the agreement's record (decode-sized steps): one collective.
  // (The device plan's metadata is in kernel memory: it goes in its own exchange, or none for a
  // lone member.)
  std::vector<int32_t>& send_meta = buf_.send_meta;
  if (!pass.device_plan) {
    send_meta.resize(pass.n_send);
    for (int64_t pos = 0; pos < pass.n_send; ++pos) send_meta[pos] = buf_.source.send_slots[pos].value();
  }
  RETURN_IF_ERROR(AgreeOnStepInto(*options_.transport, header, buf_.source.send_splits, options_.timeout, slot_counts,
                                  pass.device_plan ? nullptr : &send_meta, &pass.agreement_scratch, &pass.agreement));
  if (agreed_shadow != nullptr) *agreed_shadow = pass.agreement.shadow_version;
  const bool lone_local = LoneMember() && !options_.lone_member_graphs;
  if (in.phase == Phase::kDecode && !lone_local) AdmitDecode(pass);
  return absl::OkStatus();
}

// Decode-graph admission, evaluated identically on every member over the agreed counts.
void LayerExecutor::AdmitDecode(Pass& pass) const {
  const PlacementManifest& m = *pass.manifest;
  DecodeGraph bucket;
  bucket.graph_id = absl::StrCat("decode.bucket", options_.decode_rank_tokens, ".v", pass.version.value());
  bucket.key.process_group = options_.group->id().value();
  bucket.key.placement_version = pass.version.value();
  bucket.key.checkpoint = m.checkpoint().value();
  bucket.key.d = pass.in.d;
  bucket.key.k = pass.in.k;
  bucket.key.rank_token_capacity.assign(options_.group->size(), options_.decode_rank_tokens);
  bucket.key.slot_route_capacity.assign(m.num_slots(), options_.decode_slot_routes);
  bucket.stable_buffers_ready = graphs_;
  AdmissionStep step;
  step.decode = true;
  step.key = bucket.key;
  step.rank_tokens = pass.agreement.rank_tokens;
  step.slot_routes = pass.agreement.slot_routes;
  // Members with different graph manifests all serve eagerly: no member replays alone.
  const Admission admission = pass.agreement.graph_keys_agree ? AdmitDecodeGraph(step, &bucket)
                                                              : Admission{false, FallbackReason::kGraphKeyMismatch, ""};
  pass.result.record.graph_replay = admission.replay;
  if (!admission.replay) pass.result.record.fallback_reason = FallbackReasonName(admission.reason);
}

namespace {

// fault_swap_combine_routes: the first two sent routes of different tokens trade send positions.
void SwapTwoTokensRoutes(int64_t k, std::vector<int32_t>* row_of_route) {
  std::vector<int32_t>& rows = *row_of_route;
  for (size_t a = 0; a < rows.size(); ++a) {
    if (rows[a] < 0) continue;
    for (size_t b = a + 1; b < rows.size(); ++b) {
      if (rows[b] >= 0 && static_cast<int64_t>(a) / k != static_cast<int64_t>(b) / k) {
        std::swap(rows[a], rows[b]);
        return;
      }
    }
    return;
  }
}

}  // namespace

// The handle binds the inverse coordinates; slot metadata reaches the expert ranks (host memory;
// with the agreement when it fitted); the receive-side plan and the combine's tables.
absl::Status LayerExecutor::DispatchPlanPhase(Pass& pass) {
  pass.clock.Enter(StepPhase::kDispatch);
  if (pass.device_plan) return DeviceDispatchPlan(pass);
  const LayerStepInput& in = pass.in;
  const SourcePlan& source = buf_.source;
  InverseOf(pass.frozen->routes, buf_.accepted_ids, source, in.tokens, &pass.inverse);
  RETURN_IF_ERROR(pass.handle->BindPlan(std::move(pass.inverse)));
  const StepAgreement& agreement = pass.agreement;
  for (int64_t c : agreement.recv_counts) pass.n_recv += c;
  SplitBytes(source.send_splits, agreement.recv_counts, static_cast<int64_t>(in.d) * 2, DispatchRowBytes(pass),
             &pass.bytes);
  std::vector<int32_t>& recv_meta = buf_.recv_meta;
  RETURN_IF_ERROR(pass.handle->MarkDispatchInFlight());
  if (agreement.meta_received) {
    recv_meta.assign(agreement.recv_meta.begin(), agreement.recv_meta.end());
  } else if (LoneMember()) {  // its own, not sent to itself
    recv_meta.assign(buf_.send_meta.begin(), buf_.send_meta.end());
  } else {
    recv_meta.resize(pass.n_recv);
    RETURN_IF_ERROR(options_.transport->AllToAllV(in.step_id * 4 + 1, buf_.send_meta.data(), pass.bytes.send_meta,
                                                  recv_meta.data(), pass.bytes.recv_meta, options_.timeout));
  }
  if (static_cast<int64_t>(recv_meta.size()) != pass.n_recv) {
    return absl::InternalError("slot metadata: wrong entry count");
  }
  buf_.received.resize(pass.n_recv);
  for (int64_t i = 0; i < pass.n_recv; ++i) buf_.received[i] = PhysicalSlotId(recv_meta[i]);
  RETURN_IF_ERROR(PlanDestination(*pass.layout, options_.rank, agreement.recv_counts, buf_.received, &buf_.dest));
  CombineTables(buf_.accepted_ids, source, pass.handle->inverse().gate, in.tokens * in.k, &buf_.row_of_route,
                &buf_.gates);
  if (options_.fault_swap_combine_routes) SwapTwoTokensRoutes(in.k, &buf_.row_of_route);
  // Checked here, answered at publish: the exchange with the peers still runs (they serve their
  // steps), and this rank's output, whose combine would permute rows, is never published.
  pass.combine_tables =
      CheckCombineTables(buf_.row_of_route, pass.handle->inverse().token, in.k, &buf_.combined_positions);
  ReserveOutput(pass);
  return absl::OkStatus();
}

// Every row is written by the combine (or copied out whole): a recycled buffer, not zeroed.
void LayerExecutor::ReserveOutput(Pass& pass) {
  const LayerStepInput& in = pass.in;
  if (in.output != nullptr) return;  // the caller's memory
  {
    absl::MutexLock lock(&generations_mu_);
    if (spare_output_.capacity() > pass.result.output.capacity()) pass.result.output.swap(spare_output_);
  }
  pass.result.output.resize(static_cast<size_t>(in.tokens) * in.d);
}

// The device plan's tables of one (generation, layer): each logical expert's key (the send-order
// key of its statically chosen slot), each key's slot and logical expert, and each slot's local
// index on this rank (-1 elsewhere). The first three index arrays also live in kernel memory.
struct LayerExecutor::DevicePlanTables {
  PlacementVersion version{0};
  int num_keys = 0;  // slots of the group's members, keyed in (peer, slot) order
  std::vector<int32_t> key_of_expert, slot_of_key, expert_of_key, local_of_slot, local_of_key;
  kernels::KernelBuffer device;  // key_of_expert, slot_of_key, local_of_slot, local_of_key
  const int32_t* d_key_of_expert = nullptr;
  const int32_t* d_slot_of_key = nullptr;
  const int32_t* d_local_of_slot = nullptr;
  const int32_t* d_local_of_key = nullptr;  // the key's slot's local index here, -1 elsewhere
};

std::shared_ptr<const LayerExecutor::DevicePlanTables> LayerExecutor::DeviceTablesFor(
    PlacementVersion version, int64_t table_layer, const std::shared_ptr<const PlacementManifest>& table) {
  const std::pair<int64_t, int64_t> key(version.value(), table_layer);
  {
    absl::MutexLock lock(&generations_mu_);
    auto it = device_tables_.find(key);
    if (it != device_tables_.end()) return it->second;
  }
  std::shared_ptr<DevicePlanTables> t;
  const std::optional<std::vector<int32_t>> choice =
      table == nullptr
          ? std::nullopt
          : StaticSlotChoice(*table, *options_.group, *options_.topology, options_.rank, options_.selector);
  absl::StatusOr<PlanLayout> layout = choice.has_value() ? PlanLayout::Create(table, *options_.group)
                                                         : absl::StatusOr<PlanLayout>(absl::UnknownError(""));
  const int num_keys = layout.ok() ? layout->PeerKeyBegin(layout->num_peers()) : 0;
  if (num_keys > 0 && num_keys <= kernels::kRankByKeyMaxKeys) {
    t = std::make_shared<DevicePlanTables>();
    const PlacementManifest& m = *table;
    t->version = version;
    t->num_keys = num_keys;
    t->key_of_expert.assign(m.num_experts(), -1);
    for (int e = 0; e < m.num_experts(); ++e) {
      if ((*choice)[e] >= 0) t->key_of_expert[e] = layout->SlotKey(PhysicalSlotId((*choice)[e]));
    }
    t->slot_of_key.assign(t->num_keys, -1);
    t->expert_of_key.assign(t->num_keys, -1);
    t->local_of_slot.assign(m.num_slots(), -1);
    for (int q = 0; q < m.num_slots(); ++q) {
      const PhysicalSlotId slot(q);
      const int32_t k = layout->SlotKey(slot);
      if (k >= 0) {
        t->slot_of_key[k] = q;
        t->expert_of_key[k] = m.slot(slot).expert.value();
      }
      if (m.slot(slot).rank == options_.rank) t->local_of_slot[q] = m.LocalIndex(slot);
    }
    t->local_of_key.assign(t->num_keys, -1);
    for (int k = 0; k < t->num_keys; ++k) {
      if (t->slot_of_key[k] >= 0) t->local_of_key[k] = t->local_of_slot[t->slot_of_key[k]];
    }
    const int64_t e_bytes = 4 * static_cast<int64_t>(m.num_experts());
    const int64_t k_bytes = 4 * static_cast<int64_t>(t->num_keys);
    const int64_t q_bytes = 4 * static_cast<int64_t>(m.num_slots());
    kernels::ExpertKernels& kern = *options_.kernels;
    absl::Status s = t->device.Reserve(&kern, e_bytes + 2 * k_bytes + q_bytes);
    auto* base = t->device.as<int32_t>();
    int32_t* const slot_of_key = base + m.num_experts();
    int32_t* const local_of_slot = slot_of_key + t->num_keys;
    int32_t* const local_of_key = local_of_slot + m.num_slots();
    if (s.ok()) s = kern.CopyToKernel(base, t->key_of_expert.data(), e_bytes, nullptr);
    if (s.ok()) s = kern.CopyToKernel(slot_of_key, t->slot_of_key.data(), k_bytes, nullptr);
    if (s.ok()) s = kern.CopyToKernel(local_of_slot, t->local_of_slot.data(), q_bytes, nullptr);
    if (s.ok()) s = kern.CopyToKernel(local_of_key, t->local_of_key.data(), k_bytes, nullptr);
    if (s.ok()) s = kern.Synchronize(nullptr);
    if (!s.ok()) {
      t = nullptr;  // not uploaded (kernel memory exhausted): the host plan serves these steps
    } else {
      t->d_key_of_expert = base;
      t->d_slot_of_key = slot_of_key;
      t->d_local_of_slot = local_of_slot;
      t->d_local_of_key = local_of_key;
    }
  }
  absl::MutexLock lock(&generations_mu_);
  auto [it, inserted] = device_tables_.emplace(key, std::move(t));
  return it->second;
}

// The device plan's tables of the step's generation: another may have become active since
// validate chose them (then its own, or UNAVAILABLE where its replica choice needs the host plan).
absl::Status LayerExecutor::RefreshDeviceTables(Pass& pass) {
  const LayerStepInput& in = pass.in;
  if (pass.dtables->version != pass.version) {
    pass.dtables =
        DeviceTablesFor(pass.version, TableLayer(*pass.handle->manifest(), in.layer), pass.layout->manifest_ptr());
  }
  if (pass.dtables == nullptr) {
    return absl::UnavailableError(absl::StrCat("step ", in.step_id, ": placement-v", pass.version.value(),
                                               " became active during the step and its replica choice needs the",
                                               " host plan; retry the step"));
  }
  return absl::OkStatus();
}

// SealRoutes' answer (status[0]: the first bad route, status[1]: the first without a slot) as the
// host plan words it, the refused route's expert and gate read where the routing is.
absl::Status LayerExecutor::SealedRoutesStatus(Pass& pass, const int64_t* status, const PlacementManifest& m) {
  const LayerStepInput& in = pass.in;
  const int64_t routes = in.tokens * in.k;
  if (status[0] < 0 && status[1] < 0) return absl::OkStatus();
  const int64_t i = status[0] >= 0 ? status[0] : status[1];
  if (i >= routes) return absl::InternalError(absl::StrCat("seal routes: status names route ", i, " of ", routes));
  std::pair<int32_t, float> r;
  if (in.routing_on_device) {
    RETURN_IF_ERROR(options_.kernels->CopyToHost(&r.first, in.topk_ids + i, 4, nullptr));
    RETURN_IF_ERROR(options_.kernels->CopyToHost(&r.second, in.topk_weights + i, 4, nullptr));
  } else {
    r = {in.topk_ids[i], in.topk_weights[i]};
  }
  // The engine's route (no slot for a valid expert is the generation's).
  if (status[0] >= 0) return pass.InputCheck(RouteInputError(i, in.k, r.first, r.second, m.num_experts()));
  return absl::FailedPreconditionError(
      absl::StrCat("route ", i, ": no compatible slot holds logical expert ", r.first, " in ", m.VersionName()));
}

// The send side on the kernels: routes keyed by their slot's (peer, slot) key and checked, then
// ranked into the stable send order; the host reads back only the counts per key and the status.
absl::Status LayerExecutor::DevicePlanPhase(Pass& pass) {
  const LayerStepInput& in = pass.in;
  const PlacementManifest& m = *pass.manifest;
  RETURN_IF_ERROR(RefreshDeviceTables(pass));
  const DevicePlanTables& t = *pass.dtables;
  kernels::ExpertKernels& kern = *options_.kernels;
  const int64_t routes = in.tokens * in.k;
  // The engine's routing in kernel memory: read in place when it is there already, else
  // uploaded with the admitted table in one copy.
  StepTables routing;
  const bool in_place = in.routing_on_device;
  const int t_ids = in_place ? -1 : routing.Add(in.topk_ids, routes * 4);
  const int t_gates = in_place ? -1 : routing.Add(in.topk_weights, routes * 4);
  const int t_admitted = in.admitted != nullptr ? routing.Add(in.admitted, routes) : -1;
  RETURN_IF_ERROR(routing.Upload(device_, kern, buf_.tables, buf_.tables_host, nullptr));
  for (kernels::KernelBuffer* b : {&buf_.d_keys, &buf_.d_gates, &buf_.d_row_of_route, &buf_.d_send_meta}) {
    RETURN_IF_ERROR(b->Reserve(&kern, routes * 4));
  }
  const int q = t.num_keys;
  const int64_t small_words = 2 * static_cast<int64_t>(q) + 4;  // counts, offsets, 3 status words
  RETURN_IF_ERROR(buf_.d_small.Reserve(&kern, small_words * 8));
  int64_t* small = buf_.d_small.as<int64_t>();
  kernels::SealRoutesParams seal;
  seal.ids = in_place ? in.topk_ids : routing.Get<int32_t>(t_ids);
  seal.gates = in_place ? in.topk_weights : routing.Get<float>(t_gates);
  seal.admitted = t_admitted >= 0 ? routing.Get<uint8_t>(t_admitted) : nullptr;
  seal.routes = routes;
  seal.num_experts = m.num_experts();
  seal.key_of_expert = t.d_key_of_expert;
  seal.keys = buf_.d_keys.as<int32_t>();
  seal.gates_out = buf_.d_gates.as<float>();
  seal.status = small + 2 * q + 1;
  RETURN_IF_ERROR(kern.SealRoutes(seal, nullptr));
  kernels::RankByKeyParams rank;
  rank.raw = seal.keys;
  rank.n = routes;
  rank.num_keys = q;
  rank.position = buf_.d_row_of_route.as<int32_t>();  // the rows are packed through it (Scatter)
  rank.key_values = t.d_slot_of_key;
  rank.values = buf_.d_send_meta.as<int32_t>();
  rank.counts = small;
  rank.offsets = small + q;
  rank.status = small + 2 * q + 3;
  RETURN_IF_ERROR(kern.RankByKey(rank, nullptr));
  std::vector<int64_t>& host = buf_.plan_small;
  host.resize(small_words);
  RETURN_IF_ERROR(kern.CopyToHost(host.data(), small, small_words * 8, nullptr));  // waits for the plan
  const int64_t* counts = host.data();
  const int64_t* offsets = counts + q;
  const int64_t* status = offsets + q + 1;
  RETURN_IF_ERROR(SealedRoutesStatus(pass, status, m));
  if (status[2] >= 0) return absl::InternalError(absl::StrCat("device plan: route ", status[2], " has no valid key"));
  // Counts per physical slot (the agreement's and the record's), the send splits, the load.
  const PlanLayout& layout = *pass.layout;
  buf_.slot_counts.assign(m.num_slots(), 0);
  for (int k = 0; k < q; ++k) buf_.slot_counts[t.slot_of_key[k]] = counts[k];
  SourcePlan& source = buf_.source;
  const int peers = layout.num_peers();
  source.send_splits.resize(peers);
  source.send_offsets.resize(peers + 1);
  for (int p = 0; p < peers; ++p) {
    source.send_offsets[p] = offsets[layout.PeerKeyBegin(p)];
    source.send_splits[p] = offsets[layout.PeerKeyBegin(p + 1)] - offsets[layout.PeerKeyBegin(p)];
  }
  source.send_offsets[peers] = offsets[q];
  pass.n_send = offsets[q];
  if (!pass.po.shadow_pass) {
    std::vector<int64_t>& load = StepLoad(pass);
    for (int k = 0; k < q; ++k) {
      if (t.expert_of_key[k] < static_cast<int32_t>(load.size())) load[t.expert_of_key[k]] += counts[k];
    }
  }
  pass.result.record.device_plan = true;
  return absl::OkStatus();
}

// The receive side on the kernels: the slot metadata exchanged in kernel memory, the arrived
// rows ranked by local slot (stable: (local slot, source peer, send position), as PlanDestination
// orders them); the experts' offsets come from the agreed routes per slot.
absl::Status LayerExecutor::DeviceDispatchPlan(Pass& pass) {
  const LayerStepInput& in = pass.in;
  kernels::ExpertKernels& kern = *options_.kernels;
  RETURN_IF_ERROR(pass.handle->BindPlan(InverseCoordinates{{}, {}, in.tokens}));  // the inverse is on the device
  const StepAgreement& agreement = pass.agreement;
  for (int64_t c : agreement.recv_counts) pass.n_recv += c;
  SplitBytes(buf_.source.send_splits, agreement.recv_counts, static_cast<int64_t>(in.d) * 2, DispatchRowBytes(pass),
             &pass.bytes);
  RETURN_IF_ERROR(pass.handle->MarkDispatchInFlight());
  // A lone member's metadata is its own send side's: ranked where it is, not sent to itself.
  const int32_t* recv_meta = buf_.d_send_meta.as<int32_t>();
  if (!LoneMember()) {
    RETURN_IF_ERROR(buf_.d_recv_meta.Reserve(&kern, pass.n_recv * 4));
    RETURN_IF_ERROR(options_.transport->AllToAllV(in.step_id * 4 + 1, buf_.d_send_meta.data(), pass.bytes.send_meta,
                                                  buf_.d_recv_meta.data(), pass.bytes.recv_meta, options_.timeout));
    recv_meta = buf_.d_recv_meta.as<int32_t>();
  }
  const auto local = pass.manifest->LocalSlots(options_.rank);
  const int l_count = static_cast<int>(local.size());
  DestinationPlan& dest = buf_.dest;
  dest.expert_counts.resize(l_count);
  dest.expert_offsets.assign(l_count + 1, 0);
  for (int l = 0; l < l_count; ++l) {
    dest.expert_counts[l] = agreement.slot_routes[local[l].value()];
    dest.expert_offsets[l + 1] = dest.expert_offsets[l] + dest.expert_counts[l];
  }
  if (dest.expert_offsets[l_count] != pass.n_recv) {
    return absl::InternalError(absl::StrCat("device plan: the agreement gives rank ", options_.rank.value(),
                                            "'s slots ", dest.expert_offsets[l_count], " routes, ", pass.n_recv,
                                            " arrive"));
  }
  // A lone member reads its expert rows through the expert positions alone (DispatchRows); the
  // others' repack gathers them in expert order.
  const bool order = !LoneMember();
  RETURN_IF_ERROR(buf_.d_expert_position.Reserve(&kern, pass.n_recv * 4));
  if (order) RETURN_IF_ERROR(buf_.d_expert_order.Reserve(&kern, pass.n_recv * 4));
  if (pass.n_recv > 0) {
    int64_t* small = buf_.d_small.as<int64_t>();  // the send side's values were read back
    kernels::RankByKeyParams rank;
    rank.raw = recv_meta;
    rank.n = pass.n_recv;
    rank.key_map = pass.dtables->d_local_of_slot;
    rank.map_size = pass.manifest->num_slots();
    rank.num_keys = l_count;
    rank.position = buf_.d_expert_position.as<int32_t>();
    rank.order = order ? buf_.d_expert_order.as<int32_t>() : nullptr;
    rank.counts = small;
    rank.offsets = small + l_count;
    rank.status = small + 2 * l_count + 1;
    RETURN_IF_ERROR(kern.RankByKey(rank, nullptr));
    pass.recv_status = rank.status;      // read after the dispatch's synchronize
    pass.expert_offsets = rank.offsets;  // the agreed offsets (checked above), in kernel memory
  }
  pass.row_of_route = buf_.d_row_of_route.as<int32_t>();
  pass.gates = buf_.d_gates.as<float>();
  pass.expert_order = order ? buf_.d_expert_order.as<int32_t>() : nullptr;
  pass.expert_position = buf_.d_expert_position.as<int32_t>();
  ReserveOutput(pass);
  return absl::OkStatus();
}

// Row payloads live where the kernels run (device memory for CUDA kernels, which the NCCL
// transport moves directly); plans and slot metadata stay on the host.
absl::Status LayerExecutor::EagerPayload(Pass& pass) {
  const LayerStepInput& in = pass.in;
  RETURN_IF_ERROR(RowsForKernels(pass));
  // A lone member holds every slot: a decode step's route, experts and combine are one kernels
  // call on the tokens as they are. Prefill steps keep the grouped GEMMs.
  if (LoneMember() && in.phase == Phase::kDecode && !pass.weights->fp8) return LocalLayerPhase(pass);
  RETURN_IF_ERROR(DispatchRows(pass));
  RETURN_IF_ERROR(ExpertsPhase(pass));
  return ReturnAndCombine(pass);
}

// The step's rows where the kernels read them: staged or in place already, else the host rows
// (copied to kernel memory for device kernels).
absl::Status LayerExecutor::RowsForKernels(Pass& pass) {
  const LayerStepInput& in = pass.in;
  if (pass.rows_staged || in.rows_on_device) return absl::OkStatus();
  pass.hidden = in.hidden;
  if (device_ && in.tokens > 0) {
    const int64_t bytes = in.tokens * static_cast<int64_t>(in.d) * 2;
    RETURN_IF_ERROR(buf_.hidden.Reserve(options_.kernels, bytes));
    RETURN_IF_ERROR(options_.kernels->CopyToKernel(buf_.hidden.data(), in.hidden, bytes, nullptr));
    pass.hidden = buf_.hidden.data();
  }
  return absl::OkStatus();
}

// Where the combined rows are written (kernel memory for device kernels, then copied out).
absl::StatusOr<uint16_t*> LayerExecutor::OutputRows(Pass& pass) {
  if (!device_) return pass.host_out();
  if (pass.in.rows_on_device) return pass.in.output;  // written in place
  RETURN_IF_ERROR(buf_.output.Reserve(options_.kernels, pass.in.tokens * static_cast<int64_t>(pass.in.d) * 2));
  return buf_.output.as<uint16_t>();
}

absl::Status LayerExecutor::CopyOut(Pass& pass, const uint16_t* out) {
  if (!device_) return absl::OkStatus();
  if (pass.in.rows_on_device) {
    // The engine reads them next: once its stream waited on the done event, or once this returns.
    if (pass.in.done_event != nullptr) return options_.kernels->RecordEvent(pass.in.done_event, nullptr);
    return options_.kernels->Synchronize(nullptr);
  }
  return options_.kernels->CopyToHost(pass.host_out(), out, pass.in.tokens * static_cast<int64_t>(pass.in.d) * 2,
                                      nullptr);
}

// The step's handle through work that dispatches, computes and combines in one call (a replayed
// decode graph, the local layer): its expert rows and output ready, its combine begun under the
// step's generation.
absl::Status LayerExecutor::HandleThroughOneCall(Pass& pass) {
  RETURN_IF_ERROR(pass.handle->MarkExpertRowsReady());
  RETURN_IF_ERROR(pass.handle->MarkExpertOutputReady());
  return pass.handle->BeginCombine(*options_.registry, pass.version);
}

// LocalLayer: the decode kernels (at one token fused), with no exchange, packs or repacks.
absl::Status LayerExecutor::LocalLayerPhase(Pass& pass) {
  pass.clock.Enter(StepPhase::kExperts);
  const LayerStepInput& in = pass.in;
  RETURN_IF_ERROR(HandleThroughOneCall(pass));
  if (in.tokens == 0) return absl::OkStatus();
  const int64_t routes_n = in.tokens * in.k;
  const int local_slots = static_cast<int>(buf_.dest.expert_counts.size());
  std::vector<int32_t>& local_ids = buf_.local_ids;
  local_ids.assign(routes_n, -1);  // dropped routes add nothing
  std::vector<int64_t>& slot_routes = buf_.local_slot_routes;
  slot_routes.assign(local_slots, 0);
  for (int64_t i = 0; i < pass.n_send; ++i) {
    const int32_t local = pass.manifest->LocalIndex(buf_.accepted_slots[i]);
    local_ids[buf_.accepted_ids[i]] = local;
    ++slot_routes[local];
  }
  StepTables& tables = pass.tables;
  const int t_ids = tables.Add(local_ids.data(), routes_n * 4);
  const int t_gates = tables.Add(buf_.gates.data(), routes_n * 4);
  RETURN_IF_ERROR(tables.Upload(device_, *options_.kernels, buf_.tables, buf_.tables_host, nullptr));
  const ResidentExperts& weights = *pass.weights;
  kernels::LocalLayerParams layer;
  layer.weights = {weights.LayerGateUp(pass.layer_index), weights.LayerDown(pass.layer_index), local_slots, in.d,
                   weights.host->d_ff};
  layer.x = static_cast<const uint16_t*>(pass.hidden);
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
      // The kernels' own decode GEMMs where they beat the padded runner (CUDA's Hopper kernels
      // from four rows an expert), else the padded runner where it pays.
      if (!options_.kernels->DecodeGemmBeatsPadded(static_cast<int>(slot_routes.size()), in.d, weights.host->d_ff,
                                                   in.tokens * in.k)) {
        layer.padded_capacity = kernels::PaddedDecodeCapacity(slot_routes, in.d, weights.host->d_ff);
      }
      break;
  }
  ASSIGN_OR_RETURN(layer.out_bf16, OutputRows(pass));
  RETURN_IF_ERROR(options_.kernels->LocalLayer(layer, nullptr));
  return CopyOut(pass, layer.out_bf16);
}

// A lone member's decode step with its routing in kernel memory. The kernels key and check
// its routes (SealRoutes, the static replica choice of the device plan) and map them to local
// slots in the same pass; the copy of the checks' answer to the host is enqueued, then the local
// layer, and only then does the host wait for the answer: the GPU runs the layer while the host
// checks the step and counts its routes. On device kernels that record work, those calls are one
// launch of a recording made once per step shape and buffers (lone_decode_graphs, RecordedWork;
// the layer in stages there, which give the fused kernels' bits). Where the padded runner
// might pay (its capacity needs the counts) the answer is awaited before the layer instead. A
// refused route, or rows that fail the caller's input check, fail the step (the caller settles the
// enqueued work before it answers): their output rows may then have been written.
absl::Status LayerExecutor::LoneDecodePhase(Pass& pass) {
  absl::Status s = LoneDecodeSteps(pass);
  if (pass.in.await_input_check) {  // awaited on every path: the rows must outlive the scan
    absl::Status checked = pass.in.await_input_check();
    if (s.ok()) s = std::move(checked);
  }
  return s;
}

absl::Status LayerExecutor::LoneDecodeSteps(Pass& pass) {
  pass.clock.Enter(StepPhase::kPlan);
  const LayerStepInput& in = pass.in;
  const PlacementManifest& m = *pass.manifest;
  RETURN_IF_ERROR(RefreshDeviceTables(pass));
  const DevicePlanTables& t = *pass.dtables;
  kernels::ExpertKernels& kern = *options_.kernels;
  const LocalExperts& host = *pass.weights->host;
  int local_slots = 0;
  for (int32_t local : t.local_of_slot) local_slots = std::max(local_slots, local + 1);
  const int64_t routes = in.tokens * in.k;
  StepTables tables;  // the admitted table, when the engine gave one (host memory)
  const int t_admitted = in.admitted != nullptr ? tables.Add(in.admitted, routes) : -1;
  RETURN_IF_ERROR(tables.Upload(device_, kern, buf_.tables, buf_.tables_host, nullptr));
  for (kernels::KernelBuffer* b : {&buf_.d_gates, &buf_.d_row_of_route}) {
    RETURN_IF_ERROR(b->Reserve(&kern, routes * 4));
  }
  // The status words and the keys side by side, read back in one copy.
  const int64_t back_bytes = 16 + routes * 4;
  RETURN_IF_ERROR(buf_.d_small.Reserve(&kern, back_bytes));
  kernels::SealRoutesParams seal;
  seal.ids = in.topk_ids;
  seal.gates = in.topk_weights;
  seal.admitted = t_admitted >= 0 ? tables.Get<uint8_t>(t_admitted) : nullptr;
  seal.routes = routes;
  seal.num_experts = m.num_experts();
  seal.key_of_expert = t.d_key_of_expert;
  seal.status = buf_.d_small.as<int64_t>();
  seal.keys = reinterpret_cast<int32_t*>(seal.status + 2);
  seal.gates_out = buf_.d_gates.as<float>();
  // Each route's local slot, composed in the same pass (-1: dropped, or no slot here).
  seal.local_of_key = t.d_local_of_key;
  seal.num_keys = t.num_keys;
  seal.local = buf_.d_row_of_route.as<int32_t>();
  int32_t* const local_ids = seal.local;
  // The read-back (the status and the keys: the counts and the expert load) into registered host
  // memory; a refused route's expert and gate are read where they are, once refused.
  RETURN_IF_ERROR(buf_.lone_host.Reserve(&kern, back_bytes));
  int64_t* const status = buf_.lone_host.as<int64_t>();
  int32_t* const keys = reinterpret_cast<int32_t*>(status + 2);
  if (device_ && checks_event_.event == nullptr) {
    std::string unused;
    ASSIGN_OR_RETURN(checks_event_.event, kern.CreateIpcEvent(&unused));
    checks_event_.kernels = &kern;
  }
  // The checks and their read-back, with the event the host waits on after them; the caller's
  // input check first. In a recording the CUDA kernels run the input check on a branch of its
  // own beside the routes' checks and the layer, which do not read its answer, and the read-back
  // on another (ForkCapture), so that the layer does not wait for the copy to the host.
  const auto enqueue_checks = [&](kernels::Stream st) -> absl::Status {
    if (pass.check_in_recording) RETURN_IF_ERROR(in.start_input_check(st));
    RETURN_IF_ERROR(kern.SealRoutes(seal, st));
    ASSIGN_OR_RETURN(kernels::Stream back, kern.ForkCapture(st));
    RETURN_IF_ERROR(kern.CopyToHostAsync(status, seal.status, back_bytes, back));
    if (device_) RETURN_IF_ERROR(kern.RecordEvent(checks_event_.event, back));
    return absl::OkStatus();
  };
  // The runner: the decode kernels unless the padded one may pay, which needs the counts first
  // (LocalLayerPhase's choice, from the same counts).
  const bool fp8 = pass.weights->fp8;  // FP8 experts have no padded runner
  const bool padded_may_pay = !fp8 && (options_.decode_runner == DecodeRunner::kPadded ||
                                       (options_.decode_runner == DecodeRunner::kAuto &&
                                        !kern.DecodeGemmBeatsPadded(local_slots, in.d, host.d_ff, routes) &&
                                        routes >= 2 * int64_t{local_slots}));
  // The answer read back: the routes checked, then counted per slot, key and expert.
  const auto read_back = [&]() -> absl::Status {
    // Until the read-back enqueued before the layer has arrived (the kernels' stream up to it).
    RETURN_IF_ERROR(device_ ? WaitEvent(checks_event_.event, "decode step: the kernels' checks")
                            : kern.Synchronize(nullptr));
    RETURN_IF_ERROR(SealedRoutesStatus(pass, status, m));
    buf_.slot_counts.assign(m.num_slots(), 0);
    pass.n_send = 0;
    for (int64_t i = 0; i < routes; ++i) {
      if (keys[i] < 0) continue;
      if (keys[i] >= t.num_keys)
        return absl::InternalError(absl::StrCat("decode step: route ", i, " has no valid key"));
      ++buf_.slot_counts[t.slot_of_key[keys[i]]];
      ++pass.n_send;
    }
    std::vector<int64_t>& load = StepLoad(pass);
    for (int64_t i = 0; i < routes; ++i) {
      if (keys[i] >= 0) ++load[t.expert_of_key[keys[i]]];
    }
    return absl::OkStatus();
  };
  kernels::LocalLayerParams layer;
  if (padded_may_pay) {
    RETURN_IF_ERROR(enqueue_checks(nullptr));
    pass.clock.Enter(StepPhase::kValidate);
    RETURN_IF_ERROR(read_back());
    std::vector<int64_t>& per_local = buf_.local_slot_routes;
    per_local.assign(local_slots, 0);
    for (int q = 0; q < m.num_slots(); ++q) {
      if (t.local_of_slot[q] >= 0) per_local[t.local_of_slot[q]] += buf_.slot_counts[q];
    }
    const int64_t most = per_local.empty() ? 0 : *std::max_element(per_local.begin(), per_local.end());
    layer.padded_capacity = options_.decode_runner == DecodeRunner::kPadded
                                ? most
                                : kernels::PaddedDecodeCapacity(per_local, in.d, host.d_ff);
  }
  pass.clock.Enter(StepPhase::kExperts);
  RETURN_IF_ERROR(pass.handle->BindPlan(InverseCoordinates{{}, {}, in.tokens}));  // the inverse is on the device
  RETURN_IF_ERROR(pass.handle->MarkDispatchInFlight());
  RETURN_IF_ERROR(HandleThroughOneCall(pass));
  RETURN_IF_ERROR(RowsForKernels(pass));
  const ResidentExperts& weights = *pass.weights;
  if (!fp8) {
    layer.weights = {weights.LayerGateUp(pass.layer_index), weights.LayerDown(pass.layer_index), local_slots, in.d,
                     host.d_ff};
  }
  layer.x = static_cast<const uint16_t*>(pass.hidden);
  ReserveOutput(pass);
  layer.topk = local_ids;
  layer.gate = seal.gates_out;
  layer.num_tokens = in.tokens;
  layer.k = in.k;
  ASSIGN_OR_RETURN(layer.out_bf16, OutputRows(pass));
  // FP8 experts: the layer in its stages (LocalLayer is BF16): the routes' rows by local slot, the
  // tokens packed in E4M3 once each into those rows, the experts on the offsets where they are
  // computed, the combine; the host plan's bits (every row is computed on its own), except that
  // SwigluFp8 is sized by every route here and by the admitted ones there, which may pick the
  // other kernel family for a step with dropped routes near the GEMV / tile boundary.
  FP8LoneLayer f8;
  if (fp8) RETURN_IF_ERROR(PrepareFp8LoneLayer(pass, layer, local_slots, &f8));
  const auto enqueue_layer = [&](kernels::Stream st) -> absl::Status {
    if (!fp8) return kern.LocalLayer(layer, st);
    RETURN_IF_ERROR(kern.RouteRows(f8.route, st));
    RETURN_IF_ERROR(kern.PackFp8Rows(f8.pack, st));
    RETURN_IF_ERROR(kern.SwigluFp8(f8.experts, st));
    return kern.Combine(f8.combine, st);
  };
  if (padded_may_pay) {
    RETURN_IF_ERROR(kern.LocalLayer(layer, nullptr));
  } else if (!device_ || !options_.lone_decode_graphs) {
    RETURN_IF_ERROR(enqueue_checks(nullptr));
    RETURN_IF_ERROR(enqueue_layer(nullptr));
  } else {
    // The checks, their read-back and the layer as one recorded launch, keyed by everything the
    // calls are given that can change (RecordedWork; the read-back's size follows from tokens
    // and k, and this branch has no padded capacity and no FP32 output).
    const auto word = [](const void* p) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)); };
    const RecordedWork::Key key{static_cast<uint64_t>(in.tokens),
                                static_cast<uint64_t>(in.k),
                                word(seal.ids),
                                word(seal.gates),
                                word(seal.admitted),
                                static_cast<uint64_t>(seal.num_experts),
                                word(seal.key_of_expert),
                                word(seal.status),
                                word(seal.gates_out),
                                word(seal.local_of_key),
                                static_cast<uint64_t>(seal.num_keys),
                                word(local_ids),
                                word(status),
                                word(checks_event_.event),
                                word(fp8 ? static_cast<const void*>(f8.experts.weights.w_gate_up)
                                         : static_cast<const void*>(layer.weights.w_gate_up)),
                                word(fp8 ? static_cast<const void*>(f8.experts.weights.w_down)
                                         : static_cast<const void*>(layer.weights.w_down)),
                                word(f8.experts.weights.gate_up_scales),
                                word(f8.experts.weights.down_scales),
                                word(fp8 ? buf_.lone_fp8.data() : nullptr),
                                static_cast<uint64_t>(local_slots),
                                static_cast<uint64_t>(in.d),
                                static_cast<uint64_t>(host.d_ff),
                                word(layer.x),
                                word(layer.out_bf16),
                                static_cast<uint64_t>(pass.check_in_recording)};
    RETURN_IF_ERROR(lone_recorded_.Run(
        key,
        [&](kernels::Stream st) -> absl::Status {
          RETURN_IF_ERROR(enqueue_checks(st));
          return enqueue_layer(st);
        },
        &pass.result.record.recorded));
  }
  RETURN_IF_ERROR(CopyOut(pass, layer.out_bf16));
  if (!padded_may_pay) {
    pass.clock.Enter(StepPhase::kValidate);
    RETURN_IF_ERROR(read_back());
  }
  pass.result.record.device_plan = true;
  return absl::OkStatus();
}

// The FP8 lone decode layer's calls over one allocation (reserved here, before any recording):
// [local_slots] counts, [local_slots + 1] offsets, each route's expert row and each row's token
// ([routes] each), the packed E4M3 rows and the experts' BF16 output rows ([routes] each: a
// bound, the dropped routes take none).
absl::Status LayerExecutor::PrepareFp8LoneLayer(Pass& pass, const kernels::LocalLayerParams& layer, int local_slots,
                                                FP8LoneLayer* f8) {
  const LayerStepInput& in = pass.in;
  kernels::ExpertKernels& kern = *options_.kernels;
  const int64_t routes = in.tokens * in.k;  // bounded by ValidateStepShape
  const int64_t packed = kernels::Fp8PackedRowBytes(in.d);
  const auto region = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };
  const int64_t counts_at = 0, offsets_at = region(int64_t{local_slots} * 8);
  const int64_t rows_at = offsets_at + region((int64_t{local_slots} + 1) * 8);
  const int64_t tokens_at = rows_at + region(routes * 4);
  const int64_t packed_at = tokens_at + region(routes * 4);
  const int64_t out_at = packed_at + region(routes * packed);
  RETURN_IF_ERROR(buf_.lone_fp8.Reserve(&kern, out_at + region(routes * int64_t{in.d} * 2)));
  char* base = buf_.lone_fp8.as<char>();
  auto* const row_of_route = reinterpret_cast<int32_t*>(base + rows_at);
  auto* const rows = reinterpret_cast<uint8_t*>(base + packed_at);
  auto* const out_rows = reinterpret_cast<uint16_t*>(base + out_at);
  f8->route = {layer.topk,
               in.tokens,
               in.k,
               local_slots,
               reinterpret_cast<int64_t*>(base + counts_at),
               reinterpret_cast<int64_t*>(base + offsets_at),
               row_of_route,
               reinterpret_cast<int32_t*>(base + tokens_at)};
  f8->pack = {layer.x, in.tokens, in.d, row_of_route, in.k, rows, routes};
  kernels::SwigluFp8Params& sw = f8->experts;
  sw.weights = pass.weights->Fp8Layer(pass.layer_index);
  sw.xq = rows;  // packed rows: a row's d bytes, then its d / 128 scales
  sw.xq_ld = packed;
  sw.x_scales = reinterpret_cast<const float*>(rows + in.d);
  sw.x_scales_ld = packed / 4;
  sw.rows = routes;
  sw.offsets = f8->route.offsets;
  sw.y = out_rows;
  f8->combine = {out_rows, routes, in.d, row_of_route, layer.gate, in.tokens, in.k, nullptr, layer.out_bf16};
  return absl::OkStatus();
}

// Dispatch: the step's tables to kernel memory, rows packed in send order and exchanged.
absl::Status LayerExecutor::DispatchRows(Pass& pass) {
  const LayerStepInput& in = pass.in;
  kernels::ExpertKernels& kern = *options_.kernels;
  const int64_t row_bytes = static_cast<int64_t>(in.d) * 2, routes_n = in.tokens * in.k;
  if (!pass.device_plan) {
    StepTables& tables = pass.tables;
    // A lone member needs no expert order (see DeviceDispatchPlan).
    const int t_order = LoneMember() ? -1 : tables.Add(buf_.dest.expert_order.data(), pass.n_recv * 4);
    const int t_position = tables.Add(buf_.dest.expert_position.data(), pass.n_recv * 4);
    const int t_rows_of = tables.Add(buf_.row_of_route.data(), routes_n * 4);
    const int t_gates = tables.Add(buf_.gates.data(), routes_n * 4);
    // The FP8 experts read their offsets where they run (SwigluFp8Params::offsets).
    const int t_offsets = pass.weights->fp8 ? tables.Add(buf_.dest.expert_offsets.data(),
                                                         static_cast<int64_t>(buf_.dest.expert_offsets.size()) * 8)
                                            : -1;
    RETURN_IF_ERROR(tables.Upload(device_, kern, buf_.tables, buf_.tables_host, nullptr));
    if (t_offsets >= 0) pass.expert_offsets = tables.Get<int64_t>(t_offsets);
    pass.expert_order = t_order >= 0 ? tables.Get<int32_t>(t_order) : nullptr;
    pass.expert_position = tables.Get<int32_t>(t_position);
    pass.row_of_route = tables.Get<int32_t>(t_rows_of);
    pass.gates = tables.Get<float>(t_gates);
  }
  // The device plan's receive ranking is checked once it has finished (the copy waits for it).
  const auto check_received = [&]() -> absl::Status {
    if (pass.recv_status == nullptr) return absl::OkStatus();
    int64_t bad = -1;
    RETURN_IF_ERROR(kern.CopyToHost(&bad, pass.recv_status, sizeof(bad), nullptr));
    if (bad >= 0) {
      return absl::InternalError(absl::StrCat("received row ", bad, ": its slot metadata names no slot of rank ",
                                              options_.rank.value(), " in placement-v", pass.version.value()));
    }
    return absl::OkStatus();
  };
  if (LoneMember()) {
    // Every row goes to itself: nothing is packed or exchanged. Route -> send position composed
    // with send (= receive) position -> expert position gives each route's expert row, on the
    // kernels' stream: the engine's rows are scattered there (each token's row read once,
    // ExpertsPhase) and combined from there (ReturnAndCombine).
    RETURN_IF_ERROR(buf_.d_lone_combine.Reserve(&kern, routes_n * 4));
    RETURN_IF_ERROR(kern.ComposeIndex(
        {pass.expert_position, pass.n_recv, pass.row_of_route, routes_n, buf_.d_lone_combine.as<int32_t>()}, nullptr));
    RETURN_IF_ERROR(check_received());
    return pass.handle->MarkExpertRowsReady();
  }
  // FP8 experts: the rows go as packed FP8 rows (quantized once a token), half the bytes.
  const int64_t payload = DispatchRowBytes(pass);
  if (payload != row_bytes) {
    RETURN_IF_ERROR(PackFp8Rows(pass, pass.row_of_route, pass.n_send, buf_.send_rows));
  } else {
    RETURN_IF_ERROR(buf_.send_rows.Reserve(&kern, pass.n_send * row_bytes));
    if (pass.n_send > 0) {
      // Each sent route has its own send position (row_of_route): each token's row is read once
      // and written to its routes' positions.
      RETURN_IF_ERROR(kern.Scatter({in.d, static_cast<const uint16_t*>(pass.hidden), in.tokens, pass.row_of_route, in.k,
                                    buf_.send_rows.as<uint16_t>(), pass.n_send},
                                   nullptr));
    }
  }
  RETURN_IF_ERROR(buf_.recv_rows.Reserve(&kern, pass.n_recv * payload));
  RETURN_IF_ERROR(kern.Synchronize(nullptr));  // the transport reads the packed rows on its own stream
  RETURN_IF_ERROR(check_received());
  RETURN_IF_ERROR(options_.transport->AllToAllV(in.step_id * 4 + 2, buf_.send_rows.data(), pass.bytes.dispatch_send,
                                                buf_.recv_rows.data(), pass.bytes.dispatch_recv, options_.timeout));
  return pass.handle->MarkExpertRowsReady();
}

// Experts: receive repack by (local slot, source, send position), SwiGLU, inverse repack.
absl::Status LayerExecutor::ExpertsPhase(Pass& pass) {
  pass.clock.Enter(StepPhase::kExperts);
  kernels::ExpertKernels& kern = *options_.kernels;
  const int d = pass.in.d;
  const int64_t row_bytes = static_cast<int64_t>(d) * 2, n_recv = pass.n_recv;
  // A lone member scatters the engine's rows into expert order (every expert row is some route's)
  // and leaves the expert rows where they are for its combine (DispatchRows, ReturnAndCombine).
  const bool lone = LoneMember();
  const ResidentExperts& weights = *pass.weights;
  // FP8 experts read packed FP8 rows (PackFp8Rows: quantized once a token, per 128 values, as
  // SwigluFp8 would quantize each route: the same bits): received so from the peers, or, on a
  // lone member, packed here straight into expert order.
  const bool lone_fp8 = lone && weights.fp8;
  const int64_t packed = kernels::Fp8PackedRowBytes(d);  // FP8: the rows as they arrive (or are packed)
  if (!lone_fp8) RETURN_IF_ERROR(buf_.expert_in.Reserve(&kern, n_recv * (weights.fp8 ? packed : row_bytes)));
  RETURN_IF_ERROR(buf_.expert_out.Reserve(&kern, n_recv * row_bytes));
  if (!lone) {
    RETURN_IF_ERROR(buf_.back_rows.Reserve(&kern, n_recv * row_bytes));
    RETURN_IF_ERROR(buf_.returned.Reserve(&kern, pass.n_send * row_bytes));
  }
  // The received rows <-> expert order, one way before the experts and back after them.
  auto reorder = [&](const void* in, const int32_t* index, void* out, int64_t bytes) {
    kernels::GatherParams g;
    g.d = static_cast<int>(bytes / 2);  // as 2-byte words
    g.in = in;
    g.in_rows = n_recv;
    g.index = index;
    g.n = n_recv;
    g.out = out;
    return kern.Gather(g, nullptr);
  };
  if (n_recv > 0) {
    if (lone_fp8) {
      RETURN_IF_ERROR(PackFp8Rows(pass, buf_.d_lone_combine.as<int32_t>(), n_recv, buf_.fp8_rows));
    } else if (lone) {
      RETURN_IF_ERROR(
          kern.Scatter({d, static_cast<const uint16_t*>(pass.hidden), pass.in.tokens, buf_.d_lone_combine.as<int32_t>(),
                        pass.in.k, buf_.expert_in.as<uint16_t>(), n_recv},
                       nullptr));
    } else {
      RETURN_IF_ERROR(
          reorder(buf_.recv_rows.data(), pass.expert_order, buf_.expert_in.data(), weights.fp8 ? packed : row_bytes));
    }
    if (weights.fp8) {
      kernels::SwigluFp8Params sw;
      sw.weights = weights.Fp8Layer(pass.layer_index);
      // Packed FP8 rows: a row's d bytes, then its d / 128 scales.
      const uint8_t* rows = (lone_fp8 ? buf_.fp8_rows : buf_.expert_in).as<uint8_t>();
      sw.xq = rows;
      sw.xq_ld = packed;
      sw.x_scales = reinterpret_cast<const float*>(rows + d);
      sw.x_scales_ld = packed / 4;
      sw.rows = n_recv;
      sw.offsets = device_ ? pass.expert_offsets : buf_.dest.expert_offsets.data();
      sw.y = buf_.expert_out.as<uint16_t>();
      if (sw.offsets == nullptr) return absl::InternalError("fp8 experts: no offsets in kernel memory");
      RETURN_IF_ERROR(kern.SwigluFp8(sw, nullptr));
    } else {
      kernels::SwigluParams sw;
      sw.weights = {weights.LayerGateUp(pass.layer_index), weights.LayerDown(pass.layer_index),
                    static_cast<int>(buf_.dest.expert_counts.size()), d, weights.host->d_ff};
      sw.x = buf_.expert_in.as<uint16_t>();
      sw.rows = n_recv;
      sw.host_offsets = buf_.dest.expert_offsets.data();
      sw.y = buf_.expert_out.as<uint16_t>();
      RETURN_IF_ERROR(kern.Swiglu(sw, nullptr));
    }
    if (!lone) {
      RETURN_IF_ERROR(reorder(buf_.expert_out.data(), pass.expert_position, buf_.back_rows.data(), row_bytes));
      RETURN_IF_ERROR(kern.Synchronize(nullptr));  // the transport reads them on its own stream
    }
  }
  return pass.handle->MarkExpertOutputReady();
}

// The step's tokens in E4M3 (per 128 values, once a token) as packed rows (kernels::
// Fp8PackedRowBytes: a row's d bytes, then its d / 128 scales, zero padding) at the positions
// `dest` gives each route ([tokens, k], -1: none) in `out` ([n, packed]): one PackFp8Rows pass.
absl::Status LayerExecutor::PackFp8Rows(Pass& pass, const int32_t* dest, int64_t n, kernels::KernelBuffer& out) {
  kernels::ExpertKernels& kern = *options_.kernels;
  const int d = pass.in.d;
  RETURN_IF_ERROR(out.Reserve(&kern, n * kernels::Fp8PackedRowBytes(d)));
  if (n == 0 || pass.in.tokens == 0) return absl::OkStatus();
  kernels::PackFp8Params pk;
  pk.x = static_cast<const uint16_t*>(pass.hidden);
  pk.tokens = pass.in.tokens;
  pk.d = d;
  pk.dest = dest;
  pk.k = pass.in.k;
  pk.out = out.as<uint8_t>();
  pk.out_rows = n;
  return kern.PackFp8Rows(pk, nullptr);
}

// The bytes of a dispatched row: BF16, or a packed FP8 row for FP8 experts (not in a replayed
// decode graph, which moves BF16 rows).
int64_t LayerExecutor::DispatchRowBytes(const Pass& pass) const {
  if (pass.weights->fp8 && !pass.result.record.graph_replay) return kernels::Fp8PackedRowBytes(pass.in.d);
  return static_cast<int64_t>(pass.in.d) * 2;
}

// Return exchange (splits reversed), then the combine over the semantic key. A lone member
// combines straight from the expert rows: route -> send position composed with receive (= send)
// position -> expert position.
absl::Status LayerExecutor::ReturnAndCombine(Pass& pass) {
  pass.clock.Enter(StepPhase::kReturn);
  const LayerStepInput& in = pass.in;
  kernels::ExpertKernels& kern = *options_.kernels;
  RETURN_IF_ERROR(pass.handle->BeginCombine(*options_.registry, pass.version));
  const bool lone = LoneMember();
  if (!lone) {
    RETURN_IF_ERROR(options_.transport->AllToAllV(in.step_id * 4 + 3, buf_.back_rows.data(), pass.bytes.recv,
                                                  buf_.returned.data(), pass.bytes.send, options_.timeout));
  }
  pass.clock.Enter(StepPhase::kCombine);
  // Tables that do not invert the send order (CheckCombineTables): the rows came back, the peers
  // are served, and nothing is combined into the output.
  RETURN_IF_ERROR(pass.combine_tables);
  if (in.tokens == 0) return absl::OkStatus();
  const int32_t* row_of_route = pass.row_of_route;
  if (lone) row_of_route = buf_.d_lone_combine.as<int32_t>();  // composed in DispatchRows
  ASSIGN_OR_RETURN(uint16_t * out, OutputRows(pass));
  kernels::CombineParams c{lone ? buf_.expert_out.as<uint16_t>() : buf_.returned.as<uint16_t>(),
                           lone ? pass.n_recv : pass.n_send,
                           in.d,
                           row_of_route,
                           pass.gates,
                           in.tokens,
                           in.k,
                           nullptr,
                           out};
  RETURN_IF_ERROR(kern.Combine(c, nullptr));
  return CopyOut(pass, out);
}

absl::Status LayerExecutor::ReleasePhase(Pass& pass) {
  pass.clock.Enter(StepPhase::kRelease);
  LayerStepResult& result = pass.result;
  if (pass.trial && options_.fault_trial_output_scale != 1.0f) {
    const int64_t n = pass.in.tokens * pass.in.d;
    RowBuffer device_rows;
    uint16_t* rows = pass.host_out();
    if (pass.in.rows_on_device) {  // scaled on the host and written back (a fault drill, not a fast path)
      if (pass.in.done_event != nullptr) RETURN_IF_ERROR(WaitEvent(pass.in.done_event, "the step's GPU work"));
      device_rows.resize(n);
      RETURN_IF_ERROR(options_.kernels->CopyToHost(device_rows.data(), pass.in.output, n * 2, nullptr));
      rows = device_rows.data();
    }
    for (int64_t i = 0; i < n; ++i)
      rows[i] = kernels::FloatToBf16(kernels::Bf16ToFloat(rows[i]) * options_.fault_trial_output_scale);
    if (pass.in.rows_on_device) {
      RETURN_IF_ERROR(options_.kernels->CopyToKernel(pass.in.output, rows, n * 2, nullptr));
      RETURN_IF_ERROR(options_.kernels->Synchronize(nullptr));
    }
  }
  RETURN_IF_ERROR(pass.handle->MarkOriginRowsReady());
  RETURN_IF_ERROR(AnswersBeforeWork(pass.in) ? pass.handle->ReleaseAfterWork() : pass.handle->Release());
  StepRecord& rec = result.record;
  rec.placement_version = pass.version.value();
  rec.layer = pass.in.layer;
  rec.load_layer = pass.load_layer;
  CountRoutes(*pass.manifest, *options_.topology, options_.rank, buf_.slot_counts, pass.in.tokens * pass.in.k, &rec);
  const int me = options_.group->SlotOf(options_.rank).value();
  for (int i = 0; i < options_.group->size(); ++i) {
    if (i != me) rec.bytes_sent += pass.bytes.dispatch_send[i] + pass.bytes.recv[i];
  }
  // A lone member's decode step runs in one kernels call, without a dispatch plan.
  rec.routes_served = LoneMember() ? rec.routes_accepted : pass.n_recv;
  pass.clock.Stop();
  rec.execute_us = absl::ToDoubleMicroseconds(absl::Now() - pass.started);
  return absl::OkStatus();
}

}  // namespace moe
