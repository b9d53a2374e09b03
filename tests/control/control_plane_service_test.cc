// ControlPlaneServiceImpl as the gRPC edge alone, over a fake ReleaseManager, served on a real
// loopback socket: authorization comes before the manager, the request's fields reach it, its
// answers are encoded and its errors come back with their code and message.
#include "control/controller/control_plane_service.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "control/controller/release_manager.h"
#include "runtime/status.h"
#include "tests/control/control_plane_rpcs.h"

namespace moe {
namespace {

constexpr char kToken[] = "0123456789abcdef-token";
constexpr char kReadToken[] = "0123456789abcdef-reader";

// Records every call (the method and its arguments) and answers `error` when it is set.
class FakeReleaseManager final : public ReleaseManager {
 public:
  absl::StatusOr<ReleaseRecord> Get(const std::string& release_id) override {
    Record("Get", {release_id});
    RETURN_IF_ERROR(error);
    return release;
  }
  absl::StatusOr<std::vector<ReleaseRecord>> List() override {
    Record("List", {});
    RETURN_IF_ERROR(error);
    return std::vector<ReleaseRecord>{release};
  }
  absl::StatusOr<std::vector<StoredTransition>> History(const std::string& release_id, int64_t after_seq) override {
    Record("History", {release_id, absl::StrCat(after_seq)});
    RETURN_IF_ERROR(error);
    return transitions;
  }
  RankStatuses ClusterStatus() override {
    Record("ClusterStatus", {});
    RankStatuses ranks;
    v1::AgentStatusResponse up;
    up.set_active_version(7);
    ranks.emplace_back(up, "10.0.0.1:7000");
    ranks.emplace_back(absl::UnavailableError("connection refused"), "10.0.0.2:7000");
    return ranks;
  }
  absl::StatusOr<ReleaseRecord> Register(const std::string& request_id, const std::string& release_id,
                                         const std::string& bundle_digest, const std::string&) override {
    Record("Register", {request_id, release_id, bundle_digest});
    RETURN_IF_ERROR(error);
    return release;
  }
  absl::StatusOr<StoredTransition> Transition(const std::string& request_id, const std::string& release_id,
                                              ReleaseState to, const std::string& reason) override {
    Record("Transition", {request_id, release_id, std::string(ReleaseStateName(to)), reason});
    RETURN_IF_ERROR(error);
    return transitions.front();
  }
  absl::StatusOr<Promotion> Promote(const std::string& request_id, const std::string& release_id,
                                    const std::optional<GateEvidence>& evidence) override {
    Record("Promote", {request_id, release_id});
    promote_evidence = evidence;
    RETURN_IF_ERROR(error);
    Promotion p;
    p.evidence.inputs.canary_samples = 321;
    p.evidence.findings = {"rank 1 holds it"};
    p.transitions = transitions;
    p.release = release;
    return p;
  }
  absl::StatusOr<std::vector<StoredTransition>> Rollback(const std::string& request_id, const std::string& release_id,
                                                         const std::string& prior_release_id,
                                                         const std::string& reason) override {
    Record("Rollback", {request_id, release_id, prior_release_id, reason});
    RETURN_IF_ERROR(error);
    return transitions;
  }
  absl::StatusOr<ReleaseRecord> LoadPlacement(const std::string& request_id, const std::string& release_id,
                                              const v1::PlacementManifest& manifest) override {
    Record("LoadPlacement", {request_id, release_id, absl::StrCat(manifest.version())});
    RETURN_IF_ERROR(error);
    return release;
  }
  absl::Status Reconcile() override {
    Record("Reconcile", {});
    return error;
  }

  absl::Status error;  // answered by every call when not OK
  ReleaseRecord release{"release-v2", "sha256:2", ReleaseState::kCanary, 5, 2, ""};
  std::vector<StoredTransition> transitions = {
      {11, "req-9", 0, "release-v2", ReleaseState::kShadow, ReleaseState::kCanary, "looks good"},
      {12, "req-9", 1, "release-v1", ReleaseState::kActive, ReleaseState::kDraining, "replaced by release-v2"},
  };
  std::optional<GateEvidence> promote_evidence;

