#include "server/expert_layer_service.h"

#include <cctype>
#include <cstdio>
#include <memory>
#include <optional>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "spdlog/spdlog.h"

#include "rpc/bearer_auth.h"
#include "rpc/grpc_status.h"
#include "runtime/status.h"
#include "server/tensor_codec.h"

namespace moe {
namespace {

std::string StatusLabel(absl::StatusCode code) {
  std::string s = absl::StatusCodeToString(code);
  for (char& c : s) c = c == ' ' ? '_' : static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Bytes a request thread keeps between steps for rows copied in from or out to shared regions
// (gRPC's threads are pooled): a fresh buffer a step costs a page fault a 4 KiB page, about as
// much as the copy itself. Larger buffers are freed after their step.
constexpr size_t kKeptScratchBytes = size_t{64} << 20;

// A buffer of `bytes` for this thread's step, reused while it stays under kKeptScratchBytes.
char* Scratch(std::vector<char>& keep, std::vector<char>& once, int64_t bytes) {
  std::vector<char>& v = static_cast<size_t>(bytes) <= kKeptScratchBytes ? keep : once;
  if (v.size() < static_cast<size_t>(bytes)) v.resize(bytes);
  return v.data();
}

// The columns of a row are an int downstream (kernels); far above any model's hidden size.
constexpr int64_t kMaxCols = int64_t{1} << 20;

// What a validated request holds, every size derived from it with checked arithmetic.
struct CheckedStep {
  bool decode = false;
  int64_t tokens = 0;
  int d = 0;
  int64_t routes = 0;      // tokens x k
  int64_t wire_bytes = 0;  // tokens x d x width, in and out
};

// Phase: validate. Shape, enums and sizes against the limits, before any byte is read.
absl::StatusOr<CheckedStep> CheckRequest(const v1::StepRequest& req, const EngineApiOptions& o) {
  CheckedStep c;
  if (req.phase() != v1::PHASE_PREFILL && req.phase() != v1::PHASE_DECODE) {
    return absl::InvalidArgumentError(
        absl::StrCat("phase: ", static_cast<int>(req.phase()), " is not PHASE_PREFILL (1) or PHASE_DECODE (2)"));
  }
  c.decode = req.phase() == v1::PHASE_DECODE;
  if (req.k() <= 0 || req.k() > o.max_top_k) {
    return absl::InvalidArgumentError(absl::StrCat("k: ", req.k(), " outside [1, ", o.max_top_k, "]"));
  }
  const v1::Tensor& h = req.hidden();
  if (h.rows() < 0 || h.rows() > o.max_step_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden.rows: ", h.rows(), " outside [0, ", o.max_step_tokens, "] (--max_step_tokens)"));
  }
  if (h.cols() <= 0 || h.cols() > kMaxCols) {
    return absl::InvalidArgumentError(absl::StrCat("hidden.cols: ", h.cols(), " outside [1, ", kMaxCols, "]"));
  }
  auto bytes = WireBytes(h, "hidden");
  if (!bytes.ok()) return bytes.status();
  if (*bytes > o.max_request_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden: ", *bytes, " bytes of rows exceed ", o.max_request_bytes, " (--max_request_bytes)"));
  }
  c.tokens = h.rows();
  c.d = static_cast<int>(h.cols());
  c.wire_bytes = *bytes;
  if (__builtin_mul_overflow(c.tokens, static_cast<int64_t>(req.k()), &c.routes)) {
    return absl::InvalidArgumentError("k: hidden.rows x k overflows");
  }
  if (req.topk_ids_size() != c.routes) {
    return absl::InvalidArgumentError(
        absl::StrCat("topk_ids: ", req.topk_ids_size(), " entries, hidden has ", c.tokens, " rows and k = ", req.k()));
  }
  if (req.topk_weights_size() != c.routes) {
    return absl::InvalidArgumentError(
        absl::StrCat("topk_weights: ", req.topk_weights_size(), " entries, expected ", c.routes));
  }
  if (!req.admitted().empty() && static_cast<int64_t>(req.admitted().size()) != c.routes) {
    return absl::InvalidArgumentError(
        absl::StrCat("admitted: ", req.admitted().size(), " entries, expected ", c.routes));
  }
  if (req.has_hidden_region()) {
    if (!req.hidden().data().empty()) {
      return absl::InvalidArgumentError("hidden.data: must be empty when hidden_region is set");
    }
    if (req.hidden_region().bytes() != static_cast<uint64_t>(c.wire_bytes)) {
      return absl::InvalidArgumentError(
          absl::StrCat("hidden_region.bytes: ", req.hidden_region().bytes(), ", dtype x shape needs ", c.wire_bytes));
    }
  }
  if (req.has_output_region() && req.output_region().bytes() != static_cast<uint64_t>(c.wire_bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("output_region.bytes: ", req.output_region().bytes(), ", the output needs ", c.wire_bytes));
  }
  return c;
}

// A request decoded into the layer executor's input. `input` points into the request, into
// `hidden` and into the rows read from a shared region, so the request and this must outlive the
// step.
struct DecodedStep {
  CheckedStep checked;
  std::vector<char> once_rows;  // rows read from a region too large for the thread's kept buffer
  Bf16Rows hidden;
  LayerStepInput input;
};

// Phases: validate the request, then read the rows, inline or copied out of a registered region
// (read once: the engine changing or shrinking the region later cannot reach this step), and
// check the output region's range. Every error here is the request's.
absl::Status DecodeStepRequest(const v1::StepRequest& req, const EngineApiOptions& options, SharedRegions& regions,
                               std::optional<uid_t> caller_uid, DecodedStep* step) {
  ASSIGN_OR_RETURN(step->checked, CheckRequest(req, options));
  const CheckedStep& c = step->checked;
  thread_local std::vector<char> kept_in;
  absl::StatusOr<Bf16Rows> hidden;
  if (req.has_hidden_region()) {
    const v1::SharedRegionRef& ref = req.hidden_region();
    char* rows = Scratch(kept_in, step->once_rows, c.wire_bytes);
    RETURN_IF_ERROR(regions.Read(ref.region(), caller_uid, ref.offset(), ref.bytes(), rows, "hidden_region"));
    hidden = ReadBf16(req.hidden(), rows, c.wire_bytes, "hidden_region");
  } else {
    hidden = ReadBf16(req.hidden(), req.hidden().data().data(), req.hidden().data().size(), "hidden");
  }
  if (!hidden.ok()) return hidden.status();
  step->hidden = *std::move(hidden);
  if (req.has_output_region()) {
    const v1::SharedRegionRef& ref = req.output_region();
    RETURN_IF_ERROR(regions.CheckRange(ref.region(), caller_uid, ref.offset(), ref.bytes(), "output_region"));
  }
  LayerStepInput& in = step->input;
  in.step_id = req.step_id();
  in.layer = req.layer();
  in.phase = c.decode ? Phase::kDecode : Phase::kPrefill;
  in.hidden = step->hidden.data();
  in.tokens = c.tokens;
  in.d = c.d;
  in.topk_ids = req.topk_ids().data();
  in.topk_weights = req.topk_weights().data();
  in.k = req.k();
  in.admitted = req.admitted().empty() ? nullptr : reinterpret_cast<const uint8_t*>(req.admitted().data());
  in.expected_generation = req.expected_generation() > 0 ? req.expected_generation() : -1;
  return absl::OkStatus();
}

// Phase: encode the output rows, inline or written to the request's output region.
absl::Status EncodeOutput(const v1::StepRequest& req, const CheckedStep& c, absl::Span<const uint16_t> output,
                          SharedRegions& regions, std::optional<uid_t> caller_uid, v1::StepResponse* resp) {
  resp->set_step_id(req.step_id());
  if (!req.has_output_region()) {
    EncodeFromBf16(output, c.tokens, c.d, req.hidden().dtype(), resp->mutable_output());
    return absl::OkStatus();
  }
  thread_local std::vector<char> kept_out;
  std::vector<char> once_out;
  const v1::SharedRegionRef& ref = req.output_region();
  char* out = Scratch(kept_out, once_out, c.wire_bytes);
  EncodeBytes(output, req.hidden().dtype(), out);
  RETURN_IF_ERROR(regions.Write(ref.region(), caller_uid, ref.offset(), ref.bytes(), out, "output_region"));
  resp->mutable_output()->set_dtype(req.hidden().dtype());
  resp->mutable_output()->set_rows(c.tokens);
  resp->mutable_output()->set_cols(c.d);
  return absl::OkStatus();
}

// Phase: count the step record in the metrics.
void CountRecord(const StepRecord& r, bool decode, RankMetrics* metrics) {
  metrics->LayerRoutes(r.load_layer, r.routes_accepted, r.routes_served);
  if (!r.fallback_reason.empty()) metrics->Fallback(r.fallback_reason);  // decode steps the graph did not admit
  metrics->Routes(decode ? "decode" : "prefill", r.routes_attempted, r.routes_accepted, r.routes_dropped,
                  r.routes_remote, r.routes_inter_node);
  metrics->BytesSent(r.bytes_sent);
  metrics->Generation(r.placement_version);
  metrics->StepPhases(decode ? "decode" : "prefill", r.phase_us);
}

// Phase: encode the step record.
void EncodeRecord(const StepRecord& r, bool decode, v1::StepRecord* rec) {
  rec->set_placement_generation(r.placement_version);
  rec->set_layer(r.layer);
  rec->set_path(r.graph_replay ? v1::PATH_GRAPH_REPLAY : v1::PATH_EAGER);
  if (decode && !r.graph_replay) rec->set_fallback_reason(r.fallback_reason);
  rec->set_compute_latency_us(r.execute_us);
  rec->set_canary(r.canary);
  rec->set_routes_attempted(r.routes_attempted);
  rec->set_routes_accepted(r.routes_accepted);
  rec->set_routes_dropped(r.routes_dropped);
  rec->set_routes_remote(r.routes_remote);
  rec->set_routes_inter_node(r.routes_inter_node);
  v1::StepStages* stages = rec->mutable_stages();
  stages->set_validate_us(r.phase_us[static_cast<int>(StepPhase::kValidate)]);
  stages->set_acquire_us(r.phase_us[static_cast<int>(StepPhase::kAcquire)]);
  stages->set_plan_us(r.phase_us[static_cast<int>(StepPhase::kPlan)]);
  stages->set_agree_us(r.phase_us[static_cast<int>(StepPhase::kAgree)]);
  stages->set_dispatch_us(r.phase_us[static_cast<int>(StepPhase::kDispatch)]);
  stages->set_experts_us(r.phase_us[static_cast<int>(StepPhase::kExperts)]);
  stages->set_return_us(r.phase_us[static_cast<int>(StepPhase::kReturn)]);
  stages->set_combine_us(r.phase_us[static_cast<int>(StepPhase::kCombine)]);
  stages->set_release_us(r.phase_us[static_cast<int>(StepPhase::kRelease)]);
}

// A ring step's record, in the slot's result (stages in StepStages' field order = StepPhase's).
void RingRecord(const StepRecord& r, bool decode, ring::Result* out) {
  out->placement_generation = r.placement_version;
  out->layer = r.layer;
  out->path = r.graph_replay ? v1::PATH_GRAPH_REPLAY : v1::PATH_EAGER;
  out->canary = r.canary ? 1 : 0;
  if (decode && !r.graph_replay) {
    std::snprintf(out->fallback_reason, sizeof(out->fallback_reason), "%s", r.fallback_reason.c_str());
  }
  out->routes_attempted = r.routes_attempted;
  out->routes_accepted = r.routes_accepted;
  out->routes_dropped = r.routes_dropped;
  out->routes_remote = r.routes_remote;
  out->routes_inter_node = r.routes_inter_node;
  out->compute_latency_us = r.execute_us;
  for (int i = 0; i < kNumStepPhases; ++i) out->stages_us[i] = r.phase_us[i];
}

}  // namespace

absl::StatusOr<ExpertLayerServiceImpl::Caller> ExpertLayerServiceImpl::Authenticate(
    const grpc::ServerContext* context) const {
  Caller caller;
  if (options_.peer_uid) caller.uid = options_.peer_uid(context->peer());
  if (caller.uid.has_value()) return caller;  // admitted on the Unix socket by its credentials
  if (options_.token.empty()) {
    return absl::UnauthenticatedError(
        "the engine API takes callers on its Unix socket (--engine_socket); TCP callers need the rank's "
        "--engine_token_file");
  }
  if (absl::Status s = FromGrpcStatus(CheckBearer(context, options_.token)); !s.ok()) return s;
  return caller;
}

absl::Status ExpertLayerServiceImpl::Run(const Caller& caller, const v1::StepRequest& req, v1::StepResponse* resp) {
  const absl::Time start = absl::Now();
  const std::string phase = req.phase() == v1::PHASE_DECODE ? "decode" : "prefill";
  const char* path = "eager";  // the path label of the step latency histogram
  const absl::Status status = RunStep(caller, req, resp, &path);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (status.ok()) resp->mutable_record()->set_server_latency_us(seconds * 1e6);
  metrics_->Step(phase, path, StatusLabel(status.code()), seconds);
  return status;
}

absl::Status ExpertLayerServiceImpl::RunStep(const Caller& caller, const v1::StepRequest& req, v1::StepResponse* resp,
                                             const char** path) {
  DecodedStep step;
  if (absl::Status s = DecodeStepRequest(req, options_, regions_, caller.uid, &step); !s.ok()) {
    // A request rejected here still takes part in its step's agreement (with the abort flag), so
    // the peers abort at once instead of waiting for this rank.
    absl::MutexLock lock(&step_mu_);
    return executor_->Reject(req.step_id(), req.layer(), std::move(s));
  }
  // Phase: run the step across the ranks.
  absl::StatusOr<LayerStepResult> result;
  {
    absl::MutexLock lock(&step_mu_);
    result = executor_->Execute(step.input);
  }
  if (!result.ok()) return result.status();
  RETURN_IF_ERROR(EncodeOutput(req, step.checked, result->output, regions_, caller.uid, resp));
  executor_->RecycleOutput(std::move(result->output));  // the next step's rows go there
  *path = result->record.graph_replay ? "graph_replay" : result->record.recorded ? "recorded" : "eager";
  CountRecord(result->record, step.checked.decode, metrics_);
  EncodeRecord(result->record, step.checked.decode, resp->mutable_record());
  return absl::OkStatus();
}

absl::Status ExpertLayerServiceImpl::BeginStep() {
  absl::MutexLock lock(&mu_);
  if (draining_) return absl::UnavailableError("moe-rankd is draining");
  ++in_flight_;
  metrics_->InFlight(in_flight_);
  return absl::OkStatus();
}

void ExpertLayerServiceImpl::EndStep() {
  absl::MutexLock lock(&mu_);
  --in_flight_;
  metrics_->InFlight(in_flight_);
}

grpc::Status ExpertLayerServiceImpl::ExecuteAuthenticated(const Caller& caller, const v1::StepRequest* request,
                                                          v1::StepResponse* response) {
  if (absl::Status s = BeginStep(); !s.ok()) return ToGrpcStatus(s);
  const absl::Status s = Run(caller, *request, response);
  EndStep();
  return ToGrpcStatus(s);
}

// A ring step's metrics, kept by ServeRingStep for FinishRingStep on the same ring thread, which
// runs once the answer is published.
namespace {
struct PendingRingMetrics {
  bool pending = false;
  bool counted = false;  // the step ran: its record is counted
  bool decode = false;
  const char* path = "eager";
  absl::StatusCode code = absl::StatusCode::kOk;
  double seconds = 0;
  StepRecord record;
};
thread_local PendingRingMetrics pending_ring_metrics;
}  // namespace

// A step from a ring, as Run + RunStep do for a gRPC request: checked (a step refused here still
// joins its agreement), run with the rows read and written in the ring's slot, counted (after the
// answer is published: FinishRingStep).
void ExpertLayerServiceImpl::ServeRingStep(const RingStep& step, ring::Result* result) {
  const absl::Time start = absl::Now();
  const ring::Descriptor& desc = step.desc;
  const bool decode = desc.phase == v1::PHASE_DECODE;
  const char* path = "eager";
  absl::Status status = BeginStep();
  if (status.ok()) {
    absl::Status checked = step.status;
    if (checked.ok() && desc.phase != v1::PHASE_PREFILL && !decode) {
      checked = absl::InvalidArgumentError(
          absl::StrCat("descriptor.phase: ", desc.phase, " is not PHASE_PREFILL (1) or PHASE_DECODE (2)"));
    }
    // The rows' NaN/Inf check runs on the pool while the executor validates and plans; the
    // executor awaits it before the agreement.
    std::shared_ptr<FiniteCheckPool::Check> rows_check;
    if (checked.ok() && !step.rows_on_device)
      rows_check = check_pool_->Start(step.hidden, desc.tokens * step.d, "hidden");
    LayerStepInput in;
    in.step_id = desc.step_id;
    in.layer = desc.layer;
    in.phase = decode ? Phase::kDecode : Phase::kPrefill;
    in.hidden = step.hidden;
    in.tokens = desc.tokens;
    in.d = static_cast<int>(step.d);
    in.topk_ids = step.topk_ids;
    in.topk_weights = step.topk_weights;
    in.k = desc.k;
    in.admitted = step.admitted;
    in.expected_generation = desc.expected_generation > 0 ? desc.expected_generation : -1;
    in.output = step.output;
    in.rows_on_device = step.rows_on_device;
    in.done_event = step.done_event;  // with done events: answered once enqueued
    if (rows_check != nullptr) in.await_input_check = [&rows_check] { return rows_check->Await(); };
    // Rows on the GPU are checked there: one pass over them on the step's stream, started by the
    // executor as its pass begins (or inside a lone decode step's recorded work) and awaited
    // before its agreement (once; the answer is kept).
    std::optional<absl::Status> device_checked;
    bool device_check = false;
    absl::StatusOr<LayerStepResult> r;
    // The engine's rows (and routing) are complete once its ready event fires: nothing of the
    // step touches the engine's memory before (a bounded host wait, so an engine whose GPU work
    // hangs gets DEADLINE_EXCEEDED instead of holding the rank). Waited for before the step lock,
    // which every engine's steps take: one engine's hung work delays no other engine's steps.
    if (checked.ok() && step.ready_event != nullptr) checked = executor_->WaitReadyEvent(step.ready_event);
    {
      absl::MutexLock lock(&step_mu_);
      device_check = checked.ok() && step.rows_on_device && desc.tokens > 0;
      if (device_check) {
        in.await_input_check = [this, &device_checked]() -> absl::Status {
          if (!device_checked.has_value()) {
            absl::StatusOr<int64_t> first = executor_->FinishDeviceRowCheck();
            if (!first.ok()) {
              device_checked = first.status();
            } else if (*first >= 0) {
              device_checked = absl::InvalidArgumentError(absl::StrCat("hidden.data[", *first, "]: not finite"));
            } else {
              device_checked = absl::OkStatus();
            }
          }
          return *device_checked;
        };
        // Started by the executor: inside a lone decode step's recorded work where it records one.
        in.start_input_check = [this, x = step.hidden, n = desc.tokens * step.d](void* stream) {
          return executor_->StartDeviceRowCheck(x, n, stream);
        };
      }
      // Routing in the engine's GPU memory: a step planned on the kernels reads it in place, any
      // other step copies it to the host first (LayerStepInput::routing_on_device).
      if (step.device_topk_ids != nullptr) {
        in.topk_ids = step.device_topk_ids;
        in.topk_weights = step.device_topk_weights;
        in.routing_on_device = true;
      }
      r = checked.ok() ? executor_->Execute(in) : executor_->Reject(in.step_id, in.layer, std::move(checked));
      if (device_check) in.await_input_check().IgnoreError();  // every started scan is finished
      NoteRecordedWork();
    }
    if (rows_check != nullptr) rows_check->Await().IgnoreError();  // done already; the rows may be reused after this
    PendingRingMetrics& m = pending_ring_metrics;
    m.counted = r.ok();
    if (r.ok()) {
      path = r->record.graph_replay ? "graph_replay" : r->record.recorded ? "recorded" : "eager";
      RingRecord(r->record, decode, result);
      m.record = std::move(r->record);  // counted once the answer is out
    }
    status = r.status();
    EndStep();
  }
  result->code = static_cast<int32_t>(status.code());
  std::snprintf(result->message, sizeof(result->message), "%s", std::string(status.message()).c_str());
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (status.ok()) result->server_latency_us = seconds * 1e6;
  PendingRingMetrics& m = pending_ring_metrics;
  m.pending = true;
  m.decode = decode;
  m.path = path;
  m.code = status.code();
  m.seconds = seconds;
}

void ExpertLayerServiceImpl::NoteAnsweredWork() {
  const LayerExecutor::AnsweredStats a = executor_->AnsweredWorkStats();
  if (a.held == answered_noted_.held && a.cap_waits == answered_noted_.cap_waits) return;  // nearly every step
  answered_noted_ = a;
  if (metrics_ != nullptr) metrics_->AnsweredWork(a.held, a.cap_waits, a.cap_timeouts);
  if (a.cap_timeouts > cap_timeouts_logged_) {
    cap_timeouts_logged_ = a.cap_timeouts;
    spdlog::warn(
        "{} steps found {} answered steps' GPU work unfinished and waited the collective timeout for it "
        "(their leases stay held; an engine's GPU work does not finish, or it never waits on its done events)",
        a.cap_timeouts, LayerExecutor::kMaxAnswered);
  }
}

void ExpertLayerServiceImpl::NoteRecordedWork() {
  NoteAnsweredWork();
  const RecordedWork::Stats& w = executor_->LoneDecodeRecordings();
  const int64_t total = w.recorded + w.stale + w.failed + w.evicted + w.full;
  if (total == recorded_counted_) return;
  recorded_counted_ = total;
  if (metrics_ != nullptr) metrics_->RecordedWork(w.recorded, w.stale, w.failed, w.evicted, w.full);
  if (w.failed > failures_logged_) {
    failures_logged_ = w.failed;
    spdlog::warn("a lone decode step could not be recorded as a CUDA graph and ran call by call ({} so far): {}",
                 w.failed, w.last_failure);
  }
}

void ExpertLayerServiceImpl::FinishRingStep() {
  PendingRingMetrics& m = pending_ring_metrics;
  if (!m.pending) return;
  m.pending = false;
  if (m.counted) CountRecord(m.record, m.decode, metrics_);
  m.counted = false;
  metrics_->Step(m.decode ? "decode" : "prefill", m.path, StatusLabel(m.code), m.seconds);
}

absl::Status ExpertLayerServiceImpl::EnableStepRings(StepRingsOptions options) {
  options.register_memory = [this](void* p, int64_t bytes) { return executor_->RegisterHostMemory(p, bytes); };
  options.unregister_memory = [this](void* p) { executor_->UnregisterHostMemory(p); };
  check_pool_ = std::make_unique<FiniteCheckPool>(std::max(0, options.check_threads));
  ASSIGN_OR_RETURN(rings_, StepRings::Create(
                               std::move(options),
                               [this](const RingStep& step, ring::Result* result) { ServeRingStep(step, result); },
                               [this] { FinishRingStep(); }));
  return absl::OkStatus();
}

grpc::Status ExpertLayerServiceImpl::OpenStepRing(grpc::ServerContext* context, const v1::OpenStepRingRequest* request,
                                                  v1::OpenStepRingResponse* response) {
  auto caller = Authenticate(context);
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  if (!caller->uid.has_value()) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "step rings are for engines on the rank's host: call OpenStepRing on its --engine_socket");
  }
  if (rings_ == nullptr) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "step rings are off on this rank");
  }
  const int64_t max_tokens = request->max_tokens();
  if (max_tokens < 1 || max_tokens > options_.max_step_tokens) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("max_tokens: ", max_tokens, " outside [1, ", options_.max_step_tokens, "] (--max_step_tokens)")));
  }
  if (request->d() < 1 || request->d() > kMaxCols) {
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat("d: ", request->d(), " outside [1, ", kMaxCols, "]")));
  }
  if (request->k() < 1 || request->k() > options_.max_top_k) {
    return ToGrpcStatus(
        absl::InvalidArgumentError(absl::StrCat("k: ", request->k(), " outside [1, ", options_.max_top_k, "]")));
  }
  // max_tokens x d x 2 <= 2^20 x 2^21: no overflow; a slot's rows obey the request limit.
  if (max_tokens * request->d() * 2 > options_.max_request_bytes) {
    return ToGrpcStatus(
        absl::InvalidArgumentError(absl::StrCat("max_tokens: ", max_tokens, " rows of d = ", request->d(), " exceed ",
                                                options_.max_request_bytes, " bytes (--max_request_bytes)")));
  }
  RingDeviceRows device_rows;
  std::vector<std::string> done_handles;
  if (request->has_device_rows()) {
    auto mapped = MapDeviceRows(*request, &done_handles);
    if (!mapped.ok()) return ToGrpcStatus(mapped.status());
    device_rows = std::move(*mapped);
  }
  auto opened =
      rings_->Open(*caller->uid, request->slots(), max_tokens, request->d(), request->k(), std::move(device_rows));
  if (!opened.ok()) return ToGrpcStatus(opened.status());
  response->set_device_rows(request->has_device_rows());
  response->set_ring_id(opened->id);
  response->set_ticket(opened->ticket);
  response->set_socket_path(rings_->socket_path());
  response->set_bytes(opened->bytes);
  response->set_layout_version(ring::kLayoutVersion);
  for (std::string& h : done_handles) response->add_done_events(std::move(h));
  return grpc::Status::OK;
}

