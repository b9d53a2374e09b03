// The step's host work keeps its memory between steps: the agreement (AgreeOnStepInto: its
// records and result vectors) and the byte splits (SplitBytes) allocate nothing on a second step
// of the same shape, and neither do the CPU kernels' host tables (RouteRows, Swiglu, Combine) on
// a second call. The binary counts every operator new of the calling thread
// (//bench:alloc_counter).
#include <algorithm>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"

#include "bench/alloc_counter.h"
#include "kernels/api.h"
#include "kernels/numeric.h"
#include "runtime/exec/step_exchange.h"
#include "runtime/exec/step_phases.h"
#include "runtime/transport/step_gather.h"
#include "runtime/transport/transport.h"

namespace moe {
namespace {

// A group of one whose gathers copy in place and allocate nothing (the loopback transport's
// rendezvous allocates; this test is about the agreement's own memory).
class OneMemberFake : public Transport {
 public:
  const char* name() const override { return "one-member fake"; }
  int slot() const override { return 0; }
  int size() const override { return 1; }
  absl::Status AllGather(uint64_t, const void* in, int64_t bytes, void* out, absl::Duration) override {
    std::memcpy(out, in, bytes);
    ++gathers;
    return absl::OkStatus();
  }
  absl::Status AllToAllV(uint64_t, const void* send, absl::Span<const int64_t> send_bytes, void* recv,
                         absl::Span<const int64_t>, absl::Duration) override {
    std::memcpy(recv, send, send_bytes[0]);
    return absl::OkStatus();
  }
  int gathers = 0;
};

TEST(StepAllocationsTest, AgreementRefilledWithoutAllocating) {
  OneMemberFake t;
  AgreementScratch scratch;
  StepAgreement out;
  const std::vector<int64_t> send = {5}, slots = {2, 0, 3};
  const std::vector<int32_t> meta = {0, 2, 2, 2, 0};
  StepHeader h{100, 3, 1, 0, 0, 5};
  ASSERT_TRUE(AgreeOnStepInto(t, h, send, absl::Seconds(1), slots, &meta, &scratch, &out).ok());
  EXPECT_EQ(out.recv_counts, (std::vector<int64_t>{5}));
  EXPECT_EQ(out.slot_routes, (std::vector<int64_t>{2, 0, 3}));
  EXPECT_TRUE(out.meta_received);
  EXPECT_EQ(out.recv_meta, meta);
  // A second step of the same shape: the same results, no allocation.
  h.step_id = 101;
  const std::vector<int64_t> send2 = {4}, slots2 = {1, 1, 2};
  const std::vector<int32_t> meta2 = {1, 0, 2, 2};
  const int64_t before = bench::ThreadAllocations();
  const absl::Status s = AgreeOnStepInto(t, h, send2, absl::Seconds(1), slots2, &meta2, &scratch, &out);
  const int64_t allocations = bench::ThreadAllocations() - before;
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(allocations, 0);
  EXPECT_EQ(out.recv_counts, (std::vector<int64_t>{4}));
  EXPECT_EQ(out.slot_routes, (std::vector<int64_t>{1, 1, 2}));
  EXPECT_EQ(out.rank_tokens, (std::vector<int64_t>{5}));
  EXPECT_EQ(out.recv_meta, meta2);
  // Without metadata this time: none received, and none left over from the last step.
  ASSERT_TRUE(AgreeOnStepInto(t, h, send2, absl::Seconds(1), slots2, nullptr, &scratch, &out).ok());
  EXPECT_FALSE(out.meta_received);
  EXPECT_TRUE(out.recv_meta.empty());
  EXPECT_EQ(t.gathers, 3);
  // The value-returning form agrees with the refilled one.
  auto fresh = AgreeOnStep(t, h, send2, absl::Seconds(1), slots2);
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ(fresh->count_matrix, out.count_matrix);
  EXPECT_EQ(fresh->slot_routes, out.slot_routes);
}

TEST(StepAllocationsTest, ByteSplitsRefilledWithoutAllocating) {
  ByteSplits b;
  const std::vector<int64_t> send = {3, 0, 2, 7}, recv = {1, 4, 0, 2};
  SplitBytes(send, recv, 4096, 2112, &b);
  const int64_t before = bench::ThreadAllocations();
  SplitBytes(recv, send, 4096, 2112, &b);
  EXPECT_EQ(bench::ThreadAllocations() - before, 0);
  EXPECT_EQ(b.send, (std::vector<int64_t>{4096, 4 * 4096, 0, 2 * 4096}));
  EXPECT_EQ(b.recv_meta, (std::vector<int64_t>{12, 0, 8, 28}));
}

TEST(StepAllocationsTest, StepTablesOfAStepStayOffTheHeap) {
  const std::vector<int32_t> a = {1, 2, 3}, b = {4, 5}, c = {6};
  const int64_t before = bench::ThreadAllocations();
  StepTables tables;
  const int ta = tables.Add(a.data(), 12), tb = tables.Add(b.data(), 8), tc = tables.Add(c.data(), 4);
  const int td = tables.Add(a.data(), 4), te = tables.Add(b.data(), 4);
  EXPECT_EQ(bench::ThreadAllocations() - before, 0);
  EXPECT_EQ(tables.Get<int32_t>(ta)[2], 3);  // host kernels read the tables in place
  EXPECT_EQ(tables.Get<int32_t>(tb)[1], 5);
  EXPECT_EQ(tables.Get<int32_t>(tc)[0], 6);
  EXPECT_EQ(tables.Get<int32_t>(td)[0], 1);
  EXPECT_EQ(tables.Get<int32_t>(te)[0], 4);
}

// Member 0 of a group of two over a channel whose peer (slot 1) has sent RECORD(ready) of
// `record` when `ready` is set; sends go nowhere. Nothing here allocates.
class TwoMemberChannel : public StepGatherChannel {
 public:
  absl::Status Send(int, const StepGatherHeader&, const void*, int64_t) override {
    ++sends;
    return absl::OkStatus();
  }
  absl::StatusOr<bool> Poll(int peer, StepGatherHeader* header, void* payload, int64_t capacity,
                            int64_t* bytes) override {
    if (peer != 1 || ready == 0) return false;
    header->type = StepGatherHeader::kRecord;
    header->step = ready;
    *bytes = std::min<int64_t>(capacity, sizeof(record));
    std::memcpy(payload, record, *bytes);
    ready = 0;
    return true;
  }
  void Idle() override {}
  uint64_t ready = 0;
  char record[24] = "the peer's record";
  int sends = 0;
};

// The step agreement's gather over tag-matched transports (UCX, NCCL's shared-memory channel)
// keeps its working state in the transport's backlog: a second step allocates nothing (it made
// three allocations a step, one of 64 KiB), and a peer in another step still aborts it.
TEST(StepAllocationsTest, StepGatherKeepsItsStateBetweenSteps) {
  TwoMemberChannel ch;
  StepGatherBacklog backlog;
  char in[24] = "this member's record", out[48] = {};
  ch.ready = 1;
  ASSERT_TRUE(RunStepGather(ch, backlog, 0, 2, 1, in, 24, out, absl::Seconds(1)).ok());
  ch.ready = 2;
  const int64_t before = bench::ThreadAllocations();
  const absl::Status second = RunStepGather(ch, backlog, 0, 2, 2, in, 24, out, absl::Seconds(1));
  EXPECT_EQ(bench::ThreadAllocations() - before, 0);
  ASSERT_TRUE(second.ok()) << second;
  EXPECT_EQ(std::memcmp(out, in, 24), 0);
  EXPECT_EQ(std::memcmp(out + 24, ch.record, 24), 0);
  EXPECT_EQ(ch.sends, 2);
  ch.ready = 4;  // the peer is in step 4, this member in 3
  const absl::Status mismatch = RunStepGather(ch, backlog, 0, 2, 3, in, 24, out, absl::Seconds(1));
  EXPECT_EQ(mismatch.code(), absl::StatusCode::kAborted) << mismatch;
}

// A layer's kernels on the CPU (E 4, k 2, d 8, f 4, 6 tokens): the second call of each with the
// same shapes (RankByKey, RouteRows, CheckSwiglu, Swiglu, Combine) allocates nothing, and the results are still right
// (the routes land on their experts' rows; the combine of all-ones rows with gates summing to 1 gives ones).
TEST(StepAllocationsTest, CpuKernelsKeepTheirHostTables) {
  std::unique_ptr<kernels::ExpertKernels> k = kernels::CreateCpuKernels();
  constexpr int E = 4, K = 2, D = 8, F = 4, T = 6;
  const std::vector<int32_t> topk = {0, 1, 2, 3, 1, 0, 3, 2, 0, 2, 1, 3};
  std::vector<int64_t> counts(E), offsets(E + 1);
  std::vector<int32_t> row_of_route(T * K), token_of_row(T * K);
  kernels::RouteRowsParams rr;
  rr.topk = topk.data();
  rr.num_tokens = T;
  rr.k = K;
  rr.num_experts = E;
  rr.counts = counts.data();
  rr.offsets = offsets.data();
  rr.row_of_route = row_of_route.data();
  rr.token_of_row = token_of_row.data();

  std::vector<uint16_t> w_gate_up(E * 2 * F * D, kernels::FloatToBf16(0.01f)),
      w_down(E * D * F, kernels::FloatToBf16(0.02f)), x(T * K * D, kernels::FloatToBf16(1.0f)), y(T * K * D);
  kernels::SwigluParams sw;
  sw.weights = {w_gate_up.data(), w_down.data(), E, D, F};
  sw.x = x.data();
  sw.rows = T * K;
  sw.host_offsets = offsets.data();
  sw.y = y.data();

  const std::vector<uint16_t> ones(T * K * D, kernels::FloatToBf16(1.0f));
  const std::vector<float> gate(T * K, 0.5f);
  std::vector<float> out(T * D);
  kernels::CombineParams cb;
  cb.rows = ones.data();
  cb.num_rows = T * K;
  cb.d = D;
  cb.row_of_route = row_of_route.data();
  cb.gate = gate.data();
  cb.num_tokens = T;
  cb.k = K;
  cb.out_fp32 = out.data();

  // The device plan's ranking (the CPU reference): the routes by expert, with a token order.
  std::vector<int32_t> position(T * K), order(T * K);
  std::vector<int64_t> rank_counts(E), rank_offsets(E + 1), rank_status(1);
  kernels::RankByKeyParams rk;
  rk.raw = topk.data();
  rk.n = T * K;
  rk.num_keys = E;
  rk.position = position.data();
  rk.order = order.data();
  rk.order_divisor = K;
  rk.counts = rank_counts.data();
  rk.offsets = rank_offsets.data();
  rk.status = rank_status.data();

  for (int call = 0; call < 2; ++call) {
    const int64_t before = bench::ThreadAllocations();
    ASSERT_TRUE(k->RankByKey(rk, nullptr).ok());
    ASSERT_TRUE(k->RouteRows(rr, nullptr).ok());
    ASSERT_TRUE(kernels::CheckSwiglu(sw).ok());
    ASSERT_TRUE(k->Swiglu(sw, nullptr).ok());
    ASSERT_TRUE(k->Combine(cb, nullptr).ok());
    if (call == 1) {
      EXPECT_EQ(bench::ThreadAllocations() - before, 0);
    }
  }
  EXPECT_EQ(counts, (std::vector<int64_t>{3, 3, 3, 3}));
  EXPECT_EQ(rank_counts, counts);
  EXPECT_EQ(rank_offsets, offsets);
  EXPECT_EQ(position, row_of_route);  // both stable by route index within an expert
  EXPECT_EQ(order, token_of_row);
  EXPECT_EQ(offsets, (std::vector<int64_t>{0, 3, 6, 9, 12}));
  for (int i = 0; i < T * K; ++i) {
    EXPECT_TRUE(offsets[topk[i]] <= row_of_route[i] && row_of_route[i] < offsets[topk[i] + 1]) << "route " << i;
  }
  for (float v : out) EXPECT_FLOAT_EQ(v, 1.0f);
  EXPECT_NE(kernels::Bf16ToFloat(y[0]), 0.0f);
}

// The FP8 experts on the CPU (SwigluFp8, E 2, d 128, d_ff 128, 5 rows): the second call with the
// same shapes allocates nothing (the per-row values are kept), and gives the first call's rows.
TEST(StepAllocationsTest, CpuFp8ExpertsKeepTheirRowValues) {
  std::unique_ptr<kernels::ExpertKernels> k = kernels::CreateCpuKernels();
  constexpr int E = 2, D = 128, F = 128, R = 5;
  std::vector<uint8_t> wgu(E * 2 * F * D, 0x30), wd(E * D * F, 0x28);  // E4M3 0.5 and 0.25
  std::vector<float> sgu(E * 2 * (F / 128) * (D / 128), 0.01f), sd(E * (D / 128) * (F / 128), 0.02f);
  std::vector<uint16_t> x(R * D, kernels::FloatToBf16(1.0f)), y(R * D), first;
  const std::vector<int64_t> offsets = {0, 2, R};
  kernels::SwigluFp8Params p;
  p.weights = {wgu.data(), sgu.data(), wd.data(), sd.data(), E, D, F};
  p.x = x.data();
  p.rows = R;
  p.offsets = offsets.data();
  p.y = y.data();
  for (int call = 0; call < 2; ++call) {
    const int64_t before = bench::ThreadAllocations();
    ASSERT_TRUE(k->SwigluFp8(p, nullptr).ok());
    if (call == 1) {
      EXPECT_EQ(bench::ThreadAllocations() - before, 0);
    }
    if (call == 0) first = y;
  }
  EXPECT_EQ(y, first);
  EXPECT_GT(kernels::Bf16ToFloat(y[0]), 0.0f);
}

}  // namespace
}  // namespace moe
