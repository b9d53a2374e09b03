// PlanRebalance: balancedness of the current and the EPLB placement, computed by hand, and the
// spec's EPLB fixture (0x08C3) through it into a placement manifest.
#include "control/rebalance.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "runtime/placement/default_placement.h"
#include "tests/runtime/fixtures.h"

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

// 0x08C3 / 0x08D: W = [4,2,1,1], four ranks on two nodes, two expert groups, eight slots. The
// plan is the spec's target map (phy2log, replica ranks, rank loads, Gamma_rank = 5/3), and the
// manifest built from it keeps the replica ranks, so rho_v(e) is the spec's log2phy
// (E0: [p2, p3, p1]).
TEST(RebalanceTest, TheSpecFixtureGivesItsTargetMapAndLog2Phy) {
  RebalanceInput in;
  in.expert_load = {4, 2, 1, 1};
  in.current_slot_experts = {{0, 1}, {2, 3}, {0, 1}, {2, 3}};
  in.num_replicas = 8;
  in.num_groups = 2;
  in.num_nodes = 2;
  auto plan = PlanRebalance(in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  using ::testing::ElementsAre;
  using ::testing::Pair;
  EXPECT_THAT(plan->expert_rank, ElementsAre(Pair(1, 0), Pair(0, 0), Pair(0, 1), Pair(0, 1), Pair(2, 2), Pair(2, 2),
                                             Pair(3, 3), Pair(3, 3)));
  EXPECT_THAT(plan->replica_rank, ElementsAre(0, 2, 0, 1, 0, 1, 0, 1));
  EXPECT_THAT(plan->copies_after, ElementsAre(3, 1, 2, 2));
  ASSERT_EQ(plan->rank_load_after.size(), 4u);
  EXPECT_DOUBLE_EQ(plan->rank_load_after[0], 10.0 / 3);
  EXPECT_DOUBLE_EQ(plan->rank_load_after[1], 8.0 / 3);
  EXPECT_DOUBLE_EQ(plan->rank_load_after[2], 1);
  EXPECT_DOUBLE_EQ(plan->rank_load_after[3], 1);
  EXPECT_NEAR(plan->gamma_after, 5.0 / 3, 1e-12);
  EXPECT_NEAR(plan->balancedness_after, 3.0 / 5, 1e-12);

  CheckpointIdentity id;
  id.version = "checkpoint-0042";
  for (int e = 0; e < 4; ++e) id.digests.push_back({"sha256:e" + std::to_string(e)});
  auto m = PlacementFromAssignment(PlacementVersion(2), 4, plan->expert_rank, fixture::FourRankTwoNode(),
                                   fixture::IdentityGroup(), id, plan->replica_rank);
  ASSERT_TRUE(m.ok()) << m.status();
  const auto slots = [&](int e) {
    std::vector<int> out;
    for (PhysicalSlotId q : (*m)->SlotsOf(LogicalExpertId(e))) out.push_back(q.value());
    return out;
  };
  EXPECT_THAT(slots(0), ElementsAre(2, 3, 1));  // log2phy[E0] = [p2, p3, p1]
  EXPECT_THAT(slots(1), ElementsAre(0));
  EXPECT_THAT(slots(2), ElementsAre(4, 5));
  EXPECT_THAT(slots(3), ElementsAre(6, 7));
  EXPECT_EQ((*m)->slot(PhysicalSlotId(1)).replica.value(), 2);
  EXPECT_EQ((*m)->slot(PhysicalSlotId(1)).domain.value(), 0);
  EXPECT_EQ((*m)->slot(PhysicalSlotId(4)).domain.value(), 1);

  // Replica ranks that repeat one, or skip one, for an expert's copies are refused by name.
  std::vector<int> repeated = plan->replica_rank;
  repeated[1] = 0;  // p1 and p2 both E0's replica 0
  auto bad = PlacementFromAssignment(PlacementVersion(2), 4, plan->expert_rank, fixture::FourRankTwoNode(),
                                     fixture::IdentityGroup(), id, repeated);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), ::testing::HasSubstr("replica_id"));
  std::vector<int> skipped = plan->replica_rank;
  skipped[1] = 3;
  EXPECT_EQ(PlacementFromAssignment(PlacementVersion(2), 4, plan->expert_rank, fixture::FourRankTwoNode(),
                                    fixture::IdentityGroup(), id, skipped)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlacementFromAssignment(PlacementVersion(2), 4, plan->expert_rank, fixture::FourRankTwoNode(),
                                    fixture::IdentityGroup(), id, {0, 1})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
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
  EXPECT_DOUBLE_EQ(GammaRank({2, 4}), 4.0 / 3);
  EXPECT_DOUBLE_EQ(GammaRank({0, 0}), 1.0);
}

