#include "server/expert_layer_service.h"

#include <cctype>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/grpc_status.h"
#include "server/tensor_codec.h"

namespace moe {
namespace {

std::string StatusLabel(absl::StatusCode code) {
  std::string s = absl::StatusCodeToString(code);
  for (char& c : s) c = c == ' ' ? '_' : static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

absl::Status ExpertLayerServiceImpl::Run(const v1::StepRequest& req, v1::StepResponse* resp) {
  const absl::Time start = absl::Now();
  const bool decode = req.phase() == v1::PHASE_DECODE;
  const std::string phase = decode ? "decode" : "prefill";
  // A request rejected here still takes part in its step's agreement (with the abort flag), so
  // the peers abort at once instead of waiting for this rank.
  auto reject = [&](absl::Status why) {
    absl::MutexLock lock(&step_mu_);
    return executor_->Reject(req.step_id(), req.layer(), std::move(why));
  };
  const char* path = "eager";  // the path label of the step latency histogram
  absl::Status status = [&]() -> absl::Status {
    if (req.k() <= 0) return reject(absl::InvalidArgumentError("k: must be positive"));
    const int64_t t = req.hidden().rows();
    // Rows inline or from a registered shared-memory region.
    absl::StatusOr<Bf16Rows> hidden;
    if (req.has_hidden_region()) {
      if (!req.hidden().data().empty()) {
        return reject(absl::InvalidArgumentError("hidden.data: must be empty when hidden_region is set"));
      }
      const v1::SharedRegionRef& ref = req.hidden_region();
      auto at = regions_.Resolve(ref.region(), ref.offset(), ref.bytes(), "hidden_region");
      if (!at.ok()) return reject(at.status());
      hidden = ReadBf16(req.hidden(), *at, ref.bytes(), "hidden_region");
    } else {
      hidden = ReadBf16(req.hidden(), req.hidden().data().data(), req.hidden().data().size(), "hidden");
    }
    if (!hidden.ok()) return reject(hidden.status());
    char* output_at = nullptr;
    if (req.has_output_region()) {
      const v1::SharedRegionRef& ref = req.output_region();
      const int width = WireWidth(req.hidden().dtype());
      if (ref.bytes() != static_cast<uint64_t>(t * req.hidden().cols() * width)) {
        return reject(absl::InvalidArgumentError(absl::StrCat("output_region.bytes: ", ref.bytes(), ", the output needs ",
                                                              t * req.hidden().cols() * width)));
      }
      auto at = regions_.Resolve(ref.region(), ref.offset(), ref.bytes(), "output_region");
      if (!at.ok()) return reject(at.status());
      output_at = *at;
    }
    if (req.topk_ids_size() != t * req.k()) {
      return reject(absl::InvalidArgumentError(absl::StrCat("topk_ids: ", req.topk_ids_size(),
                                                            " entries, hidden has ", t, " rows and k = ", req.k())));
    }
    if (req.topk_weights_size() != t * req.k()) {
      return reject(absl::InvalidArgumentError(
          absl::StrCat("topk_weights: ", req.topk_weights_size(), " entries, expected ", t * req.k())));
    }
    if (!req.admitted().empty() && static_cast<int64_t>(req.admitted().size()) != t * req.k()) {
      return reject(absl::InvalidArgumentError(
          absl::StrCat("admitted: ", req.admitted().size(), " entries, expected ", t * req.k())));
    }
    LayerStepInput in;
    in.step_id = req.step_id();
    in.layer = req.layer();
    in.phase = decode ? Phase::kDecode : Phase::kPrefill;
    in.hidden = hidden->data();
    in.tokens = t;
    in.d = static_cast<int>(req.hidden().cols());
    in.topk_ids = req.topk_ids().data();
    in.topk_weights = req.topk_weights().data();
    in.k = req.k();
    in.admitted = req.admitted().empty() ? nullptr : reinterpret_cast<const uint8_t*>(req.admitted().data());
    in.expected_generation = req.expected_generation() > 0 ? req.expected_generation() : -1;
    absl::StatusOr<LayerStepResult> result;
    {
      absl::MutexLock lock(&step_mu_);
      result = executor_->Execute(in);
    }
    if (!result.ok()) return result.status();
    resp->set_step_id(req.step_id());
    if (output_at != nullptr) {
      EncodeBytes(result->output, req.hidden().dtype(), output_at);
      resp->mutable_output()->set_dtype(req.hidden().dtype());
      resp->mutable_output()->set_rows(t);
      resp->mutable_output()->set_cols(in.d);
    } else {
      EncodeFromBf16(result->output, t, in.d, req.hidden().dtype(), resp->mutable_output());
    }
    v1::StepRecord* rec = resp->mutable_record();
    const StepRecord& r = result->record;
    path = r.graph_replay ? "graph_replay" : "eager";
    rec->set_placement_generation(r.placement_version);
    rec->set_path(r.graph_replay ? v1::PATH_GRAPH_REPLAY : v1::PATH_EAGER);
    if (decode && !r.graph_replay) {
      rec->set_fallback_reason(r.fallback_reason);
      metrics_->Fallback(r.fallback_reason);
    }
    rec->set_compute_latency_us(r.execute_us);
    rec->set_canary(r.canary);
    rec->set_routes_attempted(r.routes_attempted);
    rec->set_routes_accepted(r.routes_accepted);
    rec->set_routes_dropped(r.routes_dropped);
    rec->set_routes_remote(r.routes_remote);
    rec->set_routes_inter_node(r.routes_inter_node);
    metrics_->Routes(r.routes_attempted, r.routes_accepted, r.routes_dropped, r.routes_remote, r.routes_inter_node);
    metrics_->BytesSent(r.bytes_sent);
    metrics_->Generation(r.placement_version);
    return absl::OkStatus();
  }();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (status.ok()) resp->mutable_record()->set_server_latency_us(seconds * 1e6);
  metrics_->Step(phase, path, StatusLabel(status.code()), seconds);
  return status;
}

grpc::Status ExpertLayerServiceImpl::Execute(grpc::ServerContext*, const v1::StepRequest* request,
                                             v1::StepResponse* response) {
  {
    absl::MutexLock lock(&mu_);
    if (draining_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "moe-rankd is draining");
    ++in_flight_;
    metrics_->InFlight(in_flight_);
  }
  const absl::Status s = Run(*request, response);
  absl::MutexLock lock(&mu_);
  --in_flight_;
  metrics_->InFlight(in_flight_);
  return ToGrpcStatus(s);
}

grpc::Status ExpertLayerServiceImpl::Step(grpc::ServerContext* context,
                                          grpc::ServerReaderWriter<v1::StepResponse, v1::StepRequest>* stream) {
  v1::StepRequest request;
  while (stream->Read(&request)) {
    v1::StepResponse response;
    const grpc::Status s = Execute(context, &request, &response);
    // A failed step ends the stream with its status; the engine reopens the stream to go on.
    if (!s.ok()) return s;
    if (!stream->Write(response)) break;
  }
  return grpc::Status::OK;
}

grpc::Status ExpertLayerServiceImpl::RegisterRegion(grpc::ServerContext*, const v1::RegisterRegionRequest* request,
                                                    v1::RegisterRegionResponse*) {
  return ToGrpcStatus(regions_.Register(request->name(), request->bytes()));
}

grpc::Status ExpertLayerServiceImpl::UnregisterRegion(grpc::ServerContext*, const v1::UnregisterRegionRequest* request,
                                                      v1::UnregisterRegionResponse*) {
  return ToGrpcStatus(regions_.Unregister(request->name()));
}

void ExpertLayerServiceImpl::Drain() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
  mu_.Await(absl::Condition(&idle));
}

}  // namespace moe
