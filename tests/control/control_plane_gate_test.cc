// The controller's gates against rank agents whose reports the test controls (in-process
// RankAgentService fakes on loopback sockets, the real ControlPlaneServiceImpl and AgentPool):
//  - SHADOW -> CANARY is refused when the ranks counted shadow mismatches (0x0E: runner parity
//    differs -> block canary), and the candidate is drained: DRAINING, trials stopped;
//  - the promotion gate's clauses come from the ranks: HashOK from the manifest digest every rank
//    reports against the one the controller computes over the manifest it recorded, RollbackOK
//    from the prior placement's state on every rank, stale accepts summed, and r_fallback over
//    all steps.
#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "control/controller/control_plane_service.h"
#include "control/controller/release_manager.h"
#include "rpc/placement_proto.h"
#include "runtime/placement/default_placement.h"
#include "tests/control/registry_sql.h"

namespace moe {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr int kRanks = 2;
constexpr char kToken[] = "0123456789abcdef-token";

// A rank agent that holds generations as a real one would (prepare / activate / retire) and
// answers Status with counters the test sets.
class FakeRank final : public v1::RankAgentService::Service {
 public:
  // Serves process-group epoch 1 on `node` (the controller binds manifests to what ranks report).
  explicit FakeRank(const std::string& node) {
    status_.set_process_group_epoch(1);
    status_.set_node(node);
  }
  grpc::Status PrepareGeneration(grpc::ServerContext*, const v1::PrepareGenerationRequest* req,
                                 v1::GenerationStatus* resp) override {
    const Topology topology = TwoNodeTopology(kRanks);
    auto m = ManifestFromProto(req->manifest(), topology);
    if (!m.ok()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(m.status().message()));
    absl::MutexLock lock(&mu_);
    if (refuse_prepare_) return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "out of device memory");
    v1::GenerationStatus* g = Find(req->manifest().version());
    if (g == nullptr) {
      g = status_.add_generations();
      g->set_version(req->manifest().version());
      g->set_state(v1::GENERATION_STATE_PREPARED);
      g->set_manifest_digest(PlacementDigest(**m));
    }
    *resp = *g;
    return grpc::Status::OK;
  }
  grpc::Status ActivateGeneration(grpc::ServerContext*, const v1::GenerationRequest* req,
                                  v1::GenerationStatus* resp) override {
    absl::MutexLock lock(&mu_);
    for (v1::GenerationStatus& g : *status_.mutable_generations()) {
      if (g.state() == v1::GENERATION_STATE_ACTIVE && g.version() != req->version()) {
        g.set_state(v1::GENERATION_STATE_DRAINING);
      }
    }
    v1::GenerationStatus* g = Find(req->version());
    if (g == nullptr) return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown version");
    g->set_state(v1::GENERATION_STATE_ACTIVE);
    status_.set_active_version(req->version());
    calls_.push_back(absl::StrCat("activate v", req->version()));
    *resp = *g;
    return grpc::Status::OK;
  }
  grpc::Status RetireGeneration(grpc::ServerContext*, const v1::GenerationRequest* req,
                                v1::GenerationStatus* resp) override {
    absl::MutexLock lock(&mu_);
    v1::GenerationStatus* g = Find(req->version());
    if (g == nullptr) return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown version");
    g->set_state(v1::GENERATION_STATE_RETIRED);
    calls_.push_back(absl::StrCat("retire v", req->version()));
    *resp = *g;
    return grpc::Status::OK;
  }
  grpc::Status DiscardGeneration(grpc::ServerContext*, const v1::GenerationRequest* req,
                                 v1::GenerationStatus* resp) override {
    absl::MutexLock lock(&mu_);
    calls_.push_back(absl::StrCat("discard v", req->version()));
    resp->set_version(req->version());
    auto* gens = status_.mutable_generations();
    for (int i = 0; i < gens->size(); ++i) {
      if (gens->Get(i).version() != req->version()) continue;
      if (gens->Get(i).state() != v1::GENERATION_STATE_PREPARED) {
        return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "served");
      }
      gens->DeleteSubrange(i, 1);
      break;
    }
    return grpc::Status::OK;
  }
  grpc::Status SetTrial(grpc::ServerContext*, const v1::TrialRequest* req, v1::TrialRequest* resp) override {
    absl::MutexLock lock(&mu_);
    // As a real rank: a stop of another generation's trial leaves the one running.
    const bool other_stop =
        req->version() == 0 && req->stop_version() > 0 && status_.trial().version() != req->stop_version();
    if (!other_stop) {
      *status_.mutable_trial() = *req;
      status_.mutable_trial()->clear_stop_version();
    }
    *resp = status_.trial();
    return grpc::Status::OK;
  }
  grpc::Status Status(grpc::ServerContext*, const v1::AgentStatusRequest*, v1::AgentStatusResponse* resp) override {
    absl::MutexLock lock(&mu_);
    *resp = status_;
    return grpc::Status::OK;
  }

  // The counters this rank reports for `version` (replacing earlier ones).
  void SetCounters(v1::GenerationCounters c) {
    absl::MutexLock lock(&mu_);
    for (v1::GenerationCounters& x : *status_.mutable_counters()) {
      if (x.version() == c.version()) {
        x = c;
        return;
      }
    }
    *status_.add_counters() = c;
  }
  void SetDigest(int64_t version, const std::string& digest) {
    absl::MutexLock lock(&mu_);
    Find(version)->set_manifest_digest(digest);
  }
  std::string Digest(int64_t version) {
    absl::MutexLock lock(&mu_);
    return Find(version)->manifest_digest();
  }
  void SetState(int64_t version, v1::GenerationState s) {
    absl::MutexLock lock(&mu_);
    Find(version)->set_state(s);
  }
  v1::TrialRequest Trial() {
    absl::MutexLock lock(&mu_);
    return status_.trial();
  }
  // The placement this rank serves, as after a restart on its boot placement.
  void SetActive(int64_t version) {
    absl::MutexLock lock(&mu_);
    status_.set_active_version(version);
  }
  void SetRefcount(int64_t version, int64_t n) {
    absl::MutexLock lock(&mu_);
    Find(version)->set_refcount(n);
  }
  // PrepareGeneration fails here (RESOURCE_EXHAUSTED) while set.
  void RefusePrepare(bool refuse) {
    absl::MutexLock lock(&mu_);
    refuse_prepare_ = refuse;
  }
  bool Holds(int64_t version) {
    absl::MutexLock lock(&mu_);
    return Find(version) != nullptr;
  }
  // The Activate / Retire / Discard calls since the last TakeCalls, in order.
  std::vector<std::string> TakeCalls() {
    absl::MutexLock lock(&mu_);
    return std::exchange(calls_, {});
  }

 private:
  v1::GenerationStatus* Find(int64_t version) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (v1::GenerationStatus& g : *status_.mutable_generations()) {
      if (g.version() == version) return &g;
    }
    return nullptr;
  }
  absl::Mutex mu_;
  v1::AgentStatusResponse status_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> calls_ ABSL_GUARDED_BY(mu_);
  bool refuse_prepare_ ABSL_GUARDED_BY(mu_) = false;
};

