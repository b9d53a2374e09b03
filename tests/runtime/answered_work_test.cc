// Steps that answer before their GPU work has finished (rows in the engine's device memory, a
// done event the engine's stream waits on) keep their generation lease until the event shows
// that work finished: a retirement cannot free the weights under it (spec 0x06B: the lease is
// returned at dispatch_state_releasable, and only then may the generation retire).
//
// The kernels here are the CPU reference presented as device-resident, with events the test
// fires by hand (testing::HeldEventKernels): a GPU whose work runs after the call that enqueued it.
#include <atomic>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

#include "bench/alloc_counter.h"
#include "kernels/api.h"
#include "runtime/exec/layer_executor.h"
#include "tests/runtime/random_step.h"
#include "tests/server/held_event_kernels.h"
#include "tests/server/one_rank_fixture.h"

namespace moe {
namespace {

using testing::HeldEventKernels;

constexpr int kExperts = 8, kD = 32, kFf = 48;

class AnsweredWorkTest : public testing::OneRankTest {
 protected:
  void SetUp() override {
    make_kernels_ = [this] {
      auto k = std::make_unique<HeldEventKernels>();
      held_ = k.get();
      return k;
    };
    timeout_ = absl::Milliseconds(200);
    SetUpRank(kExperts, kD, kFf, 3);
  }
  // placement-v2 (the same experts) ACTIVE, so that v1 drains and may retire.
  void ActivateV2() {
    ASSERT_NO_FATAL_FAILURE(PrepareGeneration(2, /*redundant=*/0));
    ASSERT_TRUE(registry_.Activate(PlacementVersion(2)).ok());
  }
  // One of the rank's done events (null, with a failure, if it cannot be made).
  void* NewDoneEvent() {
    std::string handle;
    absl::StatusOr<void*> e = executor_->CreateDoneEvent(&handle);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? *e : nullptr;
  }
  // `tokens` tokens' two routes each, every route admitted.
  testing::RandomRankInput Input(uint32_t seed, int64_t tokens) {
    std::mt19937 rng(seed);
    return testing::RandomTwoRouteInput(rng, tokens, kD, kExperts, /*drop_some=*/false);
  }
  // A step on `input` with its rows "in device memory" (this process's, as the fake's) and, when
  // `done` is set, answered once enqueued.
  absl::StatusOr<LayerStepResult> DeviceStep(const testing::RandomRankInput& input, uint64_t step, Phase phase,
                                             std::vector<uint16_t>* out, void* done) {
    out->assign(static_cast<size_t>(input.tokens) * kD, 0);
    LayerStepInput in = input.Step(step, 0, phase);
    in.rows_on_device = true;
    in.output = out->data();
    in.done_event = done;
    return executor_->Execute(in);
  }

  HeldEventKernels* held_ = nullptr;
};

TEST_F(AnsweredWorkTest, TheLeaseIsHeldUntilTheDoneEventFires) {
  void* const done = NewDoneEvent();
  ASSERT_NE(done, nullptr);
  std::mt19937 rng(7);
  uint64_t step = 1;
  for (Phase phase : {Phase::kDecode, Phase::kPrefill}) {
    const testing::RandomRankInput input = testing::RandomTwoRouteInput(rng, 5, kD, kExperts, /*drop_some=*/true);
    auto host = executor_->Execute(input.Step(step++, 0, phase));  // rows on the host: waited for
    ASSERT_TRUE(host.ok()) << host.status();
    EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), 0);

    std::vector<uint16_t> out;
    auto answered = DeviceStep(input, step++, phase, &out, done);
    ASSERT_TRUE(answered.ok()) << answered.status();
    EXPECT_EQ(out, std::vector<uint16_t>(host->output.begin(), host->output.end()))
        << "the answered step's rows, phase " << static_cast<int>(phase);
    EXPECT_EQ(static_cast<HeldEventKernels::Event*>(done)->records, phase == Phase::kDecode ? 1 : 2);
    EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), 1) << "the work still runs: its lease is held";
    EXPECT_EQ(executor_->ReleaseFinishedWork(), 1);
    EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), 1);
    held_->Fire(done);
    EXPECT_EQ(executor_->ReleaseFinishedWork(), 0);
    EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), 0);
  }
  // Rows on the device without a done event: the step waits for its work, holding nothing after.
  const testing::RandomRankInput input = testing::RandomTwoRouteInput(rng, 3, kD, kExperts, /*drop_some=*/false);
  std::vector<uint16_t> out;
  ASSERT_TRUE(DeviceStep(input, step++, Phase::kDecode, &out, nullptr).ok());
  EXPECT_EQ(executor_->ReleaseFinishedWork(), 0);
  EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), 0);
}

