#include "runtime/placement/eplb.h"

#include <algorithm>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "runtime/placement/migration.h"
#include "tests/runtime/fixtures.h"

namespace moe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

EplbProblem Fixture(int groups, int nodes) {
  EplbProblem p;
  p.layers = 1;
  p.experts = 4;
  p.weight = {4, 2, 1, 1};
  p.num_replicas = 8;
  p.num_groups = groups;
  p.num_nodes = nodes;
  p.num_gpus = 4;
  return p;
}

// 0x08B: greedy replication with first-index ties.
TEST(EplbTest, ReplicationTieTakesFirstIndex) {
  std::vector<int64_t> phy2log, rank, logcnt;
  ReplicateExperts({4, 2}, 1, 2, 4, &phy2log, &rank, &logcnt);
  EXPECT_THAT(logcnt, ElementsAre(3, 1));
  EXPECT_THAT(phy2log, ElementsAre(0, 1, 0, 0));
  EXPECT_THAT(rank, ElementsAre(0, 0, 1, 2));
}

TEST(EplbTest, BalancedPackingKeepsIndexOrderOnEqualWeights) {
  std::vector<int64_t> pack, rank;
  BalancedPacking({1, 1, 1, 1, 1, 1}, 1, 6, 3, &pack, &rank);
  EXPECT_THAT(pack, ElementsAre(0, 1, 2, 0, 1, 2));
  EXPECT_THAT(rank, ElementsAre(0, 0, 0, 1, 1, 1));
  // One item per pack: item i stays on pack i whatever its weight.
  BalancedPacking({1, 9, 5}, 1, 3, 3, &pack, &rank);
  EXPECT_THAT(pack, ElementsAre(0, 1, 2));
  // Equal item counts per pack even when weight would prefer otherwise.
  BalancedPacking({10, 1, 1, 1}, 1, 4, 2, &pack, &rank);
  EXPECT_THAT(pack, ElementsAre(0, 1, 1, 0));
}

// 0x08C: the hierarchical three-stage solve of the teaching fixture.
TEST(EplbTest, HierarchicalFixtureMatchesSpec) {
  auto s = RebalanceExperts(Fixture(2, 2));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->hierarchical);
  EXPECT_THAT(s->phy2log, ElementsAre(1, 0, 0, 0, 2, 2, 3, 3));
  EXPECT_THAT(s->phyrank, ElementsAre(0, 2, 0, 1, 0, 1, 0, 1));
  EXPECT_THAT(s->logcnt, ElementsAre(3, 1, 2, 2));
  EXPECT_EQ(s->max_count, 3);
  EXPECT_THAT(s->log2phy, ElementsAre(2, 3, 1,     // E0
                                      0, -1, -1,   // E1
                                      4, 5, -1,    // E2
                                      6, 7, -1));  // E3
  auto loads = IdealGpuLoads(Fixture(2, 2), *s, 0);
  EXPECT_NEAR(loads[0], 10.0 / 3, 1e-6);
  EXPECT_NEAR(loads[1], 8.0 / 3, 1e-6);
  EXPECT_NEAR(loads[2], 1.0, 1e-6);
  EXPECT_NEAR(loads[3], 1.0, 1e-6);
  EXPECT_NEAR(Imbalance(loads), 5.0 / 3, 1e-6);
}

// 0x08D: the global counterfactual when groups do not divide by nodes.
TEST(EplbTest, GlobalCounterfactualMatchesSpec) {
  auto s = RebalanceExperts(Fixture(1, 2));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->hierarchical);
  EXPECT_THAT(s->logcnt, ElementsAre(4, 2, 1, 1));
  EXPECT_THAT(s->phy2log, ElementsAre(0, 0, 1, 0, 2, 1, 3, 0));
  auto loads = IdealGpuLoads(Fixture(1, 2), *s, 0);
  EXPECT_THAT(loads, ElementsAre(2, 2, 2, 2));
  EXPECT_DOUBLE_EQ(Imbalance(loads), 1.0);
}

TEST(EplbTest, NonDivisibleSizesNameTheField) {
  EplbProblem p = Fixture(2, 2);
  p.num_replicas = 6;
  EXPECT_THAT(std::string(RebalanceExperts(p).status().message()), HasSubstr("num_replicas"));
  p = Fixture(3, 1);
  EXPECT_THAT(std::string(RebalanceExperts(p).status().message()), HasSubstr("num_groups"));
  p = Fixture(2, 2);
  p.num_gpus = 3;
  EXPECT_THAT(std::string(RebalanceExperts(p).status().message()), HasSubstr("num_gpus"));
  p = Fixture(2, 2);
  p.weight[1] = -1;
  EXPECT_THAT(std::string(RebalanceExperts(p).status().message()), HasSubstr("weight[0][1]"));
  p = Fixture(2, 2);
  p.weight.pop_back();
  EXPECT_EQ(RebalanceExperts(p).status().code(), absl::StatusCode::kInvalidArgument);
}

