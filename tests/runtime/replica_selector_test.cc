#include "runtime/placement/replica_selector.h"

#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "tests/runtime/fixtures.h"

namespace moe {
namespace {

using ::testing::Each;
using ::testing::Gt;

SemanticHandoff RandomRoutes(std::mt19937& rng, int tokens_per_rank) {
  SemanticHandoff h;
  h.num_experts = 4;
  h.top_k = 2;
  h.num_partitions = 4;
  for (int p = 0; p < 4; ++p) {
    for (int t = 0; t < tokens_per_rank; ++t) {
      const int e0 = static_cast<int>(rng() % 4);
      h.Add(Rank(p), t, 0, LogicalExpertId(e0), 0.5f, rng() % 7 != 0);
      h.Add(Rank(p), t, 1, LogicalExpertId((e0 + 1) % 4), 0.5f);
    }
  }
  return h;
}

// 0x01D1 cardinality: every accepted route gets exactly one slot, and that slot is compatible.
TEST(ReplicaSelectorTest, EveryPolicyAssignsExactlyOneCompatibleSlot) {
  Topology t = fixture::FourRankTwoNode();
  ProcessGroup g = fixture::IdentityGroup();
  auto slots = fixture::V17Slots();
  slots.push_back(fixture::Slot(6, 0, 2, 3, 1, "checkpoint-0041"));  // stale third copy of expert 0
  auto m = *PlacementManifest::Create(fixture::Options(17), slots, t);
  std::mt19937 rng(3);
  for (SelectorPolicy policy : {SelectorPolicy::kLocalityFirst, SelectorPolicy::kLeastLoad, SelectorPolicy::kRoundRobin,
                                SelectorPolicy::kHash}) {
    auto selector = ReplicaSelector::Create(policy);
    for (int trial = 0; trial < 10; ++trial) {
      SemanticHandoff h = RandomRoutes(rng, 1 + static_cast<int>(rng() % 16));
      std::vector<PhysicalSlotId> out(h.size());
      ASSERT_TRUE(selector->Select(h, *m, g, t, {}, absl::MakeSpan(out)).ok()) << SelectorPolicyName(policy);
      for (int32_t r = 0; r < h.size(); ++r) {
        if (!h.admitted[r]) {
          EXPECT_EQ(out[r].value(), -1);
          continue;
        }
        ASSERT_GE(out[r].value(), 0);
        EXPECT_TRUE(Compatible(h.expert[r], out[r], *m, g, t)) << SelectorPolicyName(policy) << " route " << r;
        EXPECT_NE(out[r].value(), 6) << "stale replica selected";
      }
    }
  }
}

TEST(ReplicaSelectorTest, LocalityFirstPrefersSameGpuThenNode) {
  Topology t = fixture::FourRankTwoNode();
  auto m = fixture::V17(t);
  SemanticHandoff h;
  h.num_experts = 4;
  h.top_k = 1;
  h.num_partitions = 4;
  h.Add(Rank(1), 0, 0, LogicalExpertId(0), 1.0f);  // q1 is on rank 1
  h.Add(Rank(3), 0, 0, LogicalExpertId(1), 1.0f);  // q3 is on node-1 (rank 2)
  h.Add(Rank(0), 0, 0, LogicalExpertId(1), 1.0f);  // q2 is on node-0 (rank 1)
  std::vector<PhysicalSlotId> out(3);
  ASSERT_TRUE(ReplicaSelector::Create(SelectorPolicy::kLocalityFirst)
                  ->Select(h, *m, fixture::IdentityGroup(), t, {}, absl::MakeSpan(out))
                  .ok());
  EXPECT_EQ(out[0], PhysicalSlotId(1));
  EXPECT_EQ(out[1], PhysicalSlotId(3));
  EXPECT_EQ(out[2], PhysicalSlotId(2));
}

TEST(ReplicaSelectorTest, LoadAwarePoliciesSpreadHotExpert) {
  Topology t = fixture::FourRankTwoNode();
  auto m = fixture::V17(t);
  SemanticHandoff h;
  h.num_experts = 4;
  h.top_k = 1;
  h.num_partitions = 4;
  for (int i = 0; i < 100; ++i) h.Add(Rank(2), i, 0, LogicalExpertId(0), 1.0f);
  for (SelectorPolicy policy : {SelectorPolicy::kLeastLoad, SelectorPolicy::kRoundRobin, SelectorPolicy::kHash}) {
    std::vector<PhysicalSlotId> out(h.size());
    ASSERT_TRUE(
        ReplicaSelector::Create(policy)->Select(h, *m, fixture::IdentityGroup(), t, {}, absl::MakeSpan(out)).ok());
    std::vector<int> per_slot(6, 0);
    for (PhysicalSlotId q : out) ++per_slot[q.value()];
    EXPECT_EQ(per_slot[0] + per_slot[1], 100);
    if (policy == SelectorPolicy::kHash) {
      EXPECT_GT(per_slot[0], 25);
      EXPECT_GT(per_slot[1], 25);
    } else {
      EXPECT_EQ(per_slot[0], 50) << SelectorPolicyName(policy);
    }
  }
}

TEST(ReplicaSelectorTest, HashIsDeterministic) {
  Topology t = fixture::FourRankTwoNode();
  auto m = fixture::V17(t);
  std::mt19937 rng(5);
  SemanticHandoff h = RandomRoutes(rng, 32);
  std::vector<PhysicalSlotId> a(h.size()), b(h.size());
  ASSERT_TRUE(ReplicaSelector::Create(SelectorPolicy::kHash)
                  ->Select(h, *m, fixture::IdentityGroup(), t, {}, absl::MakeSpan(a))
                  .ok());
  ASSERT_TRUE(ReplicaSelector::Create(SelectorPolicy::kHash)
                  ->Select(h, *m, fixture::IdentityGroup(), t, {}, absl::MakeSpan(b))
                  .ok());
  EXPECT_EQ(a, b);
}

TEST(ReplicaSelectorTest, ExpertWithoutCompatibleSlotFailsTheCall) {
  Topology t = fixture::FourRankTwoNode();
  auto slots = fixture::V17Slots();
  slots[5].checkpoint = CheckpointVersion("checkpoint-0041");  // expert 3's only copy is stale
  auto m = *PlacementManifest::Create(fixture::Options(17), slots, t);
  SemanticHandoff h = fixture::EightRoutes();
  std::vector<PhysicalSlotId> out(h.size());
  absl::Status s = ReplicaSelector::Create(SelectorPolicy::kLocalityFirst)
                       ->Select(h, *m, fixture::IdentityGroup(), t, {}, absl::MakeSpan(out));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("logical expert 3"));
  EXPECT_EQ(ParseSelectorPolicy("random").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*ParseSelectorPolicy("least-load"), SelectorPolicy::kLeastLoad);
}

}  // namespace
}  // namespace moe
