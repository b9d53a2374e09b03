// Release lifecycle (0x0EA trace), the 0x0DC promotion gate, the 0x0D ratios and 0x0DA quantiles,
// and the ordered rollback with live handles.
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "runtime/placement/registry.h"
#include "runtime/release/evidence.h"
#include "runtime/release/lifecycle.h"
#include "runtime/release/rollback.h"
#include "tests/runtime/fixtures.h"

namespace moe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

TEST(ReleaseLifecycleTest, CandidateTraceOf0x0EA) {
  ReleaseLifecycle r("release-v19");
  const ReleaseState trace[] = {ReleaseState::kVerified, ReleaseState::kLoaded, ReleaseState::kShadow,
                                ReleaseState::kCanary,   ReleaseState::kActive, ReleaseState::kDraining,
                                ReleaseState::kRetired};
  for (ReleaseState s : trace) ASSERT_TRUE(r.TransitionTo(s, "fixture").ok()) << ReleaseStateName(s);
  EXPECT_EQ(r.state(), ReleaseState::kRetired);
  ASSERT_EQ(r.history().size(), 7u);
  EXPECT_EQ(r.history().front().from, ReleaseState::kBuilt);
  EXPECT_EQ(r.history().back().to, ReleaseState::kRetired);
}

TEST(ReleaseLifecycleTest, IllegalTransitionsAreRefusedAndChangeNothing) {
  ReleaseLifecycle r("release-v19");
  // Skipping verification, or promoting straight from BUILT, is refused.
  auto s = r.TransitionTo(ReleaseState::kActive, "skip");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("BUILT -> ACTIVE"));
  EXPECT_EQ(r.state(), ReleaseState::kBuilt);
  EXPECT_TRUE(r.history().empty());
  EXPECT_EQ(r.TransitionTo(ReleaseState::kVerified, "").code(), absl::StatusCode::kInvalidArgument);
  // RETIRED is terminal.
  ASSERT_TRUE(r.TransitionTo(ReleaseState::kRetired, "hash drift").ok());
  for (const char* name : {"BUILT", "VERIFIED", "LOADED", "SHADOW", "CANARY", "ACTIVE", "DRAINING", "RETIRED"}) {
    EXPECT_FALSE(LegalTransition(ReleaseState::kRetired, *ParseReleaseState(name))) << name;
  }
  EXPECT_FALSE(LegalTransition(ReleaseState::kShadow, ReleaseState::kActive));  // canary is not optional
  EXPECT_EQ(ParseReleaseState("LIVE").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ReleaseLifecycleTest, CheckTransitionIsTheTableAndAReason) {
  EXPECT_TRUE(CheckTransition("release-v19", ReleaseState::kCanary, ReleaseState::kActive, "gate passed").ok());
  EXPECT_EQ(CheckTransition("release-v19", ReleaseState::kCanary, ReleaseState::kActive, "").code(),
            absl::StatusCode::kInvalidArgument);
  const absl::Status s = CheckTransition("release-v19", ReleaseState::kShadow, ReleaseState::kActive, "skip");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "release-v19: SHADOW -> ACTIVE is not a legal transition");
}

TEST(ReleaseLifecycleTest, StaleProposalIsNotApplied) {
  ReleaseLifecycle r("release-v19");
  auto t = *r.Propose(ReleaseState::kVerified, "digests ok");
  ASSERT_TRUE(r.TransitionTo(ReleaseState::kRetired, "withdrawn").ok());
  EXPECT_EQ(r.Apply(t).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.state(), ReleaseState::kRetired);
}

PromotionInputs PassingInputs() {
  PromotionInputs in;
  in.hash_ok = in.manifest_ok = in.faults_ok = in.rollback_ok = true;
  in.shadow_samples = 100;
  in.canary_samples = 200;
  in.routes_attempted = 800;
  in.routes_dropped = 2;
  in.steps = 240;
  in.fallback_steps = 24;
  return in;
}

TEST(PromotionGateTest, FixturePassesTheConjunction) {
  PromotionDecision d = EvaluatePromotion(PassingInputs());
  EXPECT_TRUE(d.promote);
  EXPECT_TRUE(d.failed.empty());
}

