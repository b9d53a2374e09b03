#include "runtime/exec/decode_admission.h"

#include <string>

#include "gtest/gtest.h"

#include "runtime/exec/decode_graph.h"

namespace moe {
namespace {

// 0x05C: graph decode.bucket4.v17 over placement-v17, d = 3, k = 2, P = 4, six slots.
DecodeGraph Bucket4() {
  DecodeGraph g;
  g.graph_id = "decode.bucket4.v17";
  g.key.process_group = "ep-group-0";
  g.key.placement_version = 17;
  g.key.checkpoint = "checkpoint-0042";
  g.key.d = 3;
  g.key.k = 2;
  g.key.rank_token_capacity = {4, 4, 4, 4};
  g.key.slot_route_capacity = {2, 2, 2, 2, 2, 2};
  g.stable_buffers_ready = true;
  return g;
}

AdmissionStep Step(std::vector<int64_t> tokens, std::vector<int64_t> routes, bool decode = true) {
  AdmissionStep s;
  s.decode = decode;
  s.key = Bucket4().key;
  s.rank_tokens = std::move(tokens);
  s.slot_routes = std::move(routes);
  return s;
}

TEST(DecodeAdmissionTest, DecodeFixtureReplaysWithItsLedger) {
  const DecodeGraph g = Bucket4();
  const AdmissionStep s = Step({3, 2, 0, 0}, {2, 2, 2, 2, 1, 1});
  const Admission a = AdmitDecodeGraph(s, &g);
  EXPECT_TRUE(a.replay);
  EXPECT_EQ(a.graph_id, "decode.bucket4.v17");
  const UnitLedger l = GraphUnitLedger(g.key, s.rank_tokens, s.slot_routes, /*act_bytes=*/2, /*num_ranks=*/4);
  EXPECT_EQ(l.useful_input_rows, 5);
  EXPECT_EQ(l.executed_dispatch_slots, 16);
  EXPECT_EQ(l.executed_dispatch_slots - l.useful_input_rows, 11);  // masked input slots
  EXPECT_EQ(l.useful_routes, 10);
  EXPECT_EQ(l.executed_runner_rows, 12);
  EXPECT_EQ(l.graph_payload_bytes, 496);
  EXPECT_EQ(l.host_submissions, 1);
}

TEST(DecodeAdmissionTest, EachReasonIsExact) {
  const DecodeGraph g = Bucket4();
  EXPECT_EQ(AdmitDecodeGraph(Step({3, 2, 0, 0}, {2, 2, 2, 2, 1, 1}, false), &g).reason,
            FallbackReason::kPhaseNotDecode);
  AdmissionStep stale = Step({3, 2, 0, 0}, {2, 2, 2, 2, 1, 1});
  stale.key.placement_version = 18;  // replaying a v17 graph against v18 is stale state
  EXPECT_EQ(AdmitDecodeGraph(stale, &g).reason, FallbackReason::kGraphKeyMismatch);
  // The capacities are part of the key: a step planned for a bucket of 8 tokens a rank does not
  // replay the bucket-4 graph, though its counts would fit; the key is checked before any count.
  AdmissionStep wider = Step({3, 2, 0, 0}, {2, 2, 2, 2, 1, 1});
  wider.key.rank_token_capacity = {8, 8, 8, 8};
  EXPECT_EQ(AdmitDecodeGraph(wider, &g).reason, FallbackReason::kGraphKeyMismatch);
  AdmissionStep stale_oversize = Step({5, 4, 2, 0}, {5, 4, 4, 3, 3, 3});
  stale_oversize.key.placement_version = 18;
  EXPECT_EQ(AdmitDecodeGraph(stale_oversize, &g).reason, FallbackReason::kGraphKeyMismatch);
  AdmissionStep stale_prefill = Step({3, 2, 0, 0}, {2, 2, 2, 2, 1, 1}, false);
  stale_prefill.key.placement_version = 18;
  EXPECT_EQ(AdmitDecodeGraph(stale_prefill, &g).reason, FallbackReason::kPhaseNotDecode);
  EXPECT_EQ(AdmitDecodeGraph(Step({4, 4, 4, 4}, {2, 2, 2, 2, 2, 2}), &g).replay, true);  // at capacity
  EXPECT_EQ(AdmitDecodeGraph(Step({3, 2, 0, 0}, {3, 1, 2, 2, 1, 1}), &g).reason,
            FallbackReason::kExpertRouteCapacityExceeded);
  DecodeGraph cold = g;
  cold.stable_buffers_ready = false;
  EXPECT_EQ(AdmitDecodeGraph(Step({3, 2, 0, 0}, {2, 2, 2, 2, 1, 1}), &cold).reason,
            FallbackReason::kStableBufferUnavailable);
  EXPECT_EQ(AdmitDecodeGraph(Step({3, 2, 0, 0}, {2, 2, 2, 2, 1, 1}), nullptr).reason,
            FallbackReason::kStableBufferUnavailable);
  EXPECT_STREQ(FallbackReasonName(FallbackReason::kRankTokenCapacityExceeded), "rank_token_capacity_exceeded");
}

// 0x05F: the oversize decode fails first on rank tokens and falls back without clipping.
TEST(DecodeAdmissionTest, OversizeFallsBackWithoutSemanticDrift) {
  const DecodeGraph g = Bucket4();
  const AdmissionStep s = Step({5, 4, 2, 0}, {5, 4, 4, 3, 3, 3});
  const Admission a = AdmitDecodeGraph(s, &g);
  EXPECT_FALSE(a.replay);
  EXPECT_EQ(a.reason, FallbackReason::kRankTokenCapacityExceeded);
  const UnitLedger l = EagerUnitLedger(s.rank_tokens, s.slot_routes, 7);
  EXPECT_EQ(l.useful_input_rows, 11);
  EXPECT_EQ(l.executed_dispatch_slots, 11);
  EXPECT_EQ(l.useful_routes, 22);
  EXPECT_EQ(l.executed_runner_rows, 22);
}

// 0x05B and 0x05E: prefill amortization and the mixed batch split by phase.
TEST(DecodeAdmissionTest, PrefillAndMixedLedgers) {
  const UnitLedger prefill = EagerUnitLedger({32, 24, 0, 0}, {28, 22, 18, 16, 14, 14}, 7);
  EXPECT_EQ(prefill.useful_input_rows, 56);
  EXPECT_EQ(prefill.executed_dispatch_slots, 56);
  EXPECT_EQ(prefill.useful_routes, 112);
  EXPECT_EQ(prefill.executed_runner_rows, 112);

  const DecodeGraph g = Bucket4();
  const UnitLedger p = EagerUnitLedger({7, 5, 0, 0}, {7, 6, 5, 2, 2, 2}, 7);  // 24 routes
  const AdmissionStep ds = Step({1, 2, 0, 0}, {1, 1, 1, 1, 1, 1});            // 6 routes
  ASSERT_TRUE(AdmitDecodeGraph(ds, &g).replay);
  const UnitLedger d = GraphUnitLedger(g.key, ds.rank_tokens, ds.slot_routes, 2, 4);
  EXPECT_EQ(p.useful_input_rows + d.useful_input_rows, 15);
  EXPECT_EQ(p.executed_dispatch_slots + d.executed_dispatch_slots, 28);
  EXPECT_EQ(p.executed_dispatch_slots + d.executed_dispatch_slots - 15, 13);
  EXPECT_EQ(p.useful_routes + d.useful_routes, 30);
  EXPECT_EQ(p.executed_runner_rows + d.executed_runner_rows, 36);
  EXPECT_EQ(p.executed_runner_rows + d.executed_runner_rows - 30, 6);
  EXPECT_EQ(p.host_submissions + d.host_submissions, 8);
}

// The bucket's runner: padded GEMMs from two expected rows a physical slot at a full bucket
// (peers * rank_tokens * k routes over the manifest's slots), the decode kernels below; a
// forced setting wins; names parse, others are refused naming the flag.
TEST(DecodeRunnerTest, AutoTakesPaddedFromTwoRowsASlot) {
  EXPECT_FALSE(ChoosePaddedRunner(DecodeRunner::kAuto, 1, 16, 8, 128));  // 1 row a slot
  EXPECT_TRUE(ChoosePaddedRunner(DecodeRunner::kAuto, 1, 32, 8, 128));   // 2
  EXPECT_TRUE(ChoosePaddedRunner(DecodeRunner::kAuto, 4, 8, 8, 64));     // 4
  EXPECT_FALSE(ChoosePaddedRunner(DecodeRunner::kAuto, 4, 3, 8, 97));    // 96 routes, 97 slots
  EXPECT_FALSE(ChoosePaddedRunner(DecodeRunner::kAuto, 1, 8, 8, 0));
  EXPECT_TRUE(ChoosePaddedRunner(DecodeRunner::kPadded, 1, 1, 1, 128));
  EXPECT_FALSE(ChoosePaddedRunner(DecodeRunner::kKernels, 4, 64, 8, 8));
  // Kernels whose own decode GEMMs beat the padded runner keep auto off it, not a forced choice.
  EXPECT_FALSE(ChoosePaddedRunner(DecodeRunner::kAuto, 4, 8, 8, 64, /*kernels_beat_padded=*/true));
  EXPECT_TRUE(ChoosePaddedRunner(DecodeRunner::kPadded, 4, 8, 8, 64, /*kernels_beat_padded=*/true));
  EXPECT_EQ(*ParseDecodeRunner("padded"), DecodeRunner::kPadded);
  EXPECT_EQ(*ParseDecodeRunner("kernels"), DecodeRunner::kKernels);
  EXPECT_EQ(*ParseDecodeRunner("auto"), DecodeRunner::kAuto);
  const auto bad = ParseDecodeRunner("gemm");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("decode_runner"), std::string::npos);
}

}  // namespace
}  // namespace moe
