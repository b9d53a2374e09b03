// UCX across real processes: each member is a forked child with its own UCX context, listener
// and endpoints on the loopback interface, rendezvous through files in a temp directory.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include <sys/wait.h>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

#include "tests/transport/exchange_scenarios.h"
#include "tests/transport/process_harness.h"

namespace moe {
namespace {

// Exit codes of a member.
constexpr int kOk = 0, kScenarioFailed = 1, kSetupFailed = 2;

int RunMember(const std::string& dir, int slot, int size, const std::function<absl::Status(Transport&)>& scenario) {
  auto transport = testing::UcxMemberTransport(dir, slot, size);
  if (!transport.ok()) {
    std::fprintf(stderr, "slot %d: %s\n", slot, std::string(transport.status().message()).c_str());
    return kSetupFailed;
  }
  absl::Status s = scenario(**transport);
  if (!s.ok()) std::fprintf(stderr, "slot %d: %s\n", slot, std::string(s.message()).c_str());
  return s.ok() ? kOk : kScenarioFailed;
}

std::vector<int> RunProcesses(int size, const std::function<absl::Status(Transport&)>& scenario) {
  return testing::ForkMembers(size, "ucx",
                              [&](int slot, const std::string& dir) { return RunMember(dir, slot, size, scenario); });
}

TEST(UcxTransportTest, FourProcessesExchangeRandomSplits) {
  const auto codes = RunProcesses(4, [](Transport& t) { return testing::RandomExchange(t, 4, 5); });
  for (int i = 0; i < 4; ++i) EXPECT_EQ(codes[i], kOk) << "slot " << i;
}

TEST(UcxTransportTest, HeaderMismatchAbortsAllRanksCleanly) {
  const auto codes = RunProcesses(4, [](Transport& t) { return testing::HeaderMismatchAbortsEveryone(t, 2); });
  for (int i = 0; i < 4; ++i) EXPECT_EQ(codes[i], kOk) << "slot " << i;
}

TEST(UcxTransportTest, GenerationSplitAbortsAllRanksCleanly) {
  const auto codes = RunProcesses(4, [](Transport& t) { return testing::GenerationSplitAbortsEveryone(t, 1); });
  for (int i = 0; i < 4; ++i) EXPECT_EQ(codes[i], kOk) << "slot " << i;
}

TEST(UcxTransportTest, MetadataRidesWithTheAgreement) {
  const auto codes = RunProcesses(4, [](Transport& t) { return testing::MetadataRidesWithTheAgreement(t); });
  for (int i = 0; i < 4; ++i) EXPECT_EQ(codes[i], kOk) << "slot " << i;
}

// A member that is alive but never takes part in a payload exchange of rendezvous-sized
// messages (64 KiB a peer): the others must fail within the timeout, not in the library's cancel
// of a send nobody fetches, and their next step with it fails at once (the peer is marked
// failed).
// A message shorter than the split its receiver agreed on (UCX completes a short receive without
// an error, leaving the rest of the segment as it was) is DATA_LOSS naming the peer, not a
// segment with a stale tail. Slot 0 sends slot 1 8 bytes where slot 1 expects 16.
TEST(UcxTransportTest, AShortMessageIsDataLossNamingThePeer) {
  const auto codes = RunProcesses(2, [](Transport& t) -> absl::Status {
    const int me = t.slot();
    const std::vector<int64_t> send_bytes = me == 0 ? std::vector<int64_t>{4, 8} : std::vector<int64_t>{16, 4};
    const std::vector<int64_t> recv_bytes = me == 0 ? std::vector<int64_t>{4, 16} : std::vector<int64_t>{16, 4};
    std::vector<char> send(32, static_cast<char>(0x10 + me)), recv(32, static_cast<char>(0xAA));
    const absl::Status s = t.AllToAllV(5, send.data(), send_bytes, recv.data(), recv_bytes, absl::Seconds(10));
    if (me == 0) return s;  // it got the 16 bytes it agreed on
    if (s.code() != absl::StatusCode::kDataLoss || s.message().find("peer slot 0 sent 8 bytes") == std::string::npos) {
      return absl::InternalError(absl::StrCat("expected DATA_LOSS naming peer slot 0: ", s.ToString()));
    }
    return absl::OkStatus();
  });
  for (int i = 0; i < 2; ++i) EXPECT_EQ(codes[i], kOk) << "slot " << i;
}

TEST(UcxTransportTest, SilentLivePeerTimesOutAndIsMarkedFailed) {
  const auto codes = RunProcesses(4, [](Transport& t) -> absl::Status {
    if (t.slot() == 3) {
      absl::SleepFor(absl::Seconds(3));  // alive, silent
      return absl::OkStatus();
    }
    const absl::Duration timeout = absl::Milliseconds(500);
    const std::vector<int64_t> split(t.size(), 64 << 10);
    std::vector<char> out(split[0] * t.size(), 1), in(out.size());
    absl::Time start = absl::Now();
    absl::Status s = t.AllToAllV(900, out.data(), split, in.data(), split, timeout);
    s = testing::DeadPeerFailure(s, absl::Now() - start, timeout);
    if (!s.ok()) return s;
    start = absl::Now();
    std::vector<int64_t> send(t.size(), 1);
    auto next = AgreeOnStep(t, StepHeader{901, 7, 17, 12}, send, timeout);
    return testing::DeadPeerFailure(next.status(), absl::Now() - start, timeout);
  });
  for (int i = 0; i < 4; ++i) EXPECT_EQ(codes[i], kOk) << "slot " << i;
}

TEST(UcxTransportTest, KilledPeerTurnsIntoErrorsWithinTheTimeout) {
  const auto codes = RunProcesses(
      4, [](Transport& t) { return testing::KilledPeerFailsFast(t, 3, absl::Seconds(2), [] { raise(SIGKILL); }); });
  for (int i = 0; i < 3; ++i) EXPECT_EQ(codes[i], kOk) << "slot " << i;
  EXPECT_EQ(codes[3], -SIGKILL);
}

}  // namespace
}  // namespace moe
