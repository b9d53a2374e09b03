#include "server/client.h"

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "rpc/grpc_status.h"

namespace moe {

absl::StatusOr<std::unique_ptr<ExpertLayerClient>> ExpertLayerClient::Connect(const std::string& address,
                                                                              absl::Duration timeout,
                                                                              const std::string& token) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(1 << 30);
  args.SetMaxSendMessageSize(1 << 30);
  auto channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  if (!channel->WaitForConnected(std::chrono::system_clock::now() +
                                 std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout)))) {
    return absl::UnavailableError(absl::StrCat(address, ": not reachable within ", absl::FormatDuration(timeout)));
  }
  return std::unique_ptr<ExpertLayerClient>(new ExpertLayerClient(v1::ExpertLayerService::NewStub(channel), token));
}

absl::StatusOr<StepAnswer> ExpertLayerClient::Execute(const StepCall& call, absl::Duration deadline) {
  v1::StepRequest req;
  req.set_step_id(call.step_id);
  req.set_layer(call.layer);
  req.set_phase(call.decode ? v1::PHASE_DECODE : v1::PHASE_PREFILL);
  v1::Tensor* h = req.mutable_hidden();
  h->set_dtype(v1::DTYPE_BF16);
  h->set_rows(call.tokens);
  h->set_cols(call.d);
  h->set_data(std::string(reinterpret_cast<const char*>(call.hidden.data()), call.hidden.size() * 2));
  *req.mutable_topk_ids() = {call.topk_ids.begin(), call.topk_ids.end()};
  *req.mutable_topk_weights() = {call.topk_weights.begin(), call.topk_weights.end()};
  req.set_k(call.k);
  if (call.expected_generation > 0) req.set_expected_generation(call.expected_generation);
  if (!call.admitted.empty()) req.set_admitted(std::string(call.admitted.begin(), call.admitted.end()));
  grpc::ClientContext ctx;
  if (!token_.empty()) ctx.AddMetadata("authorization", "Bearer " + token_);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(absl::ToInt64Milliseconds(deadline)));
  v1::StepResponse resp;
  const absl::Time start = absl::Now();
  const grpc::Status s = stub_->Execute(&ctx, req, &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  StepAnswer a;
  a.client_latency_us = absl::ToDoubleMicroseconds(absl::Now() - start);
  const std::string& data = resp.output().data();
  if (resp.output().dtype() != v1::DTYPE_BF16 || data.size() != call.hidden.size() * 2) {
    return absl::DataLossError(absl::StrCat("output: ", data.size(), " bytes, expected ", call.hidden.size() * 2));
  }
  a.output.resize(call.hidden.size());
  std::memcpy(a.output.data(), data.data(), data.size());
  a.record = resp.record();
  return a;
}

}  // namespace moe