TEST(PromotionGateTest, EachClauseBlocksAloneAndIsNamed) {
  struct Case {
    void (*mutate)(PromotionInputs&);
    const char* clause;
  };
  const Case cases[] = {
      {[](PromotionInputs& in) { in.hash_ok = false; }, "HashOK"},
      {[](PromotionInputs& in) { in.manifest_ok = false; }, "ManifestOK"},
      {[](PromotionInputs& in) { in.faults_ok = false; }, "FaultsOK"},
      {[](PromotionInputs& in) { in.rollback_ok = false; }, "RollbackOK"},
      {[](PromotionInputs& in) { in.shadow_samples = 99; }, "N_shadow >= 100"},
      {[](PromotionInputs& in) { in.canary_samples = 199; }, "N_canary >= 200"},
      {[](PromotionInputs& in) { in.routes_dropped = 5; }, "r_drop <= 0.005"},      // 5/800 = 0.00625
      {[](PromotionInputs& in) { in.fallback_steps = 37; }, "r_fallback <= 0.15"},  // 37/240 = 0.154
      {[](PromotionInputs& in) { in.route_mismatches = 1; }, "N_route_mismatch = 0"},
      {[](PromotionInputs& in) { in.stale_accepts = 1; }, "N_stale_accept = 0"},
      {[](PromotionInputs& in) { in.count_failures = 1; }, "N_count_failure = 0"},
  };
  for (const Case& c : cases) {
    PromotionInputs in = PassingInputs();
    c.mutate(in);
    PromotionDecision d = EvaluatePromotion(in);
    EXPECT_FALSE(d.promote) << c.clause;
    EXPECT_THAT(d.failed, ElementsAre(c.clause));
  }
  // Boundaries are inclusive: 4/800 = 0.005 and 36/240 = 0.15 still pass.
  PromotionInputs edge = PassingInputs();
  edge.routes_dropped = 4;
  edge.fallback_steps = 36;
  EXPECT_TRUE(EvaluatePromotion(edge).promote);
  // No evidence is not a pass.
  PromotionInputs empty = PassingInputs();
  empty.routes_attempted = 0;
  empty.routes_dropped = 0;
  EXPECT_FALSE(EvaluatePromotion(empty).promote);
}

TEST(EvaluationTest, RatiosOf0x0DUseTheirOwnDenominators) {
  const std::vector<EvaluationCell> cells = {
      {40, 320, 320, 0, 240, 120, 0, 0},   // prefill uniform
      {100, 200, 200, 0, 120, 60, 96, 4},  // decode fixed bucket
      {80, 160, 158, 2, 120, 70, 70, 10},  // decode hot expert
      {20, 120, 120, 0, 90, 50, 10, 10},   // mixed burst
  };
  EvaluationRatios r = Ratios(cells);
  EXPECT_DOUBLE_EQ(r.drop, 0.0025);
  EXPECT_DOUBLE_EQ(r.remote, 570.0 / 798.0);
  EXPECT_NEAR(r.remote, 0.714286, 1e-6);
  EXPECT_DOUBLE_EQ(r.inter_node, 300.0 / 798.0);
  EXPECT_NEAR(r.inter_node, 0.375940, 1e-6);
  EXPECT_DOUBLE_EQ(r.graph_replay, 0.88);
  EXPECT_DOUBLE_EQ(r.fallback_step, 0.10);
}

TEST(EvaluationTest, NearestRankQuantiles) {
  // The spec gives only the results (p50 = 11, p95 = 23, max = 24 over twenty positive units), so
  // these twenty values are ours, chosen so that x_(10) = 11, x_(19) = 23, x_(20) = 24.
  std::vector<double> v = {24, 3, 11, 7, 23, 1, 18, 12, 5, 15, 2, 9, 20, 13, 4, 17, 6, 8, 14, 16};
  ASSERT_EQ(v.size(), 20u);
  EXPECT_EQ(NearestRank(v, 0.50), 11);  // x_(10)
  EXPECT_EQ(NearestRank(v, 0.95), 23);  // x_(19)
  EXPECT_EQ(NearestRank(v, 1.0), 24);
  EXPECT_EQ(NearestRank({5}, 0.0), 5);  // rank clamps to 1
}