  // Every call so far, {method, arguments...} (Watch's handler may still be polling History).
  std::vector<std::vector<std::string>> calls() const {
    absl::MutexLock lock(&mu_);
    return calls_;
  }

 private:
  void Record(std::string method, std::vector<std::string> args) {
    args.insert(args.begin(), std::move(method));
    absl::MutexLock lock(&mu_);
    calls_.push_back(std::move(args));
  }

  mutable absl::Mutex mu_;
  std::vector<std::vector<std::string>> calls_;
};

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    service_ = std::make_unique<ControlPlaneServiceImpl>(&manager_, kToken, kReadToken);
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(service_.get());
    server_ = b.BuildAndStart();
    ASSERT_NE(port, 0);
    stub_ = v1::ControlPlaneService::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override { server_->Shutdown(); }

  std::unique_ptr<grpc::ClientContext> Ctx(const std::string& token = kToken) {
    auto c = std::make_unique<grpc::ClientContext>();
    if (!token.empty()) c->AddMetadata("authorization", absl::StrCat("Bearer ", token));
    return c;
  }

  FakeReleaseManager manager_;
  std::unique_ptr<ControlPlaneServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::ControlPlaneService::Stub> stub_;
};

using ::testing::ElementsAre;

TEST_F(ServiceTest, EveryRpcIsAuthorizedBeforeTheManagerIsCalled) {
  const auto calls = testing::EveryControlPlaneRpc(stub_.get());
  for (const auto& [name, call] : calls) {
    EXPECT_EQ(call(Ctx("").get()).error_code(), grpc::StatusCode::UNAUTHENTICATED) << name;
    EXPECT_EQ(call(Ctx("0123456789abcdef-tokeN").get()).error_code(), grpc::StatusCode::UNAUTHENTICATED) << name;
  }
  EXPECT_TRUE(manager_.calls().empty());
}

TEST_F(ServiceTest, TheReadOnlyTokenIsRefusedByEveryWriteBeforeTheManagerIsCalledAndServedByEveryRead) {
  const std::vector<std::string> writes = {"RegisterRelease", "TransitionRelease", "Promote", "Rollback",
                                           "LoadPlacement"};
  for (const auto& [name, call] : testing::EveryControlPlaneRpc(stub_.get())) {
    const bool write = std::find(writes.begin(), writes.end(), name) != writes.end();
    auto ctx = Ctx(kReadToken);
    // Watch streams until cancelled: a deadline ends it once the handler has polled.
    if (name == "Watch") ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
    const size_t before = manager_.calls().size();
    const grpc::Status s = call(ctx.get());
    if (write) {
      EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << name;
      EXPECT_THAT(s.error_message(), ::testing::StartsWith(name + ": the read-only token")) << name;
      EXPECT_EQ(manager_.calls().size(), before) << name << " reached the manager";
    } else {
      EXPECT_NE(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << name;
      EXPECT_NE(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << name;
      EXPECT_GT(manager_.calls().size(), before) << name << " did not reach the manager";
    }
  }
  // The operators' token still writes.
  v1::RegisterReleaseRequest req;
  req.set_request_id("req-1");
  req.set_release_id("release-v2");
  v1::Release r;
  EXPECT_TRUE(stub_->RegisterRelease(Ctx().get(), req, &r).ok());
}

TEST_F(ServiceTest, RegisterHandsTheFieldsOverAndEncodesTheRecord) {
  v1::RegisterReleaseRequest req;
  req.set_request_id("req-1");
  req.set_release_id("release-v2");
  req.set_bundle_digest("sha256:2");
  v1::Release r;
  ASSERT_TRUE(stub_->RegisterRelease(Ctx().get(), req, &r).ok());
  EXPECT_THAT(manager_.calls(), ElementsAre(ElementsAre("Register", "req-1", "release-v2", "sha256:2")));
  EXPECT_EQ(r.release_id(), "release-v2");
  EXPECT_EQ(r.bundle_digest(), "sha256:2");
  EXPECT_EQ(r.state(), v1::RELEASE_STATE_CANARY);
  EXPECT_EQ(r.revision(), 5);
  EXPECT_EQ(r.placement_version(), 2);
}

TEST_F(ServiceTest, TransitionDecodesTheStateAndRefusesAnUnknownOneItself) {
  v1::TransitionReleaseRequest req;
  req.set_request_id("req-2");
  req.set_release_id("release-v2");
  req.set_to(v1::RELEASE_STATE_SHADOW);
  req.set_reason("parity checked");
  v1::TransitionRecord t;
  ASSERT_TRUE(stub_->TransitionRelease(Ctx().get(), req, &t).ok());
  EXPECT_THAT(manager_.calls(),
              ElementsAre(ElementsAre("Transition", "req-2", "release-v2", "SHADOW", "parity checked")));
  EXPECT_EQ(t.seq(), 11);
  EXPECT_EQ(t.from(), v1::RELEASE_STATE_SHADOW);
  EXPECT_EQ(t.to(), v1::RELEASE_STATE_CANARY);
  EXPECT_EQ(t.reason(), "looks good");

  req.set_to(v1::RELEASE_STATE_UNSPECIFIED);
  grpc::Status s = stub_->TransitionRelease(Ctx().get(), req, &t);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), ::testing::StartsWith("to: unspecified or unknown release state"));
  EXPECT_EQ(manager_.calls().size(), 1u);  // not called again
}

// Names and reasons from the caller are bounded and free of control characters before the
// manager (and the registry, which keeps them for good) sees them: INVALID_ARGUMENT naming the
// field, the manager not called; values at the bounds pass.
TEST_F(ServiceTest, OverlongOrControlCharacterFieldsAreRefusedBeforeTheManager) {
  const std::string long_id(129, 'a'), max_id(128, 'a'), long_reason(1025, 'r'), max_reason(1024, 'r');
  const auto refused = [&](const grpc::Status& s, const std::string& field) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << field << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), ::testing::StartsWith(field + ": ")) << field;
  };
  v1::Release r;
  v1::RegisterReleaseRequest reg;
  reg.set_request_id("req-1");
  reg.set_release_id(long_id);
  refused(stub_->RegisterRelease(Ctx().get(), reg, &r), "release_id");
  reg.set_release_id("release-v2");
  reg.set_bundle_digest("sha256:2\nforged line");
  refused(stub_->RegisterRelease(Ctx().get(), reg, &r), "bundle_digest");
  reg.set_bundle_digest("sha256:2");
  reg.set_request_id(std::string("req\0x", 5));
  refused(stub_->RegisterRelease(Ctx().get(), reg, &r), "request_id");

  v1::TransitionReleaseRequest tr;
  tr.set_request_id("req-2");
  tr.set_release_id("release-v2");
  tr.set_to(v1::RELEASE_STATE_SHADOW);
  tr.set_reason(long_reason);
  v1::TransitionRecord t;
  refused(stub_->TransitionRelease(Ctx().get(), tr, &t), "reason");

  v1::RollbackRequest rb;
  rb.set_request_id("req-3");
  rb.set_release_id("release-v2");
  rb.set_prior_release_id(long_id);
  rb.set_reason("bad");
  v1::RollbackResponse rr;
  refused(stub_->Rollback(Ctx().get(), rb, &rr), "prior_release_id");

  v1::PromoteRequest pr;
  pr.set_request_id(long_id);
  pr.set_release_id("release-v2");
  v1::PromoteResponse presp;
  refused(stub_->Promote(Ctx().get(), pr, &presp), "request_id");
  pr.set_request_id("req-4");
  for (int i = 0; i < 65; ++i) pr.mutable_evidence()->add_findings("f");
  refused(stub_->Promote(Ctx().get(), pr, &presp), "evidence.findings");
  pr.mutable_evidence()->clear_findings();
  pr.mutable_evidence()->add_findings("ok");
  pr.mutable_evidence()->add_findings(long_reason);
  refused(stub_->Promote(Ctx().get(), pr, &presp), "evidence.findings[1]");

  v1::LoadPlacementRequest lp;
  lp.set_request_id("req-5");
  lp.set_release_id(long_id);
  refused(stub_->LoadPlacement(Ctx().get(), lp, &r), "release_id");
  EXPECT_TRUE(manager_.calls().empty());

  // At the bounds: served.
  tr.set_request_id(max_id);
  tr.set_release_id(max_id);
  tr.set_reason(max_reason);
  EXPECT_TRUE(stub_->TransitionRelease(Ctx().get(), tr, &t).ok());
  EXPECT_EQ(manager_.calls().size(), 1u);
}

