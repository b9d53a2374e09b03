// The memory layout of a step ring (docs/api.md "Step rings"), shared by moe-rankd and the
// engine clients (C++ here, Python in python/): a sealed memfd the rank creates, that both map.
//
//   [header, 4 KiB][slot 0][slot 1]...      slot = [descriptor + result, 4 KiB][payload]
//   payload = hidden [max_tokens, d] BF16 | output [max_tokens, d] BF16
//           | topk_ids [max_tokens, k] int32 | topk_weights [max_tokens, k] FP32
//           | admitted [max_tokens, k] uint8          (each 256-byte aligned, slots 4 KiB aligned)
//
// A ring opened with device rows (OpenStepRingRequest.device_rows, header.flags has
// kHeaderDeviceRows) leaves hidden and output out of the payload: slot s's rows are in the
// engine's GPU allocation, in a device slot at offset + s x DeviceGeometry::slot_bytes:
//   [hidden [max_tokens, d] BF16][output [max_tokens, d] BF16][topk_ids [max_tokens, k] int32]
//   [topk_weights [max_tokens, k] FP32]                       (each 256-byte aligned)
// A descriptor with kFlagDeviceRouting takes its routing from the device slot instead of the
// host slot (the admitted table, when set, stays in the host slot).
//
// Protocol. Steps have sequence numbers 0, 1, 2, ... and step n uses slot n % slots. The engine
// writes slot n's payload and descriptor (descriptor.seq = n), then stores submitted = n + 1 and,
// if rank_sleeping is set, wakes the futex on `submitted`. The rank serves steps in order: it
// copies the descriptor and the routing tables out once, runs the step reading the hidden rows
// and writing the output rows in place, writes the result (result.seq = n) and stores
// completed = n + 1, waking the futex on `completed` when engine_sleeping is set. The engine
// may have at most `slots` steps outstanding; a rank that sees more closes the ring. Counters
// are 32-bit and wrap; comparisons use their difference.
//
// The rank trusts nothing in the shared pages: its geometry comes from its own copy, each
// descriptor is validated like a gRPC StepRequest, and the routing tables are copied before they
// are checked. Rows the engine rewrites while its step runs give that step undefined output
// for those rows, and nothing else.
#ifndef MOE_SERVER_STEP_RING_LAYOUT_H_
#define MOE_SERVER_STEP_RING_LAYOUT_H_

#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <ctime>

#include <linux/futex.h>
#include <sys/socket.h>
#include <sys/syscall.h>

namespace moe::ring {

inline constexpr uint64_t kMagic = 0x31474e4952454f4dULL;  // "MOERING1", little-endian
inline constexpr uint32_t kLayoutVersion = 1;
inline constexpr size_t kPage = 4096;
inline constexpr size_t kAlign = 256;
inline constexpr int kMaxSlots = 16;
inline constexpr uint32_t kFlagAdmitted = 1;       // descriptor.flags: the admitted table is set
inline constexpr uint32_t kFlagDeviceRouting = 2;  // descriptor.flags: topk_ids / weights in the device slot
inline constexpr uint32_t kHeaderDeviceRows = 1;   // header.flags: rows in the engine's GPU memory

// A 64-byte line per counter, so the engine's and the rank's stores do not share one.
struct alignas(64) Counter {
  std::atomic<uint32_t> value{0};
};
static_assert(std::atomic<uint32_t>::is_always_lock_free);

struct Header {
  uint64_t magic;
  uint32_t layout_version;
  uint32_t slots;
  uint64_t slot_bytes;
  int64_t max_tokens;
  int64_t d;
  int64_t k;
  // Byte offsets inside a slot.
  uint64_t hidden_offset, output_offset, ids_offset, weights_offset, admitted_offset;
  uint32_t flags;           // kHeader*
  Counter submitted;        // futex word: steps the engine submitted
  Counter rank_sleeping;    // 1 while the rank waits on `submitted`
  Counter completed;        // futex word: steps the rank completed
  Counter engine_sleeping;  // 1 while the engine waits on `completed`
  Counter closed;           // 1 once the rank tore the ring down (no more steps are served)
};
static_assert(sizeof(Header) <= kPage);
static_assert(offsetof(Header, flags) == 88 && offsetof(Header, submitted) == 128, "the Python client's offsets");

// Engine -> rank, at the start of a slot.
struct Descriptor {
  uint32_t seq;    // the step's sequence number
  uint32_t flags;  // kFlag*
  int32_t phase;   // moe.v1.Phase: 1 prefill, 2 decode
  int32_t k;       // routes per row, [1, header.k]
  uint64_t step_id;
  int64_t layer;
  int64_t tokens;               // [0, header.max_tokens]
  int64_t expected_generation;  // 0: any
};

// Rank -> engine, after the descriptor.
struct Result {
  uint32_t seq;
  int32_t code;  // absl::StatusCode (= grpc::StatusCode): 0 OK
  char message[512];
  int64_t placement_generation;
  int64_t layer;
  int32_t path;  // moe.v1.ExecutionPath
  int32_t canary;
  char fallback_reason[64];
  int64_t routes_attempted, routes_accepted, routes_dropped, routes_remote, routes_inter_node;
  double server_latency_us;
  double compute_latency_us;
  double stages_us[9];  // moe.v1.StepStages in field order
};
inline constexpr size_t kResultOffset = 64;
static_assert(sizeof(Descriptor) <= kResultOffset);
static_assert(kResultOffset + sizeof(Result) <= kPage);

inline constexpr uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// The geometry both sides compute from (max_tokens, d, k, slots). False when a size overflows.
// A ring whose rows are in the engine's GPU memory (`device_rows`) has no rows in its slots:
// hidden_offset = output_offset = ids_offset.
struct Geometry {
  uint64_t hidden_offset = 0, output_offset = 0, ids_offset = 0, weights_offset = 0, admitted_offset = 0;
  uint64_t slot_bytes = 0, total_bytes = 0;
  uint64_t row_bytes = 0;  // max_tokens x d x 2: one slot's hidden (or output) rows
};
inline bool ComputeGeometry(int64_t max_tokens, int64_t d, int64_t k, int slots, Geometry* g,
                            bool device_rows = false) {
  if (max_tokens <= 0 || d <= 0 || k <= 0 || slots <= 0) return false;
  uint64_t rows = 0, routes = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(max_tokens), static_cast<uint64_t>(d) * 2, &rows)) return false;
  if (__builtin_mul_overflow(static_cast<uint64_t>(max_tokens), static_cast<uint64_t>(k), &routes)) return false;
  if (rows > (uint64_t{1} << 50) || routes > (uint64_t{1} << 48)) return false;
  g->row_bytes = rows;
  if (device_rows) rows = 0;
  uint64_t at = kPage;
  g->hidden_offset = at;
  at = AlignUp(at + rows, kAlign);
  g->output_offset = at;
  at = AlignUp(at + rows, kAlign);
  g->ids_offset = at;
  at = AlignUp(at + routes * 4, kAlign);
  g->weights_offset = at;
  at = AlignUp(at + routes * 4, kAlign);
  g->admitted_offset = at;
  at = AlignUp(at + routes, kPage);
  g->slot_bytes = at;
  if (__builtin_mul_overflow(at, static_cast<uint64_t>(slots), &g->total_bytes)) return false;
  g->total_bytes += kPage;
  return true;
}