TEST_F(AnsweredWorkTest, ARetirementWaitsForTheWorkAndIsRefusedWhileItRuns) {
  void* done = NewDoneEvent();
  const testing::RandomRankInput input = Input(8, 4);
  std::vector<uint16_t> out;
  ASSERT_TRUE(DeviceStep(input, 1, Phase::kDecode, &out, done).ok());
  ActivateV2();
  // The work never finishes: the wait gives up at the timeout, the lease stays, v1 stays.
  absl::Status waited = executor_->AwaitAnsweredWork();
  EXPECT_EQ(waited.code(), absl::StatusCode::kDeadlineExceeded) << waited;
  EXPECT_NE(waited.message().find("1 answered steps"), absl::string_view::npos) << waited;
  absl::Status retired = registry_.Retire(PlacementVersion(1));
  EXPECT_EQ(retired.code(), absl::StatusCode::kFailedPrecondition) << retired;
  // Steps go on meanwhile, on v2 (each releases what has finished first: nothing has).
  void* later = NewDoneEvent();
  ASSERT_TRUE(DeviceStep(input, 2, Phase::kDecode, &out, later).ok());
  EXPECT_EQ(executor_->ReleaseFinishedWork(), 2);
  EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), 1);
  EXPECT_EQ(registry_.Refcount(PlacementVersion(2)), 1);
  // Once v1's work finishes, the wait for v1 returns (v2's step still runs) and v1 retires.
  std::thread gpu([&] {
    absl::SleepFor(absl::Milliseconds(20));
    held_->Fire(done);
  });
  const absl::Status v1_waited = executor_->AwaitAnsweredGeneration(PlacementVersion(1));
  gpu.join();
  EXPECT_TRUE(v1_waited.ok()) << v1_waited;
  EXPECT_TRUE(registry_.Retire(PlacementVersion(1)).ok());
  executor_->DropGeneration(PlacementVersion(1));
  EXPECT_EQ(registry_.Refcount(PlacementVersion(2)), 1);
  EXPECT_EQ(executor_->AwaitAnsweredGeneration(PlacementVersion(2)).code(), absl::StatusCode::kDeadlineExceeded);
  held_->Fire(later);
  EXPECT_TRUE(executor_->AwaitAnsweredWork().ok());
  EXPECT_EQ(registry_.Refcount(PlacementVersion(2)), 0);
}

TEST_F(AnsweredWorkTest, AStepIdStillHeldWaitsForItsWork) {
  void* done = NewDoneEvent();
  const testing::RandomRankInput input = Input(9, 2);
  std::vector<uint16_t> out;
  ASSERT_TRUE(DeviceStep(input, 5, Phase::kDecode, &out, done).ok());
  // The same id again while its first use still holds the lease under it: refused at the timeout
  // (not ALREADY_EXISTS from the registry), then served once the work has finished.
  auto again = DeviceStep(input, 5, Phase::kDecode, &out, done);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kDeadlineExceeded) << again.status();
  held_->Fire(done);
  held_->hold_work_ = false;
  auto served = DeviceStep(input, 5, Phase::kDecode, &out, done);
  EXPECT_TRUE(served.ok()) << served.status();
  EXPECT_EQ(executor_->ReleaseFinishedWork(), 0);
  EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), 0);
}

TEST_F(AnsweredWorkTest, ClosingAnEventWaitsForItsWorkAndReturnsItsLeasesAtTheTimeout) {
  void* done = NewDoneEvent();
  void* other = NewDoneEvent();
  const testing::RandomRankInput input = Input(10, 2);
  std::vector<uint16_t> out;
  ASSERT_TRUE(DeviceStep(input, 1, Phase::kDecode, &out, done).ok());
  ASSERT_TRUE(DeviceStep(input, 2, Phase::kDecode, &out, other).ok());
  EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), 2);
  absl::Status closed = executor_->AwaitDoneEvent(done);
  EXPECT_EQ(closed.code(), absl::StatusCode::kDeadlineExceeded) << closed;
  EXPECT_NE(closed.message().find("returned"), absl::string_view::npos) << closed;
  EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), 1) << "the other event's step still holds its lease";
  EXPECT_EQ(executor_->ReleaseFinishedWork(), 1);
  held_->Fire(other);
  EXPECT_TRUE(executor_->AwaitDoneEvent(other).ok());
  EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), 0);
  // Closing an event waits the same way, then destroys it: its step's lease does not outlive it.
  void* third = NewDoneEvent();
  ASSERT_TRUE(DeviceStep(input, 3, Phase::kDecode, &out, third).ok());
  EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), 1);
  const absl::Time start = absl::Now();
  executor_->CloseReadyEvent(third);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(200)) << "closed before the timeout with its work running";
  EXPECT_EQ(held_->closed_, 1);
  EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), 0);
  EXPECT_EQ(executor_->ReleaseFinishedWork(), 0);
}