TEST_F(ServiceTest, ManagerErrorsKeepTheirCodeAndMessage) {
  const std::vector<absl::Status> errors = {
      absl::FailedPreconditionError("to: ACTIVE is reached through Promote (the 0x0DC gate)"),
      absl::AlreadyExistsError("request_id: 'r' was used for another request"),
      absl::NotFoundError("release_id: no release 'x'"),
      absl::UnavailableError("rank 127.0.0.1:1: connection refused"),
      absl::DeadlineExceededError("rollback committed; on the ranks: slow"),
  };
  for (const absl::Status& e : errors) {
    manager_.error = e;
    v1::RollbackRequest rb;
    v1::RollbackResponse rr;
    grpc::Status s = stub_->Rollback(Ctx().get(), rb, &rr);
    EXPECT_EQ(static_cast<int>(s.error_code()), static_cast<int>(e.code()));
    EXPECT_EQ(s.error_message(), e.message());
    v1::TransitionReleaseRequest tr;
    tr.set_to(v1::RELEASE_STATE_RETIRED);
    v1::TransitionRecord t;
    s = stub_->TransitionRelease(Ctx().get(), tr, &t);
    EXPECT_EQ(static_cast<int>(s.error_code()), static_cast<int>(e.code()));
    EXPECT_EQ(s.error_message(), e.message());
    v1::GetReleaseRequest get;
    v1::Release r;
    s = stub_->GetRelease(Ctx().get(), get, &r);
    EXPECT_EQ(static_cast<int>(s.error_code()), static_cast<int>(e.code()));
    EXPECT_EQ(s.error_message(), e.message());
  }
}

