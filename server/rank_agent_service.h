// RankAgentService: the controller's view of and handle on this rank's placement generations.
// Preparing a generation verifies its manifest against this rank's topology and process group,
// loads this rank's slots from the checkpoint (every slot's parameter digest checked) and adds
// them beside the active generation; steps in flight are never disturbed. Retirement is refused
// while any dispatch handle holds the generation (the rank enforces the fence itself).
#ifndef MOE_SERVER_RANK_AGENT_SERVICE_H_
#define MOE_SERVER_RANK_AGENT_SERVICE_H_

#include <array>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <grpcpp/security/credentials.h>

#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"

#include "proto/moe/v1/rank_agent.grpc.pb.h"
#include "runtime/checkpoint/checkpoint_reader.h"
#include "runtime/exec/layer_executor.h"
#include "runtime/placement/registry.h"

namespace moe {

struct RankAgentContext {
  Rank rank;
  // The topology and process group are the executor's bound epoch (LayerExecutor::Membership):
  // while the group re-forms, lifecycle calls answer UNAVAILABLE.
  GenerationRegistry* registry = nullptr;        // not owned
  LayerExecutor* executor = nullptr;             // not owned
  const CheckpointReader* checkpoint = nullptr;  // not owned
  std::string token;                             // bearer token; must be non-empty
  // How this agent dials its peers' agents (FetchSlotWeights): rpc/tls.h; null: plaintext.
  std::shared_ptr<grpc::ChannelCredentials> peer_credentials;
  // The coordinates this rank runs (its flags), which a release bundle's must equal.
  v1::RuntimeCoordinates runtime;
  // The most bytes of BF16 expert weights a prepared generation may put on this rank, checked
  // before any is reserved (0: the host's available memory at the time, AvailableHostBytes).
  int64_t max_weight_bytes = 0;
};

class RankAgentServiceImpl final : public v1::RankAgentService::Service {
 public:
  explicit RankAgentServiceImpl(RankAgentContext context) : c_(std::move(context)) {}

  grpc::Status PrepareGeneration(grpc::ServerContext* ctx, const v1::PrepareGenerationRequest* req,
                                 v1::GenerationStatus* resp) override;
  grpc::Status ActivateGeneration(grpc::ServerContext* ctx, const v1::GenerationRequest* req,
                                  v1::GenerationStatus* resp) override;
  grpc::Status StopDispatch(grpc::ServerContext* ctx, const v1::GenerationRequest* req,
                            v1::GenerationStatus* resp) override;
  grpc::Status RetireGeneration(grpc::ServerContext* ctx, const v1::GenerationRequest* req,
                                v1::GenerationStatus* resp) override;
  grpc::Status DiscardGeneration(grpc::ServerContext* ctx, const v1::GenerationRequest* req,
                                 v1::GenerationStatus* resp) override;
  grpc::Status SetTrial(grpc::ServerContext* ctx, const v1::TrialRequest* req, v1::TrialRequest* resp) override;
  grpc::Status FetchSlotWeights(grpc::ServerContext* ctx, const v1::FetchSlotRequest* req,
                                v1::SlotWeights* resp) override;
  grpc::Status Status(grpc::ServerContext* ctx, const v1::AgentStatusRequest* req,
                      v1::AgentStatusResponse* resp) override;

 private:
  // The executor's epoch; UNAVAILABLE naming the rank while it has none.
  absl::StatusOr<std::pair<Topology, ProcessGroup>> Membership() const;
  grpc::Status Describe(PlacementVersion v, v1::GenerationStatus* out) const;
  // Waits (at most the collective timeout) for v's steps answered before their GPU work finished,
  // where v's state is one the change `takes` and v is not the trial candidate (whose steps would
  // keep adding more).
  void AwaitAnsweredSteps(PlacementVersion v, absl::FunctionRef<bool(GenerationState)> takes);
  void Fill(const GenerationInfo& g, v1::GenerationStatus* out) const;
  // Authenticates, validates the version, and applies `change` to a known generation under mu_.
  grpc::Status Change(const grpc::ServerContext* ctx, const v1::GenerationRequest& req, v1::GenerationStatus* resp,
                      const std::function<absl::Status(PlacementVersion, GenerationState)>& change);

  // This rank's slots of `to`, materialized as the 0x08F plan from the active placement says
  // (copies only from members of `group`).
  struct Materialized {
    LocalExperts experts;
    int retained = 0, duplicated = 0, copied = 0, loaded = 0;
  };
  absl::StatusOr<Materialized> Materialize(const PlacementManifest& to, const std::vector<std::string>& peers,
                                           const Topology& topology, const ProcessGroup& group);

  RankAgentContext c_;
  absl::Mutex mu_;  // one lifecycle change at a time
  mutable absl::Mutex summary_mu_;
  std::map<int64_t, std::array<int, 4>> materialized_ ABSL_GUARDED_BY(summary_mu_);  // retained, dup, copied, loaded
};

}  // namespace moe

#endif  // MOE_SERVER_RANK_AGENT_SERVICE_H_