// The engine's GPU allocation for a ring's rows (OpenStepRingRequest.device_rows), mapped and
// checked to hold every slot's hidden and output rows, and the rank's done events when asked for
// (their IPC handles in `done_handles`). The request's sizes are checked already.
absl::StatusOr<RingDeviceRows> ExpertLayerServiceImpl::MapDeviceRows(const v1::OpenStepRingRequest& request,
                                                                     std::vector<std::string>* done_handles) {
  const v1::DeviceRows& dr = request.device_rows();
  if (request.slots() < 1 || request.slots() > ring::kMaxSlots) {
    return absl::InvalidArgumentError(absl::StrCat("slots: ", request.slots(), " outside [1, ", ring::kMaxSlots, "]"));
  }
  if (request.d() % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("d: ", request.d(), " is not a multiple of 8 (device rows are read in 16-byte vectors)"));
  }
  if (dr.offset() % 256 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("device_rows.offset: ", dr.offset(), " is not a multiple of 256"));
  }
  ring::DeviceGeometry g;
  if (!ring::ComputeDeviceGeometry(request.max_tokens(), request.d(), request.k(), request.slots(), &g) ||
      g.total_bytes > (uint64_t{1} << 48)) {
    return absl::InvalidArgumentError("max_tokens: the ring's device slots overflow");
  }
  const uint64_t need = g.total_bytes;
  if (dr.offset() > (uint64_t{1} << 48)) {
    return absl::InvalidArgumentError(absl::StrCat("device_rows.offset: ", dr.offset(), " is past any allocation"));
  }
  // A refusal is named from the request's root ("device_rows.ipc_handle: ..."), whatever layer
  // refused it.
  const auto named = [](const absl::Status& s) {
    const absl::string_view why = s.message();
    return absl::Status(s.code(),
                        absl::StartsWith(why, "device_rows") ? std::string(why) : absl::StrCat("device_rows.", why));
  };
  absl::StatusOr<kernels::ExpertKernels::IpcMapping> opened = executor_->OpenDeviceRows(dr.ipc_handle());
  if (!opened.ok()) return named(opened.status());
  const kernels::ExpertKernels::IpcMapping m = *opened;
  if (m.bytes < 0 || static_cast<uint64_t>(m.bytes) < dr.offset() + need) {
    executor_->CloseDeviceRows(m.base);
    return absl::InvalidArgumentError(absl::StrCat("device_rows: the allocation holds ", m.bytes, " bytes; offset ",
                                                   dr.offset(), " + ", request.slots(), " device slots of ",
                                                   g.slot_bytes, " bytes need ", dr.offset() + need));
  }
  void* event = nullptr;
  if (!dr.ready_event().empty()) {
    absl::StatusOr<void*> opened_event = executor_->OpenReadyEvent(dr.ready_event());
    if (!opened_event.ok()) {
      executor_->CloseDeviceRows(m.base);
      return named(opened_event.status());
    }
    event = *opened_event;
  }
  RingDeviceRows rows;
  rows.rows = static_cast<char*>(m.base) + dr.offset();
  rows.ready_event = event;
  auto done = std::make_shared<std::vector<void*>>();  // closed by the release, with the rest
  rows.release = [executor = executor_, base = m.base, event, done] {
    // The work of the steps answered with the done events (which may still write the rows) is
    // waited for first, all in one wait, so the rows are unmapped after it. Work that does not
    // finish within the timeout keeps its leases, its events and the mapping: they are left
    // open rather than freed under kernels that may still run (a fault there would poison the
    // rank's CUDA context for every engine).
    if (absl::Status waited = executor->AwaitDoneEvents(*done); !waited.ok()) {
      spdlog::warn("step ring teardown: {}; the ring's device rows stay mapped and its done events open",
                   waited.ToString());
      if (event != nullptr) executor->CloseReadyEvent(event);
      return;
    }
    for (void* e : *done) executor->CloseReadyEvent(e);
    if (event != nullptr) executor->CloseReadyEvent(event);
    executor->CloseDeviceRows(base);
  };
  for (int s = 0; dr.done_events() && s < request.slots(); ++s) {
    std::string handle;
    absl::StatusOr<void*> made = executor_->CreateDoneEvent(&handle);
    if (!made.ok()) {
      done_handles->clear();
      rows.release();  // unmaps the rows, closes the events made so far
      return named(made.status());
    }
    done->push_back(*made);
    done_handles->push_back(std::move(handle));
  }
  rows.done_events = *done;
  return rows;
}

