// StepRings with device rows, on the host: a host buffer stands in for the engine's GPU
// allocation (the rank side never dereferences it here; the serve callback records what the
// ring hands it). Checks the device slot arithmetic, the device-routing flag, and that the
// mapping's release runs exactly once: when a ring is refused and when it is torn down.
#include "server/step_rings.h"

#include <unistd.h>

#include <atomic>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

#include "server/step_ring_layout.h"

namespace moe {
namespace {

constexpr int64_t kMaxTokens = 6, kD = 16, kK = 3;
constexpr int kSlots = 2;

struct Seen {
  absl::Mutex mu;
  std::vector<RingStep> steps;
};

class DeviceRowsRingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = "/tmp/moe-rings-XXXXXX";  // a short path: Unix socket paths have at most 107 characters
    ASSERT_NE(mkdtemp(dir_.data()), nullptr);
    StepRingsOptions o;
    o.spin_us = 0;
    rings_ = MakeRings(o, "ring.sock", [this](const RingStep& step, ring::Result* result) {
      absl::MutexLock lock(&seen_.mu);
      seen_.steps.push_back(step);
      result->code = step.status.ok() ? 0 : static_cast<int32_t>(step.status.code());
      std::snprintf(result->message, sizeof(result->message), "%s", std::string(step.status.message()).c_str());
    });
    ASSERT_NE(rings_, nullptr);
  }
  // StepRings of `o` on socket `name` in this test's directory (removed with it), serving with
  // `serve` (by default: answering every step 0); null, with a failure, if it cannot start.
  std::unique_ptr<StepRings> MakeRings(
      StepRingsOptions o, const std::string& name, RingServe serve = [](const RingStep&, ring::Result*) {}) {
    o.socket_path = dir_ + "/" + name;
    auto rings = StepRings::Create(std::move(o), std::move(serve));
    EXPECT_TRUE(rings.ok()) << rings.status();
    return rings.ok() ? *std::move(rings) : nullptr;
  }
  void TearDown() override {
    rings_.reset();
    rmdir(dir_.c_str());
  }