v1::PlacementManifest Manifest(int64_t version) {
  std::map<std::string, std::string> md = {{"checkpoint", "checkpoint-0042"}};
  for (int e = 0; e < 4; ++e) md[absl::StrCat("digest.", e)] = absl::StrCat("expert-", e, "-digest");
  auto m = DefaultPlacement(PlacementVersion(version), 4, version % 2, TwoNodeTopology(kRanks),
                            LocalClusterGroup(kRanks, 1), md);
  EXPECT_TRUE(m.ok()) << m.status();
  return ManifestToProto(**m, TwoNodeTopology(kRanks));
}

class GateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::vector<std::string> addresses;
    for (int r = 0; r < kRanks; ++r) {
      ranks_.push_back(
          std::make_unique<FakeRank>(TwoNodeTopology(kRanks).NodeName(TwoNodeTopology(kRanks).NodeOf(Rank(r)))));
      grpc::ServerBuilder b;
      int port = 0;
      b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
      b.RegisterService(ranks_.back().get());
      rank_servers_.push_back(b.BuildAndStart());
      ASSERT_NE(port, 0);
      addresses.push_back(absl::StrCat("127.0.0.1:", port));
    }
    const char* dir = std::getenv("TEST_TMPDIR");
    const std::string path = absl::StrCat(dir != nullptr ? dir : "/tmp", "/gate-", getpid(), ".db");
    for (const char* suffix : {"", "-wal", "-shm"}) unlink((path + suffix).c_str());
    store_path_ = path;
    store_ = *ReleaseStore::Open(path);
    pool_ = std::make_unique<AgentPool>(addresses, "agent-token", absl::Seconds(10));
    PromotionThresholds thresholds;
    thresholds.min_shadow = 10;
    thresholds.min_canary = 10;
    manager_ = std::make_unique<StoreReleaseManager>(store_.get(), thresholds, pool_.get(), TwoNodeTopology(kRanks),
                                                     absl::Seconds(5), MigrationBudget{}, TrialPolicy{2, 3, 0});
    service_ = std::make_unique<ControlPlaneServiceImpl>(manager_.get(), kToken);
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(service_.get());
    server_ = b.BuildAndStart();
    ASSERT_NE(port, 0);
    stub_ = v1::ControlPlaneService::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    server_->Shutdown();
    for (auto& s : rank_servers_) s->Shutdown();
  }

  std::unique_ptr<grpc::ClientContext> Ctx() {
    auto c = std::make_unique<grpc::ClientContext>();
    c->AddMetadata("authorization", absl::StrCat("Bearer ", kToken));
    return c;
  }
  grpc::Status Transition(const std::string& request_id, const std::string& id, v1::ReleaseState to) {
    v1::TransitionReleaseRequest req;
    req.set_request_id(request_id);
    req.set_release_id(id);
    req.set_to(to);
    req.set_reason("test");
    v1::TransitionRecord rec;
    return stub_->TransitionRelease(Ctx().get(), req, &rec);
  }
  // Register `id` and verify it.
  void RegisterVerified(const std::string& id) {
    v1::RegisterReleaseRequest reg;
    reg.set_request_id(id + ":register");
    reg.set_release_id(id);
    reg.set_bundle_digest("sha256:" + id);
    v1::Release rel;
    ASSERT_TRUE(stub_->RegisterRelease(Ctx().get(), reg, &rel).ok());
    ASSERT_TRUE(Transition(id + ":verify", id, v1::RELEASE_STATE_VERIFIED).ok());
  }
  // Register, verify, load `version` on the ranks, SHADOW.
  void ToShadow(const std::string& id, int64_t version) { ToShadow(id, Manifest(version)); }
  void ToShadow(const std::string& id, const v1::PlacementManifest& manifest) {
    RegisterVerified(id);
    v1::Release rel;
    v1::LoadPlacementRequest load;
    load.set_request_id(id + ":load");
    load.set_release_id(id);
    *load.mutable_manifest() = manifest;
    grpc::Status loaded = stub_->LoadPlacement(Ctx().get(), load, &rel);
    ASSERT_TRUE(loaded.ok()) << loaded.error_message();
    ASSERT_TRUE(Transition(id + ":shadow", id, v1::RELEASE_STATE_SHADOW).ok());
  }
  v1::Release Get(const std::string& id) {
    v1::GetReleaseRequest req;
    req.set_release_id(id);
    v1::Release rel;
    EXPECT_TRUE(stub_->GetRelease(Ctx().get(), req, &rel).ok());
    return rel;
  }
  std::vector<v1::TransitionRecord> History(const std::string& id) {
    v1::HistoryRequest req;
    req.set_release_id(id);
    v1::HistoryResponse resp;
    EXPECT_TRUE(stub_->History(Ctx().get(), req, &resp).ok());
    return {resp.transitions().begin(), resp.transitions().end()};
  }
  grpc::Status Promote(const std::string& request_id, const std::string& id, v1::PromoteResponse* resp,
                       const v1::PromotionEvidence* evidence = nullptr) {
    v1::PromoteRequest req;
    req.set_request_id(request_id);
    req.set_release_id(id);
    if (evidence != nullptr) *req.mutable_evidence() = *evidence;
    return stub_->Promote(Ctx().get(), req, resp);
  }
  // release-v1 on placement-v1, promoted with operator evidence (nothing to roll back to yet).
  void Bootstrap() {
    ToShadow("release-v1", 1);
    ASSERT_TRUE(Transition("release-v1:canary", "release-v1", v1::RELEASE_STATE_CANARY).ok());
    v1::PromotionEvidence e;
    e.set_hash_ok(true);
    e.set_manifest_ok(true);
    e.set_faults_ok(true);
    e.set_rollback_ok(true);
    e.set_shadow_samples(100);
    e.set_canary_samples(200);
    e.set_routes_attempted(800);
    e.set_steps(240);
    v1::PromoteResponse resp;
    grpc::Status s = Promote("release-v1:promote", "release-v1", &resp, &e);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  // release-v1 ACTIVE on placement-v1 (Bootstrap), then release-v2 on placement-v2 through a
  // healthy canary and promoted from the ranks' counters: release-v1 DRAINING, the prior.
  void PromoteV2OverV1() {
    Bootstrap();
    ToShadow("release-v2", 2);
    for (auto& r : ranks_) r->SetCounters(Healthy(2));
    ASSERT_TRUE(Transition("release-v2:canary", "release-v2", v1::RELEASE_STATE_CANARY).ok());
    v1::PromoteResponse promoted;
    const grpc::Status s = Promote("p2", "release-v2", &promoted);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  // Rank `lost` leaves the group, which serves epoch 2 on the survivors; its agent stops.
  void LoseRank(int lost) {
    AgentGroup survivors;
    survivors.epoch = 2;
    survivors.addresses = pool_->addresses();
    survivors.addresses[lost] = "";
    for (int r = 0; r < kRanks; ++r) {
      survivors.node_of_rank.push_back(TwoNodeTopology(kRanks).NodeName(TwoNodeTopology(kRanks).NodeOf(Rank(r))));
    }
    pool_->SetGroup(survivors);
    rank_servers_[lost]->Shutdown();
  }
  // A rollback of release-v2 to release-v1 under `request_id`.
  static v1::RollbackRequest RollbackV2ToV1(const std::string& request_id) {
    v1::RollbackRequest req;
    req.set_request_id(request_id);
    req.set_release_id("release-v2");
    req.set_prior_release_id("release-v1");
    req.set_reason("candidate faulted");
    return req;
  }
  // Counters of a healthy candidate on one rank: 120 steps of which 50 decode, 12 fallback.
  static v1::GenerationCounters Healthy(int64_t version) {
    v1::GenerationCounters c;
    c.set_version(version);
    c.set_steps(120);
    c.set_decode_steps(50);
    c.set_fallback_steps(12);
    c.set_canary_steps(10);
    c.set_shadow_samples(10);
    c.set_routes_attempted(400);
    return c;
  }

  // Runs `sql` on the registry's file (tests/control/registry_sql.h).
  void Sql(const std::string& sql) { testing::RegistrySql(store_path_, sql); }

  std::vector<std::unique_ptr<FakeRank>> ranks_;
  std::vector<std::unique_ptr<grpc::Server>> rank_servers_;
  std::string store_path_;
  std::unique_ptr<ReleaseStore> store_;
  std::unique_ptr<AgentPool> pool_;
  std::unique_ptr<StoreReleaseManager> manager_;
  std::unique_ptr<ControlPlaneServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::ControlPlaneService::Stub> stub_;
};

// A load that one rank refuses leaves nothing prepared on the others: each is asked to discard
// the version, the release stays VERIFIED, and the same request succeeds once the rank can.
TEST_F(GateTest, ALoadOneRankRefusesIsDiscardedOnEveryRank) {
  Bootstrap();
  for (auto& r : ranks_) r->TakeCalls();
  RegisterVerified("release-v2");
  v1::Release rel;
  ranks_[1]->RefusePrepare(true);
  v1::LoadPlacementRequest load;
  load.set_request_id("release-v2:load");
  load.set_release_id("release-v2");
  *load.mutable_manifest() = Manifest(2);
  grpc::Status refused = stub_->LoadPlacement(Ctx().get(), load, &rel);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_THAT(refused.error_message(), HasSubstr("rank 1"));
  EXPECT_THAT(refused.error_message(), HasSubstr("no rank holds it now"));
  EXPECT_FALSE(ranks_[0]->Holds(2));  // rank 0 had prepared it
  for (auto& r : ranks_) EXPECT_EQ(r->TakeCalls(), std::vector<std::string>{"discard v2"});
  EXPECT_EQ(Get("release-v2").state(), v1::RELEASE_STATE_VERIFIED);
  EXPECT_TRUE(ranks_[0]->Holds(1));  // the serving placement untouched
  ranks_[1]->RefusePrepare(false);
  grpc::Status loaded = stub_->LoadPlacement(Ctx().get(), load, &rel);
  ASSERT_TRUE(loaded.ok()) << loaded.error_message();
  EXPECT_EQ(Get("release-v2").state(), v1::RELEASE_STATE_LOADED);
  for (auto& r : ranks_) EXPECT_TRUE(r->Holds(2));
}

// Every rank prepared the load but the registry could not record it LOADED: the ranks discard
// it too (nothing stays allocated for a load no release records), and the load succeeds once the
// registry records again.
TEST_F(GateTest, ALoadTheRegistryCannotRecordIsDiscardedOnEveryRank) {
  Bootstrap();
  RegisterVerified("release-v2");
  v1::Release rel;
  for (auto& r : ranks_) r->TakeCalls();
  Sql("CREATE TRIGGER refuse_loads BEFORE INSERT ON transitions WHEN NEW.to_state = 'LOADED' "
      "BEGIN SELECT RAISE(ABORT, 'refused by the test'); END;");
  v1::LoadPlacementRequest load;
  load.set_request_id("release-v2:load");
  load.set_release_id("release-v2");
  *load.mutable_manifest() = Manifest(2);
  grpc::Status refused = stub_->LoadPlacement(Ctx().get(), load, &rel);
  EXPECT_FALSE(refused.ok());
  EXPECT_THAT(refused.error_message(), HasSubstr("refused by the test"));
  EXPECT_THAT(refused.error_message(), HasSubstr("no rank holds it now"));
  for (auto& r : ranks_) {
    EXPECT_FALSE(r->Holds(2));
    EXPECT_EQ(r->TakeCalls(), std::vector<std::string>{"discard v2"});
  }
  EXPECT_EQ(Get("release-v2").state(), v1::RELEASE_STATE_VERIFIED);
  Sql("DROP TRIGGER refuse_loads;");
  grpc::Status loaded = stub_->LoadPlacement(Ctx().get(), load, &rel);
  ASSERT_TRUE(loaded.ok()) << loaded.error_message();
  EXPECT_EQ(Get("release-v2").state(), v1::RELEASE_STATE_LOADED);
  for (auto& r : ranks_) EXPECT_TRUE(r->Holds(2));
}

// A transition the registry would refuse (no request id, no reason) drives no rank first: a
// RETIRED without a reason left the ranks without the generation and the registry DRAINING,
// and a CANARY without a request id whose parity fails drained the candidate under "/blocked".
TEST_F(GateTest, ARefusedTransitionDrivesNoRank) {
  auto transition = [&](const std::string& request_id, const std::string& id, v1::ReleaseState to,
                        const std::string& reason) {
    v1::TransitionReleaseRequest req;
    req.set_request_id(request_id);
    req.set_release_id(id);
    req.set_to(to);
    req.set_reason(reason);
    v1::TransitionRecord rec;
    return stub_->TransitionRelease(Ctx().get(), req, &rec);
  };
  ToShadow("release-v1", 1);
  ASSERT_TRUE(transition("drain-1", "release-v1", v1::RELEASE_STATE_DRAINING, "stop").ok());
  ToShadow("release-v2", 2);
  v1::GenerationCounters drift = Healthy(2);
  drift.set_shadow_mismatches(4);  // a CANARY of release-v2 is blocked
  for (auto& r : ranks_) r->SetCounters(drift);
  RegisterVerified("release-v9");
  for (auto& r : ranks_) r->TakeCalls();
  const size_t before = History("").size();

  grpc::Status s = transition("retire-1", "release-v1", v1::RELEASE_STATE_RETIRED, "");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("reason"));
  s = transition("", "release-v1", v1::RELEASE_STATE_RETIRED, "done");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("request_id"));
  s = transition("", "release-v2", v1::RELEASE_STATE_CANARY, "go");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("request_id"));
  for (auto& r : ranks_) {
    EXPECT_TRUE(r->TakeCalls().empty());
    EXPECT_EQ(r->Trial().version(), 2);  // release-v2's shadow trials still running
  }
  // A request id already used for a registration (no transitions recorded under it): refused
  // before the ranks retire the generation, not after (the registry still said DRAINING).
  s = transition("release-v2:register", "release-v1", v1::RELEASE_STATE_RETIRED, "done");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_THAT(s.error_message(), HasSubstr("was used for another request"));
  {
    v1::LoadPlacementRequest load;  // the same for a load: no rank prepares it
    load.set_request_id("release-v2:register");
    load.set_release_id("release-v9");
    *load.mutable_manifest() = Manifest(9);
    v1::Release rel;
    s = stub_->LoadPlacement(Ctx().get(), load, &rel);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  }
  for (auto& r : ranks_) {
    EXPECT_TRUE(r->TakeCalls().empty());
    EXPECT_EQ(r->Trial().version(), 2);
  }
  EXPECT_EQ(Get("release-v1").state(), v1::RELEASE_STATE_DRAINING);
  EXPECT_EQ(Get("release-v2").state(), v1::RELEASE_STATE_SHADOW);
  EXPECT_EQ(History("").size(), before);
  // The same retirement, asked properly, retires on every rank.
  s = transition("retire-2", "release-v1", v1::RELEASE_STATE_RETIRED, "done");
  ASSERT_TRUE(s.ok()) << s.error_message();
  for (auto& r : ranks_) EXPECT_EQ(r->TakeCalls(), std::vector<std::string>{"retire v1"});
  EXPECT_EQ(Get("release-v1").state(), v1::RELEASE_STATE_RETIRED);
}