grpc::Status ExpertLayerServiceImpl::CloseStepRing(grpc::ServerContext* context,
                                                   const v1::CloseStepRingRequest* request,
                                                   v1::CloseStepRingResponse*) {
  auto caller = Authenticate(context);
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  if (rings_ == nullptr || !caller->uid.has_value()) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND, absl::StrCat("ring_id: no step ring ", request->ring_id()));
  }
  return ToGrpcStatus(rings_->Close(*caller->uid, request->ring_id()));
}

grpc::Status ExpertLayerServiceImpl::Execute(grpc::ServerContext* context, const v1::StepRequest* request,
                                             v1::StepResponse* response) {
  // NOTE: an unauthenticated caller is refused before its request reaches the step agreement: it
  // cannot make the peers abort a step either.
  auto caller = Authenticate(context);
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  return ExecuteAuthenticated(*caller, request, response);
}

grpc::Status ExpertLayerServiceImpl::Step(grpc::ServerContext* context,
                                          grpc::ServerReaderWriter<v1::StepResponse, v1::StepRequest>* stream) {
  auto caller = Authenticate(context);
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  v1::StepRequest request;
  while (stream->Read(&request)) {
    v1::StepResponse response;
    const grpc::Status s = ExecuteAuthenticated(*caller, &request, &response);
    // A failed step ends the stream with its status; the engine reopens the stream to go on.
    if (!s.ok()) return s;
    if (!stream->Write(response)) break;
  }
  return grpc::Status::OK;
}

grpc::Status ExpertLayerServiceImpl::RegisterRegion(grpc::ServerContext* context,
                                                    const v1::RegisterRegionRequest* request,
                                                    v1::RegisterRegionResponse*) {
  auto caller = Authenticate(context);
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  return ToGrpcStatus(regions_.Register(request->name(), request->bytes(), caller->uid));
}

grpc::Status ExpertLayerServiceImpl::UnregisterRegion(grpc::ServerContext* context,
                                                      const v1::UnregisterRegionRequest* request,
                                                      v1::UnregisterRegionResponse*) {
  auto caller = Authenticate(context);
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  return ToGrpcStatus(regions_.Unregister(request->name(), caller->uid));
}

void ExpertLayerServiceImpl::Drain() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
  mu_.Await(absl::Condition(&idle));
}

}  // namespace moe