  // Claims ring `opened` as this process (the same uid) and maps it.
  char* Claim(const StepRings::Opened& opened, int* conn) {
    *conn = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, rings_->socket_path().c_str(), sizeof(addr.sun_path) - 1);
    if (connect(*conn, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) return nullptr;
    char msg[24];
    std::memcpy(msg, &opened.id, 8);
    std::memcpy(msg + 8, opened.ticket.data(), 16);
    if (send(*conn, msg, sizeof(msg), MSG_NOSIGNAL) != 24) return nullptr;
    char reply = 0;
    int fd = -1;
    if (!ring::ReceiveReply(*conn, &reply, &fd) || reply != 'K' || fd < 0) return nullptr;
    void* base = mmap(nullptr, opened.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    return base == MAP_FAILED ? nullptr : static_cast<char*>(base);
  }

  // Submits step `seq` with `flags` and `tokens`, waits until the ring completed it.
  void Submit(char* base, const ring::Geometry& g, uint32_t seq, uint32_t flags, int64_t tokens) {
    auto* h = reinterpret_cast<ring::Header*>(base);
    char* slot = base + ring::kPage + (seq % kSlots) * g.slot_bytes;
    ring::Descriptor d{};
    d.seq = seq;
    d.flags = flags;
    d.phase = 1;
    d.k = kK;
    d.step_id = 100 + seq;
    d.tokens = tokens;
    std::memcpy(slot, &d, sizeof(d));
    h->submitted.value.store(seq + 1);
    ring::FutexWake(&h->submitted.value);
    const absl::Time until = absl::Now() + absl::Seconds(10);
    while (h->completed.value.load() != seq + 1 && absl::Now() < until) absl::SleepFor(absl::Microseconds(50));
    ASSERT_EQ(h->completed.value.load(), seq + 1);
  }

  std::string dir_;
  Seen seen_;
  std::unique_ptr<StepRings> rings_;
};

TEST_F(DeviceRowsRingTest, DeviceSlotsRoutingFlagAndOneRelease) {
  ring::DeviceGeometry dg;
  ASSERT_TRUE(ring::ComputeDeviceGeometry(kMaxTokens, kD, kK, kSlots, &dg));
  std::vector<char> device(dg.total_bytes + 512);  // stands in for the engine's allocation
  char* rows = device.data() + 256;                // the ring's offset inside it
  std::atomic<int> released{0};
  int marker = 0;
  RingDeviceRows dr;
  dr.rows = rows;
  dr.ready_event = &marker;
  int done[kSlots] = {};  // stand in for the rank's done events, one per slot
  for (int& e : done) dr.done_events.push_back(&e);
  dr.release = [&released] { ++released; };
  auto opened = rings_->Open(getuid(), kSlots, kMaxTokens, kD, kK, std::move(dr));
  ASSERT_TRUE(opened.ok()) << opened.status();
  ring::Geometry g;
  ASSERT_TRUE(ring::ComputeGeometry(kMaxTokens, kD, kK, kSlots, &g, /*device_rows=*/true));
  EXPECT_EQ(opened->bytes, g.total_bytes);  // no rows in the host slots
  EXPECT_EQ(g.hidden_offset, g.ids_offset);

  int conn = -1;
  char* base = Claim(*opened, &conn);
  ASSERT_NE(base, nullptr);
  const auto* header = reinterpret_cast<const ring::Header*>(base);
  EXPECT_EQ(header->flags, ring::kHeaderDeviceRows);
  // Host routing in slot 0, then device routing in slot 1, then slot 0 again.
  const int32_t ids[kMaxTokens * kK] = {1, 2, 3, 4, 5, 6};
  std::memcpy(base + ring::kPage + g.ids_offset, ids, sizeof(ids));
  Submit(base, g, 0, 0, 2);
  Submit(base, g, 1, ring::kFlagDeviceRouting, 4);
  Submit(base, g, 2, ring::kFlagDeviceRouting | ring::kFlagAdmitted, kMaxTokens);
  Submit(base, g, 3, 8, 1);  // an unknown flag: refused, the ring serves on

  std::vector<RingStep> steps;
  {
    absl::MutexLock lock(&seen_.mu);
    steps = seen_.steps;
  }
  ASSERT_EQ(steps.size(), 4u);
  const RingStep& host_routing = steps[0];
  EXPECT_TRUE(host_routing.status.ok()) << host_routing.status;
  EXPECT_TRUE(host_routing.rows_on_device);
  EXPECT_EQ(host_routing.ready_event, &marker);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(steps[i].done_event, &done[i % kSlots]) << "step " << i;
  EXPECT_EQ(reinterpret_cast<const char*>(host_routing.hidden), rows + dg.hidden_offset);
  EXPECT_EQ(reinterpret_cast<const char*>(host_routing.output), rows + dg.output_offset);
  ASSERT_NE(host_routing.topk_ids, nullptr);  // a private copy of the host slot's table
  EXPECT_EQ(host_routing.topk_ids[5], 6);
  EXPECT_EQ(host_routing.device_topk_ids, nullptr);

  const RingStep& device_routing = steps[1];
  EXPECT_TRUE(device_routing.status.ok()) << device_routing.status;
  EXPECT_EQ(reinterpret_cast<const char*>(device_routing.hidden), rows + dg.slot_bytes + dg.hidden_offset);
  EXPECT_EQ(reinterpret_cast<const char*>(device_routing.output), rows + dg.slot_bytes + dg.output_offset);
  EXPECT_EQ(reinterpret_cast<const char*>(device_routing.device_topk_ids), rows + dg.slot_bytes + dg.ids_offset);
  EXPECT_EQ(reinterpret_cast<const char*>(device_routing.device_topk_weights),
            rows + dg.slot_bytes + dg.weights_offset);
  EXPECT_EQ(device_routing.topk_ids, nullptr);

  const RingStep& full = steps[2];  // slot 0 again, every token, the admitted table from the host slot
  EXPECT_TRUE(full.status.ok()) << full.status;
  EXPECT_EQ(reinterpret_cast<const char*>(full.device_topk_ids), rows + dg.ids_offset);
  EXPECT_NE(full.admitted, nullptr);
  // The device slot's last table ends inside the mapping the rank checked.
  EXPECT_LE(dg.weights_offset + static_cast<uint64_t>(full.desc.tokens * kK * 4), dg.slot_bytes);

  EXPECT_FALSE(steps[3].status.ok());
  EXPECT_NE(std::string(steps[3].status.message()).find("descriptor.flags"), std::string::npos);

  EXPECT_EQ(released.load(), 0);
  ASSERT_TRUE(rings_->Close(getuid(), opened->id).ok());
  EXPECT_EQ(released.load(), 1);  // released with the ring, once
  munmap(base, opened->bytes);
  close(conn);
}

// Step n uses slot n mod slots with n a 32-bit counter: only a power of two keeps the slots in
// turn across the wrap (with 3 slots, steps 2^32 - 1 and 2^32 would both use slot 0 while the
// first is still outstanding), so other counts are refused, naming the field.
TEST_F(DeviceRowsRingTest, ASlotCountThatIsNotAPowerOfTwoIsRefused) {
  for (int slots : {3, 5, 6, 7, 9, 12, 15}) {
    const uint32_t last = 0xFFFFFFFFu, next = last + 1;  // the wrap: next is 0
    EXPECT_NE((last % slots + 1) % slots, next % slots) << "the turn survives the wrap at " << slots << " slots";
    auto refused = rings_->Open(getuid(), slots, kMaxTokens, kD, kK);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << slots;
    EXPECT_NE(std::string(refused.status().message()).find("slots: "), std::string::npos) << refused.status();
    EXPECT_NE(std::string(refused.status().message()).find("power of two"), std::string::npos) << refused.status();
  }
  EXPECT_EQ(rings_->size(), 0);
  for (int slots : {1, 2, 4, 8, 16}) {
    auto opened = rings_->Open(getuid(), slots, kMaxTokens, kD, kK);
    ASSERT_TRUE(opened.ok()) << slots << ": " << opened.status();
    ASSERT_TRUE(rings_->Close(getuid(), opened->id).ok());
  }
}

TEST_F(DeviceRowsRingTest, ARefusedRingReleasesTheMappingAndAHostRingRefusesDeviceRouting) {
  std::atomic<int> released{0};
  std::vector<char> device(1 << 16);
  RingDeviceRows dr;
  dr.rows = device.data();
  dr.release = [&released] { ++released; };
  auto refused = rings_->Open(getuid(), /*slots=*/0, kMaxTokens, kD, kK, std::move(dr));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_EQ(released.load(), 1);
  EXPECT_EQ(rings_->size(), 0);
  RingDeviceRows short_of_events;  // done events, but not one per slot
  short_of_events.rows = device.data();
  int one_event = 0;
  short_of_events.done_events = {&one_event};
  short_of_events.release = [&released] { ++released; };
  refused = rings_->Open(getuid(), kSlots, kMaxTokens, kD, kK, std::move(short_of_events));
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(std::string(refused.status().message()).find("done_events"), std::string::npos) << refused.status();
  EXPECT_EQ(released.load(), 2);
  EXPECT_EQ(rings_->size(), 0);

  auto host = rings_->Open(getuid(), kSlots, kMaxTokens, kD, kK);
  ASSERT_TRUE(host.ok()) << host.status();
  ring::Geometry g;
  ASSERT_TRUE(ring::ComputeGeometry(kMaxTokens, kD, kK, kSlots, &g));
  int conn = -1;
  char* base = Claim(*host, &conn);
  ASSERT_NE(base, nullptr);
  EXPECT_EQ(reinterpret_cast<const ring::Header*>(base)->flags, 0u);
  Submit(base, g, 0, ring::kFlagDeviceRouting, 1);
  {
    absl::MutexLock lock(&seen_.mu);
    ASSERT_EQ(seen_.steps.size(), 1u);
    EXPECT_FALSE(seen_.steps[0].status.ok());
    EXPECT_NE(std::string(seen_.steps[0].status.message()).find("device routing on a ring without device rows"),
              std::string::npos);
    EXPECT_FALSE(seen_.steps[0].rows_on_device);
  }
  munmap(base, host->bytes);
  close(conn);
}

// A step's descriptor and host routing are read once into the rank's own memory: an engine that
// rewrites its slot while the step is served (here inside the serve callback, after the rank read
// it) changes nothing the step sees.
TEST_F(DeviceRowsRingTest, TheDescriptorAndRoutingAreReadOnce) {
  rings_.reset();
  std::atomic<char*> engine_view{nullptr};
  ring::Geometry g;
  ASSERT_TRUE(ring::ComputeGeometry(kMaxTokens, kD, kK, kSlots, &g));
  std::vector<int32_t> seen_ids;
  std::vector<float> seen_weights;
  int64_t seen_tokens = -1;
  bool routing_outside_ring = false;
  StepRingsOptions o;
  o.spin_us = 0;
  rings_ = MakeRings(o, "ring.sock", [&](const RingStep& step, ring::Result* result) {
    char* slot = engine_view.load() + ring::kPage + (step.desc.seq % kSlots) * g.slot_bytes;
    // The engine's rewrite: every routing entry and the descriptor's token count.
    std::memset(slot + g.ids_offset, 0x7f, kMaxTokens * kK * 4);
    std::memset(slot + g.weights_offset, 0x7f, kMaxTokens * kK * 4);
    reinterpret_cast<ring::Descriptor*>(slot)->tokens = kMaxTokens * 1000;
    seen_tokens = step.desc.tokens;
    const int64_t routes = step.desc.tokens * step.desc.k;
    seen_ids.assign(step.topk_ids, step.topk_ids + routes);
    seen_weights.assign(step.topk_weights, step.topk_weights + routes);
    const char* ids = reinterpret_cast<const char*>(step.topk_ids);
    routing_outside_ring = ids < engine_view.load() || ids >= engine_view.load() + g.total_bytes;
    result->code = 0;
  });
  ASSERT_NE(rings_, nullptr);
  auto opened = rings_->Open(getuid(), kSlots, kMaxTokens, kD, kK);
  ASSERT_TRUE(opened.ok()) << opened.status();
  int conn = -1;
  char* base = Claim(*opened, &conn);
  ASSERT_NE(base, nullptr);
  engine_view = base;
  char* slot = base + ring::kPage;
  const std::vector<int32_t> ids = {1, 2, 3, 4, 5, 6};
  const std::vector<float> weights = {0.5f, 0.25f, 0.25f, 0.125f, 0.5f, 0.375f};
  std::memcpy(slot + g.ids_offset, ids.data(), ids.size() * 4);
  std::memcpy(slot + g.weights_offset, weights.data(), weights.size() * 4);
  Submit(base, g, 0, 0, 2);
  EXPECT_EQ(seen_tokens, 2);
  EXPECT_EQ(seen_ids, ids);
  EXPECT_EQ(seen_weights, weights);
  EXPECT_TRUE(routing_outside_ring) << "the step reads its routing from the engine's slot";
  munmap(base, opened->bytes);
  close(conn);
}

// The ring limits: all of them (--max_step_rings) and a uid's share (--max_step_rings_per_uid),
// so that one admitted engine cannot take every ring; a ring's close gives its uid one back. Rings
// being opened count against both while they are made, so concurrent opens never pass them.
using StepRingLimitsTest = DeviceRowsRingTest;

TEST_F(StepRingLimitsTest, EachUidHasItsShareAndAllTogetherTheLimit) {
  StepRingsOptions o;
  o.max_rings = 5;
  o.max_rings_per_uid = 2;
  std::unique_ptr<StepRings> rings = MakeRings(o, "limits.sock");
  ASSERT_NE(rings, nullptr);
  const uid_t a = getuid(), b = getuid() + 1, c = getuid() + 2;
  std::vector<StepRings::Opened> a_rings;
  for (int i = 0; i < 2; ++i) {
    auto opened = rings->Open(a, kSlots, kMaxTokens, kD, kK);
    ASSERT_TRUE(opened.ok()) << opened.status();
    a_rings.push_back(*opened);
  }
  auto third = rings->Open(a, kSlots, kMaxTokens, kD, kK);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted) << third.status();
  EXPECT_NE(std::string(third.status().message()).find("--max_step_rings_per_uid"), std::string::npos)
      << third.status();
  for (uid_t other : {b, b}) EXPECT_TRUE(rings->Open(other, kSlots, kMaxTokens, kD, kK).ok());
  EXPECT_TRUE(rings->Open(c, kSlots, kMaxTokens, kD, kK).ok());
  auto sixth = rings->Open(c, kSlots, kMaxTokens, kD, kK);
  EXPECT_EQ(sixth.status().code(), absl::StatusCode::kResourceExhausted) << sixth.status();
  EXPECT_NE(std::string(sixth.status().message()).find("--max_step_rings)"), std::string::npos) << sixth.status();
  EXPECT_EQ(rings->size(), 5);
  // Another uid cannot close a's ring; a's close gives a (and the whole) one ring back.
  EXPECT_EQ(rings->Close(b, a_rings[0].id).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(rings->Close(a, a_rings[0].id).ok());
  EXPECT_TRUE(rings->Open(a, kSlots, kMaxTokens, kD, kK).ok());
  EXPECT_EQ(rings->Open(a, kSlots, kMaxTokens, kD, kK).status().code(), absl::StatusCode::kResourceExhausted);
}

// Concurrent opens of one uid never hold more rings than its share, even while each is being made.
TEST_F(StepRingLimitsTest, ConcurrentOpensStayWithinTheLimits) {
  StepRingsOptions o;
  o.max_rings = 8;
  o.max_rings_per_uid = 3;
  std::atomic<int> registered{0}, most{0};
  o.register_memory = [&](void*, int64_t) {
    const int now = ++registered;
    for (int seen = most.load(); now > seen && !most.compare_exchange_weak(seen, now);) {
    }
    absl::SleepFor(absl::Milliseconds(5));  // a pin that takes a while: the others run into it
    return absl::OkStatus();
  };
  o.unregister_memory = [&](void*) { --registered; };
  std::unique_ptr<StepRings> rings = MakeRings(o, "limits.sock");
  ASSERT_NE(rings, nullptr);
  std::atomic<int> served{0};
  std::vector<std::thread> callers;
  for (int i = 0; i < 12; ++i) {
    callers.emplace_back([&] {
      if (rings->Open(getuid(), kSlots, kMaxTokens, kD, kK).ok()) ++served;
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(served.load(), 3);
  EXPECT_EQ(rings->size(), 3);
  EXPECT_LE(most.load(), 3) << "rings pinned at once past the uid's share";
  rings.reset();
  EXPECT_EQ(registered.load(), 0);
}

}  // namespace
}  // namespace moe
