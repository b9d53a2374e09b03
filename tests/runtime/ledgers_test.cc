#include "runtime/plan/ledgers.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "tests/runtime/fixtures.h"

namespace moe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

struct Planned {
  Topology topology = fixture::FourRankTwoNode();
  std::shared_ptr<const PlacementManifest> manifest = fixture::V17(topology);
  FrozenHandoff handoff = *Freeze(fixture::EightRoutes());
  ClusterPlan plan;
  Planned() {
    PlanLayout layout = *PlanLayout::Create(manifest, fixture::IdentityGroup());
    plan = *PlanCluster(handoff, fixture::EightRouteSlots(), layout, topology);
  }
};

// 0x02B1: logical, physical and rank ledgers.
TEST(LedgersTest, LoadLedgersMatchSpec) {
  Planned f;
  LoadLedger l = ComputeLoadLedger(f.plan, f.handoff, *f.manifest);
  EXPECT_THAT(l.logical_expert_rows, ElementsAre(4, 2, 1, 1));
  EXPECT_THAT(l.physical_slot_rows, ElementsAre(2, 2, 1, 1, 1, 1));
  EXPECT_THAT(l.destination_rank_rows, ElementsAre(2, 3, 2, 1));
}

// 0x03C1, 0x03D1, 0x03D2, 0x03D6.
TEST(LedgersTest, ByteLedgersMatchSpec) {
  Planned f;
  ByteLedger b = ComputeByteLedger(f.plan, f.handoff, 3, LedgerWidths{});
  EXPECT_EQ(b.routes, 8);
  EXPECT_EQ(b.remote_routes, 6);
  EXPECT_EQ(b.staging_dispatch, 48);
  EXPECT_EQ(b.staging_combine, 48);
  EXPECT_EQ(b.remote_dispatch, 36);
  EXPECT_EQ(b.remote_combine, 36);
  EXPECT_EQ(b.dispatch_meta, 48);
  EXPECT_EQ(b.combine_meta, 24);
  EXPECT_EQ(b.route_handle, 256);
  EXPECT_EQ(b.count_matrix, 128);
  EXPECT_EQ(b.send_offsets, 160);
  EXPECT_EQ(b.recv_splits, 128);
  EXPECT_EQ(b.expert_offset_entries, 10);
  EXPECT_EQ(b.expert_offsets, 80);
  EXPECT_EQ(b.remote_logical, 144);
  EXPECT_EQ(b.max_split, 2);
  EXPECT_EQ(b.padded_rows, 32);
  EXPECT_EQ(b.padding_rows, 24);
  EXPECT_EQ(b.padded_per_direction, 192);
  EXPECT_EQ(b.padded_round_trip, 384);
  EXPECT_EQ(b.useful_round_trip, 96);
}

