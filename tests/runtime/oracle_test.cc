#include "runtime/plan/oracle.h"

#include <cmath>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "runtime/placement/replica_selector.h"
#include "tests/runtime/fixtures.h"

namespace moe {
namespace {

using ::testing::FloatNear;
using ::testing::Pointwise;

PartitionRows RunFixture(RunnerLayoutParams runner) {
  Topology topo = fixture::FourRankTwoNode();
  auto manifest = fixture::V17(topo);
  FrozenHandoff frozen = *Freeze(fixture::EightRoutes());
  PlanLayout layout = *PlanLayout::Create(manifest, fixture::IdentityGroup());
  ClusterPlan plan = *PlanCluster(frozen, fixture::EightRouteSlots(), layout, topo);
  auto out =
      PhysicalOutputs(plan, frozen, *manifest, fixture::EightRouteHidden(), 3, fixture::TeachingScales(), runner);
  EXPECT_TRUE(out.ok()) << out.status();
  return *out;
}

void ExpectSpecOutputs(const PartitionRows& out) {
  // 0x03C3 / 0x04F.
  const std::vector<float> p0 = {1.35f, 13.5f, 135.0f, 3.2f, 32.0f, 320.0f};
  const std::vector<float> p1 = {8.22f, 82.2f, 822.0f, 6.2f, 62.0f, 620.0f};
  EXPECT_THAT(out[0], Pointwise(FloatNear(1e-4f), p0));
  EXPECT_THAT(out[1], Pointwise(FloatNear(1e-3f), p1));
  EXPECT_TRUE(out[2].empty());
  EXPECT_TRUE(out[3].empty());
}

TEST(OracleTest, GroupedRunnerReproducesSpecOutputs) {
  ExpectSpecOutputs(RunFixture({RunnerKind::kGrouped, 0, 1, 128}));
}

TEST(OracleTest, PaddedRunnerReproducesSpecOutputs) {
  // Capacity 3 aligned to 2: padding rows are NaN-poisoned and must never reach combine.
  ExpectSpecOutputs(RunFixture({RunnerKind::kPaddedDense, 3, 2, 128}));
}

TEST(OracleTest, BlockSparseRunnerReproducesSpecOutputs) {
  ExpectSpecOutputs(RunFixture({RunnerKind::kBlockSparse, 0, 1, 2}));
}

TEST(OracleTest, SemanticComputationReproducesSpecOutputs) {
  auto out = SemanticOutputs(fixture::EightRoutes(), fixture::EightRouteHidden(), 3, fixture::TeachingScales());
  ASSERT_TRUE(out.ok());
  ExpectSpecOutputs(*out);
}

TEST(OracleTest, PaddedCapacityBelowSegmentIsAnErrorNotADrop) {
  Topology topo = fixture::FourRankTwoNode();
  auto manifest = fixture::V17(topo);
  FrozenHandoff frozen = *Freeze(fixture::EightRoutes());
  PlanLayout layout = *PlanLayout::Create(manifest, fixture::IdentityGroup());
  ClusterPlan plan = *PlanCluster(frozen, fixture::EightRouteSlots(), layout, topo);
  auto out = PhysicalOutputs(plan, frozen, *manifest, fixture::EightRouteHidden(), 3, fixture::TeachingScales(),
                             {RunnerKind::kPaddedDense, 1, 1, 128});
  EXPECT_EQ(out.status().code(), absl::StatusCode::kFailedPrecondition);
}

// 0x0CD: each partition carries T x top_k routes, accepted or dropped. A handoff missing one
// (p1.t1's second route) would be computed as if the token had one expert less.
TEST(OracleTest, AHandoffMissingARouteIsRefused) {
  SemanticHandoff h = fixture::EightRoutes();
  h.origin.pop_back();
  h.token.pop_back();
  h.route_slot.pop_back();
  h.expert.pop_back();
  h.gate.pop_back();
  h.admitted.pop_back();
  ASSERT_TRUE(h.Validate().ok());
  auto out = SemanticOutputs(h, fixture::EightRouteHidden(), 3, fixture::TeachingScales());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(out.status().message()),
              ::testing::HasSubstr("partition 1 has 3 routes (accepted and dropped) for 2 tokens x top_k 2"));
}

// Random routings under every selector and layout: the physical path equals the semantic one
// (bitwise: both evaluate g * (s * h) in FP32), with dropped routes excluded from both.
TEST(OracleTest, PhysicalEqualsSemanticOnRandomRoutings) {
  std::mt19937 rng(11);
  Topology topo = fixture::FourRankTwoNode();
  auto manifest = fixture::V17(topo);
  PlanLayout layout = *PlanLayout::Create(manifest, fixture::IdentityGroup());
  const int d = 5;
  std::vector<float> scales = {1.5f, -2.0f, 3.25f, 0.5f};
  for (int trial = 0; trial < 30; ++trial) {
    SemanticHandoff h;
    h.scope = ExecutionScopeId(trial);
    h.num_experts = 4;
    h.top_k = 2;
    h.num_partitions = 4;
    PartitionRows hidden(4);
    for (int p = 0; p < 4; ++p) {
      const int tokens = static_cast<int>(rng() % 9);  // zero-token ranks included
      for (int t = 0; t < tokens; ++t) {
        for (int c = 0; c < d; ++c) hidden[p].push_back(std::uniform_real_distribution<float>(-4, 4)(rng));
        const int e0 = static_cast<int>(rng() % 4);
        const int e1 = (e0 + 1 + static_cast<int>(rng() % 3)) % 4;
        h.Add(Rank(p), t, 0, LogicalExpertId(e0), std::uniform_real_distribution<float>(0, 1)(rng), rng() % 8 != 0);
        h.Add(Rank(p), t, 1, LogicalExpertId(e1), std::uniform_real_distribution<float>(0, 1)(rng));
      }
    }
    FrozenHandoff frozen = *Freeze(h);
    auto policy = static_cast<SelectorPolicy>(trial % 4);
    std::vector<PhysicalSlotId> slots(h.size());
    ASSERT_TRUE(ReplicaSelector::Create(policy)
                    ->Select(h, *manifest, fixture::IdentityGroup(), topo, {}, absl::MakeSpan(slots))
                    .ok());
    ClusterPlan plan = *PlanCluster(frozen, slots, layout, topo);
    auto semantic = *SemanticOutputs(h, hidden, d, scales);
    for (RunnerLayoutParams runner :
         {RunnerLayoutParams{RunnerKind::kGrouped, 0, 1, 128}, RunnerLayoutParams{RunnerKind::kPaddedDense, 64, 8, 128},
          RunnerLayoutParams{RunnerKind::kBlockSparse, 0, 1, 4}}) {
      auto physical = PhysicalOutputs(plan, frozen, *manifest, hidden, d, scales, runner);
      ASSERT_TRUE(physical.ok()) << physical.status();
      for (int p = 0; p < 4; ++p) {
        ASSERT_EQ((*physical)[p].size(), semantic[p].size());
        for (size_t i = 0; i < semantic[p].size(); ++i) {
          ASSERT_FALSE(std::isnan((*physical)[p][i])) << "padding reached combine";
          ASSERT_EQ((*physical)[p][i], semantic[p][i]) << RunnerKindName(runner.kind) << " p" << p << " i" << i;
        }
      }
    }
  }
}

}  // namespace
}  // namespace moe
