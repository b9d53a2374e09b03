#include "control/controller/agent_pool.h"

#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

#include "rpc/grpc_status.h"
#include "runtime/status.h"

namespace moe {

AgentPool::AgentPool(std::vector<std::string> addresses, std::string token, absl::Duration rpc_timeout,
                     std::shared_ptr<grpc::ChannelCredentials> credentials)
    : world_(static_cast<int>(addresses.size())),
      token_(std::move(token)),
      rpc_timeout_(rpc_timeout),
      credentials_(credentials != nullptr ? std::move(credentials) : grpc::InsecureChannelCredentials()) {
  auto state = std::make_shared<State>();
  for (const std::string& a : addresses) {
    state->addresses.push_back(a);
    state->stubs.push_back(v1::RankAgentService::NewStub(grpc::CreateChannel(a, credentials_)));
  }
  state_ = std::move(state);
}

AgentPool::AgentPool(int world, std::string token, absl::Duration rpc_timeout,
                     std::shared_ptr<grpc::ChannelCredentials> credentials)
    : world_(world),
      group_mode_(true),
      token_(std::move(token)),
      rpc_timeout_(rpc_timeout),
      credentials_(credentials != nullptr ? std::move(credentials) : grpc::InsecureChannelCredentials()) {
  auto state = std::make_shared<State>();
  state->addresses.assign(world, "");
  state->stubs.assign(world, nullptr);
  state_ = std::move(state);
}

std::shared_ptr<const AgentPool::State> AgentPool::Current() const {
  absl::MutexLock lock(&mu_);
  return state_;
}

std::vector<std::string> AgentPool::addresses() const { return Current()->addresses; }

void AgentPool::SetGroup(AgentGroup group) {
  auto state = std::make_shared<State>();
  const std::shared_ptr<const State> old = Current();
  for (int r = 0; r < world_; ++r) {
    const std::string a = r < static_cast<int>(group.addresses.size()) ? group.addresses[r] : "";
    state->addresses.push_back(a);
    if (a.empty()) {
      state->stubs.push_back(nullptr);
    } else if (old->addresses[r] == a && old->stubs[r] != nullptr) {
      state->stubs.push_back(old->stubs[r]);  // the same agent: keep its channel
    } else {
      state->stubs.push_back(v1::RankAgentService::NewStub(grpc::CreateChannel(a, credentials_)));
    }
  }
  state->group = std::move(group);
  absl::MutexLock lock(&mu_);
  state_ = std::move(state);
}

std::unique_ptr<grpc::ClientContext> AgentPool::Context() const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->AddMetadata("authorization", "Bearer " + token_);
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + rpc_timeout_));
  return ctx;
}