// The gate's inputs aggregated from four ranks' reports (runtime/release/evidence.h): every
// rank holds candidate placement-v20 PREPARED under the recorded manifest's digest and prior
// placement-v19 ACTIVE; together they ran the 0x0D fixture's totals (240 steps of which 100
// decode, 24 fallback steps, 800 / 2 routes).
constexpr char kDigest[] = "sha256:0f1e2d";
EvidenceExpectation Expect() {
  EvidenceExpectation e;
  e.candidate_version = 20;
  e.manifest_digest = kDigest;
  e.prior_version = 19;
  return e;
}
std::vector<RankReport> HealthyRanks() {
  std::vector<RankReport> ranks(4);
  for (int r = 0; r < 4; ++r) {
    RankReport& x = ranks[r];
    x.name = "rank " + std::to_string(r);
    x.candidate_state = GenerationState::kPrepared;
    x.candidate_digest = kDigest;
    x.prior_state = GenerationState::kActive;
    x.counters.steps = 60;  // prefill, decode and canary steps
    x.counters.decode_steps = 25;
    x.counters.fallback_steps = 6;
    x.counters.canary_steps = 200 + r;
    x.counters.shadow_samples = 100 + r;
    x.counters.routes_attempted = 200;
    x.counters.routes_dropped = r == 0 ? 2 : 0;
  }
  return ranks;
}

TEST(RankEvidenceTest, HealthyRanksPassTheGate) {
  const GateEvidence e = AggregateRankEvidence(HealthyRanks(), Expect());
  EXPECT_THAT(e.findings, IsEmpty());
  EXPECT_TRUE(e.inputs.hash_ok && e.inputs.manifest_ok && e.inputs.faults_ok && e.inputs.rollback_ok);
  EXPECT_EQ(e.inputs.shadow_samples, 100);  // collective: the smallest per-rank count
  EXPECT_EQ(e.inputs.canary_samples, 200);
  EXPECT_EQ(e.inputs.routes_attempted, 800);
  EXPECT_EQ(e.inputs.routes_dropped, 2);
  const PromotionDecision d = EvaluatePromotion(e.inputs);
  EXPECT_TRUE(d.promote) << testing::PrintToString(d.failed);
}

TEST(RankEvidenceTest, FallbackRatioDividesByAllSteps) {
  // 0x0D: r_fallback = fallback steps / all steps = 24 / 240 = 0.10. Dividing by the decode
  // steps (24 / 100 = 0.24) would block this release at max 0.15.
  const GateEvidence e = AggregateRankEvidence(HealthyRanks(), Expect());
  EXPECT_EQ(e.inputs.steps, 240);
  EXPECT_EQ(e.inputs.fallback_steps, 24);
  EXPECT_TRUE(EvaluatePromotion(e.inputs).promote);
  // ... and a fallback share above the threshold of ALL steps still blocks: 40 / 240 = 0.167.
  std::vector<RankReport> ranks = HealthyRanks();
  for (RankReport& r : ranks) r.counters.fallback_steps = 10;
  EXPECT_THAT(EvaluatePromotion(AggregateRankEvidence(ranks, Expect()).inputs).failed,
              ElementsAre("r_fallback <= 0.15"));
}

TEST(RankEvidenceTest, HashOkNeedsTheRecordedDigestOnEveryRank) {
  std::vector<RankReport> other = HealthyRanks();
  other[2].candidate_digest = "sha256:999999";  // rank 2 holds other slots under the same version
  GateEvidence e = AggregateRankEvidence(other, Expect());
  EXPECT_FALSE(e.inputs.hash_ok);
  EXPECT_TRUE(e.inputs.manifest_ok);
  EXPECT_THAT(EvaluatePromotion(e.inputs).failed, ElementsAre("HashOK"));
  ASSERT_THAT(e.findings, ElementsAre(HasSubstr("rank 2 holds placement-v20 under manifest digest sha256:999999")));

  std::vector<RankReport> silent = HealthyRanks();
  silent[1].candidate_digest.clear();  // a rank that reports no digest proves nothing
  e = AggregateRankEvidence(silent, Expect());
  EXPECT_FALSE(e.inputs.hash_ok);
  EXPECT_THAT(e.findings, ElementsAre(HasSubstr("rank 1 reports no manifest digest")));

  EvidenceExpectation unrecorded = Expect();
  unrecorded.manifest_digest.clear();  // nothing recorded to compare against
  unrecorded.manifest_problem = "release-v20 has no recorded placement manifest";
  e = AggregateRankEvidence(HealthyRanks(), unrecorded);
  EXPECT_FALSE(e.inputs.hash_ok);
  EXPECT_THAT(e.findings, ElementsAre(HasSubstr("no recorded placement manifest")));

  std::vector<RankReport> retired = HealthyRanks();
  retired[3].candidate_state = GenerationState::kRetired;  // the digest matches, the weights are gone
  e = AggregateRankEvidence(retired, Expect());
  EXPECT_FALSE(e.inputs.hash_ok);
  EXPECT_FALSE(e.inputs.manifest_ok);
}

