#include <atomic>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
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

// A member that abandons a step (bound to an epoch it has not opened) makes the members in that
// step's agreement abort at once instead of waiting out their timeout; its LEFT pairs with
// nothing later: the next step agrees on every member.
TEST(LoopbackTransportTest, AnAbandonedStepAbortsItsAgreementAtOnceAndNothingLater) {
  std::atomic<int> answered{0};
  auto results = RunMembers(3, [&answered](Transport& t) -> absl::Status {
    const uint64_t word = 0x11;
    std::vector<uint64_t> all(t.size());
    if (t.slot() == 2) {
      t.AbandonStep(41);
    } else {
      const absl::Time start = absl::Now();
      absl::Status s = t.StepGather(41, &word, 8, all.data(), absl::Seconds(20));
      if (s.code() != absl::StatusCode::kAborted || s.message().find("gave up step_id 41") == std::string::npos) {
        return absl::InternalError(absl::StrCat("step 41: ", s.ToString()));
      }
      if (absl::Now() - start > absl::Seconds(5))
        return absl::InternalError("step 41 waited for the abandoning member");
    }
    ++answered;  // the engine sends the next step once every rank answered this one
    while (answered.load() < t.size()) absl::SleepFor(absl::Milliseconds(1));
    return t.StepGather(42, &word, 8, all.data(), absl::Seconds(20));
  });
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(results[i].ok()) << "slot " << i << ": " << results[i];
}

// A peer's agreement record is checked before it is read: metadata claimed inline beyond what
// the record holds, counts past what any member can send (2^24 tokens x top-64), and a count row
// that does not sum to the slot counts (count conservation, with the payload the executor counts
// by) abort the step naming the peer instead of reading past the record or sizing buffers by
// them. Slot 1 posts a crafted record whose identity words match slot 0's.
TEST(LoopbackTransportTest, ACorruptPeerRecordAbortsTheStepNamingThePeer) {
  struct Case {
    int64_t count_to_0, meta_entries, slot_count;
    const char* expect;
  };
  const int64_t kSlots = 4;
  for (const Case& c :
       {Case{5000, 5000, 5000, "claims 5000 metadata entries inline"},
        Case{int64_t{1} << 40, -1, 0, "reports more than"}, Case{3, -1, int64_t{-5}, "reports slot count -5"},
        Case{3, -1, int64_t{1} << 62, "reports slot count"},
        Case{3, -1, 2, "sends 3 routes but counts 2 by physical slot (count conservation"}}) {
    auto results = RunMembers(2, [&](Transport& t) -> absl::Status {
      const StepHeader h{900, 7, 17, 12};
      if (t.slot() == 1) {
        const int64_t words = kAgreementRecordWords;
        std::vector<int64_t> record(words, 0), all(words * 2);
        record[0] = static_cast<int64_t>(h.step_id);
        record[1] = h.layer;
        record[2] = h.placement_version;
        record[3] = h.process_group_epoch;
        record[6] = kSlots;           // slot_count_length
        record[7] = -1;               // no shadow proposal
        record[10] = c.meta_entries;  // metadata entries inline (-1: none)
        record[12] = c.count_to_0;    // counts: to slot 0, to slot 1
        record[14] = c.slot_count;    // physical slot 0's count (inline after the counts)
        (void)t.StepGather(h.step_id, record.data(), words * 8, all.data(), absl::Seconds(20));
        return absl::OkStatus();
      }
      const std::vector<int64_t> send = {0, 0}, slots(kSlots, 0);
      const std::vector<int32_t> meta;
      auto a = AgreeOnStep(t, h, send, absl::Seconds(20), slots, &meta);
      if (a.ok()) return absl::InternalError("agreed on a corrupt record");
      if (a.status().code() != absl::StatusCode::kAborted ||
          a.status().message().find("peer slot 1") == std::string::npos ||
          a.status().message().find(c.expect) == std::string::npos) {
        return absl::InternalError(
            absl::StrCat("expected ABORTED naming peer slot 1 and '", c.expect, "': ", a.status().ToString()));
      }
      const bool conservation = std::string(c.expect).find("count conservation") != std::string::npos;
      if (IsCountConservationFailure(a.status()) != conservation) {
        return absl::InternalError(
            absl::StrCat("count-conservation payload ", conservation ? "missing" : "set", ": ", a.status().ToString()));
      }
      return absl::OkStatus();
    });
    for (int i = 0; i < 2; ++i) EXPECT_TRUE(results[i].ok()) << c.expect << ": slot " << i << ": " << results[i];
  }
}

}  // namespace
}  // namespace moe