TEST_F(ServiceTest, PromoteDecodesOperatorEvidenceAndEncodesTheResult) {
  v1::PromoteRequest req;
  req.set_request_id("req-3");
  req.set_release_id("release-v2");
  v1::PromoteResponse resp;
  ASSERT_TRUE(stub_->Promote(Ctx().get(), req, &resp).ok());
  EXPECT_FALSE(manager_.promote_evidence.has_value());  // none given: the manager reads the ranks
  EXPECT_EQ(resp.evidence().canary_samples(), 321);
  EXPECT_THAT(resp.evidence().findings(), ElementsAre("rank 1 holds it"));
  EXPECT_EQ(resp.drained_release_id(), "release-v1");
  EXPECT_EQ(resp.release().release_id(), "release-v2");

  v1::PromotionEvidence* e = req.mutable_evidence();
  e->set_hash_ok(true);
  e->set_rollback_ok(true);
  e->set_shadow_samples(100);
  e->set_routes_dropped(3);
  e->set_count_failures(2);
  e->add_findings("operator says so");
  ASSERT_TRUE(stub_->Promote(Ctx().get(), req, &resp).ok());
  ASSERT_TRUE(manager_.promote_evidence.has_value());
  const GateEvidence& g = *manager_.promote_evidence;
  EXPECT_TRUE(g.inputs.hash_ok);
  EXPECT_FALSE(g.inputs.manifest_ok);
  EXPECT_TRUE(g.inputs.rollback_ok);
  EXPECT_EQ(g.inputs.shadow_samples, 100);
  EXPECT_EQ(g.inputs.routes_dropped, 3);
  EXPECT_EQ(g.inputs.count_failures, 2);
  EXPECT_THAT(g.findings, ElementsAre("operator says so"));
  EXPECT_THAT(manager_.calls().back(), ElementsAre("Promote", "req-3", "release-v2"));
}