// A ring's done events are waited for together: one wait, one timeout, for the steps of all of
// them (one after the other, each event's wait could last the timeout). At the timeout the
// leases of the work still running stay held (the ring then keeps its events and mapping).
TEST_F(AnsweredWorkTest, SeveralEventsAreAwaitedInOneWait) {
  std::vector<void*> ring = {NewDoneEvent(), NewDoneEvent(), NewDoneEvent()};
  void* outside = NewDoneEvent();
  const testing::RandomRankInput input = Input(12, 2);
  std::vector<uint16_t> out;
  uint64_t step = 1;
  for (void* e : ring) ASSERT_TRUE(DeviceStep(input, step++, Phase::kDecode, &out, e).ok());
  ASSERT_TRUE(DeviceStep(input, step++, Phase::kDecode, &out, outside).ok());
  EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), 4);
  // Two of the ring's steps finish while it waits; the third never does.
  std::thread gpu([&] {
    absl::SleepFor(absl::Milliseconds(20));
    held_->Fire(ring[0]);
    held_->Fire(ring[2]);
  });
  const absl::Status waited = executor_->AwaitDoneEvents(ring);
  gpu.join();
  EXPECT_EQ(waited.code(), absl::StatusCode::kDeadlineExceeded) << waited;
  EXPECT_NE(waited.message().find("1 answered steps"), absl::string_view::npos) << waited;
  EXPECT_NE(waited.message().find("stay held"), absl::string_view::npos) << waited;
  EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), 2) << "the finished steps' leases went back, not the others";
  EXPECT_EQ(executor_->ReleaseFinishedWork(), 2);
  held_->Fire(ring[1]);
  EXPECT_TRUE(executor_->AwaitDoneEvents(ring).ok());
  EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), 1) << "the step outside the ring still runs";
  held_->Fire(outside);
  EXPECT_EQ(executor_->ReleaseFinishedWork(), 0);
}

// An engine that never lets its GPU work finish cannot pile up leases: the step past
// kMaxAnswered held waits for the oldest work, up to the timeout, and each such wait is counted
// (the rank's moe_answered_cap_waits_total) with its outcome.
TEST_F(AnsweredWorkTest, StepsPastTheCapWaitForTheOldestWorkAndAreCounted) {
  void* early = NewDoneEvent();
  void* late = NewDoneEvent();
  const testing::RandomRankInput input = Input(15, 1);
  std::vector<uint16_t> out;
  uint64_t step = 1;
  for (int i = 0; i < LayerExecutor::kMaxAnswered; ++i) {
    ASSERT_TRUE(DeviceStep(input, step++, Phase::kDecode, &out, early).ok());
  }
  LayerExecutor::AnsweredStats stats = executor_->AnsweredWorkStats();
  EXPECT_EQ(stats.held, LayerExecutor::kMaxAnswered);
  EXPECT_EQ(stats.cap_waits, 0);
  // One more: the step waits the timeout for work that never finishes, and answers with every
  // lease still held.
  absl::Time start = absl::Now();
  ASSERT_TRUE(DeviceStep(input, step++, Phase::kDecode, &out, early).ok());
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(200));
  stats = executor_->AnsweredWorkStats();
  EXPECT_EQ(stats.held, LayerExecutor::kMaxAnswered + 1);
  EXPECT_EQ(stats.cap_waits, 1);
  EXPECT_EQ(stats.cap_timeouts, 1);
  EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), LayerExecutor::kMaxAnswered + 1);
  // The next one's wait ends when the older work finishes.
  std::thread gpu([&] {
    absl::SleepFor(absl::Milliseconds(20));
    held_->Fire(early);
  });
  start = absl::Now();
  ASSERT_TRUE(DeviceStep(input, step++, Phase::kDecode, &out, late).ok());
  gpu.join();
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(200));
  stats = executor_->AnsweredWorkStats();
  EXPECT_EQ(stats.held, 1) << "the late step's work still runs";
  EXPECT_EQ(stats.cap_waits, 2);
  EXPECT_EQ(stats.cap_timeouts, 1);
  EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), 1);
  held_->Fire(late);
  EXPECT_EQ(executor_->ReleaseFinishedWork(), 0);
}

