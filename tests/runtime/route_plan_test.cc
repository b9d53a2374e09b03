#include "runtime/plan/route_plan.h"

#include <algorithm>
#include <numeric>
#include <random>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "tests/runtime/fixtures.h"

namespace moe {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;

struct Fixture {
  Topology topology = fixture::FourRankTwoNode();
  std::shared_ptr<const PlacementManifest> manifest = fixture::V17(topology);
  FrozenHandoff handoff = *Freeze(fixture::EightRoutes());
  std::vector<PhysicalSlotId> slots = fixture::EightRouteSlots();

  ClusterPlan Plan(const ProcessGroup& group) {
    auto layout = PlanLayout::Create(manifest, group);
    EXPECT_TRUE(layout.ok()) << layout.status();
    auto plan = PlanCluster(handoff, slots, *layout, topology);
    EXPECT_TRUE(plan.ok()) << plan.status();
    return *plan;
  }
};

std::vector<int32_t> SendOrderRouteIds(const ClusterPlan& plan, int rank) {
  std::vector<int32_t> out;
  for (int32_t i : plan.source[rank].send_order) out.push_back(plan.source_routes[rank][i]);
  return out;
}

// 0x03B: count matrix, send offsets and send order.
TEST(RoutePlanTest, CountMatrixOffsetsAndSendOrderMatchSpec) {
  Fixture f;
  ClusterPlan plan = f.Plan(fixture::IdentityGroup());
  EXPECT_THAT(plan.count_matrix, ElementsAre(1, 2, 1, 0,  //
                                             1, 1, 1, 1,  //
                                             0, 0, 0, 0,  //
                                             0, 0, 0, 0));
  EXPECT_THAT(plan.source[0].send_offsets, ElementsAre(0, 1, 3, 4, 4));
  EXPECT_THAT(plan.source[1].send_offsets, ElementsAre(0, 1, 2, 3, 4));
  EXPECT_THAT(plan.source[2].send_offsets, ElementsAre(0, 0, 0, 0, 0));
  EXPECT_THAT(plan.source[3].send_offsets, ElementsAre(0, 0, 0, 0, 0));
  // rank 0: r00 | r02 r01 | r03 | empty ; rank 1: r05 | r07 | r06 | r04
  EXPECT_THAT(SendOrderRouteIds(plan, 0), ElementsAre(0, 2, 1, 3));
  EXPECT_THAT(SendOrderRouteIds(plan, 1), ElementsAre(5, 7, 6, 4));
  EXPECT_EQ(plan.accepted, 8);
}

// 0x03C1: receive splits are the transpose; payload arrives source-major.
TEST(RoutePlanTest, ReceiveSplitsAreTheTranspose) {
  Fixture f;
  ClusterPlan plan = f.Plan(fixture::IdentityGroup());
  EXPECT_THAT(plan.destination[0].recv_splits, ElementsAre(1, 1, 0, 0));
  EXPECT_THAT(plan.destination[1].recv_splits, ElementsAre(2, 1, 0, 0));
  EXPECT_THAT(plan.destination[2].recv_splits, ElementsAre(1, 1, 0, 0));
  EXPECT_THAT(plan.destination[3].recv_splits, ElementsAre(0, 1, 0, 0));
  EXPECT_THAT(plan.receive_routes[0], ElementsAre(0, 5));
  EXPECT_THAT(plan.receive_routes[1], ElementsAre(2, 1, 7));
  EXPECT_THAT(plan.receive_routes[2], ElementsAre(3, 6));
  EXPECT_THAT(plan.receive_routes[3], ElementsAre(4));
}

// 0x03C2: repack by (physical slot, source, send position) and local expert offsets.
TEST(RoutePlanTest, ExpertRepackAndOffsetsMatchSpec) {
  Fixture f;
  ClusterPlan plan = f.Plan(fixture::IdentityGroup());
  EXPECT_THAT(plan.ExpertRoutes(Rank(0)), ElementsAre(0, 5));
  EXPECT_THAT(plan.ExpertRoutes(Rank(1)), ElementsAre(2, 7, 1));
  EXPECT_THAT(plan.ExpertRoutes(Rank(2)), ElementsAre(6, 3));
  EXPECT_THAT(plan.ExpertRoutes(Rank(3)), ElementsAre(4));
  EXPECT_THAT(plan.destination[0].expert_counts, ElementsAre(2));
  EXPECT_THAT(plan.destination[0].expert_offsets, ElementsAre(0, 2));
  EXPECT_THAT(plan.destination[1].expert_counts, ElementsAre(2, 1));
  EXPECT_THAT(plan.destination[1].expert_offsets, ElementsAre(0, 2, 3));
  EXPECT_THAT(plan.destination[2].expert_counts, ElementsAre(1, 1));
  EXPECT_THAT(plan.destination[2].expert_offsets, ElementsAre(0, 1, 2));
  EXPECT_THAT(plan.destination[3].expert_counts, ElementsAre(1));
  EXPECT_THAT(plan.destination[3].expert_offsets, ElementsAre(0, 1));
}

// 0x03C3: the inverse composition restores every route.
TEST(RoutePlanTest, InverseCoordinatesRoundTrip) {
  Fixture f;
  ClusterPlan plan = f.Plan(fixture::IdentityGroup());
  for (int32_t r = 0; r < 8; ++r) {
    const int src = f.handoff.routes.origin[r].value();
    const int dst = plan.destination_rank[r];
    // expert position -> receive position -> route id; send position -> route id.
    const int32_t recv = plan.destination[dst].expert_order[plan.expert_position[r]];
    EXPECT_EQ(recv, plan.receive_position[r]);
    EXPECT_EQ(plan.receive_routes[dst][recv], r);
    EXPECT_EQ(plan.source_routes[src][plan.source[src].send_order[plan.send_position[r]]], r);
  }
}

// 0x07B: split vectors in peer-slot order.
TEST(RoutePlanTest, PeerSlotOrderIndexesSplitVectors) {
  Fixture f;
  ClusterPlan plan = f.Plan(fixture::PeerOrderGroup());
  // Count matrix stays in global ranks.
  EXPECT_THAT(plan.count_matrix, ElementsAre(1, 2, 1, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0));
  EXPECT_THAT(plan.source[0].send_splits, ElementsAre(1, 1, 0, 2));
  EXPECT_THAT(plan.source[1].send_splits, ElementsAre(1, 1, 1, 1));
  EXPECT_THAT(plan.source[2].send_splits, ElementsAre(0, 0, 0, 0));
  EXPECT_THAT(plan.source[3].send_splits, ElementsAre(0, 0, 0, 0));
  EXPECT_THAT(plan.destination[1].recv_splits, ElementsAre(0, 2, 0, 1));
  // Send order follows peer order: rank 0 sends to rank 2 (r03), rank 0 (r00), rank 1 (r02 r01).
  EXPECT_THAT(SendOrderRouteIds(plan, 0), ElementsAre(3, 0, 2, 1));
}

TEST(RoutePlanTest, RejectsRouteToSlotOfAnotherExpert) {
  Fixture f;
  f.slots[1] = PhysicalSlotId(0);  // r01 targets expert 1 but q0 stores expert 0
  auto layout = PlanLayout::Create(f.manifest, fixture::IdentityGroup());
  auto plan = PlanCluster(f.handoff, f.slots, *layout, f.topology);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(plan.status().message()), ::testing::HasSubstr("another logical expert"));
}

