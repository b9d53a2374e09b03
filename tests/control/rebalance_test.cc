// PlanRebalance: balancedness of the current and the EPLB placement, computed by hand.
#include "control/rebalance.h"

#include "gtest/gtest.h"

namespace moe {
namespace {

TEST(RebalanceTest, HotExpertGetsCopiesAndRanksEvenOut) {
  RebalanceInput in;
  in.expert_load = {600, 100, 100, 100, 100, 100, 100, 100};  // expert 0 is hot
  // Two ranks, four experts each, one copy each: rank 0 carries 900, rank 1 carries 400.
  in.current_slot_experts = {{0, 1, 2, 3}, {4, 5, 6, 7}};
  in.num_replicas = 12;
  auto plan = *PlanRebalance(in);
  ASSERT_EQ(plan.rank_load_before.size(), 2u);
  EXPECT_DOUBLE_EQ(plan.rank_load_before[0], 900);
  EXPECT_DOUBLE_EQ(plan.rank_load_before[1], 400);
  EXPECT_DOUBLE_EQ(plan.balancedness_before, 650.0 / 900.0);
  // 12 slots: the hot expert gets the four extra copies (600/5 = 120 > 100 stops there).
  EXPECT_EQ(plan.copies_after[0], 5);
  for (int e = 1; e < 8; ++e) EXPECT_EQ(plan.copies_after[e], 1) << e;
  EXPECT_EQ(plan.expert_rank.size(), 12u);
  // Total load is conserved and the ranks end within one expert copy of each other.
  EXPECT_DOUBLE_EQ(plan.rank_load_after[0] + plan.rank_load_after[1], 1300);
  EXPECT_GT(plan.balancedness_after, plan.balancedness_before);
  EXPECT_GE(plan.balancedness_after, 650.0 / 700.0);
  int on_rank0 = 0;
  for (const auto& [e, r] : plan.expert_rank) on_rank0 += r == 0;
  EXPECT_EQ(on_rank0, 6);
}

TEST(RebalanceTest, DefaultsAndErrors) {
  RebalanceInput in;
  in.expert_load = {5, 5, 5};
  in.current_slot_experts = {{0, 1}, {2}};  // 3 slots on 2 ranks: rounded up to 4
  auto plan = *PlanRebalance(in);
  EXPECT_EQ(plan.num_replicas, 4);
  in.num_replicas = 5;
  EXPECT_EQ(PlanRebalance(in).status().code(), absl::StatusCode::kInvalidArgument);
  in.num_replicas = 0;
  in.current_slot_experts = {{0, 1}, {1}};  // expert 2 has no slot
  EXPECT_EQ(PlanRebalance(in).status().code(), absl::StatusCode::kFailedPrecondition);
  in.expert_load.clear();
  EXPECT_EQ(PlanRebalance(in).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_DOUBLE_EQ(Balancedness({2, 4}), 0.75);
  EXPECT_DOUBLE_EQ(Balancedness({0, 0}), 1.0);
}

}  // namespace
}  // namespace moe