// Structural invariants on random DeepSeek-like problems.
TEST(EplbTest, RandomSolutionsAreConsistent) {
  std::mt19937 rng(1);
  for (int trial = 0; trial < 20; ++trial) {
    EplbProblem p;
    p.layers = 1 + static_cast<int>(rng() % 4);
    p.num_nodes = 1 << (rng() % 3);
    p.num_gpus = p.num_nodes * (1 + static_cast<int>(rng() % 4));
    p.num_groups = p.num_nodes * (1 + static_cast<int>(rng() % 3)) + (trial % 5 == 0 ? 1 : 0);
    p.experts = p.num_groups * (1 + static_cast<int>(rng() % 4)) * p.num_nodes;
    p.num_replicas = p.num_gpus * ((p.experts + p.num_gpus - 1) / p.num_gpus + static_cast<int>(rng() % 3));
    p.weight.resize(static_cast<size_t>(p.layers) * p.experts);
    for (float& w : p.weight) w = static_cast<float>(rng() % 1000);
    auto s = RebalanceExperts(p);
    ASSERT_TRUE(s.ok()) << s.status();
    for (int l = 0; l < p.layers; ++l) {
      std::vector<int64_t> seen(p.experts, 0);
      for (int q = 0; q < p.num_replicas; ++q) {
        const int64_t e = s->phy2log[l * p.num_replicas + q];
        const int64_t k = s->phyrank[l * p.num_replicas + q];
        ASSERT_GE(e, 0);
        ASSERT_LT(k, s->logcnt[l * p.experts + e]);
        EXPECT_EQ(s->log2phy[(static_cast<size_t>(l) * p.experts + e) * s->max_count + k], q);
        ++seen[e];
      }
      int64_t total = 0;
      for (int e = 0; e < p.experts; ++e) {
        EXPECT_EQ(seen[e], s->logcnt[l * p.experts + e]);
        EXPECT_GE(seen[e], 1);
        total += seen[e];
        for (int k = static_cast<int>(seen[e]); k < s->max_count; ++k) {
          EXPECT_EQ(s->log2phy[(static_cast<size_t>(l) * p.experts + e) * s->max_count + k], -1);
        }
      }
      EXPECT_EQ(total, p.num_replicas);
    }
  }
}

// 0x08F: placement-v18 -> placement-v19 migration. v19 is the EPLB solution of 0x08C (two
// copies per GPU). The spec names v18's q0 (E0, rank 0), q2 (E1, rank 1), q4 (E2, rank 2) and
// q5 (E3, rank 3); q1 and q3 hold copies no v19 slot on their rank can retain (here E2 on rank
// 1 and E1 on rank 2), which is what makes three old copies retire.
TEST(MigrationTest, PlacementV18ToV19MatchesSpec) {
  Topology t = fixture::FourRankTwoNode();
  auto v18 = *PlacementManifest::Create(
      fixture::Options(18),
      {fixture::Slot(0, 0, 0, 0, 0), fixture::Slot(1, 2, 1, 1, 0), fixture::Slot(2, 1, 0, 1, 0),
       fixture::Slot(3, 1, 1, 2, 1), fixture::Slot(4, 2, 0, 2, 1), fixture::Slot(5, 3, 0, 3, 1)},
      t);
  auto solution = *RebalanceExperts(Fixture(2, 2));
  std::vector<SlotRecord> target;
  for (int q = 0; q < 8; ++q) {
    target.push_back(
        fixture::Slot(q, static_cast<int>(solution.phy2log[q]), static_cast<int>(solution.phyrank[q]), q / 2, q / 4));
    target.back().name = "p" + std::to_string(q);
  }
  auto v19 = *PlacementManifest::Create(fixture::Options(19), target, t);
  const int64_t expert_bytes = 3 * 2 * 3 * 2;  // 3 d d_ff b_w with d=2, d_ff=3, BF16
  ASSERT_EQ(expert_bytes, 36);
  auto plan = PlanMigration(*v18, *v19, t, expert_bytes);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->steps.size(), 8u);
  using A = MigrationAction;
  const std::vector<std::tuple<A, int, int, bool>> expected = {
      {A::kSameNodeCopy, 1, 2, false},   // p0 E1 <- rank 1 q2
      {A::kRetain, 0, 0, false},         // p1 E0 retains rank 0 q0
      {A::kSameNodeCopy, 0, 0, false},   // p2 E0 <- rank 0 q0
      {A::kLocalDuplicate, 1, 2, true},  // p3 E0 duplicates p2
      {A::kRetain, 2, 4, false},         // p4 E2 retains rank 2 q4
      {A::kLocalDuplicate, 2, 4, true},  // p5 E2 duplicates p4
      {A::kRetain, 3, 5, false},         // p6 E3 retains rank 3 q5
      {A::kLocalDuplicate, 3, 6, true},  // p7 E3 duplicates p6
  };
  for (size_t i = 0; i < expected.size(); ++i) {
    const MigrationStep& s = plan->steps[i];
    EXPECT_EQ(s.target_slot.value(), static_cast<int>(i));
    EXPECT_EQ(s.action, std::get<0>(expected[i])) << "p" << i << ": " << MigrationActionName(s.action);
    EXPECT_EQ(s.source_rank.value(), std::get<1>(expected[i])) << "p" << i;
    EXPECT_EQ(s.source_slot.value(), std::get<2>(expected[i])) << "p" << i;
    EXPECT_EQ(s.source_is_target, std::get<3>(expected[i])) << "p" << i;
  }
  EXPECT_EQ(plan->retained_copies, 3);
  EXPECT_EQ(plan->retained_bytes, 108);
  EXPECT_EQ(plan->same_node_copies, 2);
  EXPECT_EQ(plan->same_node_bytes, 72);
  EXPECT_EQ(plan->local_duplicates, 3);
  EXPECT_EQ(plan->local_bytes, 108);
  EXPECT_EQ(plan->cross_node_copies, 0);
  EXPECT_EQ(plan->retired_copies, 3);
  EXPECT_EQ(plan->retired_bytes, 108);
  EXPECT_EQ(plan->resident_from, 216);
  EXPECT_EQ(plan->resident_to, 288);
  EXPECT_EQ(plan->peak_bytes, 396);
  // The ranks copy the retained slots into the new generation's storage: 216 + 288 at once.
  EXPECT_EQ(plan->materialized_peak_bytes, 504);
  EXPECT_EQ(plan->reserved_bytes, 5 * 36);  // five non-retained target copies (0x08G)
}

