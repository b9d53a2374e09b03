// The controller's reconcile loop: a kick returns while a reconcile is blocked (the coordinator's
// tick thread never waits for the release manager's writer lock), kicks during a run fold into
// one more run, the interval runs it unkicked, and the destructor waits for the run in progress.
#include "control/controller/reconciler.h"

#include <atomic>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

// Polls `pred` for up to 10 s (the reconciler runs on its own thread).
template <typename Pred>
bool Eventually(Pred pred) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    if (pred()) return true;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return pred();
}

TEST(ReconcilerTest, AKickReturnsWhileAReconcileIsBlockedAndKicksDuringItFoldIntoOneMoreRun) {
  absl::Notification entered, release;
  std::atomic<int> calls{0};
  Reconciler r(
      [&] {
        if (calls.fetch_add(1) == 0) {
          entered.Notify();
          release.WaitForNotification();  // a LoadPlacement holding the writer lock
        }
        return absl::OkStatus();
      },
      absl::ZeroDuration());
  // The first kick from a thread of its own, so that a Kick running the reconcile inline fails
  // the test (it would block there on `release`) instead of hanging it.
  absl::Notification kicked;
  std::thread kicker([&] {
    r.Kick();
    kicked.Notify();
  });
  const bool returned = kicked.WaitForNotificationWithTimeout(absl::Seconds(5));
  if (!returned) release.Notify();
  kicker.join();
  ASSERT_TRUE(returned) << "Kick ran the reconcile on the caller's thread";
  ASSERT_TRUE(entered.WaitForNotificationWithTimeout(absl::Seconds(10)));
  // The first run is blocked: each kick returns at once.
  const absl::Time t0 = absl::Now();
  for (int i = 0; i < 5; ++i) r.Kick();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(1));
  EXPECT_EQ(calls.load(), 1);
  EXPECT_EQ(r.runs(), 0);
  release.Notify();
  ASSERT_TRUE(Eventually([&] { return r.runs() == 2; }));
  // Five kicks during the first run gave one run after it, no more.
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(calls.load(), 2);
  EXPECT_EQ(r.runs(), 2);
}

TEST(ReconcilerTest, WithoutAnIntervalItRunsOnlyWhenKicked) {
  std::atomic<int> calls{0};
  Reconciler r(
      [&] {
        ++calls;
        return absl::UnavailableError("rank 1: connection refused");  // a failure does not stop the loop
      },
      absl::ZeroDuration());
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(calls.load(), 0);
  r.Kick();
  ASSERT_TRUE(Eventually([&] { return r.runs() == 1; }));
  r.Kick();
  ASSERT_TRUE(Eventually([&] { return r.runs() == 2; }));
  EXPECT_EQ(calls.load(), 2);
}

TEST(ReconcilerTest, TheIntervalRunsItUnkicked) {
  std::atomic<int> calls{0};
  Reconciler r(
      [&] {
        ++calls;
        return absl::OkStatus();
      },
      absl::Milliseconds(10));
  ASSERT_TRUE(Eventually([&] { return r.runs() >= 3; }));
  EXPECT_GE(calls.load(), 3);
}

TEST(ReconcilerTest, TheDestructorWaitsForTheRunInProgress) {
  absl::Notification entered;
  std::atomic<bool> finished{false};
  {
    Reconciler r(
        [&] {
          entered.Notify();
          absl::SleepFor(absl::Milliseconds(200));
          finished = true;
          return absl::OkStatus();
        },
        absl::ZeroDuration());
    r.Kick();
    ASSERT_TRUE(entered.WaitForNotificationWithTimeout(absl::Seconds(10)));
  }
  EXPECT_TRUE(finished.load());
}

}  // namespace
}  // namespace moe
