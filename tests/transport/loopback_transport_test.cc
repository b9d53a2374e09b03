#include <thread>
#include <vector>

#include "gtest/gtest.h"

#include "tests/transport/exchange_scenarios.h"

namespace moe {
namespace {

template <typename F>
std::vector<absl::Status> RunMembers(int p, F scenario) {
  LoopbackFabric fabric(p);
  std::vector<absl::Status> results(p);
  std::vector<std::thread> threads;
  for (int i = 0; i < p; ++i) {
    threads.emplace_back([&, i] {
      auto t = fabric.Endpoint(i);
      results[i] = scenario(*t);
    });
  }
  for (auto& th : threads) th.join();
  return results;
}

TEST(LoopbackTransportTest, RandomExchangeWithZeroPeers) {
  for (int p : {1, 2, 4, 7}) {
    auto results = RunMembers(p, [](Transport& t) { return testing::RandomExchange(t, 3, 11); });
    for (int i = 0; i < p; ++i) EXPECT_TRUE(results[i].ok()) << "p=" << p << " slot " << i << ": " << results[i];
  }
}

TEST(LoopbackTransportTest, HeaderMismatchAbortsEveryMember) {
  auto results = RunMembers(4, [](Transport& t) { return testing::HeaderMismatchAbortsEveryone(t, 2); });
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(results[i].ok()) << "slot " << i << ": " << results[i];
}

TEST(LoopbackTransportTest, GenerationSplitAbortsEveryMember) {
  auto results = RunMembers(4, [](Transport& t) { return testing::GenerationSplitAbortsEveryone(t, 1); });
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(results[i].ok()) << "slot " << i << ": " << results[i];
}

TEST(LoopbackTransportTest, GraphKeyAndShadowProposalsNeverAbort) {
  auto results = RunMembers(4, [](Transport& t) { return testing::ProposalsAgreeOrNot(t, 3); });
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(results[i].ok()) << "slot " << i << ": " << results[i];
}

TEST(LoopbackTransportTest, MetadataRidesWithTheAgreement) {
  for (int p : {1, 2, 4}) {
    auto results = RunMembers(p, [](Transport& t) { return testing::MetadataRidesWithTheAgreement(t); });
    for (int i = 0; i < p; ++i) EXPECT_TRUE(results[i].ok()) << "p=" << p << " slot " << i << ": " << results[i];
  }
}

TEST(LoopbackTransportTest, SilentPeerTimesOut) {
  auto results = RunMembers(4, [](Transport& t) -> absl::Status {
    if (t.slot() == 3) return absl::OkStatus();  // never takes part
    return testing::SilentPeerTimesOut(t, absl::Milliseconds(300));
  });
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(results[i].ok()) << "slot " << i << ": " << results[i];
}

}  // namespace
}  // namespace moe
