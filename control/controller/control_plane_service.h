// ControlPlaneService on moe-controller: the release registry over the durable store. Every RPC
// checks the bearer token first (UNAUTHENTICATED otherwise); mutating RPCs are serialized so a
// promotion or rollback reads and writes one consistent registry, and each is one atomic store
// batch, so a controller killed mid-request leaves either all of it or none of it.
#ifndef MOE_CONTROL_CONTROLLER_CONTROL_PLANE_SERVICE_H_
#define MOE_CONTROL_CONTROLLER_CONTROL_PLANE_SERVICE_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"

#include "control/controller/agent_pool.h"
#include "control/controller/release_manager.h"
#include "control/store/release_store.h"
#include "proto/moe/v1/control_plane.grpc.pb.h"
#include "runtime/placement/topology.h"
#include "runtime/release/lifecycle.h"

namespace moe {

class ControlPlaneServiceImpl final : public v1::ControlPlaneService::Service {
 public:
  // `token` must be non-empty: calls carry `authorization: Bearer <token>`.
  // `agents` (may be null or empty: the registry alone) are the ranks the releases' placements
  // are driven onto; `topology` is theirs (one rank per agent, required with agents): placement
  // manifests are read, digested and migrated against it.
  ControlPlaneServiceImpl(ReleaseStore* store, std::string token, PromotionThresholds thresholds = {},
                          AgentPool* agents = nullptr, std::optional<Topology> topology = std::nullopt,
                          absl::Duration drain_timeout = absl::Seconds(60), MigrationBudget migration = {},
                          TrialPolicy trial = {});

  // After a restart: the ranks' active generation is made the placement of the release the store
  // records ACTIVE (a controller killed between committing a promotion or rollback and driving the
  // ranks finishes it here). Idempotent.
  absl::Status Reconcile();

  grpc::Status RegisterRelease(grpc::ServerContext* ctx, const v1::RegisterReleaseRequest* req,
                               v1::Release* resp) override;
  grpc::Status TransitionRelease(grpc::ServerContext* ctx, const v1::TransitionReleaseRequest* req,
                                 v1::TransitionRecord* resp) override;
  grpc::Status Promote(grpc::ServerContext* ctx, const v1::PromoteRequest* req, v1::PromoteResponse* resp) override;
  grpc::Status Rollback(grpc::ServerContext* ctx, const v1::RollbackRequest* req, v1::RollbackResponse* resp) override;
  grpc::Status LoadPlacement(grpc::ServerContext* ctx, const v1::LoadPlacementRequest* req, v1::Release* resp) override;
  grpc::Status ClusterStatus(grpc::ServerContext* ctx, const v1::ClusterStatusRequest* req,
                             v1::ClusterStatusResponse* resp) override;
  grpc::Status GetRelease(grpc::ServerContext* ctx, const v1::GetReleaseRequest* req, v1::Release* resp) override;
  grpc::Status ListReleases(grpc::ServerContext* ctx, const v1::ListReleasesRequest* req,
                            v1::ListReleasesResponse* resp) override;
  grpc::Status History(grpc::ServerContext* ctx, const v1::HistoryRequest* req, v1::HistoryResponse* resp) override;
  grpc::Status Watch(grpc::ServerContext* ctx, const v1::WatchRequest* req,
                     grpc::ServerWriter<v1::TransitionRecord>* writer) override;

 private:
  grpc::Status Authorize(const grpc::ServerContext* ctx) const;

  ReleaseStore* store_;
  const std::string token_;
  AgentPool* agents_;
  StoreReleaseManager manager_;  // every mutating RPC but Reconcile goes through it
  absl::Mutex& write_mu_;        // the manager's: one mutating request at a time
};

// Conversions between the proto and the lifecycle enum (INVALID_ARGUMENT naming `field`).
absl::StatusOr<ReleaseState> FromProto(v1::ReleaseState s, const char* field);
v1::ReleaseState ToProto(ReleaseState s);

}  // namespace moe

#endif  // MOE_CONTROL_CONTROLLER_CONTROL_PLANE_SERVICE_H_