TEST(MigrationTest, IncompatibleCopiesAreNotRetainedAndMissingExpertsLoad) {
  Topology t = fixture::FourRankTwoNode();
  auto slots = fixture::V17Slots();
  slots[5].parameter_digest = ParameterDigest("expert-3-state-v41");  // E3's only copy is stale
  auto from = *PlacementManifest::Create(fixture::Options(17), slots, t);
  auto to = fixture::V17(t);
  auto plan = *PlanMigration(*from, *to, t, 36);
  EXPECT_EQ(plan.steps[5].action, MigrationAction::kCheckpointLoad);
  EXPECT_EQ(plan.retained_copies, 5);
  EXPECT_EQ(plan.retired_copies, 1);
}

// A rebound placement keeps the slots of a lost rank (PlacementManifest::Rebound), but that rank
// serves no copies: given the group, the planner copies from a member instead. v17 plus a copy
// of E1 on rank 0: E1's holders are q2 on rank 1 (rank 0's node) and q3 on rank 2 (the other
// node); with rank 1 lost the copy comes from rank 2, across nodes.
TEST(MigrationTest, CopiesComeOnlyFromMembersOfTheGroup) {
  Topology t = fixture::FourRankTwoNode();
  auto from = fixture::V17(t);
  auto slots = fixture::V17Slots();
  slots.push_back(fixture::Slot(6, 1, 2, 0, 0));
  auto to = *PlacementManifest::Create(fixture::Options(18), slots, t);
  auto step_of_q6 = [](const MigrationPlan& plan) {
    for (const MigrationStep& s : plan.steps) {
      if (s.target_slot == PhysicalSlotId(6)) return s;
    }
    ADD_FAILURE() << "no step for q6";
    return MigrationStep{};
  };
  const MigrationStep all = step_of_q6(*PlanMigration(*from, *to, t, 36));
  EXPECT_EQ(all.action, MigrationAction::kSameNodeCopy);
  EXPECT_EQ(all.source_rank, Rank(1));
  const ProcessGroup without1 =
      *ProcessGroup::Create(ProcessGroupId("ep-group-0"), ProcessGroupEpoch(13), {Rank(0), Rank(2), Rank(3)});
  const MigrationStep members = step_of_q6(*PlanMigration(*from, *to, t, 36, &without1));
  EXPECT_EQ(members.action, MigrationAction::kCrossNodeCopy);
  EXPECT_EQ(members.source_rank, Rank(2));
  EXPECT_EQ(members.source_slot, PhysicalSlotId(3));
  // With E1's other holder lost too, it loads from the checkpoint.
  const ProcessGroup only0and3 =
      *ProcessGroup::Create(ProcessGroupId("ep-group-0"), ProcessGroupEpoch(14), {Rank(0), Rank(3)});
  EXPECT_EQ(step_of_q6(*PlanMigration(*from, *to, t, 36, &only0and3)).action, MigrationAction::kCheckpointLoad);
}

}  // namespace
}  // namespace moe