// 0x03D6 larger shape: T=4096, k=2, d=4096, BF16, remote fraction 0.75.
// 0x0AB's table: the fixture's six remote rows in BF16, FP8 with a scale per row and FP8 with a
// scale per 128 values; at d = 3 the scales make FP8 the larger payload.
TEST(LedgersTest, PrecisionPayloadsMatchSpec) {
  Planned f;
  const int64_t remote = ComputeByteLedger(f.plan, f.handoff, 3, LedgerWidths{}).remote_routes;
  ASSERT_EQ(remote, 6);
  const struct {
    int64_t d, bf16, row, block;
  } table[] = {{3, 36, 42, 42}, {16, 192, 120, 120}, {7168, 86016, 43032, 44352}};
  for (const auto& want : table) {
    auto p = ComputePrecisionPayloads(remote, want.d);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->bf16, want.bf16) << "d " << want.d;
    EXPECT_EQ(p->fp8_row_scale, want.row) << "d " << want.d;
    EXPECT_EQ(p->fp8_block_scales, want.block) << "d " << want.d;
  }
  EXPECT_EQ(ComputePrecisionPayloads(-1, 3).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputePrecisionPayloads(6, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputePrecisionPayloads(int64_t{1} << 62, 7168).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(LedgersTest, LargeShapeStagingAndRemotePayload) {
  Topology topo = Topology::SingleNode(4);
  std::vector<SlotRecord> slots;
  for (int q = 0; q < 4; ++q) slots.push_back(fixture::Slot(q, q, 0, q, 0));
  auto manifest = *PlacementManifest::Create(fixture::Options(17), slots, topo);
  SemanticHandoff h;
  h.num_experts = 4;
  h.top_k = 2;
  h.num_partitions = 4;
  h.Reserve(8192);
  std::vector<PhysicalSlotId> chosen;
  for (int s = 0; s < 4; ++s) {
    for (int t = 0; t < 1024; ++t) {
      for (int j = 0; j < 2; ++j) {
        const int e = (s + j + t) % 4;  // local exactly when (j + t) % 4 == 0: one route in four
        h.Add(Rank(s), t, j, LogicalExpertId(e), 0.5f);
        chosen.push_back(PhysicalSlotId(e));
      }
    }
  }
  FrozenHandoff frozen = *Freeze(h);
  PlanLayout layout = *PlanLayout::Create(manifest, fixture::IdentityGroup());
  ClusterPlan plan = *PlanCluster(frozen, chosen, layout, topo);
  ByteLedger b = ComputeByteLedger(plan, frozen, 4096, LedgerWidths{});
  constexpr int64_t kMiB = 1 << 20;
  EXPECT_EQ(b.staging_dispatch, 64 * kMiB);
  EXPECT_EQ(b.staging_dispatch + b.staging_combine, 128 * kMiB);
  EXPECT_EQ(b.remote_dispatch + b.remote_combine, 96 * kMiB);
}

// 0x03D3: fourteen buffers, sum 1,136 B, peak 904 B at epoch 4.
TEST(LedgersTest, BufferLifetimesSumAndPeak) {
  Planned f;
  ByteLedger b = ComputeByteLedger(f.plan, f.handoff, 3, LedgerWidths{});
  auto buffers = LayerStepBuffers(b, 3, LedgerWidths{});
  ASSERT_EQ(buffers.size(), 14u);
  auto report = CheckLifetimes(LayerStepEvents(), buffers);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->total_bytes, 1136);
  EXPECT_EQ(report->peak_bytes, 904);
  EXPECT_EQ(report->peak_epoch, 4);
}

// 0x03D5: the oracle rejects six unsafe schedules, each for its own reason: an early send release,
// an early handle release, a missing dependency, a cyclic event graph, an epoch before its
// dependency and an overlapping live alias.
TEST(LedgersTest, UnsafeSchedulesAreRejected) {
  Planned f;
  ByteLedger b = ComputeByteLedger(f.plan, f.handoff, 3, LedgerWidths{});
  auto expect_rejected = [&](auto mutate, const char* why) {
    auto events = LayerStepEvents();
    auto buffers = LayerStepBuffers(b, 3, LedgerWidths{});
    mutate(events, buffers);
    auto report = CheckLifetimes(events, buffers);
    ASSERT_FALSE(report.ok()) << why;
    EXPECT_THAT(std::string(report.status().message()), HasSubstr(why));
  };
  using E = std::vector<ScheduleEvent>;
  using B = std::vector<BufferLifetime>;
  expect_rejected([](E&, B& bufs) { bufs[5].end = 2; }, "early release");  // packed send payload
  expect_rejected([](E&, B& bufs) { bufs[1].end = 8; }, "early release");  // route handle
  expect_rejected([](E& ev, B&) { ev[4].deps = {"dispatch_finished"}; }, "missing dependency");
  expect_rejected([](E& ev, B&) { ev[4].deps.clear(); }, "missing dependency");
  expect_rejected([](E& ev, B&) { ev[3].epoch = 1; }, "epoch before dependency");
  expect_rejected(
      [](E& ev, B&) {
        for (auto& e : ev) e.epoch = 0;
        ev[0].deps = {"downstream_consumer"};
        ev.push_back({"root", "route", 0, {}});
      },
      "cyclic event graph");
  expect_rejected(
      [](E&, B& bufs) {
        bufs.push_back({"second return payload", 48, 5, 7, "combine_complete", "expert_output_return"});
      },
      "overlapping live alias");
}

// A cycle (b waits on c, c on b) is named as one, whatever epochs its events carry; an acyclic
// graph whose epochs run against a dependency is an ordering error.
TEST(LedgersTest, CyclicEventGraphIsRejected) {
  for (int c_epoch : {1, 2}) {
    std::vector<ScheduleEvent> events = {{"a", "s", 0, {}}, {"b", "s", 1, {"a", "c"}}, {"c", "s", c_epoch, {"b"}}};
    auto report = CheckLifetimes(events, {});
    ASSERT_FALSE(report.ok());
    EXPECT_THAT(std::string(report.status().message()), HasSubstr("cyclic event graph")) << "c at " << c_epoch;
  }
  std::vector<ScheduleEvent> backwards = {{"a", "s", 0, {}}, {"b", "s", 2, {"a"}}, {"c", "s", 1, {"b"}}};
  EXPECT_THAT(std::string(CheckLifetimes(backwards, {}).status().message()), HasSubstr("epoch before dependency"));
}

// 0x04B-0x04F: runner ledgers over the global six segments [2,2,1,1,1,1].
TEST(LedgersTest, RunnerLedgersMatchSpec) {
  const std::vector<int64_t> counts = {2, 2, 1, 1, 1, 1};
  auto padded_layout = *MakeRunnerLayout(counts, {RunnerKind::kPaddedDense, 3, 2, 128});
  auto padded = *ComputeRunnerLedger(padded_layout, 3, 4, 2);
  EXPECT_EQ(padded.capacity_rows, 18);
  EXPECT_EQ(padded.executed_rows, 24);
  EXPECT_EQ(padded.useful_rows, 8);
  EXPECT_NEAR(padded.utilization, 8.0 / 24.0, 1e-12);
  EXPECT_EQ(padded.input_values, 72);
  EXPECT_EQ(padded.intermediate_values, 96);
  EXPECT_EQ(padded.matmul_flops, 1728);
  EXPECT_EQ(padded.useful_flops, 576);

  auto grouped_layout = *MakeRunnerLayout(counts, {RunnerKind::kGrouped, 0, 1, 128});
  EXPECT_THAT(grouped_layout.executed_offsets, ElementsAre(0, 2, 4, 5, 6, 7, 8));
  auto grouped = *ComputeRunnerLedger(grouped_layout, 3, 4, 2);
  EXPECT_EQ(grouped.executed_rows, 8);
  EXPECT_EQ(grouped.input_values, 24);
  EXPECT_EQ(grouped.intermediate_values, 32);
  EXPECT_EQ(grouped.matmul_flops, 576);
  EXPECT_EQ(grouped.state_bytes, 384);

  auto block_layout = *MakeRunnerLayout(counts, {RunnerKind::kBlockSparse, 0, 1, 2});
  EXPECT_THAT(block_layout.executed_offsets, ElementsAre(0, 2, 4, 6, 8, 10, 12));
  auto block = *ComputeRunnerLedger(block_layout, 3, 4, 2);
  EXPECT_EQ(block.executed_rows, 12);
  EXPECT_NEAR(block.utilization, 8.0 / 12.0, 1e-12);
  EXPECT_EQ(block.input_values, 36);
  EXPECT_EQ(block.intermediate_values, 48);
  EXPECT_EQ(block.matmul_flops, 864);
  EXPECT_EQ(block.row_blocks, 6);
  EXPECT_EQ(block.nonzero_blocks, 12);
  EXPECT_EQ(block.state_bytes, 172);
}

TEST(LedgersTest, GroupedDescriptorsSkipEmptySlotsButKeepIdentity) {
  auto layout = *MakeRunnerLayout({2, 0, 1}, {RunnerKind::kGrouped, 0, 1, 128});
  EXPECT_THAT(layout.executed_offsets, ElementsAre(0, 2, 2, 3));
  EXPECT_EQ(ComputeRunnerLedger(layout, 3, 4, 2)->state_bytes, 2 * 64);
}

// 0x07C: three route classes.
TEST(LedgersTest, RouteClassesMatchSpec) {
  Planned f;
  RouteClassLedger c = ComputeRouteClasses(f.plan, f.handoff, f.topology, 3, LedgerWidths{});
  EXPECT_THAT(c.routes[kSameGpu], ElementsAre(0, 7));
  EXPECT_THAT(c.routes[kSameNodeRemoteGpu], ElementsAre(1, 2, 5));
  EXPECT_THAT(c.routes[kDifferentNode], ElementsAre(3, 4, 6));
  EXPECT_EQ(c.dispatch_bytes[kSameNodeRemoteGpu], 18);
  EXPECT_EQ(c.round_trip_bytes[kSameNodeRemoteGpu], 36);
  EXPECT_EQ(c.directed_pairs[kSameNodeRemoteGpu], 2);
  EXPECT_EQ(c.dispatch_bytes[kDifferentNode], 18);
  EXPECT_EQ(c.round_trip_bytes[kDifferentNode], 36);
  EXPECT_EQ(c.directed_pairs[kDifferentNode], 3);
}

// 0x07E: relay stages, preserved inter-node payload, added relay bytes, pair counts.
TEST(LedgersTest, HierarchicalRelayLedgerMatchesSpec) {
  Planned f;
  RelayLedger r = ComputeRelayLedger(f.plan, f.handoff, f.topology, 3, LedgerWidths{});
  EXPECT_EQ(r.dispatch_to_source_relay, 2);
  EXPECT_EQ(r.dispatch_relay_to_relay, 3);
  EXPECT_EQ(r.dispatch_relay_to_final, 1);
  EXPECT_EQ(r.combine_to_expert_relay, 1);
  EXPECT_EQ(r.combine_relay_to_relay, 3);
  EXPECT_EQ(r.combine_relay_to_origin, 2);
  EXPECT_EQ(r.inter_node_round_trip_bytes, 36);
  EXPECT_EQ(r.added_relay_bytes, 36);
  EXPECT_EQ(r.flat_inter_node_pairs, 6);
  EXPECT_EQ(r.hierarchical_inter_node_pairs, 2);
}

// 0x07G: process-group construction.
TEST(LedgersTest, HierarchicalGroupsValidateAgainstTopology) {
  Topology t = fixture::FourRankTwoNode();
  const ProcessGroupEpoch e(12);
  auto group = [&](const char* id, std::vector<int> ranks, ProcessGroupEpoch epoch) {
    std::vector<Rank> peers;
    for (int r : ranks) peers.push_back(Rank(r));
    return *ProcessGroup::Create(ProcessGroupId(id), epoch, peers);
  };
  ProcessGroup ep = fixture::PeerOrderGroup();
  std::vector<ProcessGroup> nodes = {group("ep-node-0", {1, 0}, e), group("ep-node-1", {3, 2}, e)};
  EXPECT_TRUE(ValidateHierarchicalGroups(t, ep, nodes, group("ep-relays", {2, 0}, e)).ok());
  EXPECT_FALSE(ValidateHierarchicalGroups(t, ep, nodes, group("ep-relays", {2, 1}, e)).ok());
  EXPECT_FALSE(
      ValidateHierarchicalGroups(t, ep, {group("ep-node-0", {1, 2}, e), nodes[1]}, group("ep-relays", {2, 0}, e)).ok());
  EXPECT_FALSE(ValidateHierarchicalGroups(t, ep, {group("ep-node-0", {1, 0}, ProcessGroupEpoch(13)), nodes[1]},
                                          group("ep-relays", {2, 0}, e))
                   .ok());
}

}  // namespace
}  // namespace moe
