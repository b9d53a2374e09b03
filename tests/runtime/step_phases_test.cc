// The pure parts of a step's phases (runtime/exec/step_phases.h), each on a small hand example.
#include "runtime/exec/step_phases.h"

#include <cstdint>
#include <set>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

#include "tests/runtime/fixtures.h"

namespace moe {
namespace {

// Two tokens, k = 2; the router dropped token 1's second choice.
struct TwoTokens {
  std::vector<uint16_t> hidden = std::vector<uint16_t>(2 * 4, 0);
  std::vector<int32_t> ids = {3, 1, 2, 0};
  std::vector<float> gates = {0.75f, 0.25f, 1.0f, 0.5f};
  std::vector<uint8_t> admitted = {1, 1, 1, 0};
  LayerStepInput Input() const {
    LayerStepInput in;
    in.step_id = 9;
    in.hidden = hidden.data();
    in.tokens = 2;
    in.d = 4;
    in.topk_ids = ids.data();
    in.topk_weights = gates.data();
    in.k = 2;
    in.admitted = admitted.data();
    return in;
  }
};

TEST(StepPhasesTest, PhaseNamesInOrder) {
  const char* want[] = {"validate", "acquire", "plan", "agree", "dispatch", "experts", "return", "combine", "release"};
  for (int i = 0; i < kNumStepPhases; ++i) EXPECT_STREQ(StepPhaseName(static_cast<StepPhase>(i)), want[i]);
  EXPECT_STREQ(StepPhaseName(static_cast<StepPhase>(kNumStepPhases)), "unknown");
}

TEST(StepPhasesTest, ValidateNamesTheFieldAndSkipsDroppedRoutes) {
  TwoTokens t;
  EXPECT_TRUE(ValidateStepInput(t.Input(), 4).ok());
  t.ids[3] = 99;  // dropped by the router: not checked
  EXPECT_TRUE(ValidateStepInput(t.Input(), 4).ok());
  t.ids[1] = 4;
  absl::Status s = ValidateStepInput(t.Input(), 4);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("topk_ids[0][1]: expert 4 outside [0, 4)"), std::string::npos) << s;
  t.ids[1] = 1;
  t.gates[2] = -1.0f;
  s = ValidateStepInput(t.Input(), 4);
  EXPECT_NE(s.message().find("topk_weights[1][0]"), std::string::npos) << s;
  LayerStepInput in = t.Input();
  in.k = 0;
  EXPECT_NE(ValidateStepInput(in, 4).message().find("topk_ids: k must be positive"), std::string::npos);
}

TEST(StepPhasesTest, SealKeepsDroppedRoutesUnadmitted) {
  TwoTokens t;
  auto frozen = SealRoutes(t.Input(), Rank(1), 4, 2);
  ASSERT_TRUE(frozen.ok()) << frozen.status();
  const SemanticHandoff& h = frozen->routes;
  ASSERT_EQ(h.size(), 4);
  EXPECT_EQ(h.token, (std::vector<int32_t>{0, 0, 1, 1}));
  EXPECT_EQ(h.admitted[3], 0);
  EXPECT_EQ(h.gate[3], 0.0f);
  EXPECT_EQ(h.gate[0], 0.75f);
  EXPECT_TRUE(VerifyFrozen(*frozen).ok());
}

// Refilling an earlier step's columns (longer, with other values) seals the same handoff as
// fresh columns: every column, its length and the fingerprint.
TEST(StepPhasesTest, SealIntoReusedColumnsEqualsAFreshSeal) {
  TwoTokens t;
  auto fresh = SealRoutes(t.Input(), Rank(1), 4, 2);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  SemanticHandoff old;
  for (int i = 0; i < 9; ++i) old.Add(Rank(0), i, 0, LogicalExpertId(3), 0.5f, i % 2 == 0);
  auto reused = SealRoutes(t.Input(), Rank(1), 4, 2, &old);
  ASSERT_TRUE(reused.ok()) << reused.status();
  const SemanticHandoff &a = fresh->routes, &b = reused->routes;
  EXPECT_EQ(a.origin, b.origin);
  EXPECT_EQ(a.token, b.token);
  EXPECT_EQ(a.route_slot, b.route_slot);
  EXPECT_EQ(a.expert, b.expert);
  EXPECT_EQ(a.gate, b.gate);
  EXPECT_EQ(a.admitted, b.admitted);
  EXPECT_EQ(fresh->fingerprint, reused->fingerprint);
  EXPECT_GE(b.origin.capacity(), 9u);  // the old columns' memory, refilled
}

TEST(StepPhasesTest, AcceptKeepsAdmittedRoutesInSemanticOrder) {
  TwoTokens t;
  auto frozen = SealRoutes(t.Input(), Rank(0), 4, 2);
  ASSERT_TRUE(frozen.ok());
  const std::vector<PhysicalSlotId> slots = {PhysicalSlotId(5), PhysicalSlotId(1), PhysicalSlotId(3),
                                             PhysicalSlotId(0)};
  std::vector<int32_t> ids = {42};
  std::vector<PhysicalSlotId> accepted;
  AcceptRoutes(frozen->routes, slots, &ids, &accepted);
  EXPECT_EQ(ids, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(accepted, (std::vector<PhysicalSlotId>{PhysicalSlotId(5), PhysicalSlotId(1), PhysicalSlotId(3)}));
}

TEST(StepPhasesTest, GraphManifestWordTellsEverySettingApart) {
  const auto word = [](int64_t tokens, int64_t routes, bool graphs, DecodeRunner runner, int64_t k = 2,
                       int64_t d = 64) { return GraphManifestWord(tokens, routes, graphs, runner, k, d); };
  std::set<uint64_t> words = {
      word(8, 16, true, DecodeRunner::kKernels),        word(4, 16, true, DecodeRunner::kKernels),
      word(8, 32, true, DecodeRunner::kKernels),        word(8, 16, false, DecodeRunner::kKernels),
      word(8, 16, true, DecodeRunner::kPadded),         word(8, 16, true, DecodeRunner::kKernels, 1),
      word(8, 16, true, DecodeRunner::kKernels, 2, 128)};
  EXPECT_EQ(words.size(), 7u);
  EXPECT_EQ(word(8, 16, true, DecodeRunner::kAuto), word(8, 16, true, DecodeRunner::kAuto));
}

// Three accepted routes sent in the order 2, 0, 1 (send_order), so route i sits at
// send_position[i]: inverse coordinates and the combine's token-major tables must agree.
TEST(StepPhasesTest, InverseAndCombineTablesAgree) {
  TwoTokens t;
  auto frozen = SealRoutes(t.Input(), Rank(0), 4, 2);
  ASSERT_TRUE(frozen.ok());
  const std::vector<int32_t> accepted_ids = {0, 1, 2};
  SourcePlan source;
  source.send_order = {2, 0, 1};
  source.send_position = {1, 2, 0};
  InverseCoordinates inv;
  InverseOf(frozen->routes, accepted_ids, source, 2, &inv);
  EXPECT_EQ(inv.num_tokens, 2);
  EXPECT_EQ(inv.token, (std::vector<int32_t>{1, 0, 0}));
  EXPECT_EQ(inv.gate, (std::vector<float>{1.0f, 0.75f, 0.25f}));
  std::vector<int32_t> row_of_route;
  std::vector<float> gates;
  CombineTables(accepted_ids, source, inv.gate, 4, &row_of_route, &gates);
  EXPECT_EQ(row_of_route, (std::vector<int32_t>{1, 2, 0, -1}));
  EXPECT_EQ(gates, (std::vector<float>{0.75f, 0.25f, 1.0f, 0.0f}));
  // Refilled for a step with fewer sends (the executor reuses the vectors): sized to it.
  const std::vector<int32_t> fewer = {2, 0};
  SourcePlan two;
  two.send_order = {1, 0};
  InverseOf(frozen->routes, fewer, two, 2, &inv);
  EXPECT_EQ(inv.token, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(inv.gate, (std::vector<float>{0.75f, 1.0f}));
}

TEST(StepPhasesTest, ByteSplitsPerPeer) {
  const std::vector<int64_t> send = {3, 0, 2}, recv = {1, 4, 0};
  ByteSplits b;
  SplitBytes(send, recv, 8192, 4224, &b);  // d = 4096: BF16 rows, packed FP8 dispatch rows
  EXPECT_EQ(b.send, (std::vector<int64_t>{3 * 8192, 0, 2 * 8192}));
  EXPECT_EQ(b.recv, (std::vector<int64_t>{8192, 4 * 8192, 0}));
  EXPECT_EQ(b.dispatch_send, (std::vector<int64_t>{3 * 4224, 0, 2 * 4224}));
  EXPECT_EQ(b.dispatch_recv, (std::vector<int64_t>{4224, 4 * 4224, 0}));
  EXPECT_EQ(b.send_meta, (std::vector<int64_t>{12, 0, 8}));
  EXPECT_EQ(b.recv_meta, (std::vector<int64_t>{4, 16, 0}));
  // Reused for a smaller group: sized to it, nothing left over from the last call.
  const std::vector<int64_t> send2 = {5, 1}, recv2 = {2, 7};
  SplitBytes(send2, recv2, 16, 16, &b);
  EXPECT_EQ(b.send, (std::vector<int64_t>{80, 16}));
  EXPECT_EQ(b.dispatch_send, b.send);
  EXPECT_EQ(b.recv, (std::vector<int64_t>{32, 112}));
  EXPECT_EQ(b.send_meta, (std::vector<int64_t>{20, 4}));
  EXPECT_EQ(b.recv_meta, (std::vector<int64_t>{8, 28}));
}

// The spec's four-rank, two-node manifest (fixtures: slots 0-2 on node 0, 3-5 on node 1).
TEST(StepPhasesTest, CountRoutesSplitsRemoteAndInterNode) {
  const Topology topology = fixture::FourRankTwoNode();
  const auto m = fixture::V17(topology);
  // Routes accepted to slots 0, 1, 3 and 5, one each.
  std::vector<int64_t> slot_counts(m->num_slots(), 0);
  for (int q : {0, 1, 3, 5}) ++slot_counts[q];
  StepRecord rec;
  CountRoutes(*m, topology, Rank(0), slot_counts, 6, &rec);
  EXPECT_EQ(rec.routes_attempted, 6);
  EXPECT_EQ(rec.routes_accepted, 4);
  EXPECT_EQ(rec.routes_dropped, 2);
  EXPECT_EQ(rec.routes_remote, 3);      // slots 1 (rank 1), 3 (rank 2), 5 (rank 3)
  EXPECT_EQ(rec.routes_inter_node, 2);  // ranks 2 and 3 are on node 1
  // Several routes to one slot count once each.
  slot_counts[3] = 3;
  StepRecord more;
  CountRoutes(*m, topology, Rank(0), slot_counts, 7, &more);
  EXPECT_EQ(more.routes_accepted, 6);
  EXPECT_EQ(more.routes_dropped, 1);
  EXPECT_EQ(more.routes_remote, 5);
  EXPECT_EQ(more.routes_inter_node, 4);
}

TEST(StepPhasesTest, PhaseClockAddsUpConsecutivePhases) {
  std::array<double, kNumStepPhases> us{};
  PhaseClock clock(&us);
  clock.Enter(StepPhase::kValidate);
  clock.Enter(StepPhase::kAgree);
  absl::SleepFor(absl::Milliseconds(2));
  clock.Enter(StepPhase::kAgree);  // re-entering adds to the same phase
  clock.Stop();
  EXPECT_GE(us[static_cast<int>(StepPhase::kAgree)], 2000);
  EXPECT_LT(us[static_cast<int>(StepPhase::kValidate)], 2000);
  EXPECT_EQ(us[static_cast<int>(StepPhase::kExperts)], 0);
  clock.Stop();  // stopping twice adds nothing
  EXPECT_EQ(us[static_cast<int>(StepPhase::kExperts)], 0);
}

// Host kernels read the tables in place; device kernels read one uploaded block in which every
// table starts 16-byte aligned (the CPU kernels stand in for the device: same copy calls).
TEST(StepPhasesTest, TablesInPlaceOrInOneAlignedBlock) {
  auto kern = kernels::CreateCpuKernels();
  const std::vector<int32_t> a = {1, 2, 3};
  const std::vector<float> b = {0.5f, 0.25f};
  StepTables host_tables;
  const int ta = host_tables.Add(a.data(), 12), tb = host_tables.Add(b.data(), 8);
  kernels::KernelBuffer block;
  std::vector<uint8_t> staging;
  ASSERT_TRUE(host_tables.Upload(false, *kern, block, staging, nullptr).ok());
  EXPECT_EQ(host_tables.Get<int32_t>(ta), a.data());
  EXPECT_EQ(host_tables.Get<float>(tb), b.data());
  StepTables device_tables;
  const int da = device_tables.Add(a.data(), 12), db = device_tables.Add(b.data(), 8);
  EXPECT_EQ(device_tables.total_bytes(), 32);
  ASSERT_TRUE(device_tables.Upload(true, *kern, block, staging, nullptr).ok());
  const int32_t* ga = device_tables.Get<int32_t>(da);
  const float* gb = device_tables.Get<float>(db);
  EXPECT_NE(ga, a.data());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(gb) - reinterpret_cast<uintptr_t>(ga), 16u);
  EXPECT_EQ(std::vector<int32_t>(ga, ga + 3), a);
  EXPECT_EQ(std::vector<float>(gb, gb + 2), b);
}

// The combine tables invert the send order (0x0E): each sent position combined once, by a route
// of the token it was sent for; anything else is DATA_LOSS naming the route.
TEST(StepPhasesTest, CombineTablesMustInvertTheSendOrder) {
  std::vector<uint8_t> seen;
  // k = 2; routes (0,0) (0,1) (1,0) sent to positions 2, 0, 1; route (1,1) not sent.
  const std::vector<int32_t> token_of_position = {0, 1, 0};
  EXPECT_TRUE(CheckCombineTables({2, 0, 1, -1}, token_of_position, 2, &seen).ok());
  const absl::Status swapped = CheckCombineTables({1, 0, 2, -1}, token_of_position, 2, &seen);
  EXPECT_EQ(swapped.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(swapped.message().find("route 0 (token 0) combines send position 1, which was sent for token 1"),
            std::string::npos)
      << swapped.message();
  EXPECT_EQ(CheckCombineTables({2, 2, 1, -1}, token_of_position, 2, &seen).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(CheckCombineTables({2, 0, 3, -1}, token_of_position, 2, &seen).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(CheckCombineTables({2, 0, -1, -1}, token_of_position, 2, &seen).code(), absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace moe