// The device slot of a ring with device rows (offsets inside one slot, and its size). False when
// a size overflows.
struct DeviceGeometry {
  uint64_t hidden_offset = 0, output_offset = 0, ids_offset = 0, weights_offset = 0;
  uint64_t slot_bytes = 0, total_bytes = 0;  // total: every slot
};
inline bool ComputeDeviceGeometry(int64_t max_tokens, int64_t d, int64_t k, int slots, DeviceGeometry* g) {
  Geometry host;
  if (!ComputeGeometry(max_tokens, d, k, slots, &host)) return false;  // the same bounds on every size
  const uint64_t rows = host.row_bytes, routes = static_cast<uint64_t>(max_tokens) * static_cast<uint64_t>(k);
  g->hidden_offset = 0;
  g->output_offset = AlignUp(rows, kAlign);
  g->ids_offset = AlignUp(g->output_offset + rows, kAlign);
  g->weights_offset = AlignUp(g->ids_offset + routes * 4, kAlign);
  g->slot_bytes = AlignUp(g->weights_offset + routes * 4, kAlign);
  return !__builtin_mul_overflow(g->slot_bytes, static_cast<uint64_t>(slots), &g->total_bytes);
}

// Waits while `word` holds `seen` (shared, not private: the ring is mapped by two processes),
// at most `timeout_ns`. Spurious returns are fine: callers re-check.
inline void FutexWait(std::atomic<uint32_t>* word, uint32_t seen, int64_t timeout_ns) {
  struct timespec ts;
  ts.tv_sec = timeout_ns / 1000000000;
  ts.tv_nsec = timeout_ns % 1000000000;
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}
inline void FutexWake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, 1, nullptr, nullptr, 0);
}

// The claim's reply on the ring socket: one byte ('K' granted, 'N' refused), with `fd` attached
// (SCM_RIGHTS) when it is >= 0. True when the byte was sent.
inline bool SendReply(int conn, char byte, int fd) {
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  if (fd >= 0) {
    mh.msg_control = control;
    mh.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  return sendmsg(conn, &mh, MSG_NOSIGNAL) == 1;
}

// Reads that reply: the byte, and the descriptor attached to it (-1 when none). False when no
// byte arrived.
inline bool ReceiveReply(int conn, char* byte, int* fd) {
  *fd = -1;
  iovec iov{byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = control;
  mh.msg_controllen = sizeof(control);
  if (recvmsg(conn, &mh, MSG_CMSG_CLOEXEC) != 1) return false;
  const cmsghdr* c = CMSG_FIRSTHDR(&mh);
  if (c != nullptr && c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS &&
      c->cmsg_len == CMSG_LEN(sizeof(int))) {
    std::memcpy(fd, CMSG_DATA(c), sizeof(int));
  }
  return true;
}

}  // namespace moe::ring

#endif  // MOE_SERVER_STEP_RING_LAYOUT_H_