// A slot id outside the generation (an assignment made for another placement) is refused naming
// the route and the generation, before any table is indexed with it.
TEST(RoutePlanTest, RejectsASlotOutsideTheGeneration) {
  for (int32_t bad : {-1, 6, 1 << 30}) {
    Fixture f;
    f.slots[3] = PhysicalSlotId(bad);
    auto layout = PlanLayout::Create(f.manifest, fixture::IdentityGroup());
    auto plan = PlanCluster(f.handoff, f.slots, *layout, f.topology);
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(plan.status().message()),
                ::testing::HasSubstr(absl::StrCat("route 3: physical slot ", bad, " is not in placement-v17")));
  }
}

TEST(RoutePlanTest, RejectsMutatedHandoffBeforePlanning) {
  Fixture f;
  f.handoff.routes.expert[3] = LogicalExpertId(3);
  auto layout = PlanLayout::Create(f.manifest, fixture::IdentityGroup());
  auto plan = PlanCluster(f.handoff, f.slots, *layout, f.topology);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(plan.status().message()), ::testing::HasSubstr("mutated"));
  Fixture g;
  g.handoff.routes.gate[0] = 0.66f;
  EXPECT_FALSE(PlanCluster(g.handoff, g.slots, *layout, g.topology).ok());
}

TEST(RoutePlanTest, RejectsLayoutForAnotherProcessGroupEpoch) {
  Fixture f;
  auto layout =
      PlanLayout::Create(f.manifest, ProcessGroup::Identity(ProcessGroupId("ep-group-0"), ProcessGroupEpoch(13), 4));
  EXPECT_EQ(layout.status().code(), absl::StatusCode::kFailedPrecondition);
}