// A late retry of a transition the release has since left answers the recorded transition and
// drives no trial: CANARY, then DRAINING, then the CANARY request again leaves trials stopped.
TEST_F(GateTest, ALateRetryDoesNotRestartTrials) {
  ToShadow("release-v2", 2);
  for (auto& r : ranks_) r->SetCounters(Healthy(2));
  ASSERT_TRUE(Transition("release-v2:canary", "release-v2", v1::RELEASE_STATE_CANARY).ok());
  ASSERT_EQ(ranks_[0]->Trial().canary_every(), 3);
  ASSERT_TRUE(Transition("release-v2:drain", "release-v2", v1::RELEASE_STATE_DRAINING).ok());
  for (auto& r : ranks_) ASSERT_EQ(r->Trial().version(), 0);
  const grpc::Status s = Transition("release-v2:canary", "release-v2", v1::RELEASE_STATE_CANARY);
  EXPECT_TRUE(s.ok()) << s.error_message();  // the recorded answer
  for (auto& r : ranks_) {
    EXPECT_EQ(r->Trial().version(), 0);
    EXPECT_EQ(r->Trial().canary_every(), 0);
  }
  EXPECT_EQ(Get("release-v2").state(), v1::RELEASE_STATE_DRAINING);
}

TEST_F(GateTest, ShadowMismatchesBlockCanaryAndDrainTheCandidate) {
  Bootstrap();
  ToShadow("release-v2", 2);
  ASSERT_EQ(ranks_[0]->Trial().version(), 2);  // shadow trials running
  v1::GenerationCounters drift = Healthy(2);
  drift.set_canary_steps(0);
  ranks_[0]->SetCounters(drift);
  drift.set_shadow_mismatches(4);  // rank 1's shadow outputs differ
  ranks_[1]->SetCounters(drift);
  const size_t before = History("").size();

  grpc::Status s = Transition("release-v2:canary", "release-v2", v1::RELEASE_STATE_CANARY);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("4 shadow mismatches and 0 failed shadow passes of placement-v2"));
  EXPECT_THAT(s.error_message(), HasSubstr("--max_shadow_mismatches 0"));
  EXPECT_THAT(s.error_message(), HasSubstr("drained"));
  // Drained, never CANARY; the ranks' trials stopped.
  EXPECT_EQ(Get("release-v2").state(), v1::RELEASE_STATE_DRAINING);
  const std::vector<v1::TransitionRecord> h = History("release-v2");
  ASSERT_FALSE(h.empty());
  EXPECT_EQ(h.back().from(), v1::RELEASE_STATE_SHADOW);
  EXPECT_EQ(h.back().to(), v1::RELEASE_STATE_DRAINING);
  EXPECT_THAT(h.back().reason(), HasSubstr("canary blocked: runner parity differs"));
  for (const v1::TransitionRecord& t : h) EXPECT_NE(t.to(), v1::RELEASE_STATE_CANARY);
  for (auto& r : ranks_) EXPECT_EQ(r->Trial().version(), 0);
  EXPECT_EQ(History("").size(), before + 1);
  // A retry gets the same answer and writes nothing.
  s = Transition("release-v2:canary", "release-v2", v1::RELEASE_STATE_CANARY);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("4 shadow mismatches"));
  EXPECT_EQ(History("").size(), before + 1);
  // The release ACTIVE before is untouched.
  EXPECT_EQ(Get("release-v1").state(), v1::RELEASE_STATE_ACTIVE);
  // The refused request's id for another release's CANARY is another request: no rank is
  // driven (its shadow trials go on) and nothing is answered as that release's refusal.
  ToShadow("release-v4", 4);
  for (auto& r : ranks_) r->TakeCalls();
  s = Transition("release-v2:canary", "release-v4", v1::RELEASE_STATE_CANARY);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS) << s.error_message();
  for (auto& r : ranks_) {
    EXPECT_TRUE(r->TakeCalls().empty());
    EXPECT_EQ(r->Trial().version(), 4);
  }
  // A retry of release-v2's refused CANARY re-drives its stop, of placement-v2's trial only:
  // release-v4's shadow trials, begun since, go on.
  s = Transition("release-v2:canary", "release-v2", v1::RELEASE_STATE_CANARY);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("trials stopped on every rank"));
  for (auto& r : ranks_) EXPECT_EQ(r->Trial().version(), 4);
  EXPECT_EQ(Get("release-v4").state(), v1::RELEASE_STATE_SHADOW);
  ASSERT_TRUE(Transition("release-v4:drain", "release-v4", v1::RELEASE_STATE_DRAINING).ok());

  // A candidate whose shadow outputs match goes on to CANARY (shadow and canary trials).
  ToShadow("release-v3", 3);
  ranks_[0]->SetCounters(Healthy(3));
  ranks_[1]->SetCounters(Healthy(3));
  s = Transition("release-v3:canary", "release-v3", v1::RELEASE_STATE_CANARY);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(ranks_[1]->Trial().version(), 3);
  EXPECT_EQ(ranks_[1]->Trial().canary_every(), 3);

  // Neither drained release can be made ACTIVE by a rollback: release-v2 was drained from SHADOW
  // (it never passed the gate), and a CANARY candidate is no ACTIVE one to roll back.
  for (auto& r : ranks_) r->TakeCalls();
  const size_t committed = History("").size();
  auto rollback = [&](const std::string& id, const std::string& candidate, const std::string& prior) {
    v1::RollbackRequest req;
    req.set_request_id(id);
    req.set_release_id(candidate);
    req.set_prior_release_id(prior);
    v1::RollbackResponse resp;
    return stub_->Rollback(Ctx().get(), req, &resp);
  };
  s = rollback("rb-blocked", "release-v1", "release-v2");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("entered DRAINING from SHADOW"));
  s = rollback("rb-canary", "release-v3", "release-v2");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("only the ACTIVE release is rolled back"));
  EXPECT_EQ(History("").size(), committed);
  EXPECT_EQ(Get("release-v1").state(), v1::RELEASE_STATE_ACTIVE);
  EXPECT_EQ(Get("release-v2").state(), v1::RELEASE_STATE_DRAINING);
  EXPECT_EQ(Get("release-v3").state(), v1::RELEASE_STATE_CANARY);
  for (auto& r : ranks_) EXPECT_TRUE(r->TakeCalls().empty());
}