absl::Status AgentPool::OnEachOf(const State& st, const std::string& what, const AgentCall& call) {
  if (group_mode_ && !st.group.has_value()) {
    return absl::UnavailableError(absl::StrCat(what, ": the process group has not formed yet"));
  }
  for (size_t r = 0; r < st.stubs.size(); ++r) {
    if (st.stubs[r] == nullptr) continue;  // not a member of the epoch
    auto ctx = Context();
    absl::Status s = FromGrpcStatus(call(*st.stubs[r], *ctx));
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat(what, " on rank ", r, " (", st.addresses[r], "): ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status AgentPool::Prepare(const v1::PlacementManifest& manifest, const v1::RuntimeCoordinates* runtime,
                                bool rebind) {
  v1::PrepareGenerationRequest req;
  *req.mutable_manifest() = manifest;
  // One snapshot for the epoch, the nodes, the peers and the members driven.
  const std::shared_ptr<const State> st = Current();
  AgentGroup serving;
  if (st->group.has_value()) {
    serving = *st->group;
  } else {
    ASSIGN_OR_RETURN(serving, ServingGroup());  // a fixed list of agents: what they report
  }
  const AgentGroup* group = &serving;
  if (!rebind && manifest.process_group_epoch() != 0 && manifest.process_group_epoch() != group->epoch) {
    return absl::FailedPreconditionError(absl::StrCat("manifest.process_group_epoch: ", manifest.process_group_epoch(),
                                                      ", the ranks serve process-group epoch ", group->epoch,
                                                      " (0: bind to the epoch served)"));
  }
  {
    // Bound to the epoch the ranks serve: its number, and each slot's node in its topology.
    const AgentGroup& g = *group;
    v1::PlacementManifest* m = req.mutable_manifest();
    m->set_process_group_epoch(g.epoch);
    const auto bind = [&g](v1::PhysicalSlot* slot) {
      const int r = slot->destination_rank();
      if (r >= 0 && r < static_cast<int>(g.node_of_rank.size())) slot->set_topology_domain(g.node_of_rank[r]);
    };
    for (v1::PhysicalSlot& slot : *m->mutable_slots()) bind(&slot);
    for (v1::LayerSlots& layer : *m->mutable_layer_slots()) {
      for (v1::PhysicalSlot& slot : *layer.mutable_slots()) bind(&slot);
    }
  }
  if (runtime != nullptr) *req.mutable_runtime() = *runtime;
  // Every rank may copy slots from the others (0x08F network copies).
  for (const std::string& a : st->addresses) req.add_peer_agents(a);
  return OnEachOf(*st, absl::StrCat("prepare placement-v", manifest.version()),
                  [&](v1::RankAgentService::Stub& stub, grpc::ClientContext& ctx) {
                    v1::GenerationStatus out;
                    return stub.PrepareGeneration(&ctx, req, &out);
                  });
}

absl::StatusOr<AgentGroup> AgentPool::ServingGroup() {
  const std::shared_ptr<const State> st = Current();
  if (st->group.has_value()) return *st->group;
  if (group_mode_) return absl::UnavailableError("the ranks' process group has not formed yet");
  // A fixed list of agents: the epoch and nodes they report (every rank must be in the same).
  return ObservedGroup();
}

absl::StatusOr<AgentGroup> AgentPool::ObservedGroup() {
  AgentGroup g;
  for (auto& [status, address] : Status()) {
    const size_t r = g.addresses.size();
    if (!status.ok()) {
      return absl::Status(status.status().code(),
                          absl::StrCat("status of rank ", r, " (", address, "): ", status.status().message()));
    }
    if (status->process_group_epoch() <= 0) {
      return absl::UnavailableError(absl::StrCat("rank ", r, " (", address, ") serves no process-group epoch"));
    }
    if (r > 0 && status->process_group_epoch() != g.epoch) {
      return absl::UnavailableError(absl::StrCat("rank ", r, " serves process-group epoch ",
                                                 status->process_group_epoch(), ", rank 0 epoch ", g.epoch));
    }
    g.epoch = status->process_group_epoch();
    g.addresses.push_back(address);
    g.node_of_rank.push_back(status->node());
  }
  return g;
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

absl::Status AgentPool::StopTrial(int64_t version) {
  v1::TrialRequest req;
  req.set_stop_version(version);
  return OnEach(absl::StrCat("stop trials of placement-v", version),
                [&](v1::RankAgentService::Stub& stub, grpc::ClientContext& ctx) {
                  v1::TrialRequest out;
                  return stub.SetTrial(&ctx, req, &out);
                });
}

absl::Status AgentPool::Retire(int64_t version) {
  return OnEachVersion("retire", version, &v1::RankAgentService::Stub::RetireGeneration);
}

absl::Status AgentPool::Discard(int64_t version) {
  const std::shared_ptr<const State> st = Current();
  v1::GenerationRequest req;
  req.set_version(version);
  absl::Status first;
  for (size_t r = 0; r < st->stubs.size(); ++r) {
    if (st->stubs[r] == nullptr) continue;  // not a member of the epoch
    auto ctx = Context();
    v1::GenerationStatus out;
    absl::Status s = FromGrpcStatus(st->stubs[r]->DiscardGeneration(ctx.get(), req, &out));
    if (!s.ok() && first.ok()) {
      first = absl::Status(s.code(), absl::StrCat("discard placement-v", version, " on rank ", r, " (",
                                                  st->addresses[r], "): ", s.message()));
    }
  }
  return first;
}

absl::Status AgentPool::AwaitDrained(int64_t version, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    std::vector<std::string> holding;
    const std::shared_ptr<const State> state = Current();
    for (size_t r = 0; r < state->stubs.size(); ++r) {
      if (state->stubs[r] == nullptr) continue;
      auto ctx = Context();
      v1::AgentStatusResponse st;
      absl::Status s = FromGrpcStatus(state->stubs[r]->Status(ctx.get(), {}, &st));
      if (!s.ok())
        return absl::Status(s.code(),
                            absl::StrCat("status of rank ", r, " (", state->addresses[r], "): ", s.message()));
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
  const std::shared_ptr<const State> state = Current();
  for (size_t r = 0; r < state->stubs.size(); ++r) {
    if (state->stubs[r] == nullptr) {
      out.emplace_back(absl::UnavailableError(absl::StrCat("rank ", r, " is not in the process group's epoch")),
                       state->addresses[r]);
      continue;
    }
    auto ctx = Context();
    v1::AgentStatusResponse st;
    absl::Status s = FromGrpcStatus(state->stubs[r]->Status(ctx.get(), {}, &st));
    out.emplace_back(s.ok() ? absl::StatusOr<v1::AgentStatusResponse>(st) : absl::StatusOr<v1::AgentStatusResponse>(s),
                     state->addresses[r]);
  }
  return out;
}

}  // namespace moe