// The hierarchical policy's node n is ranks [n*R/N, (n+1)*R/N): the ranks' own nodes must be
// that layout, else node packing would call a crossing placement node-local (0x07I).
TEST(RebalanceTest, HierarchicalNodesMustBeTheRanksNodes) {
  EXPECT_TRUE(CheckRebalanceNodes({"a", "a", "b", "b"}, 2).ok());
  EXPECT_TRUE(CheckRebalanceNodes({"a", "b", "a", "b"}, 1).ok());  // one node: no node packing
  absl::Status s = CheckRebalanceNodes({"a", "b", "a", "b"}, 2);   // interleaved
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()),
              ::testing::HasSubstr("the solver's node 0 is ranks 0..1, but rank 1 is on node 'b'"));
  s = CheckRebalanceNodes({"a", "a", "a", "a"}, 2);  // one real node called two
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("rank 2 is on node 'a'"));
  EXPECT_EQ(CheckRebalanceNodes({"a", "a", "b", ""}, 2).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(CheckRebalanceNodes({"a", "a", "b"}, 2).code(), absl::StatusCode::kInvalidArgument);
}

// Loads counted on another checkpoint, or mid-switch (another generation or epoch), are not one
// EPLB input: refused naming the rank.
TEST(RebalanceTest, OneLoadSignalNeedsOneCheckpointGenerationAndEpoch) {
  const std::vector<RankLoadSource> ok = {{"r0", "ckpt-1", "a", 3, 1}, {"r1", "ckpt-1", "b", 3, 1}};
  EXPECT_TRUE(CheckOneLoadSignal(ok, 2).ok());
  std::vector<RankLoadSource> bad = ok;
  bad[1].checkpoint_version = "ckpt-2";
  absl::Status s = CheckOneLoadSignal(bad, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("rank r1 serves checkpoint 'ckpt-2', rank r0 'ckpt-1'"));
  bad = ok;
  bad[1].active_version = 4;
  s = CheckOneLoadSignal(bad, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("rank r1 serves placement-v4 in process-group epoch 1"));
  bad = ok;
  bad[0].process_group_epoch = 2;
  EXPECT_EQ(CheckOneLoadSignal(bad, 1).code(), absl::StatusCode::kFailedPrecondition);
  bad = ok;
  bad[1].node = "a";  // both on one node, called two
  EXPECT_EQ(CheckOneLoadSignal(bad, 2).code(), absl::StatusCode::kFailedPrecondition);
}

// `rebalance --window_s`: the routes counted between two reads (after - before, whole and per
// layer), and each way the two reads fail to be one window of one signal, naming the rank.
TEST(RebalanceTest, LoadOverWindowIsTheDifferenceOfOneSignal) {
  auto rank = [](std::string address, std::vector<int64_t> routes, std::vector<int64_t> layer3) {
    RankLoadCounts c;
    c.source = {std::move(address), "ckpt-1", "a", 3, 1};
    c.routes = std::move(routes);
    c.layers = {{3, std::move(layer3)}};
    return c;
  };
  const std::vector<RankLoadCounts> before = {rank("r0", {10, 5, 0}, {4, 2, 0}), rank("r1", {1, 1, 1}, {1, 0, 1})};
  const std::vector<RankLoadCounts> after = {rank("r0", {30, 5, 7}, {12, 2, 3}), rank("r1", {1, 4, 1}, {1, 3, 1})};
  auto w = LoadOverWindow(before, after);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ((*w)[0].routes, (std::vector<int64_t>{20, 0, 7}));
  EXPECT_EQ((*w)[1].routes, (std::vector<int64_t>{0, 3, 0}));
  EXPECT_EQ((*w)[0].layers[0].second, (std::vector<int64_t>{8, 0, 3}));
  EXPECT_EQ((*w)[1].layers[0].second, (std::vector<int64_t>{0, 3, 0}));
  EXPECT_EQ((*w)[1].source.address, "r1");

  auto fails = [&](std::vector<RankLoadCounts> b, std::vector<RankLoadCounts> a, const std::string& want) {
    auto r = LoadOverWindow(b, a);
    ASSERT_FALSE(r.ok()) << want;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << want;
    EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr(want));
  };
  std::vector<RankLoadCounts> a = after;
  a[1].routes[2] = 0;  // r1 restarted: its counter went back
  fails(before, a, "rank r1: expert 2's routes went from 1 to 0: the daemon restarted");
  a = after;
  a[0].layers[0].second[0] = 3;
  fails(before, a, "rank r0: layer 3 expert 0's routes went from 4 to 3");
  a = after;
  a[1].source.active_version = 4;  // a switch within the window
  fails(before, a, "rank r1 served checkpoint 'ckpt-1' placement-v3 epoch 1 at the window's start");
  a = after;
  a[0].source.process_group_epoch = 2;
  fails(before, a, "its slots changed within the window");
  a = after;
  a[1].source.address = "r9";
  fails(before, a, "rank 1 is r1 in the first read, r9 in the second");
  fails(before, {after[0]}, "the first read lists 2 ranks, the second 1");
  a = after;
  a[0].routes.push_back(1);
  fails(before, a, "rank r0: counts 3 experts in the first read, 4 in the second");
  a = after;
  a[1].layers.clear();
  fails(before, a, "rank r1 reports 1 layers in the first read, 0 in the second");
  fails(before, before, "no routes were counted within the window");
}

}  // namespace
}  // namespace moe