TEST_F(GateTest, PromotionClausesComeFromTheRanks) {
  Bootstrap();
  ToShadow("release-v3", 3);
  for (auto& r : ranks_) r->SetCounters(Healthy(3));
  ASSERT_TRUE(Transition("release-v3:canary", "release-v3", v1::RELEASE_STATE_CANARY).ok());
  v1::PromoteResponse resp;

  // HashOK: rank 1 holds placement-v3 under another manifest digest than the recorded one.
  const std::string digest = ranks_[1]->Digest(3);
  ranks_[1]->SetDigest(3, "sha256:other-slots");
  grpc::Status s = Promote("p1", "release-v3", &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("promotion gate failed: HashOK (read from the ranks)"));
  EXPECT_THAT(s.error_message(), HasSubstr("rank 1 (127.0.0.1:"));
  EXPECT_THAT(s.error_message(),
              HasSubstr("under manifest digest sha256:other-slots, the recorded manifest's is " + digest));
  ranks_[1]->SetDigest(3, "");  // a rank that reports none proves nothing either
  s = Promote("p1b", "release-v3", &resp);
  EXPECT_THAT(s.error_message(), HasSubstr("HashOK"));
  ranks_[1]->SetDigest(3, digest);

  // RollbackOK: the prior placement is retired on rank 0.
  ranks_[0]->SetState(1, v1::GENERATION_STATE_RETIRED);
  s = Promote("p2", "release-v3", &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("gate failed: RollbackOK"));
  EXPECT_THAT(s.error_message(), HasSubstr("prior placement-v1 is RETIRED"));
  ranks_[0]->SetState(1, v1::GENERATION_STATE_ACTIVE);

  // Stale accepts are counted on the ranks and summed.
  v1::GenerationCounters stale = Healthy(3);
  stale.set_stale_accepts(1);
  ranks_[1]->SetCounters(stale);
  s = Promote("p3", "release-v3", &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("gate failed: N_stale_accept = 0"));
  ranks_[1]->SetCounters(Healthy(3));
  EXPECT_EQ(Get("release-v3").state(), v1::RELEASE_STATE_CANARY);

  // All clauses hold. r_fallback = 24 / 240 steps = 0.10 passes the 0.15 threshold (over the
  // 100 decode steps it would be 0.24).
  s = Promote("p4", "release-v3", &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.evidence().steps(), 240);
  EXPECT_EQ(resp.evidence().fallback_steps(), 24);
  EXPECT_TRUE(resp.evidence().hash_ok());
  EXPECT_TRUE(resp.evidence().rollback_ok());
  EXPECT_EQ(resp.evidence().findings_size(), 0);
  EXPECT_EQ(resp.release().state(), v1::RELEASE_STATE_ACTIVE);
  EXPECT_EQ(resp.drained_release_id(), "release-v1");
}

