// Every ControlPlaneService RPC refuses a call without the bearer token, or with another one,
// before touching the registry; served over a real loopback socket.
#include <unistd.h>

#include <cstdlib>
#include <functional>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

#include "control/controller/control_plane_service.h"
#include "control/controller/release_manager.h"

namespace moe {
namespace {

class AuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* dir = std::getenv("TEST_TMPDIR");
    const std::string path = absl::StrCat(dir != nullptr ? dir : "/tmp", "/auth-", getpid(), ".db");
    unlink(path.c_str());
    store_ = *ReleaseStore::Open(path);
    manager_ = std::make_unique<StoreReleaseManager>(store_.get());
    service_ = std::make_unique<ControlPlaneServiceImpl>(manager_.get(), "0123456789abcdef-token");
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    b.RegisterService(service_.get());
    server_ = b.BuildAndStart();
    ASSERT_NE(port_, 0);
    stub_ = v1::ControlPlaneService::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port_), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override { server_->Shutdown(); }

  std::unique_ptr<ReleaseStore> store_;
  std::unique_ptr<StoreReleaseManager> manager_;
  std::unique_ptr<ControlPlaneServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::ControlPlaneService::Stub> stub_;
  int port_ = 0;
};

TEST_F(AuthTest, EveryRpcNeedsTheToken) {
  using Call = std::function<grpc::Status(grpc::ClientContext*)>;
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
  const std::vector<std::pair<const char*, Call>> calls = {
      {"RegisterRelease",
       [&](grpc::ClientContext* c) {
         v1::Release r;
         return stub_->RegisterRelease(c, reg, &r);
       }},
      {"TransitionRelease",
       [&](grpc::ClientContext* c) {
         v1::TransitionRecord r;
         return stub_->TransitionRelease(c, tr, &r);
       }},
      {"Promote",
       [&](grpc::ClientContext* c) {
         v1::PromoteResponse r;
         return stub_->Promote(c, pr, &r);
       }},
      {"Rollback",
       [&](grpc::ClientContext* c) {
         v1::RollbackResponse r;
         return stub_->Rollback(c, rb, &r);
       }},
      {"GetRelease",
       [&](grpc::ClientContext* c) {
         v1::Release r;
         return stub_->GetRelease(c, {}, &r);
       }},
      {"ListReleases",
       [&](grpc::ClientContext* c) {
         v1::ListReleasesResponse r;
         return stub_->ListReleases(c, {}, &r);
       }},
      {"History",
       [&](grpc::ClientContext* c) {
         v1::HistoryResponse r;
         return stub_->History(c, {}, &r);
       }},
  };
  for (const auto& [name, call] : calls) {
    grpc::ClientContext none;
    EXPECT_EQ(call(&none).error_code(), grpc::StatusCode::UNAUTHENTICATED) << name;
    grpc::ClientContext wrong;
    wrong.AddMetadata("authorization", "Bearer 0123456789abcdef-tokeN");
    EXPECT_EQ(call(&wrong).error_code(), grpc::StatusCode::UNAUTHENTICATED) << name;
  }
  EXPECT_TRUE(store_->List()->empty());
  EXPECT_TRUE(store_->History("")->empty());
  // The right token is served.
  grpc::ClientContext ok;
  ok.AddMetadata("authorization", "Bearer 0123456789abcdef-token");
  v1::Release r;
  EXPECT_TRUE(stub_->RegisterRelease(&ok, reg, &r).ok());
  EXPECT_EQ(r.state(), v1::RELEASE_STATE_BUILT);
}

}  // namespace
}  // namespace moe