TEST(RankEvidenceTest, RollbackOkNeedsThePriorReactivatableOnEveryRank) {
  for (GenerationState loaded : {GenerationState::kActive, GenerationState::kPrepared, GenerationState::kDraining}) {
    std::vector<RankReport> ranks = HealthyRanks();
    ranks[1].prior_state = loaded;
    EXPECT_TRUE(AggregateRankEvidence(ranks, Expect()).inputs.rollback_ok) << GenerationStateName(loaded);
  }
  std::vector<RankReport> retired = HealthyRanks();
  retired[1].prior_state = GenerationState::kRetired;  // its weights are freed: nothing to go back to
  GateEvidence e = AggregateRankEvidence(retired, Expect());
  EXPECT_FALSE(e.inputs.rollback_ok);
  EXPECT_THAT(EvaluatePromotion(e.inputs).failed, ElementsAre("RollbackOK"));
  EXPECT_THAT(e.findings, ElementsAre(HasSubstr("rank 1: prior placement-v19 is RETIRED")));

  std::vector<RankReport> missing = HealthyRanks();
  missing[0].prior_state.reset();  // e.g. a restarted rank that never prepared it again
  EXPECT_FALSE(AggregateRankEvidence(missing, Expect()).inputs.rollback_ok);

  EvidenceExpectation no_prior = Expect();
  no_prior.prior_version = 0;
  no_prior.prior_problem = "no release is ACTIVE";
  e = AggregateRankEvidence(HealthyRanks(), no_prior);
  EXPECT_FALSE(e.inputs.rollback_ok);
  EXPECT_THAT(e.findings, ElementsAre(HasSubstr("no release is ACTIVE")));
}

TEST(RankEvidenceTest, StaleAcceptsMismatchesAndFailuresAreCountedNotAssumed) {
  std::vector<RankReport> stale = HealthyRanks();
  stale[3].counters.stale_accepts = 1;
  GateEvidence e = AggregateRankEvidence(stale, Expect());
  EXPECT_EQ(e.inputs.stale_accepts, 1);
  EXPECT_THAT(EvaluatePromotion(e.inputs).failed, ElementsAre("N_stale_accept = 0"));

  std::vector<RankReport> drift = HealthyRanks();
  drift[2].counters.shadow_mismatches = 3;
  drift[0].counters.shadow_mismatches = 1;
  e = AggregateRankEvidence(drift, Expect());
  EXPECT_EQ(e.inputs.route_mismatches, 4);
  EXPECT_THAT(EvaluatePromotion(e.inputs).failed, ElementsAre("N_route_mismatch = 0"));

  std::vector<RankReport> failing = HealthyRanks();
  failing[1].counters.failed_steps = 2;
  failing[2].counters.shadow_failures = 1;
  e = AggregateRankEvidence(failing, Expect());
  EXPECT_FALSE(e.inputs.faults_ok);
  EXPECT_EQ(e.inputs.count_failures, 0);  // failures are not count-conservation failures
  EXPECT_THAT(EvaluatePromotion(e.inputs).failed, ElementsAre("FaultsOK"));

  std::vector<RankReport> unconserved = HealthyRanks();
  unconserved[3].counters.count_failures = 2;
  e = AggregateRankEvidence(unconserved, Expect());
  EXPECT_TRUE(e.inputs.faults_ok);
  EXPECT_EQ(e.inputs.count_failures, 2);
  EXPECT_THAT(EvaluatePromotion(e.inputs).failed, ElementsAre("N_count_failure = 0"));
  EXPECT_THAT(e.findings, ::testing::Contains(::testing::HasSubstr("did not conserve")));
}