// HashOK reads every layer's slot table: a per-layer generation whose second layer leaves a slot
// without a digest gave the ranks nothing to verify that copy by, so it is never promoted, though
// its first table (the manifest's own slots) is complete.
TEST_F(GateTest, HashOkNeedsADigestInEveryLayersTable) {
  Bootstrap();
  v1::PlacementManifest layered = Manifest(3);
  layered.add_layers(0);
  layered.add_layers(1);
  for (int layer = 0; layer < 2; ++layer) {
    v1::LayerSlots* table = layered.add_layer_slots();
    table->set_layer(layer);
    *table->mutable_slots() = layered.slots();
  }
  layered.mutable_layer_slots(1)->mutable_slots(2)->clear_parameter_digest();
  ToShadow("release-v3", layered);
  for (auto& r : ranks_) r->SetCounters(Healthy(3));
  ASSERT_TRUE(Transition("release-v3:canary", "release-v3", v1::RELEASE_STATE_CANARY).ok());
  v1::PromoteResponse resp;
  grpc::Status s = Promote("p1", "release-v3", &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("HashOK"));
  EXPECT_THAT(s.error_message(), HasSubstr("slot q2 of the recorded manifest (layer 1) has no parameter digest"));
  EXPECT_EQ(Get("release-v3").state(), v1::RELEASE_STATE_CANARY);
}