// 0x07G: the group's ranks are the topology's, and 0x03A1: every rank keeps its partition (empty
// or not). A group of the right size holding a rank the topology lacks, and a handoff of fewer
// partitions than ranks, are refused before planning reads past either.
TEST(RoutePlanTest, RejectsAGroupOtherThanTheTopologysRanksAndMissingPartitions) {
  Fixture f;
  auto stranger =
      ProcessGroup::Create(ProcessGroupId("ep-group-0"), ProcessGroupEpoch(12), {Rank(0), Rank(1), Rank(2), Rank(7)});
  ASSERT_TRUE(stranger.ok()) << stranger.status();
  auto layout = PlanLayout::Create(f.manifest, *stranger);
  ASSERT_TRUE(layout.ok()) << layout.status();
  {
    SemanticHandoff no_rank3 = fixture::EightRoutes();
    no_rank3.admitted[4] = false;  // r04, the one route to rank 3 (q5): no route names it
    auto frozen = Freeze(no_rank3);
    ASSERT_TRUE(frozen.ok()) << frozen.status();
    auto plan = PlanCluster(*frozen, f.slots, *layout, f.topology);
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(plan.status().message()), ::testing::HasSubstr("does not hold rank 3"));
  }
  SemanticHandoff two = fixture::EightRoutes();
  two.num_partitions = 2;  // the routes name partitions 0 and 1 only
  auto frozen = Freeze(two);
  ASSERT_TRUE(frozen.ok()) << frozen.status();
  auto identity = PlanLayout::Create(f.manifest, fixture::IdentityGroup());
  auto plan = PlanCluster(*frozen, f.slots, *identity, f.topology);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(plan.status().message()), ::testing::HasSubstr("2 partitions, the topology has 4 ranks"));
}

TEST(RoutePlanTest, DestinationRejectsRowsForForeignSlots) {
  Fixture f;
  auto layout = PlanLayout::Create(f.manifest, fixture::IdentityGroup());
  DestinationPlan d;
  const std::vector<int64_t> splits = {1, 0, 0, 0};
  const std::vector<PhysicalSlotId> rows = {PhysicalSlotId(5)};  // q5 lives on rank 3
  EXPECT_EQ(PlanDestination(*layout, Rank(0), splits, rows, &d).code(), absl::StatusCode::kFailedPrecondition);
  const std::vector<int64_t> bad_sum = {2, 0, 0, 0};
  const std::vector<PhysicalSlotId> one = {PhysicalSlotId(0)};
  EXPECT_EQ(PlanDestination(*layout, Rank(0), bad_sum, one, &d).code(), absl::StatusCode::kInvalidArgument);
}