TEST_F(ServiceTest, RollbackLoadAndReadsReachTheManager) {
  v1::RollbackRequest rb;
  rb.set_request_id("req-4");
  rb.set_release_id("release-v2");
  rb.set_prior_release_id("release-v1");
  v1::RollbackResponse rr;
  ASSERT_TRUE(stub_->Rollback(Ctx().get(), rb, &rr).ok());
  ASSERT_EQ(rr.transitions_size(), 2);
  EXPECT_EQ(rr.transitions(1).release_id(), "release-v1");

  v1::LoadPlacementRequest load;
  load.set_request_id("req-5");
  load.set_release_id("release-v2");
  v1::Release r;
  // No manifest: the manager decides (the release bundle's placement, or INVALID_ARGUMENT for a
  // release without one: controller_test / fault_table_test).
  ASSERT_TRUE(stub_->LoadPlacement(Ctx().get(), load, &r).ok());
  load.mutable_manifest()->set_version(4);
  ASSERT_TRUE(stub_->LoadPlacement(Ctx().get(), load, &r).ok());

  v1::HistoryRequest history;
  history.set_release_id("release-v2");
  v1::HistoryResponse hr;
  ASSERT_TRUE(stub_->History(Ctx().get(), history, &hr).ok());
  EXPECT_EQ(hr.transitions_size(), 2);
  v1::ListReleasesResponse lr;
  ASSERT_TRUE(stub_->ListReleases(Ctx().get(), {}, &lr).ok());
  EXPECT_EQ(lr.releases_size(), 1);
  EXPECT_THAT(manager_.calls(), ElementsAre(ElementsAre("Rollback", "req-4", "release-v2", "release-v1", ""),
                                            ElementsAre("LoadPlacement", "req-5", "release-v2", "0"),
                                            ElementsAre("LoadPlacement", "req-5", "release-v2", "4"),
                                            ElementsAre("History", "release-v2", "0"), ElementsAre("List")));
}

TEST_F(ServiceTest, ClusterStatusReportsEachRankOrItsError) {
  v1::ClusterStatusResponse resp;
  ASSERT_TRUE(stub_->ClusterStatus(Ctx().get(), {}, &resp).ok());
  ASSERT_EQ(resp.ranks_size(), 2);
  EXPECT_EQ(resp.ranks(0).address(), "10.0.0.1:7000");
  EXPECT_EQ(resp.ranks(0).status().active_version(), 7);
  EXPECT_EQ(resp.ranks(1).address(), "10.0.0.2:7000");
  EXPECT_EQ(resp.ranks(1).error(), "connection refused");
}

TEST_F(ServiceTest, WatchRefusesANegativeSeqAndStreamsFromTheManager) {
  v1::WatchRequest req;
  req.set_after_seq(-1);
  auto refused_ctx = Ctx();  // outlives the stream
  auto refused = stub_->Watch(refused_ctx.get(), req);
  v1::TransitionRecord r;
  EXPECT_FALSE(refused->Read(&r));
  EXPECT_EQ(refused->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(manager_.calls().empty());

  req.set_after_seq(10);
  req.set_release_id("release-v2");
  auto ctx = Ctx();
  auto reader = stub_->Watch(ctx.get(), req);
  ASSERT_TRUE(reader->Read(&r));
  EXPECT_EQ(r.seq(), 11);
  ASSERT_TRUE(reader->Read(&r));
  EXPECT_EQ(r.seq(), 12);
  ctx->TryCancel();
  while (reader->Read(&r)) {
  }
  (void)reader->Finish();
  ASSERT_FALSE(manager_.calls().empty());
  EXPECT_THAT(manager_.calls().front(), ElementsAre("History", "release-v2", "10"));
}

}  // namespace
}  // namespace moe
