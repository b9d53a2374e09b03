// RecordedWork's policy against kernels that pretend to record (a fake kernels object: the CUDA
// graphs themselves run in nccl_executor_test on the GPU): a key's first step eager, its second
// recorded and launched, then launches; a recording made stale by freed memory starts again; a
// failed recording runs the step eagerly and a key that fails twice stays eager; the least
// recently used key makes room once idle for twice the capacity, and keys cycled beyond the
// capacity leave the kept ones launching; kernels that record nothing run everything eagerly.
#include "runtime/exec/recorded_work.h"

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

using kernels::Stream;

// Records what the enqueue callbacks give it: a step run on the null stream is eager, one on the
// capture stream is a recording; LaunchCaptured "replays" the recording's count.
class FakeRecorder final : public kernels::ExpertKernels {
 public:
  const char* name() const override { return "fake"; }
  absl::Status Gather(const kernels::GatherParams&, Stream) override { return Unused(); }
  absl::Status HistogramScan(const kernels::HistogramParams&, Stream) override { return Unused(); }
  absl::Status RouteRows(const kernels::RouteRowsParams&, Stream) override { return Unused(); }
  absl::Status Swiglu(const kernels::SwigluParams&, Stream) override { return Unused(); }
  absl::Status Combine(const kernels::CombineParams&, Stream) override { return Unused(); }
  absl::Status Quantize(const kernels::QuantizeParams&, Stream) override { return Unused(); }
  absl::Status Dequantize(const kernels::DequantizeParams&, Stream) override { return Unused(); }
  absl::Status LocalLayer(const kernels::LocalLayerParams&, Stream) override { return Unused(); }
  absl::Status SwigluFp8(const kernels::SwigluFp8Params&, Stream) override { return Unused(); }

  absl::StatusOr<Stream> BeginCapture() override {
    if (!records) return absl::UnimplementedError("no recording here");
    if (capturing) return absl::FailedPreconditionError("nested");
    capturing = true;
    return capture_stream();
  }
  absl::StatusOr<void*> EndCapture(Stream s) override {
    EXPECT_EQ(s, capture_stream());
    capturing = false;
    if (fail_end) return absl::FailedPreconditionError("end_capture: cannot record that");
    works.push_back(Work{epoch});
    return static_cast<void*>(&works.back());
  }
  absl::StatusOr<bool> LaunchCaptured(void* w, Stream s) override {
    EXPECT_EQ(s, nullptr);
    auto* work = static_cast<Work*>(w);
    EXPECT_EQ(work->dropped, false);
    if (work->epoch != epoch) return false;
    ++launches;
    return true;
  }
  void DropCaptured(void* w) override {
    auto* work = static_cast<Work*>(w);
    EXPECT_FALSE(work->dropped) << "dropped twice";
    work->dropped = true;
    ++drops;
  }

  Stream capture_stream() { return static_cast<Stream>(&capture_tag); }
  static absl::Status Unused() { return absl::UnimplementedError("not used by this test"); }

  struct Work {
    int epoch = 0;
    bool dropped = false;
  };
  bool records = true, fail_end = false, capturing = false;
  int epoch = 0, launches = 0, drops = 0;
  char capture_tag = 0;
  std::vector<Work> works;  // reserved: the recordings' pointers into it stay valid
  FakeRecorder() { works.reserve(64); }
};

RecordedWork::Key KeyOf(uint64_t v) {
  RecordedWork::Key k{};
  k[0] = v;
  return k;
}

// Steps run eagerly (the null stream) and recordings (the capture stream) of an enqueue callback.
struct Counts {
  int eager = 0, recorded = 0;
  auto Enqueue() {
    return [this](Stream s) {
      (s == nullptr ? eager : recorded)++;
      return absl::OkStatus();
    };
  }
};

TEST(RecordedWorkTest, FirstStepEagerThenRecordedThenLaunched) {
  FakeRecorder fake;
  Counts c;
  auto enqueue = c.Enqueue();
  {
    RecordedWork work(&fake, 8);
    bool launched = true;
    ASSERT_TRUE(work.Run(KeyOf(1), enqueue, &launched).ok());
    EXPECT_FALSE(launched);
    EXPECT_EQ(c.eager, 1);
    EXPECT_EQ(fake.launches, 0);
    ASSERT_TRUE(work.Run(KeyOf(1), enqueue, &launched).ok());
    EXPECT_TRUE(launched);
    EXPECT_EQ(c.recorded, 1);     // recorded once...
    EXPECT_EQ(fake.launches, 1);  // ...and launched for this step
    EXPECT_EQ(c.eager, 1);
    for (int i = 0; i < 5; ++i) ASSERT_TRUE(work.Run(KeyOf(1), enqueue).ok());
    EXPECT_EQ(c.recorded, 1);
    EXPECT_EQ(c.eager, 1);
    EXPECT_EQ(fake.launches, 6);
    // Another key starts from an eager step of its own.
    ASSERT_TRUE(work.Run(KeyOf(2), enqueue).ok());
    EXPECT_EQ(c.eager, 2);
    EXPECT_EQ(work.stats().launches, 6);
    EXPECT_EQ(work.stats().recorded, 1);
    EXPECT_EQ(work.stats().eager, 2);
    EXPECT_EQ(work.size(), 2);
  }
  EXPECT_EQ(fake.drops, 1);  // the one recording, dropped with the cache
}