// 0x0E "active candidate faults -> roll back to prior generation", with --auto_rollback_faults 2:
// the reconcile leaves release-v2 ACTIVE at one fault of its placement on the ranks, and at two
// rolls it back to release-v1, which its promotion drained. release-v1, ACTIVE again by that
// rollback, is never rolled back to the release that faulted, whatever its own counts.
TEST_F(GateTest, AnActiveReleaseWhoseFaultsReachTheThresholdIsRolledBack) {
  ASSERT_NO_FATAL_FAILURE(PromoteV2OverV1());
  PromotionThresholds thresholds;
  thresholds.min_shadow = 10;
  thresholds.min_canary = 10;
  StoreReleaseManager automatic(store_.get(), thresholds, pool_.get(), TwoNodeTopology(kRanks), absl::Seconds(5),
                                MigrationBudget{}, TrialPolicy{2, 3, 0, /*auto_rollback_faults=*/2});
  for (auto& r : ranks_) r->TakeCalls();
  v1::GenerationCounters faulty = Healthy(2);
  faulty.set_failed_steps(1);
  ranks_[1]->SetCounters(faulty);
  ASSERT_TRUE(automatic.Reconcile().ok());
  EXPECT_EQ(Get("release-v2").state(), v1::RELEASE_STATE_ACTIVE);
  for (auto& r : ranks_) EXPECT_TRUE(r->TakeCalls().empty());

  faulty.set_count_failures(1);  // two faults of placement-v2, summed over the ranks
  ranks_[1]->SetCounters(faulty);
  const absl::Status rolled = automatic.Reconcile();
  ASSERT_TRUE(rolled.ok()) << rolled;
  EXPECT_EQ(Get("release-v1").state(), v1::RELEASE_STATE_ACTIVE);
  EXPECT_NE(Get("release-v2").state(), v1::RELEASE_STATE_ACTIVE);
  bool reasoned = false;
  for (const v1::TransitionRecord& t : History("release-v2")) {
    reasoned =
        reasoned || t.reason().find("auto rollback: the ranks counted 2 faults of placement-v2") != std::string::npos;
  }
  EXPECT_TRUE(reasoned);
  for (auto& r : ranks_) {
    const std::vector<std::string> calls = r->TakeCalls();
    EXPECT_NE(std::find(calls.begin(), calls.end(), "activate v1"), calls.end());
  }

  v1::GenerationCounters prior_faults = Healthy(1);
  prior_faults.set_failed_steps(5);
  for (auto& r : ranks_) r->SetCounters(prior_faults);
  ASSERT_TRUE(automatic.Reconcile().ok());
  EXPECT_EQ(Get("release-v1").state(), v1::RELEASE_STATE_ACTIVE);
  for (auto& r : ranks_) EXPECT_TRUE(r->TakeCalls().empty());
}

// An auto-rollback that is refused (rank 0 retired the prior's placement) does not stop the
// reconcile: rank 1, back on another placement as after a restart, is still brought to the
// ACTIVE one, and the faulting release stays ACTIVE (nothing half-applied).
TEST_F(GateTest, ARefusedAutoRollbackStillBringsTheRanksToTheActivePlacement) {
  ASSERT_NO_FATAL_FAILURE(PromoteV2OverV1());
  StoreReleaseManager automatic(store_.get(), PromotionThresholds{}, pool_.get(), TwoNodeTopology(kRanks),
                                absl::Seconds(5), MigrationBudget{}, TrialPolicy{2, 3, 0, /*auto_rollback_faults=*/2});
  v1::GenerationCounters faulty = Healthy(2);
  faulty.set_failed_steps(2);
  ranks_[1]->SetCounters(faulty);
  ranks_[0]->SetState(1, v1::GENERATION_STATE_RETIRED);
  ranks_[1]->SetActive(1);
  for (auto& r : ranks_) r->TakeCalls();
  const absl::Status reconciled = automatic.Reconcile();
  EXPECT_TRUE(reconciled.ok()) << reconciled;
  EXPECT_EQ(Get("release-v2").state(), v1::RELEASE_STATE_ACTIVE);
  EXPECT_EQ(Get("release-v1").state(), v1::RELEASE_STATE_DRAINING);
  for (auto& r : ranks_) EXPECT_EQ(r->TakeCalls(), std::vector<std::string>{"activate v2"});
}

