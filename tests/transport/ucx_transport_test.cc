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