TEST(RankEvidenceTest, NoRanksIsNoEvidence) {
  const GateEvidence e = AggregateRankEvidence({}, Expect());
  EXPECT_FALSE(e.inputs.hash_ok || e.inputs.manifest_ok || e.inputs.faults_ok || e.inputs.rollback_ok);
  EXPECT_FALSE(EvaluatePromotion(e.inputs).promote);
}

std::shared_ptr<const PlacementManifest> Version(int64_t v) {
  Topology t = fixture::FourRankTwoNode();
  return *PlacementManifest::Create(fixture::Options(v), fixture::V17Slots(), t);
}

TEST(RollbackTest, OrderedStateTransferWithLiveHandles) {
  GenerationRegistry registry;
  ASSERT_TRUE(registry.Prepare(Version(18)).ok());
  ASSERT_TRUE(registry.Activate(PlacementVersion(18)).ok());
  ASSERT_TRUE(registry.Prepare(Version(19)).ok());
  ASSERT_TRUE(registry.Activate(PlacementVersion(19)).ok());  // candidate live; v18 DRAINING, loaded
  // Three placement-v19 handles are in flight.
  std::vector<GenerationLease> leases;
  for (int h = 0; h < 3; ++h) leases.push_back(*registry.AcquireActive(HandleId(100 + h)));
  ASSERT_EQ(registry.Refcount(PlacementVersion(19)), 3);

  std::vector<std::string> observed;
  bool graphs_released_with_refs = false;
  std::thread finisher([&] {
    // Handles complete against their snapshot only after new dispatch already moved to v18.
    while (registry.ActiveVersion() != 18) std::this_thread::yield();
    observed.push_back("v18 active while v19 refcount=" + std::to_string(registry.Refcount(PlacementVersion(19))));
    for (auto& l : leases) ASSERT_TRUE(l.Release().ok());
  });
  auto report = RollBack(
      registry, PlacementVersion(19), PlacementVersion(18),
      [&] { graphs_released_with_refs = registry.Refcount(PlacementVersion(19)) != 0; }, absl::Seconds(10));
  finisher.join();
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_THAT(report->steps,
              ElementsAre("stop new dispatch on placement-v19", "activate placement-v18 for new dispatch",
                          "drain placement-v19 handles to zero", "release placement-v19 graph resources",
                          "retire placement-v19", "rollback complete"));
  EXPECT_THAT(observed, ElementsAre("v18 active while v19 refcount=3"));
  EXPECT_FALSE(graphs_released_with_refs);
  EXPECT_EQ(*registry.State(PlacementVersion(19)), GenerationState::kRetired);
  EXPECT_EQ(*registry.State(PlacementVersion(18)), GenerationState::kActive);
  // New dispatch lands on the prior generation.
  EXPECT_EQ(registry.AcquireActive(HandleId(200))->version(), PlacementVersion(18));
}

TEST(RollbackTest, StuckHandleTimesOutWithoutRetiring) {
  GenerationRegistry registry;
  ASSERT_TRUE(registry.Prepare(Version(18)).ok());
  ASSERT_TRUE(registry.Activate(PlacementVersion(18)).ok());
  ASSERT_TRUE(registry.Prepare(Version(19)).ok());
  ASSERT_TRUE(registry.Activate(PlacementVersion(19)).ok());
  GenerationLease stuck = *registry.AcquireActive(HandleId(7));
  bool released = false;
  auto report = RollBack(
      registry, PlacementVersion(19), PlacementVersion(18), [&] { released = true; }, absl::Milliseconds(20));
  EXPECT_EQ(report.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(report.status().message()), HasSubstr("1 handles"));
  EXPECT_FALSE(released);
  EXPECT_EQ(*registry.State(PlacementVersion(19)), GenerationState::kDraining);
  EXPECT_EQ(registry.ActiveVersion(), 18);
  ASSERT_TRUE(stuck.Release().ok());
  // A retry completes once the handle is gone.
  EXPECT_TRUE(RollBack(registry, PlacementVersion(19), PlacementVersion(18), nullptr, absl::Seconds(1)).ok());
}