// A prior that an operator retired since the promotion is no rollback target: the reconcile
// neither tries it nor fails, and the faulting release stays ACTIVE.
TEST_F(GateTest, AnAutoRollbackNeverTargetsARetiredPrior) {
  ASSERT_NO_FATAL_FAILURE(PromoteV2OverV1());
  ASSERT_TRUE(Transition("release-v1:retire", "release-v1", v1::RELEASE_STATE_RETIRED).ok());
  StoreReleaseManager automatic(store_.get(), PromotionThresholds{}, pool_.get(), TwoNodeTopology(kRanks),
                                absl::Seconds(5), MigrationBudget{}, TrialPolicy{2, 3, 0, /*auto_rollback_faults=*/2});
  v1::GenerationCounters faulty = Healthy(2);
  faulty.set_failed_steps(3);
  ranks_[1]->SetCounters(faulty);
  for (auto& r : ranks_) r->TakeCalls();
  const size_t before = History("").size();
  const absl::Status reconciled = automatic.Reconcile();
  EXPECT_TRUE(reconciled.ok()) << reconciled;
  EXPECT_EQ(Get("release-v2").state(), v1::RELEASE_STATE_ACTIVE);
  EXPECT_EQ(History("").size(), before);
  for (auto& r : ranks_) EXPECT_TRUE(r->TakeCalls().empty());
}

// The ranks run one candidate's trial at a time: a second candidate's SHADOW is refused while
// the first is SHADOW or CANARY (it would take over the first one's trial steps while the
// registry still names the first), and allowed once the first has left.
TEST_F(GateTest, ASecondCandidatesTrialWaitsForTheFirst) {
  ASSERT_NO_FATAL_FAILURE(Bootstrap());
  ASSERT_NO_FATAL_FAILURE(ToShadow("release-v2", 2));
  ASSERT_TRUE(Transition("release-v2:canary", "release-v2", v1::RELEASE_STATE_CANARY).ok());
  ASSERT_NO_FATAL_FAILURE(RegisterVerified("release-v3"));
  v1::LoadPlacementRequest load;
  load.set_request_id("release-v3:load");
  load.set_release_id("release-v3");
  *load.mutable_manifest() = Manifest(3);
  v1::Release rel;
  ASSERT_TRUE(stub_->LoadPlacement(Ctx().get(), load, &rel).ok());
  const grpc::Status refused = Transition("release-v3:shadow", "release-v3", v1::RELEASE_STATE_SHADOW);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(refused.error_message(), HasSubstr("to: SHADOW refused for release-v3: release-v2 is CANARY"));
  EXPECT_EQ(Get("release-v3").state(), v1::RELEASE_STATE_LOADED);
  for (auto& r : ranks_) {
    EXPECT_EQ(r->Trial().version(), 2);
    EXPECT_GT(r->Trial().canary_every(), 0) << "release-v2's canary goes on";
  }
  // A retry of release-v2's committed CANARY is still answered from the record.
  EXPECT_TRUE(Transition("release-v2:canary", "release-v2", v1::RELEASE_STATE_CANARY).ok());
  ASSERT_TRUE(Transition("release-v2:drain", "release-v2", v1::RELEASE_STATE_DRAINING).ok());
  const grpc::Status shadow = Transition("release-v3:shadow", "release-v3", v1::RELEASE_STATE_SHADOW);
  ASSERT_TRUE(shadow.ok()) << shadow.error_message();
  for (auto& r : ranks_) EXPECT_EQ(r->Trial().version(), 3);
}

// A rollback to a prior whose placement one rank no longer holds (a retirement of the prior that
// stopped after that rank) is refused before anything commits: the registry would say ACTIVE of
// a placement the ranks cannot activate.
TEST_F(GateTest, RollbackToAPriorARankRetiredIsRefused) {
  ASSERT_NO_FATAL_FAILURE(PromoteV2OverV1());
  ranks_[0]->SetState(1, v1::GENERATION_STATE_RETIRED);  // rank 0 retired placement-v1, rank 1 did not
  for (auto& r : ranks_) r->TakeCalls();
  const size_t before = History("").size();
  v1::RollbackRequest req = RollbackV2ToV1("rb");
  v1::RollbackResponse resp;
  grpc::Status s = stub_->Rollback(Ctx().get(), req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("placement-v1 is RETIRED on rank"));
  EXPECT_EQ(Get("release-v2").state(), v1::RELEASE_STATE_ACTIVE);
  EXPECT_EQ(Get("release-v1").state(), v1::RELEASE_STATE_DRAINING);
  EXPECT_EQ(History("").size(), before);
  for (auto& r : ranks_) EXPECT_TRUE(r->TakeCalls().empty());
}

// 0x0EA: the prior must serve the candidate's checkpoint. A prior whose recorded placement is of
// another checkpoint is refused before anything commits or any rank is driven.
TEST_F(GateTest, RollbackToAPriorOfAnotherCheckpointIsRefused) {
  ASSERT_NO_FATAL_FAILURE(PromoteV2OverV1());
  Sql("UPDATE releases SET placement_manifest = replace(placement_manifest, 'checkpoint-0042', 'checkpoint-0041') "
      "WHERE release_id = 'release-v1';");
  for (auto& r : ranks_) r->TakeCalls();
  const size_t before = History("").size();
  v1::RollbackResponse resp;
  grpc::Status s = stub_->Rollback(Ctx().get(), RollbackV2ToV1("rb-ckpt"), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("serves checkpoint-0041"));
  EXPECT_EQ(Get("release-v2").state(), v1::RELEASE_STATE_ACTIVE);
  EXPECT_EQ(History("").size(), before);
  for (auto& r : ranks_) EXPECT_TRUE(r->TakeCalls().empty());
}

