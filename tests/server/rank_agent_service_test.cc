// RankAgentService over a real gRPC socket on one rank: a new generation is prepared beside the
// active one (verified, loaded, digests checked), activated for new steps while a handle still
// holds the old one, and the old one retires only once that handle is gone. Bad manifests are
// rejected before the registry sees them (0x0E: a differing process-group generation rejects the
// load); every RPC needs the bearer token.
#include "server/rank_agent_service.h"

#include <chrono>
#include <random>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "kernels/numeric.h"
#include "rpc/placement_proto.h"
#include "runtime/checkpoint/expert_loader.h"
#include "tests/server/held_event_kernels.h"
#include "tests/server/one_rank_fixture.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

constexpr int kD = 64, kExperts = 4;
constexpr char kToken[] = "agent-token-0123456789";

// Reads through `inner`, but every ReadExpert waits until Release(): a prepare that holds the
// agent's lock for as long as a test needs.
class HeldReader final : public CheckpointReader {
 public:
  explicit HeldReader(const CheckpointReader* inner) : inner_(inner) {}
  const std::string& version() const override { return inner_->version(); }
  ExpertShape shape() const override { return inner_->shape(); }
  const std::vector<int64_t>& layers() const override { return inner_->layers(); }
  absl::Status ReadExpert(int64_t layer, int expert, uint16_t* gate_up, uint16_t* down) const override {
    {
      absl::MutexLock lock(&mu_);
      entered_ = true;
      mu_.Await(absl::Condition(&released_));
    }
    return inner_->ReadExpert(layer, expert, gate_up, down);
  }
  std::string RecordedDigest(int64_t layer, int expert) const override { return inner_->RecordedDigest(layer, expert); }
  std::string Describe() const override { return "held " + inner_->Describe(); }

  // False when no read began within `timeout` (the prepare failed before reading).
  bool AwaitEntered(absl::Duration timeout) const {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(&entered_), timeout);
  }
  void Release() {
    absl::MutexLock lock(&mu_);
    released_ = true;
  }

 private:
  const CheckpointReader* inner_;
  mutable absl::Mutex mu_;
  mutable bool entered_ = false;
  bool released_ = false;
};