TEST(RollbackTest, RetiredPriorIsRefused) {
  GenerationRegistry registry;
  ASSERT_TRUE(registry.Prepare(Version(18)).ok());
  ASSERT_TRUE(registry.Activate(PlacementVersion(18)).ok());
  ASSERT_TRUE(registry.Prepare(Version(19)).ok());
  ASSERT_TRUE(registry.Activate(PlacementVersion(19)).ok());
  ASSERT_TRUE(registry.Retire(PlacementVersion(18)).ok());
  auto report = RollBack(registry, PlacementVersion(19), PlacementVersion(18), nullptr, absl::Seconds(1));
  EXPECT_EQ(report.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(registry.ActiveVersion(), 19);  // nothing half-applied
}

// 0x0EA asserts the prior and the candidate serve one checkpoint: a prior of another checkpoint
// is refused before anything changes.
TEST(RollbackTest, APriorOfAnotherCheckpointIsRefused) {
  GenerationRegistry registry;
  Topology t = fixture::FourRankTwoNode();
  ManifestOptions older = fixture::Options(18);
  older.checkpoint = CheckpointVersion("checkpoint-0041");
  std::vector<SlotRecord> slots = fixture::V17Slots();
  for (SlotRecord& s : slots) s.checkpoint = older.checkpoint;
  ASSERT_TRUE(registry.Prepare(*PlacementManifest::Create(older, slots, t)).ok());
  ASSERT_TRUE(registry.Activate(PlacementVersion(18)).ok());
  ASSERT_TRUE(registry.Prepare(Version(19)).ok());
  ASSERT_TRUE(registry.Activate(PlacementVersion(19)).ok());
  auto report = RollBack(registry, PlacementVersion(19), PlacementVersion(18), nullptr, absl::Seconds(1));
  EXPECT_EQ(report.status().code(), absl::StatusCode::kFailedPrecondition) << report.status();
  EXPECT_THAT(std::string(report.status().message()), HasSubstr("checkpoint-0041"));
  EXPECT_EQ(registry.ActiveVersion(), 19);  // nothing half-applied
  EXPECT_EQ(*registry.State(PlacementVersion(18)), GenerationState::kDraining);
}

// A target that records the calls RollBack makes and fails the step named `fail_at`.
class RecordingTarget : public RollbackTarget {
 public:
  explicit RecordingTarget(std::string fail_at = "") : fail_at_(std::move(fail_at)) {}
  absl::Status StopDispatch(PlacementVersion v) override { return Call("stop", v); }
  absl::Status ActivatePrior(PlacementVersion v) override { return Call("activate", v); }
  absl::Status AwaitDrained(PlacementVersion v) override { return Call("drain", v); }
  absl::Status ReleaseGraphs(PlacementVersion v) override { return Call("release", v); }
  absl::Status Retire(PlacementVersion v) override { return Call("retire", v); }
  std::vector<std::string> calls;

 private:
  absl::Status Call(const std::string& step, PlacementVersion v) {
    calls.push_back(step + " v" + std::to_string(v.value()));
    return step == fail_at_ ? absl::UnavailableError("rank 1 (x): " + step) : absl::OkStatus();
  }
  std::string fail_at_;
};

TEST(RollbackTest, OneOrderOverAnyTarget) {
  RecordingTarget target;
  auto report = RollBack(target, PlacementVersion(19), PlacementVersion(18));
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_THAT(target.calls, ElementsAre("stop v19", "activate v18", "drain v19", "release v19", "retire v19"));
  EXPECT_EQ(report->steps.size(), 6u);
  EXPECT_EQ(report->steps.back(), "rollback complete");
}

TEST(RollbackTest, FirstFailingStepStopsItAndIsReturnedUnchanged) {
  RecordingTarget target("drain");
  auto report = RollBack(target, PlacementVersion(19), PlacementVersion(18));
  EXPECT_EQ(report.status(), absl::UnavailableError("rank 1 (x): drain"));
  EXPECT_THAT(target.calls, ElementsAre("stop v19", "activate v18", "drain v19"));
}

}  // namespace
}  // namespace moe
