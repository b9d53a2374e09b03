// Every ControlPlaneService RPC as one call on a stub, for the tests that check each one refuses
// a caller without the token (control_plane_auth_test over the real registry,
// control_plane_service_test over a fake manager). The requests are ones that would commit
// something if they were served.
#ifndef MOE_TESTS_CONTROL_CONTROL_PLANE_RPCS_H_
#define MOE_TESTS_CONTROL_CONTROL_PLANE_RPCS_H_

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "proto/moe/v1/control_plane.grpc.pb.h"

namespace moe::testing {

using RpcCall = std::function<grpc::Status(grpc::ClientContext*)>;

inline std::vector<std::pair<std::string, RpcCall>> EveryControlPlaneRpc(v1::ControlPlaneService::Stub* stub) {
  v1::RegisterReleaseRequest reg;
  reg.set_request_id("r1");
  reg.set_release_id("release-v1");
  reg.set_bundle_digest("sha256:1");
  v1::TransitionReleaseRequest tr;
  tr.set_request_id("r2");
  tr.set_release_id("release-v1");
  tr.set_to(v1::RELEASE_STATE_VERIFIED);
  tr.set_reason("x");
  v1::PromoteRequest pr;
  pr.set_request_id("r3");
  pr.set_release_id("release-v1");
  pr.mutable_evidence();
  v1::RollbackRequest rb;
  rb.set_request_id("r4");
  rb.set_release_id("release-v1");
  rb.set_prior_release_id("release-v0");
  v1::LoadPlacementRequest load;
  load.set_request_id("r5");
  load.set_release_id("release-v1");
  load.mutable_manifest()->set_version(3);
  return {
      {"RegisterRelease",
       [stub, reg](grpc::ClientContext* c) {
         v1::Release r;
         return stub->RegisterRelease(c, reg, &r);
       }},
      {"TransitionRelease",
       [stub, tr](grpc::ClientContext* c) {
         v1::TransitionRecord r;
         return stub->TransitionRelease(c, tr, &r);
       }},
      {"Promote",
       [stub, pr](grpc::ClientContext* c) {
         v1::PromoteResponse r;
         return stub->Promote(c, pr, &r);
       }},
      {"Rollback",
       [stub, rb](grpc::ClientContext* c) {
         v1::RollbackResponse r;
         return stub->Rollback(c, rb, &r);
       }},
      {"LoadPlacement",
       [stub, load](grpc::ClientContext* c) {
         v1::Release r;
         return stub->LoadPlacement(c, load, &r);
       }},
      {"ClusterStatus",
       [stub](grpc::ClientContext* c) {
         v1::ClusterStatusResponse r;
         return stub->ClusterStatus(c, {}, &r);
       }},
      {"GetRelease",
       [stub](grpc::ClientContext* c) {
         v1::Release r;
         return stub->GetRelease(c, {}, &r);
       }},
      {"ListReleases",
       [stub](grpc::ClientContext* c) {
         v1::ListReleasesResponse r;
         return stub->ListReleases(c, {}, &r);
       }},
      {"History",
       [stub](grpc::ClientContext* c) {
         v1::HistoryResponse r;
         return stub->History(c, {}, &r);
       }},
      {"Watch",
       [stub](grpc::ClientContext* c) {
         auto reader = stub->Watch(c, {});
         v1::TransitionRecord r;
         while (reader->Read(&r)) {
         }
         return reader->Finish();
       }},
  };
}

}  // namespace moe::testing

#endif  // MOE_TESTS_CONTROL_CONTROL_PLANE_RPCS_H_