TEST(RecordedWorkTest, StaleRecordingStartsAgainFromAnEagerStep) {
  FakeRecorder fake;
  Counts c;
  auto enqueue = c.Enqueue();
  RecordedWork work(&fake, 8);
  ASSERT_TRUE(work.Run(KeyOf(7), enqueue).ok());
  ASSERT_TRUE(work.Run(KeyOf(7), enqueue).ok());
  ASSERT_EQ(fake.launches, 1);
  ++fake.epoch;  // the kernels freed memory
  bool launched = true;
  ASSERT_TRUE(work.Run(KeyOf(7), enqueue, &launched).ok());
  EXPECT_FALSE(launched);
  EXPECT_EQ(work.stats().stale, 1);
  EXPECT_EQ(fake.drops, 1);
  EXPECT_EQ(c.eager, 2);  // this step ran eagerly, not the stale recording
  EXPECT_EQ(fake.launches, 1);
  ASSERT_TRUE(work.Run(KeyOf(7), enqueue).ok());
  EXPECT_EQ(c.recorded, 2);  // recorded again
  EXPECT_EQ(fake.launches, 2);
}

TEST(RecordedWorkTest, FailedRecordingsRunEagerlyAndTwoKeepTheKeyEager) {
  FakeRecorder fake;
  Counts c;
  auto enqueue = c.Enqueue();
  RecordedWork work(&fake, 8);
  fake.fail_end = true;
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(work.Run(KeyOf(3), enqueue).ok());
  EXPECT_EQ(c.recorded, 2);  // two attempts (steps 2 and 3), each followed by its eager step
  EXPECT_EQ(c.eager, 6);     // every step ran, eagerly
  EXPECT_EQ(fake.launches, 0);
  EXPECT_EQ(work.stats().failed, 2);
  EXPECT_EQ(work.stats().last_failure, "end_capture: cannot record that");
  EXPECT_FALSE(fake.capturing);
  // A call that fails inside the recording: ended, then the step runs eagerly and returns the
  // eager call's answer.
  fake.fail_end = false;
  int calls = 0;
  auto refusing = [&](Stream s) -> absl::Status {
    ++calls;
    if (s != nullptr) return absl::FailedPreconditionError("cannot be recorded");
    return absl::InvalidArgumentError("topk_ids: bad");
  };
  EXPECT_EQ(work.Run(KeyOf(4), refusing).code(), absl::StatusCode::kInvalidArgument);  // eager first
  EXPECT_EQ(work.Run(KeyOf(4), refusing).code(), absl::StatusCode::kInvalidArgument);  // recording failed
  EXPECT_EQ(calls, 3);
  EXPECT_FALSE(fake.capturing);
  EXPECT_EQ(fake.drops, 1);  // what was recorded of the failed call is dropped, never launched
  EXPECT_EQ(fake.launches, 0);
}

TEST(RecordedWorkTest, AKeyIdleForTwiceTheCapacityMakesRoom) {
  FakeRecorder fake;
  auto enqueue = [&](Stream) { return absl::OkStatus(); };
  RecordedWork work(&fake, 2);
  for (uint64_t k : {1, 1, 2, 2}) ASSERT_TRUE(work.Run(KeyOf(k), enqueue).ok());  // both recorded
  ASSERT_TRUE(work.Run(KeyOf(3), enqueue).ok());  // key 2 ran a step ago: 3 runs eagerly, nothing dropped
  EXPECT_EQ(work.stats().full, 1);
  EXPECT_EQ(work.stats().evicted, 0);
  EXPECT_EQ(fake.drops, 0);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(work.Run(KeyOf(1), enqueue).ok());  // key 2 idle for 5 steps > 2 x 2
  ASSERT_TRUE(work.Run(KeyOf(3), enqueue).ok());                              // evicts 2
  EXPECT_EQ(work.size(), 2);
  EXPECT_EQ(work.stats().evicted, 1);
  EXPECT_EQ(fake.drops, 1);
  EXPECT_TRUE(fake.works[1].dropped);   // key 2's recording
  EXPECT_FALSE(fake.works[0].dropped);  // key 1's
  const int before = fake.launches;
  ASSERT_TRUE(work.Run(KeyOf(1), enqueue).ok());
  EXPECT_EQ(fake.launches, before + 1);  // key 1 still launches its recording
}

// An engine cycling through more keys than are kept: the kept keys are recorded once and
// launched every turn after, the others run eagerly, and nothing is dropped or recorded again
// (least recently used eviction would have dropped each key just before its turn came).
TEST(RecordedWorkTest, KeysCycledBeyondTheCapacityKeepTheFirstOnesLaunching) {
  FakeRecorder fake;
  auto enqueue = [&](Stream) { return absl::OkStatus(); };
  RecordedWork work(&fake, 3);
  for (int turn = 0; turn < 10; ++turn) {
    for (uint64_t k : {1, 2, 3, 4, 5}) ASSERT_TRUE(work.Run(KeyOf(k), enqueue).ok());
  }
  const RecordedWork::Stats& st = work.stats();
  EXPECT_EQ(st.recorded, 3);        // keys 1-3, on their second turn
  EXPECT_EQ(st.launches, 3 * 9);    // then every turn
  EXPECT_EQ(st.eager, 3 + 2 * 10);  // keys 1-3's first turn, keys 4 and 5 always
  EXPECT_EQ(st.full, 2 * 10);
  EXPECT_EQ(st.evicted, 0);
  EXPECT_EQ(fake.drops, 0);
  EXPECT_EQ(work.size(), 3);
}

TEST(RecordedWorkTest, KernelsThatRecordNothingRunEveryStepEagerly) {
  FakeRecorder fake;
  fake.records = false;
  Counts c;
  auto enqueue = c.Enqueue();
  RecordedWork work(&fake, 8);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(work.Run(KeyOf(1), enqueue).ok());
  EXPECT_EQ(c.eager, 5);
  EXPECT_EQ(c.recorded, 0);
  EXPECT_EQ(work.stats().failed, 1);  // the one attempt that found out
}

}  // namespace
}  // namespace moe
