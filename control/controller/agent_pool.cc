#include "control/controller/agent_pool.h"

#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

#include "rpc/grpc_status.h"

namespace moe {

AgentPool::AgentPool(std::vector<std::string> addresses, std::string token, absl::Duration rpc_timeout,
                     std::shared_ptr<grpc::ChannelCredentials> credentials)
    : addresses_(std::move(addresses)), token_(std::move(token)), rpc_timeout_(rpc_timeout) {
  if (credentials == nullptr) credentials = grpc::InsecureChannelCredentials();
  for (const std::string& a : addresses_) {
    stubs_.push_back(v1::RankAgentService::NewStub(grpc::CreateChannel(a, credentials)));
  }
}

std::unique_ptr<grpc::ClientContext> AgentPool::Context() const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->AddMetadata("authorization", "Bearer " + token_);
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + rpc_timeout_));
  return ctx;
}

absl::Status AgentPool::OnEach(
    const std::string& what,
    const std::function<grpc::Status(v1::RankAgentService::Stub&, grpc::ClientContext&)>& call) {
  for (size_t r = 0; r < stubs_.size(); ++r) {
    auto ctx = Context();
    absl::Status s = FromGrpcStatus(call(*stubs_[r], *ctx));
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat(what, " on rank ", r, " (", addresses_[r], "): ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status AgentPool::Prepare(const v1::PlacementManifest& manifest, const v1::RuntimeCoordinates* runtime) {
  v1::PrepareGenerationRequest req;
  *req.mutable_manifest() = manifest;
  if (runtime != nullptr) *req.mutable_runtime() = *runtime;
  // Every rank may copy slots from the others (0x08F network copies).
  for (const std::string& a : addresses_) req.add_peer_agents(a);
  return OnEach(absl::StrCat("prepare placement-v", manifest.version()),
                [&](v1::RankAgentService::Stub& stub, grpc::ClientContext& ctx) {
                  v1::GenerationStatus out;
                  return stub.PrepareGeneration(&ctx, req, &out);
                });
}

absl::Status AgentPool::OnEachVersion(const char* verb, int64_t version, VersionRpc rpc) {
  v1::GenerationRequest req;
  req.set_version(version);
  return OnEach(absl::StrCat(verb, " placement-v", version),
                [&](v1::RankAgentService::Stub& stub, grpc::ClientContext& ctx) {
                  v1::GenerationStatus out;
                  return (stub.*rpc)(&ctx, req, &out);
                });
}

absl::Status AgentPool::Activate(int64_t version) {
  return OnEachVersion("activate", version, &v1::RankAgentService::Stub::ActivateGeneration);
}

absl::Status AgentPool::SetTrial(int64_t version, int64_t shadow_every, int64_t canary_every) {
  v1::TrialRequest req;
  req.set_version(version);
  req.set_shadow_every(shadow_every);
  req.set_canary_every(canary_every);
  return OnEach(version > 0 ? absl::StrCat("trial of placement-v", version) : std::string("stop trials"),
                [&](v1::RankAgentService::Stub& stub, grpc::ClientContext& ctx) {
                  v1::TrialRequest out;
                  return stub.SetTrial(&ctx, req, &out);
                });
}

absl::Status AgentPool::Retire(int64_t version) {
  return OnEachVersion("retire", version, &v1::RankAgentService::Stub::RetireGeneration);
}

absl::Status AgentPool::AwaitDrained(int64_t version, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    std::vector<std::string> holding;
    for (size_t r = 0; r < stubs_.size(); ++r) {
      auto ctx = Context();
      v1::AgentStatusResponse st;
      absl::Status s = FromGrpcStatus(stubs_[r]->Status(ctx.get(), {}, &st));
      if (!s.ok())
        return absl::Status(s.code(), absl::StrCat("status of rank ", r, " (", addresses_[r], "): ", s.message()));
      for (const v1::GenerationStatus& g : st.generations()) {
        if (g.version() == version && g.refcount() > 0) holding.push_back(absl::StrCat("rank ", r, ": ", g.refcount()));
      }
    }
    if (holding.empty()) return absl::OkStatus();
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("placement-v", version, " still held (",
                                                      absl::StrJoin(holding, ", "), ") after ",
                                                      absl::FormatDuration(timeout)));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

std::vector<std::pair<absl::StatusOr<v1::AgentStatusResponse>, std::string>> AgentPool::Status() {
  std::vector<std::pair<absl::StatusOr<v1::AgentStatusResponse>, std::string>> out;
  for (size_t r = 0; r < stubs_.size(); ++r) {
    auto ctx = Context();
    v1::AgentStatusResponse st;
    absl::Status s = FromGrpcStatus(stubs_[r]->Status(ctx.get(), {}, &st));
    out.emplace_back(s.ok() ? absl::StatusOr<v1::AgentStatusResponse>(st) : absl::StatusOr<v1::AgentStatusResponse>(s),
                     addresses_[r]);
  }
  return out;
}

}  // namespace moe
