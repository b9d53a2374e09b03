// Every ControlPlaneService RPC refuses a call without the bearer token, or with another one,
// before touching the registry, and the read-only token reads but never writes; served over a
// real loopback socket.
#include <unistd.h>

#include <cstdlib>
#include <memory>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

#include "control/controller/control_plane_service.h"
#include "control/controller/release_manager.h"
#include "tests/control/control_plane_rpcs.h"

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
    service_ =
        std::make_unique<ControlPlaneServiceImpl>(manager_.get(), "0123456789abcdef-token", "0123456789abcdef-reader");
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
  const auto calls = testing::EveryControlPlaneRpc(stub_.get());
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
  v1::RegisterReleaseRequest reg;
  reg.set_request_id("r1");
  reg.set_release_id("release-v1");
  reg.set_bundle_digest("sha256:1");
  EXPECT_TRUE(stub_->RegisterRelease(&ok, reg, &r).ok());
  EXPECT_EQ(r.state(), v1::RELEASE_STATE_BUILT);
}

TEST_F(AuthTest, TheReadOnlyTokenReadsTheRegistryAndChangesNothing) {
  auto ctx = [](const char* token) {
    auto c = std::make_unique<grpc::ClientContext>();
    c->AddMetadata("authorization", absl::StrCat("Bearer ", token));
    return c;
  };
  v1::RegisterReleaseRequest reg;
  reg.set_request_id("r0");
  reg.set_release_id("release-v0");
  reg.set_bundle_digest("sha256:0");
  v1::Release r;
  ASSERT_TRUE(stub_->RegisterRelease(ctx("0123456789abcdef-token").get(), reg, &r).ok());
  const size_t history = store_->History("")->size();
  // The reads a dashboard or `moectl status` makes.
  v1::ListReleasesResponse list;
  ASSERT_TRUE(stub_->ListReleases(ctx("0123456789abcdef-reader").get(), {}, &list).ok());
  ASSERT_EQ(list.releases_size(), 1);
  EXPECT_EQ(list.releases(0).release_id(), "release-v0");
  v1::GetReleaseRequest get;
  get.set_release_id("release-v0");
  ASSERT_TRUE(stub_->GetRelease(ctx("0123456789abcdef-reader").get(), get, &r).ok());
  EXPECT_EQ(r.state(), v1::RELEASE_STATE_BUILT);
  v1::HistoryResponse h;
  ASSERT_TRUE(stub_->History(ctx("0123456789abcdef-reader").get(), {}, &h).ok());
  EXPECT_EQ(static_cast<size_t>(h.transitions_size()), history);
  // Every write, each a request that would commit something: refused, and nothing committed.
  for (const auto& [name, call] : testing::EveryControlPlaneRpc(stub_.get())) {
    if (name == "ClusterStatus" || name == "GetRelease" || name == "ListReleases" || name == "History" ||
        name == "Watch") {
      continue;
    }
    const grpc::Status s = call(ctx("0123456789abcdef-reader").get());
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << name << ": " << s.error_message();
  }
  ASSERT_EQ(store_->List()->size(), 1u);
  EXPECT_EQ(store_->List()->front().release_id, "release-v0");
  EXPECT_EQ(store_->History("")->size(), history);
}

}  // namespace
}  // namespace moe