class RankAgentTest : public testing::OneRankTest {
 protected:
  void SetUp() override {
    SetUpRank(kExperts, kD, 32, 3);
    RankAgentContext c{Rank(0), &registry_, executor_.get(), reader_.get(), kToken};
    c.runtime.set_dtype("BF16");  // as moe-rankd reports --expert_dtype bf16
    service_ = std::make_unique<RankAgentServiceImpl>(std::move(c));
    server_ = Serve(service_.get(), &stub_);
  }
  // `service` on a real socket at 127.0.0.1, and in `*stub` a client dialing it.
  static std::unique_ptr<grpc::Server> Serve(RankAgentServiceImpl* service,
                                             std::unique_ptr<v1::RankAgentService::Stub>* stub) {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    *stub = v1::RankAgentService::NewStub(
        grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
    return server;
  }
  void TearDown() override { server_->Shutdown(); }

  std::unique_ptr<grpc::ClientContext> Ctx() {
    auto c = std::make_unique<grpc::ClientContext>();
    c->AddMetadata("authorization", std::string("Bearer ") + kToken);
    return c;
  }
  v1::PlacementManifest Manifest(int64_t version) {
    return ManifestToProto(
        **DefaultPlacement(PlacementVersion(version), kExperts, 0, topology_, group_, ckpt_.metadata), topology_);
  }
  grpc::Status Prepare(const v1::PlacementManifest& m, v1::GenerationStatus* out) {
    v1::PrepareGenerationRequest req;
    *req.mutable_manifest() = m;
    return stub_->PrepareGeneration(Ctx().get(), req, out);
  }
  grpc::Status Lifecycle(const char* op, int64_t version, v1::GenerationStatus* out) {
    v1::GenerationRequest req;
    req.set_version(version);
    const std::string name(op);
    if (name == "activate") return stub_->ActivateGeneration(Ctx().get(), req, out);
    if (name == "stop") return stub_->StopDispatch(Ctx().get(), req, out);
    return stub_->RetireGeneration(Ctx().get(), req, out);
  }
  // A step of 3 tokens on the active generation; with `done`, its rows "in device memory" (the
  // held-event kernels') and answered once enqueued.
  int64_t StepGeneration(uint64_t step, void* done = nullptr) {
    const int tokens = 3, k = 2;
    std::vector<uint16_t> hidden(tokens * kD);
    std::mt19937 rng(step);
    for (auto& h : hidden) h = kernels::FloatToBf16(std::normal_distribution<float>(0, 1)(rng));
    std::vector<int32_t> ids = {0, 1, 2, 3, 1, 2};
    std::vector<float> w(tokens * k, 0.5f);
    LayerStepInput in;
    in.step_id = step;
    in.hidden = hidden.data();
    in.tokens = tokens;
    in.d = kD;
    in.topk_ids = ids.data();
    in.topk_weights = w.data();
    in.k = k;
    std::vector<uint16_t> out(tokens * kD);
    if (done != nullptr) {
      in.rows_on_device = true;
      in.output = out.data();
      in.done_event = done;
    }
    auto r = executor_->Execute(in);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->record.placement_version : -1;
  }

  std::unique_ptr<RankAgentServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::RankAgentService::Stub> stub_;
};

TEST_F(RankAgentTest, GenerationSwapWithFences) {
  v1::GenerationStatus st;
  ASSERT_TRUE(Prepare(Manifest(2), &st).ok());
  EXPECT_EQ(st.state(), v1::GENERATION_STATE_PREPARED);
  EXPECT_EQ(st.local_slots(), kExperts);
  ASSERT_TRUE(Prepare(Manifest(2), &st).ok());  // repeat is idempotent
  EXPECT_EQ(StepGeneration(1), 1);              // preparing did not change what steps use

  // A step's handle holds placement-v1 across the switch.
  GenerationLease in_flight = *registry_.AcquireActive(HandleId(900));
  ASSERT_TRUE(Lifecycle("activate", 2, &st).ok());
  EXPECT_EQ(st.state(), v1::GENERATION_STATE_ACTIVE);
  EXPECT_EQ(StepGeneration(2), 2);  // new steps use v2
  grpc::Status early = Lifecycle("retire", 1, &st);
  EXPECT_EQ(early.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(*registry_.State(PlacementVersion(1)), GenerationState::kDraining);
  ASSERT_TRUE(in_flight.Release().ok());
  ASSERT_TRUE(Lifecycle("retire", 1, &st).ok());
  EXPECT_EQ(st.state(), v1::GENERATION_STATE_RETIRED);
  ASSERT_TRUE(Lifecycle("retire", 1, &st).ok());  // repeat
  // A retired generation is not "prepared" again: its weights are gone.
  grpc::Status again = Prepare(Manifest(1), &st);
  EXPECT_EQ(again.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << again.error_message();
  EXPECT_THAT(again.error_message(), ::testing::HasSubstr("was retired on this rank"));
  // Retiring a generation this rank never held (a restarted rank) holds nothing: done.
  st.Clear();
  ASSERT_TRUE(Lifecycle("retire", 77, &st).ok());
  EXPECT_EQ(st.version(), 77);
  EXPECT_EQ(st.state(), v1::GENERATION_STATE_RETIRED);
  EXPECT_EQ(Lifecycle("activate", 77, &st).error_code(), grpc::StatusCode::NOT_FOUND);

  v1::AgentStatusResponse status;
  ASSERT_TRUE(stub_->Status(Ctx().get(), {}, &status).ok());
  EXPECT_EQ(status.active_version(), 2);
  ASSERT_EQ(status.generations_size(), 2);
  EXPECT_EQ(status.generations(0).state(), v1::GENERATION_STATE_RETIRED);
  EXPECT_EQ(StepGeneration(3), 2);
}

// Steps answered before their GPU work finished (done events) hold their generation until it has:
// a drain's refcount (what the controller waits on through Status) counts them while the work
// runs and, once it has finished, not even on a rank that serves no further step.
class RankAgentHeldWorkTest : public RankAgentTest {
 protected:
  void SetUp() override {
    make_kernels_ = [this] {
      auto k = std::make_unique<testing::HeldEventKernels>();
      held_ = k.get();
      return k;
    };
    timeout_ = absl::Milliseconds(200);
    RankAgentTest::SetUp();
  }
  int64_t Refcount(int64_t version) {
    v1::AgentStatusResponse status;
    EXPECT_TRUE(stub_->Status(Ctx().get(), {}, &status).ok());
    for (const auto& g : status.generations()) {
      if (g.version() == version) return g.refcount();
    }
    return -1;
  }
  testing::HeldEventKernels* held_ = nullptr;
};

TEST_F(RankAgentHeldWorkTest, AnIdleRankReportsOnlyWorkStillRunning) {
  std::string handle;
  absl::StatusOr<void*> done = executor_->CreateDoneEvent(&handle);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(StepGeneration(1, *done), 1);
  v1::GenerationStatus st;
  ASSERT_TRUE(Prepare(Manifest(2), &st).ok());
  ASSERT_TRUE(Lifecycle("activate", 2, &st).ok());
  EXPECT_EQ(Refcount(1), 1) << "the answered step's work still runs";
  grpc::Status early = Lifecycle("retire", 1, &st);
  EXPECT_EQ(early.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << early.error_message();
  // Retiring the ACTIVE generation is refused by the registry, the answered work not waited for.
  EXPECT_EQ(Lifecycle("retire", 2, &st).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  held_->Fire(*done);
  EXPECT_EQ(Refcount(1), 0) << "finished work holds nothing, with no step since";
  ASSERT_TRUE(Lifecycle("retire", 1, &st).ok());
  EXPECT_EQ(st.state(), v1::GENERATION_STATE_RETIRED);
}

TEST_F(RankAgentTest, BadManifestsLeaveNothingBehind) {
  v1::GenerationStatus st;
  // Parameter digest drift on one slot: the load is refused, naming the slot.
  v1::PlacementManifest drift = Manifest(3);
  drift.mutable_slots(2)->set_parameter_digest("0000");
  grpc::Status s = Prepare(drift, &st);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_FALSE(registry_.State(PlacementVersion(3)).ok());
  // A slot with no digest gives the rank nothing to verify its copy by (0x08K): refused before
  // anything is read, naming the slot.
  v1::PlacementManifest undigested = Manifest(3);
  undigested.mutable_slots(1)->clear_parameter_digest();
  s = Prepare(undigested, &st);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("slot q1 (expert 1) has no parameter digest"));
  EXPECT_FALSE(registry_.State(PlacementVersion(3)).ok());
  // A generation of another checkpoint (every slot consistently so): this rank serves its own.
  v1::PlacementManifest foreign = Manifest(3);
  foreign.set_checkpoint_version("checkpoint-other");
  for (v1::PhysicalSlot& slot : *foreign.mutable_slots()) slot.set_checkpoint_version("checkpoint-other");
  s = Prepare(foreign, &st);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(),
              HasSubstr("manifest.checkpoint_version: placement-v3 is of checkpoint checkpoint-other"));
  EXPECT_FALSE(registry_.State(PlacementVersion(3)).ok());
  // Process-group generation differs: reject load.
  v1::PlacementManifest epoch = Manifest(3);
  epoch.set_process_group_epoch(2);
  s = Prepare(epoch, &st);
  EXPECT_NE(s.error_code(), grpc::StatusCode::OK);
  EXPECT_THAT(s.error_message(), HasSubstr("epoch"));
  EXPECT_FALSE(registry_.State(PlacementVersion(3)).ok());
  // Same version, other slots.
  ASSERT_TRUE(Prepare(Manifest(3), &st).ok());
  v1::PlacementManifest other = Manifest(3);
  other.mutable_slots(0)->set_logical_expert_id(1);
  other.mutable_slots(1)->set_logical_expert_id(0);
  EXPECT_EQ(Prepare(other, &st).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  // Unknown version, bad version.
  EXPECT_EQ(Lifecycle("activate", 7, &st).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Lifecycle("stop", 0, &st).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // Nothing changed for serving.
  EXPECT_EQ(StepGeneration(4), 1);
}

// A manifest that puts more expert weights on the rank than it may hold is refused before any
// is reserved (RESOURCE_EXHAUSTED naming manifest.slots and both numbers), leaving nothing
// behind; at the limit it is prepared.
TEST_F(RankAgentTest, AManifestOverTheWeightLimitIsRefusedBeforeAnythingIsReserved) {
  const v1::PlacementManifest manifest = Manifest(2);
  auto parsed = ManifestFromProto(manifest, topology_);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  auto need = LocalExpertBytes(*reader_, **parsed, Rank(0));
  ASSERT_TRUE(need.ok()) << need.status();
  for (const int64_t limit : {*need - 1, *need}) {
    RankAgentContext c{Rank(0), &registry_, executor_.get(), reader_.get(), kToken};
    c.runtime.set_dtype("BF16");
    c.max_weight_bytes = limit;
    RankAgentServiceImpl service(std::move(c));
    std::unique_ptr<v1::RankAgentService::Stub> stub;
    std::unique_ptr<grpc::Server> server = Serve(&service, &stub);
    v1::PrepareGenerationRequest req;
    *req.mutable_manifest() = manifest;
    v1::GenerationStatus st;
    const grpc::Status s = stub->PrepareGeneration(Ctx().get(), req, &st);
    server->Shutdown();
    if (limit < *need) {
      EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
      EXPECT_THAT(s.error_message(), HasSubstr("manifest.slots"));
      EXPECT_THAT(s.error_message(), HasSubstr(absl::StrCat(*need, " bytes of expert weights, more than the ", limit)));
      EXPECT_FALSE(registry_.State(PlacementVersion(2)).ok());
      EXPECT_EQ(StepGeneration(5), 1);  // still serving
    } else {
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(st.state(), v1::GENERATION_STATE_PREPARED);
    }
  }
}

// A release bundle's topology.nodes (RuntimeCoordinates.nodes): the rank prepares the placement
// only on the node the bundle expects it on, and refuses a list of another length; a refusal
// leaves nothing behind.
TEST_F(RankAgentTest, BundleNodesMustBeTheRanks) {
  const std::string mine = topology_.NodeName(topology_.NodeOf(Rank(0)));
  v1::GenerationStatus st;
  v1::PrepareGenerationRequest req;
  *req.mutable_manifest() = Manifest(5);
  req.mutable_runtime()->add_nodes("elsewhere");
  grpc::Status s = stub_->PrepareGeneration(Ctx().get(), req, &st);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(),
              HasSubstr("runtime.nodes[0]: the release bundle expects node elsewhere, rank 0 is on " + mine));
  EXPECT_FALSE(registry_.State(PlacementVersion(5)).ok());
  req.mutable_runtime()->clear_nodes();
  req.mutable_runtime()->add_nodes(mine);
  req.mutable_runtime()->add_nodes(mine);
  s = stub_->PrepareGeneration(Ctx().get(), req, &st);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("runtime.nodes: the release bundle names 2 ranks' nodes"));
  EXPECT_FALSE(registry_.State(PlacementVersion(5)).ok());
  req.mutable_runtime()->clear_nodes();
  req.mutable_runtime()->add_nodes(mine);
  ASSERT_TRUE(stub_->PrepareGeneration(Ctx().get(), req, &st).ok());
  EXPECT_EQ(st.state(), v1::GENERATION_STATE_PREPARED);
}

// A release bundle's runtime.dtype must be the rank's --expert_dtype: an FP8 release is refused
// by a BF16 rank, naming the field and the flag, and leaves nothing behind.
TEST_F(RankAgentTest, BundleDtypeMustBeTheRanks) {
  v1::GenerationStatus st;
  v1::PrepareGenerationRequest req;
  *req.mutable_manifest() = Manifest(5);
  req.mutable_runtime()->set_dtype("FP8");
  grpc::Status s = stub_->PrepareGeneration(Ctx().get(), req, &st);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(),
              HasSubstr("runtime.dtype: the release bundle says FP8, rank 0 runs BF16 (--expert_dtype)"));
  EXPECT_FALSE(registry_.State(PlacementVersion(5)).ok());
  req.mutable_runtime()->set_dtype("BF16");
  ASSERT_TRUE(stub_->PrepareGeneration(Ctx().get(), req, &st).ok());
  EXPECT_EQ(st.state(), v1::GENERATION_STATE_PREPARED);
}

TEST_F(RankAgentTest, EveryRpcNeedsTheToken) {
  grpc::ClientContext a, b, c, d, e;
  v1::GenerationStatus st;
  v1::AgentStatusResponse status;
  v1::GenerationRequest req;
  req.set_version(1);
  v1::PrepareGenerationRequest prep;
  *prep.mutable_manifest() = Manifest(2);
  EXPECT_EQ(stub_->PrepareGeneration(&a, prep, &st).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(stub_->ActivateGeneration(&b, req, &st).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(stub_->StopDispatch(&c, req, &st).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(stub_->RetireGeneration(&d, req, &st).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  e.AddMetadata("authorization", "Bearer wrong");
  EXPECT_EQ(stub_->Status(&e, {}, &status).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_FALSE(registry_.State(PlacementVersion(2)).ok());
  EXPECT_EQ(registry_.ActiveVersion(), 1);
}

}  // namespace
}  // namespace moe

namespace moe {
namespace {

// Materialization (0x08F) on one rank: a placement with the same slots retains every weight in
// memory; FetchSlotWeights serves a slot's bytes to peers; trials need a PREPARED candidate.
TEST_F(RankAgentTest, MaterializeFetchAndTrials) {
  v1::GenerationStatus st;
  ASSERT_TRUE(Prepare(Manifest(2), &st).ok());
  v1::AgentStatusResponse status;
  ASSERT_TRUE(stub_->Status(Ctx().get(), {}, &status).ok());
  ASSERT_EQ(status.generations_size(), 2);
  EXPECT_EQ(status.generations(1).retained(), kExperts);  // every slot already in memory here
  EXPECT_EQ(status.generations(1).loaded(), 0);

  v1::FetchSlotRequest f;
  f.set_version(1);
  f.set_slot(2);
  v1::SlotWeights w;
  ASSERT_TRUE(stub_->FetchSlotWeights(Ctx().get(), f, &w).ok());
  const TensorBlob& gu = ckpt_.tensors.at("experts." + std::to_string(w.expert()) + ".w_gate_up");
  EXPECT_EQ(w.w_gate_up(), std::string(gu.data.begin(), gu.data.end()));
  f.set_slot(99);
  grpc::Status missing = stub_->FetchSlotWeights(Ctx().get(), f, &w);
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(missing.error_message(), ::testing::HasSubstr("slot: q99"));
  f.set_version(7);
  EXPECT_EQ(stub_->FetchSlotWeights(Ctx().get(), f, &w).error_code(), grpc::StatusCode::NOT_FOUND);

  v1::PrepareGenerationRequest bad;
  *bad.mutable_manifest() = Manifest(3);
  bad.add_peer_agents("127.0.0.1:1");
  bad.add_peer_agents("127.0.0.1:2");
  grpc::Status peers = stub_->PrepareGeneration(Ctx().get(), bad, &st);
  EXPECT_EQ(peers.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(peers.error_message(), ::testing::HasSubstr("peer_agents"));
  EXPECT_FALSE(registry_.State(PlacementVersion(3)).ok());  // nothing left behind

  v1::TrialRequest t, got;
  t.set_version(2);
  t.set_shadow_every(2);
  ASSERT_TRUE(stub_->SetTrial(Ctx().get(), t, &got).ok());
  EXPECT_EQ(got.version(), 2);
  EXPECT_EQ(StepGeneration(2), 1);  // shadow steps answer with the active generation
  EXPECT_EQ(executor_->Counters().at(2).shadow_samples, 1);
  t.set_version(9);
  EXPECT_EQ(stub_->SetTrial(Ctx().get(), t, &got).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  t.set_version(2);
  t.set_canary_every(-1);
  EXPECT_EQ(stub_->SetTrial(Ctx().get(), t, &got).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // A stop names the trial it stops: one of another generation (a late stop of an earlier
  // candidate's trial) leaves placement-v2's running; its own stops it.
  v1::TrialRequest stop;
  stop.set_stop_version(3);
  ASSERT_TRUE(stub_->SetTrial(Ctx().get(), stop, &got).ok());
  EXPECT_EQ(got.version(), 2);
  EXPECT_EQ(executor_->Trial().version, 2);
  stop.set_stop_version(2);
  ASSERT_TRUE(stub_->SetTrial(Ctx().get(), stop, &got).ok());
  EXPECT_EQ(got.version(), 0);
  EXPECT_EQ(executor_->Trial().version, -1);
  v1::TrialRequest both;  // a stop_version with a trial to start is not a stop
  both.set_version(2);
  both.set_stop_version(2);
  EXPECT_EQ(stub_->SetTrial(Ctx().get(), both, &got).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  t.set_canary_every(3);
  ASSERT_TRUE(stub_->SetTrial(Ctx().get(), t, &got).ok());
  EXPECT_EQ(executor_->Trial().version, 2);
  ASSERT_TRUE(Lifecycle("activate", 2, &st).ok());  // promotion ends the trial
  EXPECT_EQ(executor_->Trial().version, -1);
}

// A placement whose load failed on another rank is forgotten here: its weights dropped, the
// version preparable again with other slots. Only a PREPARED generation outside a trial.
TEST_F(RankAgentTest, DiscardForgetsAPreparedGenerationThatNeverServed) {
  v1::GenerationRequest req;
  v1::GenerationStatus st;
  {
    grpc::ClientContext none;
    req.set_version(2);
    EXPECT_EQ(stub_->DiscardGeneration(&none, req, &st).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  req.set_version(0);
  EXPECT_EQ(stub_->DiscardGeneration(Ctx().get(), req, &st).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  req.set_version(9);  // unknown here: nothing held, done
  ASSERT_TRUE(stub_->DiscardGeneration(Ctx().get(), req, &st).ok());
  EXPECT_EQ(st.state(), v1::GENERATION_STATE_UNSPECIFIED);

  ASSERT_TRUE(Prepare(Manifest(2), &st).ok());
  // The same version with other slots (one more replica) is refused while v2 is held ...
  const v1::PlacementManifest wider = ManifestToProto(
      **DefaultPlacement(PlacementVersion(2), kExperts, 1, topology_, group_, ckpt_.metadata), topology_);
  EXPECT_EQ(Prepare(wider, &st).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  req.set_version(2);
  v1::TrialRequest t, got;
  t.set_version(2);
  t.set_shadow_every(2);
  ASSERT_TRUE(stub_->SetTrial(Ctx().get(), t, &got).ok());
  EXPECT_EQ(StepGeneration(2), 1);  // a shadow step: v2's counters hold a sample
  ASSERT_EQ(executor_->Counters().at(2).shadow_samples, 1);
  grpc::Status trial = stub_->DiscardGeneration(Ctx().get(), req, &st);
  EXPECT_EQ(trial.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << trial.error_message();
  EXPECT_THAT(trial.error_message(), HasSubstr("trial"));
  t.set_version(0);
  ASSERT_TRUE(stub_->SetTrial(Ctx().get(), t, &got).ok());
  ASSERT_TRUE(stub_->DiscardGeneration(Ctx().get(), req, &st).ok());
  EXPECT_FALSE(registry_.State(PlacementVersion(2)).ok());
  EXPECT_EQ(executor_->Counters().count(2), 0u) << "the stopped trial's counts would reach the next v2";
  ASSERT_TRUE(stub_->DiscardGeneration(Ctx().get(), req, &st).ok());  // repeat
  EXPECT_EQ(StepGeneration(1), 1);                                    // steps never saw it
  // ... and prepared after the discard.
  ASSERT_TRUE(Prepare(wider, &st).ok());
  EXPECT_EQ(st.state(), v1::GENERATION_STATE_PREPARED);
  EXPECT_GT(st.local_slots(), kExperts);
  // A generation that served is retired, never discarded.
  req.set_version(1);
  grpc::Status active = stub_->DiscardGeneration(Ctx().get(), req, &st);
  EXPECT_EQ(active.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << active.error_message();
  EXPECT_THAT(active.error_message(), HasSubstr("ACTIVE"));
  EXPECT_THAT(active.error_message(), ::testing::StartsWith("version: ")) << "the refusal names the field";
  EXPECT_EQ(*registry_.State(PlacementVersion(1)), GenerationState::kActive);
  // A version this rank never registered: the registry's refusal, named by the field too.
  v1::GenerationRequest unknown;
  unknown.set_version(77);
  grpc::Status missing = stub_->ActivateGeneration(Ctx().get(), unknown, &st);
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::NOT_FOUND) << missing.error_message();
  EXPECT_THAT(missing.error_message(), ::testing::StartsWith("version: placement-v77"));
}

// A discard that waited behind a load while its caller gave up answers CANCELLED when it runs,
// and removes nothing: the generation that load prepared meanwhile stays PREPARED.
TEST_F(RankAgentTest, DiscardWhoseCallerLeftRemovesNothing) {
  HeldReader held(reader_.get());
  GenerationRegistry registry;  // nothing active here: every slot of a prepare is a checkpoint read
  RankAgentContext c{Rank(0), &registry, executor_.get(), &held, kToken};
  c.runtime.set_dtype("BF16");
  RankAgentServiceImpl service(std::move(c));
  std::unique_ptr<v1::RankAgentService::Stub> stub;
  std::unique_ptr<grpc::Server> server = Serve(&service, &stub);

  grpc::Status prepared;
  std::thread load([&] {
    v1::PrepareGenerationRequest req;
    *req.mutable_manifest() = Manifest(2);
    v1::GenerationStatus st;
    prepared = stub->PrepareGeneration(Ctx().get(), req, &st);
  });
  if (!held.AwaitEntered(absl::Seconds(30))) {  // the prepare holds the agent's lock, reading its first slot
    held.Release();
    load.join();
    FAIL() << "the prepare never read the checkpoint: " << prepared.error_message();
  }
  v1::GenerationRequest req;
  req.set_version(2);
  v1::GenerationStatus st;
  auto ctx = Ctx();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
  EXPECT_EQ(stub->DiscardGeneration(ctx.get(), req, &st).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  // The server's deadline counts from the request's arrival, a little after the client's, and its
  // cancellation reaches the call's context after that: give it time before the load lets go.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  held.Release();
  load.join();
  ASSERT_TRUE(prepared.ok()) << prepared.error_message();
  server->Shutdown();  // returns once every handler has, the discard's too (it ran after the load)
  auto state = registry.State(PlacementVersion(2));
  ASSERT_TRUE(state.ok()) << "the discard whose caller left removed the prepared generation: " << state.status();
  EXPECT_EQ(*state, GenerationState::kPrepared);
  EXPECT_NE(executor_->HostWeights(PlacementVersion(2)), nullptr);
}

}  // namespace
}  // namespace moe
