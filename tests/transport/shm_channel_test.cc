// The shared-memory agreement channel under the step_gather.h protocol, between real processes
// (forked members): records of every size gathered over many steps (the rings wrap), members in
// different steps abort at once, a member that does not join leaves the others a deadline, and
// segments that do not fit are refused.
#include "runtime/transport/shm_channel.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <sys/mman.h>
#include <sys/stat.h>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

#include "runtime/transport/step_gather.h"
#include "tests/transport/process_harness.h"

namespace moe {
namespace {

// Unique across concurrent runs (sandboxes may share /dev/shm and give every run the same pid).
std::string SegmentName(const char* what) {
  return absl::StrCat("/moe-agree-test-", what, "-", getpid(), "-", std::random_device()());
}

// Member `me` of `size` on segment `name` (member 0 creates it).
std::unique_ptr<ShmStepChannel> Member(const std::string& name, int me, int size) {
  auto c = me == 0 ? ShmStepChannel::Create(name, size) : ShmStepChannel::Open(name, me, size, absl::Seconds(10));
  return c.ok() ? std::move(*c) : nullptr;
}

// The payload member `m` sends at step `s`: its size varies with the step, its bytes name both.
std::vector<char> Record(int m, uint64_t s, int64_t bytes) {
  std::vector<char> r(bytes);
  for (int64_t i = 0; i < bytes; ++i) r[i] = static_cast<char>(m * 31 + s * 7 + i);
  return r;
}

TEST(ShmStepChannelTest, ThreeProcessesGatherEveryStepAcrossRingWraps) {
  const std::string name = SegmentName("gather");
  constexpr int kSize = 3;
  const std::vector<int> codes = testing::ForkMembers(kSize, "shm-gather", [&](int me, const std::string&) {
    auto ch = Member(name, me, kSize);
    if (ch == nullptr) return 10;
    StepGatherBacklog backlog;
    backlog.from.resize(kSize);
    for (uint64_t step = 1; step <= 300; ++step) {
      const int64_t bytes = 8 + static_cast<int64_t>(step * 977 % 7000);  // up to ~7 KiB: 300 steps wrap 256 KiB
      const std::vector<char> mine = Record(me, step, bytes);
      std::vector<char> all(bytes * kSize);
      const absl::Status s =
          RunStepGather(*ch, backlog, me, kSize, step, mine.data(), bytes, all.data(), absl::Seconds(20));
      if (!s.ok()) {
        std::fprintf(stderr, "member %d step %llu: %s\n", me, static_cast<unsigned long long>(step),
                     s.ToString().c_str());
        return 11;
      }
      for (int m = 0; m < kSize; ++m) {
        if (std::memcmp(all.data() + m * bytes, Record(m, step, bytes).data(), bytes) != 0) return 12;
      }
    }
    return 0;
  });
  ShmStepChannel::Unlink(name);
  EXPECT_EQ(codes, std::vector<int>(kSize, 0));
}

TEST(ShmStepChannelTest, MembersInDifferentStepsAbortAtOnceAndTheNextStepIsGathered) {
  const std::string name = SegmentName("mismatch");
  constexpr int kSize = 3;
  const std::vector<int> codes = testing::ForkMembers(kSize, "shm-mismatch", [&](int me, const std::string&) {
    auto ch = Member(name, me, kSize);
    if (ch == nullptr) return 10;
    StepGatherBacklog backlog;
    backlog.from.resize(kSize);
    const uint64_t step = me == 2 ? 41 : 40;  // member 2 is in another step
    const int64_t bytes = 64;
    std::vector<char> mine = Record(me, step, bytes), all(bytes * kSize);
    const absl::Time start = absl::Now();
    const absl::Status s =
        RunStepGather(*ch, backlog, me, kSize, step, mine.data(), bytes, all.data(), absl::Seconds(20));
    if (s.code() != absl::StatusCode::kAborted) return 11;
    if (absl::Now() - start > absl::Seconds(5)) return 12;  // not a timeout
    if (std::string(s.message()).find("step_id") == std::string::npos) return 13;
    // The engines retry an aborted step after a back-off (10 ms and up); a member that retried at
    // once could still meet a slower peer's record of the aborted step before its LEFT.
    absl::SleepFor(absl::Milliseconds(50));
    mine = Record(me, 42, bytes);
    const absl::Status next =
        RunStepGather(*ch, backlog, me, kSize, 42, mine.data(), bytes, all.data(), absl::Seconds(20));
    if (!next.ok()) {
      std::fprintf(stderr, "member %d step 42: %s\n", me, next.ToString().c_str());
      return 14;
    }
    for (int m = 0; m < kSize; ++m) {
      if (std::memcmp(all.data() + m * bytes, Record(m, 42, bytes).data(), bytes) != 0) return 15;
    }
    return 0;
  });
  ShmStepChannel::Unlink(name);
  EXPECT_EQ(codes, std::vector<int>(kSize, 0));
}

TEST(ShmStepChannelTest, AMemberThatDoesNotJoinLeavesTheOthersADeadline) {
  const std::string name = SegmentName("absent");
  constexpr int kSize = 2;
  const std::vector<int> codes = testing::ForkMembers(kSize, "shm-absent", [&](int me, const std::string&) {
    auto ch = Member(name, me, kSize);
    if (ch == nullptr) return 10;
    if (me == 1) return 0;  // opens the channel and leaves
    StepGatherBacklog backlog;
    backlog.from.resize(kSize);
    char mine[16] = {}, all[32];
    const absl::Status s = RunStepGather(*ch, backlog, me, kSize, 7, mine, 16, all, absl::Milliseconds(300));
    return s.code() == absl::StatusCode::kDeadlineExceeded ? 0 : 11;
  });
  ShmStepChannel::Unlink(name);
  EXPECT_EQ(codes, std::vector<int>(kSize, 0));
}

// A length word a peer corrupted (near 2^64, so that the rounded message size wraps to 0) is
// DATA_LOSS naming the peer, not a message read again forever. The segment is written through a
// mapping of its own: a 64-byte header, then size x size rings of {head, tail, data}, each of
// head and tail on its own 64-byte line.
TEST(ShmStepChannelTest, ACorruptLengthFromAPeerIsDataLoss) {
  const std::string name = SegmentName("corrupt");
  auto me = ShmStepChannel::Create(name, 2);
  ASSERT_TRUE(me.ok()) << me.status();
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  struct stat st {};
  ASSERT_EQ(fstat(fd, &st), 0);
  void* base = mmap(nullptr, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  ASSERT_NE(base, MAP_FAILED);
  const size_t ring_bytes = 128 + ShmStepChannel::kRingBytes;
  ASSERT_EQ(static_cast<size_t>(st.st_size), 64 + 4 * ring_bytes) << "the segment's layout changed";
  char* ring_1_to_0 = static_cast<char*>(base) + 64 + (1 * 2 + 0) * ring_bytes;
  const uint64_t body = 0xFFFFFFFFFFFFFFF8ull, head = 64;
  std::memcpy(ring_1_to_0 + 128, &body, 8);  // the message's length word
  std::memcpy(ring_1_to_0, &head, 8);        // published
  StepGatherHeader h;
  char payload[64];
  int64_t got = 0;
  auto polled = (*me)->Poll(1, &h, payload, sizeof(payload), &got);
  EXPECT_EQ(polled.status().code(), absl::StatusCode::kDataLoss) << polled.status();
  EXPECT_NE(std::string(polled.status().message()).find("peer slot 1"), std::string::npos) << polled.status();
  StepGatherBacklog backlog;
  backlog.from.resize(2);
  char mine[16] = {}, all[32];
  const absl::Status s = RunStepGather(**me, backlog, 0, 2, 7, mine, 16, all, absl::Milliseconds(300));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  munmap(base, st.st_size);
  ShmStepChannel::Unlink(name);
}

// A member giving a step up tells its peers at once, without waiting on one whose ring is full
// (it stopped taking its messages): the LEFT is dropped for that peer instead of holding the
// member for the channel's send wait (1 s) per such peer.
TEST(ShmStepChannelTest, GivingAStepUpDoesNotWaitOnAFullRing) {
  const std::string name = SegmentName("full");
  auto me = ShmStepChannel::Create(name, 2);
  ASSERT_TRUE(me.ok()) << me.status();
  auto peer = ShmStepChannel::Open(name, 1, 2, absl::Seconds(5));  // opened, never polled
  ASSERT_TRUE(peer.ok()) << peer.status();
  StepGatherHeader h;
  h.type = StepGatherHeader::kRecord;
  std::vector<char> record(kMaxStepGatherRecordBytes - 64);
  int sent = 0;
  for (; sent < 16; ++sent) {
    h.step = sent;
    if (!(*me)->SendWithoutWaiting(1, h).ok()) break;  // header-only messages until one does not fit
    if (!(*me)->Send(1, h, record.data(), static_cast<int64_t>(record.size())).ok()) break;
  }
  ASSERT_LT(sent, 16) << "the ring never filled";
  while ((*me)->SendWithoutWaiting(1, h).ok()) {
  }
  const absl::Time start = absl::Now();
  AbandonStepGather(**me, 0, 2, 99);
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(500)) << "waited on the full ring";
  EXPECT_EQ((*me)->SendWithoutWaiting(1, h).code(), absl::StatusCode::kUnavailable);
  ShmStepChannel::Unlink(name);
}

TEST(ShmStepChannelTest, SegmentsThatDoNotFitAreRefused) {
  const std::string name = SegmentName("refused");
  auto created = ShmStepChannel::Create(name, 2);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_FALSE(ShmStepChannel::Create(name, 2).ok());                     // the name exists
  auto wrong = ShmStepChannel::Open(name, 1, 3, absl::Milliseconds(50));  // another group size
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition) << wrong.status();
  EXPECT_FALSE(ShmStepChannel::Open(name, 2, 2, absl::Milliseconds(50)).ok());  // no such member
  ShmStepChannel::Unlink(name);
  EXPECT_FALSE(ShmStepChannel::Open(name, 1, 2, absl::Milliseconds(50)).ok());  // gone
  StepGatherHeader h;
  std::vector<char> big(ShmStepChannel::kRingBytes);
  EXPECT_EQ((*created)->Send(1, h, big.data(), static_cast<int64_t>(big.size())).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*created)->Send(0, h, nullptr, 0).code(), absl::StatusCode::kInvalidArgument);  // itself
}

}  // namespace
}  // namespace moe
