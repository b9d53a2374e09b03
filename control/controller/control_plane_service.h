// ControlPlaneService on moe-controller: the gRPC edge of the release registry. Every RPC checks
// the bearer token first (UNAUTHENTICATED otherwise, before the manager is called; the read-only
// token on an RPC that writes: PERMISSION_DENIED, before the manager is called), decodes the
// request, calls one ReleaseManager method (release_manager.h: the logic, its serialization and
// its atomic store commits) and encodes the answer; a manager's error reaches the client with its
// code and message as they are (rpc/grpc_status.h).
#ifndef MOE_CONTROL_CONTROLLER_CONTROL_PLANE_SERVICE_H_
#define MOE_CONTROL_CONTROLLER_CONTROL_PLANE_SERVICE_H_

#include <string>

#include "absl/status/statusor.h"

#include "control/controller/release_manager.h"
#include "proto/moe/v1/control_plane.grpc.pb.h"
#include "runtime/release/lifecycle.h"

namespace moe {

class ControlPlaneServiceImpl final : public v1::ControlPlaneService::Service {
 public:
  // `manager` is not owned and outlives the service. `token` must be non-empty: calls carry
  // `authorization: Bearer <token>`. `read_token` (empty: none) is also admitted by the RPCs that
  // only read (ClusterStatus, GetRelease, ListReleases, History, Watch): dashboards, `moectl
  // status` and `watch` without the power to register, load, promote or roll back. It must differ
  // from `token`.
  ControlPlaneServiceImpl(ReleaseManager* manager, std::string token, std::string read_token = "");

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
  // The operator token, or the read-only one.
  grpc::Status AuthorizeRead(const grpc::ServerContext* ctx) const;
  // The operator token only; the read-only one is PERMISSION_DENIED naming `rpc`.
  grpc::Status AuthorizeWrite(const grpc::ServerContext* ctx, const char* rpc) const;

  ReleaseManager* manager_;
  const std::string token_;
  const std::string read_token_;
};

// Conversions between the proto and the lifecycle enum (INVALID_ARGUMENT naming `field`).
absl::StatusOr<ReleaseState> FromProto(v1::ReleaseState s, const char* field);
v1::ReleaseState ToProto(ReleaseState s);

}  // namespace moe

#endif  // MOE_CONTROL_CONTROLLER_CONTROL_PLANE_SERVICE_H_