// Property: the counting-sort plan equals a comparison-sort reference on random routings,
// with random peer orders and ranks that own no tokens or no slots.
TEST(RoutePlanTest, MatchesComparisonSortOnRandomRoutings) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 40; ++trial) {
    const int p_count = 1 + static_cast<int>(rng() % 8);
    const int experts = 1 + static_cast<int>(rng() % 12);
    const int extra = static_cast<int>(rng() % 6);
    std::vector<RankInfo> ranks;
    for (int r = 0; r < p_count; ++r)
      ranks.push_back(RankInfo{Rank(r), TopologyDomainId(r / 2), r % 2, "", r % 2 == 0});
    std::vector<std::string> nodes;
    for (int n = 0; n < (p_count + 1) / 2; ++n) nodes.push_back("node-" + std::to_string(n));
    Topology topo = *Topology::Create(ranks, nodes);
    std::vector<Rank> peers;
    for (int r = 0; r < p_count; ++r) peers.push_back(Rank(r));
    std::shuffle(peers.begin(), peers.end(), rng);
    ProcessGroup group = *ProcessGroup::Create(ProcessGroupId("ep-group-0"), ProcessGroupEpoch(12), peers);
    std::vector<SlotRecord> slots;
    std::vector<int> copies(experts, 0);
    for (int q = 0; q < experts + extra; ++q) {
      const int e = q < experts ? q : static_cast<int>(rng() % experts);
      const int rank = static_cast<int>(rng() % p_count);
      slots.push_back(fixture::Slot(q, e, copies[e]++, rank, rank / 2));
    }
    auto manifest = *PlacementManifest::Create(fixture::Options(17, experts), slots, topo);
    SemanticHandoff h;
    h.num_experts = experts;
    h.top_k = 4;
    h.num_partitions = p_count;
    std::vector<PhysicalSlotId> chosen;
    for (int src = 0; src < p_count; ++src) {
      const int tokens = static_cast<int>(rng() % 20);
      for (int t = 0; t < tokens; ++t) {
        for (int j = 0; j < 4; ++j) {
          const int e = static_cast<int>(rng() % experts);
          h.Add(Rank(src), t, j, LogicalExpertId(e), 0.25f, rng() % 10 != 0);
          const auto copies = manifest->SlotsOf(LogicalExpertId(e));
          chosen.push_back(copies[rng() % copies.size()]);
        }
      }
    }
    FrozenHandoff frozen = *Freeze(h);
    PlanLayout layout = *PlanLayout::Create(manifest, group);
    auto plan = PlanCluster(frozen, chosen, layout, topo);
    ASSERT_TRUE(plan.ok()) << plan.status();

    for (int src = 0; src < p_count; ++src) {
      // Reference: stable sort of this source's accepted routes by (dest peer, slot, route id).
      std::vector<int32_t> ref;
      for (int32_t r = 0; r < h.size(); ++r) {
        if (h.admitted[r] && h.origin[r].value() == src) ref.push_back(r);
      }
      std::stable_sort(ref.begin(), ref.end(), [&](int32_t a, int32_t b) {
        const auto ka = std::make_tuple(group.SlotOf(manifest->slot(chosen[a]).rank).value(), chosen[a].value(), a);
        const auto kb = std::make_tuple(group.SlotOf(manifest->slot(chosen[b]).rank).value(), chosen[b].value(), b);
        return ka < kb;
      });
      EXPECT_THAT(SendOrderRouteIds(*plan, src), ElementsAreArray(ref));
      const auto& off = plan->source[src].send_offsets;
      EXPECT_EQ(off.back(), static_cast<int64_t>(ref.size()));
      for (int i = 0; i < p_count; ++i) {
        EXPECT_EQ(plan->source[src].send_splits[i], plan->Count(Rank(src), group.RankAt(PeerSlot(i))));
        EXPECT_EQ(off[i + 1] - off[i], plan->source[src].send_splits[i]);
      }
    }
    for (int u = 0; u < p_count; ++u) {
      for (int i = 0; i < p_count; ++i) {
        EXPECT_EQ(plan->destination[u].recv_splits[i], plan->Count(group.RankAt(PeerSlot(i)), Rank(u)));
      }
      // Expert-major order is (local slot, source peer, send position).
      const auto routes = plan->ExpertRoutes(Rank(u));
      for (size_t i = 1; i < routes.size(); ++i) {
        const int32_t a = routes[i - 1], b = routes[i];
        const auto ka =
            std::make_tuple(manifest->LocalIndex(chosen[a]), group.SlotOf(h.origin[a]).value(), plan->send_position[a]);
        const auto kb =
            std::make_tuple(manifest->LocalIndex(chosen[b]), group.SlotOf(h.origin[b]).value(), plan->send_position[b]);
        EXPECT_LT(ka, kb);
      }
    }
  }
}

}  // namespace
}  // namespace moe