// A re-formed group's Bind waits for every answered step's work first (Rebind needs their leases
// returned) and says so when that work does not finish.
TEST_F(AnsweredWorkTest, BindWaitsForTheAnsweredWork) {
  void* done = NewDoneEvent();
  const testing::RandomRankInput input = Input(13, 3);
  std::vector<uint16_t> out;
  ASSERT_TRUE(DeviceStep(input, 1, Phase::kDecode, &out, done).ok());
  executor_->Unbind("test: re-forming as epoch 2");
  auto group = ProcessGroup::Create(group_.id(), ProcessGroupEpoch(2), {Rank(0)});
  ASSERT_TRUE(group.ok()) << group.status();
  const absl::Status refused = executor_->Bind(transport_.get(), topology_, *group, nullptr);
  EXPECT_EQ(refused.code(), absl::StatusCode::kDeadlineExceeded) << refused;
  EXPECT_NE(refused.message().find("executor: Bind: 1 answered steps"), absl::string_view::npos) << refused;
  EXPECT_FALSE(executor_->Membership().has_value());
  EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), 1);
  std::thread gpu([&] {
    absl::SleepFor(absl::Milliseconds(20));
    held_->Fire(done);
  });
  const absl::Status bound = executor_->Bind(transport_.get(), topology_, *group, nullptr);
  gpu.join();
  ASSERT_TRUE(bound.ok()) << bound;
  EXPECT_EQ(executor_->Membership()->second.epoch().value(), 2);
  EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), 0);
  held_->hold_work_ = false;
  EXPECT_TRUE(DeviceStep(input, 2, Phase::kDecode, &out, done).ok());
}

// A step the release's shadow samples, with rows and routing in the engine's device memory, is
// served from private copies of both, taken as the step begins: the engine rewriting them during
// the step (here in the served pass's input check, before its rows are read) changes neither
// pass, so no mismatch can be forced, and the served rows reach the engine's memory, with the
// done event recorded after them, once compared.
TEST_F(AnsweredWorkTest, AShadowedDeviceStepReadsOneCopyOfItsRowsAndRouting) {
  ASSERT_NO_FATAL_FAILURE(PrepareGeneration(2, /*redundant=*/0));
  executor_->SetTrial(2, 1, 0);  // every step a shadow
  held_->hold_work_ = false;
  void* done = NewDoneEvent();
  const testing::RandomRankInput input = Input(14, 4);
  auto host = executor_->Execute(input.Step(1, 0, Phase::kPrefill));
  ASSERT_TRUE(host.ok()) << host.status();
  std::vector<uint16_t> rows = input.hidden, out(input.hidden.size(), 0);
  std::vector<int32_t> ids = input.ids;
  std::vector<float> gates = input.gates;
  LayerStepInput in = input.Step(2, 0, Phase::kPrefill);
  in.hidden = rows.data();
  in.topk_ids = ids.data();
  in.topk_weights = gates.data();
  in.rows_on_device = in.routing_on_device = true;
  in.output = out.data();
  in.done_event = done;
  int checks = 0;
  in.await_input_check = [&] {
    if (++checks == 1) {  // the served pass's check: the engine rewrites its rows and routing
      for (uint16_t& v : rows) v ^= 0x8000;
      for (int32_t& e : ids) e = (e + 1) % kExperts;
    }
    return absl::OkStatus();
  };
  const int records = static_cast<HeldEventKernels::Event*>(done)->records;
  auto served = executor_->Execute(in);
  ASSERT_TRUE(served.ok()) << served.status();
  EXPECT_EQ(checks, 2);
  const GenerationCounters c = executor_->Counters()[2];
  EXPECT_EQ(c.shadow_samples, 2);
  EXPECT_EQ(c.shadow_failures, 0);
  EXPECT_EQ(c.shadow_mismatches, 0) << "the shadow read the rewritten rows or routing";
  EXPECT_EQ(out, std::vector<uint16_t>(host->output.begin(), host->output.end())) << "the served rows";
  EXPECT_EQ(static_cast<HeldEventKernels::Event*>(done)->records, records + 1) << "the done event, after the rows";
  EXPECT_EQ(executor_->ReleaseFinishedWork(), 0);
  EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), 0);
}

// The leases' bookkeeping allocates nothing a step: returning the finished ones and the check for
// the step's own id (each step does both as it acquires its generation), with work both finished
// and running.
TEST_F(AnsweredWorkTest, ReturningFinishedLeasesAllocatesNothing) {
  void* first = NewDoneEvent();
  void* second = NewDoneEvent();
  const testing::RandomRankInput input = Input(11, 2);
  std::vector<uint16_t> out;
  ASSERT_TRUE(DeviceStep(input, 1, Phase::kDecode, &out, first).ok());
  ASSERT_TRUE(DeviceStep(input, 2, Phase::kDecode, &out, second).ok());
  held_->Fire(first);
  const int64_t before = bench::ThreadAllocations();
  const int held = executor_->ReleaseFinishedWork();
  const absl::Status other_id = executor_->AwaitAnsweredStep(HandleId(3));
  EXPECT_EQ(bench::ThreadAllocations() - before, 0);
  EXPECT_EQ(held, 1);
  EXPECT_TRUE(other_id.ok()) << other_id;
  EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), 1);
  held_->Fire(second);
}

}  // namespace
}  // namespace moe