// A group that re-formed on the survivors of a lost rank (the rank is outside the epoch) can
// still be rolled back: only the epoch's members are checked and driven. The lost rank, once
// replaced, is brought to the ACTIVE placement by the reconciler.
TEST_F(GateTest, RollbackOnTheSurvivorsOfALostRank) {
  ASSERT_NO_FATAL_FAILURE(PromoteV2OverV1());
  LoseRank(1);
  for (auto& r : ranks_) r->TakeCalls();
  v1::RollbackResponse resp;
  grpc::Status s = stub_->Rollback(Ctx().get(), RollbackV2ToV1("rb-survivors"), &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(Get("release-v1").state(), v1::RELEASE_STATE_ACTIVE);
  EXPECT_EQ(Get("release-v2").state(), v1::RELEASE_STATE_RETIRED);
  for (int r = 0; r < kRanks; ++r) {
    if (r == 1) {
      EXPECT_TRUE(ranks_[r]->TakeCalls().empty()) << "the lost rank was driven";
    } else {
      EXPECT_THAT(ranks_[r]->TakeCalls(), ::testing::ElementsAre("activate v1", "retire v2")) << "rank " << r;
    }
  }
}

// A candidate can also go on while the group serves on the survivors of a lost rank: SHADOW ->
// CANARY reads the members' shadow counters and the promotion gate their evidence (the lost
// rank served no candidate step); only the members are driven. The lost rank's replacement is
// brought to the ACTIVE placement by the reconciler.
TEST_F(GateTest, PromotionOnTheSurvivorsOfALostRank) {
  Bootstrap();
  ToShadow("release-v3", 3);
  for (auto& r : ranks_) r->SetCounters(Healthy(3));
  LoseRank(1);
  for (auto& r : ranks_) r->TakeCalls();
  grpc::Status s = Transition("release-v3:canary", "release-v3", v1::RELEASE_STATE_CANARY);
  ASSERT_TRUE(s.ok()) << s.error_message();
  v1::PromoteResponse resp;
  s = Promote("p-survivors", "release-v3", &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(resp.evidence().hash_ok());
  EXPECT_EQ(resp.evidence().steps(), 120);  // rank 0's alone
  EXPECT_EQ(Get("release-v3").state(), v1::RELEASE_STATE_ACTIVE);
  EXPECT_THAT(ranks_[0]->TakeCalls(), ::testing::ElementsAre("activate v3"));
  EXPECT_TRUE(ranks_[1]->TakeCalls().empty()) << "the lost rank was driven";
}

// 0x0EA on the ranks: the prior activated, the candidate drained to zero handles, then retired
// and committed RETIRED; a candidate that does not drain stays DRAINING (committed) and the
// request is retried with the same request_id.
TEST_F(GateTest, RollbackDrivesTheRanksInOrder) {
  ASSERT_NO_FATAL_FAILURE(PromoteV2OverV1());
  grpc::Status s;
  for (auto& r : ranks_) r->TakeCalls();
  ranks_[1]->SetRefcount(2, 1);  // a step still holds placement-v2 on rank 1

  v1::RollbackRequest req = RollbackV2ToV1("rb");
  v1::RollbackResponse resp;
  s = stub_->Rollback(Ctx().get(), req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(s.error_message(), HasSubstr("rollback committed; on the ranks: placement-v2 still held (rank 1: 1)"));
  EXPECT_THAT(s.error_message(), HasSubstr("; retry with the same request_id"));
  EXPECT_EQ(Get("release-v2").state(), v1::RELEASE_STATE_DRAINING);
  EXPECT_EQ(Get("release-v1").state(), v1::RELEASE_STATE_ACTIVE);
  for (auto& r : ranks_) EXPECT_THAT(r->TakeCalls(), ::testing::ElementsAre("activate v1"));

  ranks_[1]->SetRefcount(2, 0);
  resp.Clear();
  s = stub_->Rollback(Ctx().get(), req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  for (auto& r : ranks_) EXPECT_THAT(r->TakeCalls(), ::testing::ElementsAre("activate v1", "retire v2"));
  ASSERT_EQ(resp.transitions_size(), 3);
  EXPECT_EQ(resp.transitions(2).to(), v1::RELEASE_STATE_RETIRED);
  EXPECT_EQ(resp.transitions(2).reason(), "handles drained and retired on every rank");
  EXPECT_EQ(Get("release-v2").state(), v1::RELEASE_STATE_RETIRED);

  // Request ids answer only the request they were used for: the same rollback replays, one to
  // another prior and a load of another manifest are refused, and the ranks are not driven.
  ASSERT_TRUE(stub_->Rollback(Ctx().get(), req, &resp).ok());  // re-drives the ranks (no-ops there)
  for (auto& r : ranks_) r->TakeCalls();
  req.set_prior_release_id("release-v9");
  s = stub_->Rollback(Ctx().get(), req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS) << s.error_message();
  v1::LoadPlacementRequest load;
  load.set_request_id("release-v2:load");
  load.set_release_id("release-v2");
  *load.mutable_manifest() = Manifest(2);
  v1::Release rel;
  ASSERT_TRUE(stub_->LoadPlacement(Ctx().get(), load, &rel).ok());  // the recorded request
  for (auto& r : ranks_) r->TakeCalls();
  *load.mutable_manifest() = Manifest(7);
  s = stub_->LoadPlacement(Ctx().get(), load, &rel);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS) << s.error_message();
  for (auto& r : ranks_) EXPECT_TRUE(r->TakeCalls().empty());
}

TEST_F(GateTest, FirstReleaseFromRankCountersHasNothingToRollBackTo) {
  ToShadow("release-v1", 1);
  for (auto& r : ranks_) r->SetCounters(Healthy(1));
  ASSERT_TRUE(Transition("release-v1:canary", "release-v1", v1::RELEASE_STATE_CANARY).ok());
  v1::PromoteResponse resp;
  grpc::Status s = Promote("p1", "release-v1", &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("gate failed: RollbackOK"));
  EXPECT_THAT(s.error_message(), HasSubstr("no release is ACTIVE"));
  EXPECT_THAT(s.error_message(), Not(HasSubstr("HashOK")));
}

}  // namespace
}  // namespace moe
