#include "runtime/transport/shm_channel.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>

#include <sys/mman.h>
#include <sys/stat.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace moe {

namespace {

constexpr uint64_t kMagic = 0x4d4f4541475245ull;  // "MOEAGRE"
constexpr int kMaxMembers = 256;
// How long Send waits for room in a peer's ring before it calls the peer gone.
constexpr absl::Duration kSendWait = absl::Seconds(1);

struct SegmentHeader {
  std::atomic<uint64_t> magic;  // stored last by the creator (release)
  uint64_t size;
  uint64_t ring_bytes;
};

static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared-memory rings need lock-free 64-bit atomics");

constexpr size_t kHeaderBytes = 64;

}  // namespace

// head: bytes the producer has published; tail: bytes the consumer has taken. Each on its own
// cache line.
struct ShmStepChannel::Ring {
  alignas(64) std::atomic<uint64_t> head;
  alignas(64) std::atomic<uint64_t> tail;
  alignas(64) char data[ShmStepChannel::kRingBytes];
};

namespace {

absl::Status Errno(const std::string& what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// Copies between a ring's data and linear memory, wrapping at the end.
void CopyIn(char* data, uint64_t at, const void* src, size_t n) {
  const size_t off = at % ShmStepChannel::kRingBytes, first = std::min(n, ShmStepChannel::kRingBytes - off);
  std::memcpy(data + off, src, first);
  if (first < n) std::memcpy(data, static_cast<const char*>(src) + first, n - first);
}
void CopyOut(const char* data, uint64_t at, void* dst, size_t n) {
  const size_t off = at % ShmStepChannel::kRingBytes, first = std::min(n, ShmStepChannel::kRingBytes - off);
  std::memcpy(dst, data + off, first);
  if (first < n) std::memcpy(static_cast<char*>(dst) + first, data, n - first);
}

}  // namespace

size_t ShmStepChannel::SegmentBytes(int size) {
  return kHeaderBytes + sizeof(Ring) * static_cast<size_t>(size) * static_cast<size_t>(size);
}

absl::StatusOr<std::unique_ptr<ShmStepChannel>> ShmStepChannel::Create(const std::string& name, int size) {
  if (size < 1 || size > kMaxMembers) return absl::InvalidArgumentError(absl::StrCat("shm agreement: size ", size));
  const size_t bytes = SegmentBytes(size);
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) return Errno(absl::StrCat("shm agreement: create ", name));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const absl::Status s = Errno(absl::StrCat("shm agreement: size ", name));
    close(fd);
    shm_unlink(name.c_str());
    return s;
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) {
    shm_unlink(name.c_str());
    return Errno(absl::StrCat("shm agreement: map ", name));
  }
  // A fresh segment is zero-filled: every head and tail starts at 0.
  auto* h = static_cast<SegmentHeader*>(base);
  h->size = static_cast<uint64_t>(size);
  h->ring_bytes = kRingBytes;
  h->magic.store(kMagic, std::memory_order_release);
  return std::unique_ptr<ShmStepChannel>(new ShmStepChannel(base, bytes, 0, size));
}

absl::StatusOr<std::unique_ptr<ShmStepChannel>> ShmStepChannel::Open(const std::string& name, int me, int size,
                                                                     absl::Duration timeout) {
  if (size < 1 || size > kMaxMembers || me < 0 || me >= size) {
    return absl::InvalidArgumentError(absl::StrCat("shm agreement: member ", me, " of ", size));
  }
  const size_t bytes = SegmentBytes(size);
  const absl::Time deadline = absl::Now() + timeout;
  int fd = -1;
  while ((fd = shm_open(name.c_str(), O_RDWR, 0)) < 0) {
    if (errno != ENOENT || absl::Now() > deadline) return Errno(absl::StrCat("shm agreement: open ", name));
    absl::SleepFor(absl::Milliseconds(1));
  }
  struct stat st {};
  while (fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) < bytes && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  if (static_cast<size_t>(st.st_size) != bytes) {
    close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("shm agreement: ", name, " holds ", st.st_size, " bytes, a group of ", size, " needs ", bytes));
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return Errno(absl::StrCat("shm agreement: map ", name));
  auto* h = static_cast<SegmentHeader*>(base);
  while (h->magic.load(std::memory_order_acquire) != kMagic && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  if (h->magic.load(std::memory_order_acquire) != kMagic || h->size != static_cast<uint64_t>(size) ||
      h->ring_bytes != static_cast<uint64_t>(kRingBytes)) {
    munmap(base, bytes);
    return absl::FailedPreconditionError(
        absl::StrCat("shm agreement: ", name, " is not a segment for ", size, " members of this layout"));
  }
  return std::unique_ptr<ShmStepChannel>(new ShmStepChannel(base, bytes, me, size));
}

void ShmStepChannel::Unlink(const std::string& name) { shm_unlink(name.c_str()); }

ShmStepChannel::~ShmStepChannel() { munmap(base_, bytes_); }

ShmStepChannel::Ring* ShmStepChannel::ring(int from, int to) const {
  return reinterpret_cast<Ring*>(static_cast<char*>(base_) + kHeaderBytes) + (from * size_ + to);
}

absl::Status ShmStepChannel::Send(int peer, const StepGatherHeader& header, const void* payload, int64_t bytes) {
  return SendOnRing(peer, header, payload, bytes, kSendWait);
}

absl::Status ShmStepChannel::SendWithoutWaiting(int peer, const StepGatherHeader& header) {
  return SendOnRing(peer, header, nullptr, 0, absl::ZeroDuration());
}

absl::Status ShmStepChannel::SendOnRing(int peer, const StepGatherHeader& header, const void* payload, int64_t bytes,
                                        absl::Duration wait) {
  if (peer < 0 || peer >= size_ || peer == me_) {
    return absl::InvalidArgumentError(absl::StrCat("shm agreement: peer slot ", peer));
  }
  const uint64_t body = sizeof(StepGatherHeader) + static_cast<uint64_t>(bytes);
  const uint64_t need = (8 + body + 7) / 8 * 8;
  if (bytes < 0 || need > static_cast<uint64_t>(kRingBytes)) {
    return absl::InvalidArgumentError(absl::StrCat("shm agreement: a ", bytes, "-byte record does not fit the ring"));
  }
  Ring* r = ring(me_, peer);
  const uint64_t head = r->head.load(std::memory_order_relaxed);  // only this member writes it
  if (head + need - r->tail.load(std::memory_order_acquire) > static_cast<uint64_t>(kRingBytes)) {
    const absl::Time deadline = absl::Now() + wait;
    while (head + need - r->tail.load(std::memory_order_acquire) > static_cast<uint64_t>(kRingBytes)) {
      if (absl::Now() >= deadline) {
        return absl::UnavailableError(absl::StrCat("shm agreement: peer slot ", peer,
                                                   " has not taken its messages for ", absl::FormatDuration(wait)));
      }
      std::this_thread::yield();
    }
  }
  CopyIn(r->data, head, &body, 8);
  CopyIn(r->data, head + 8, &header, sizeof(header));
  if (bytes > 0) CopyIn(r->data, head + 8 + sizeof(header), payload, static_cast<size_t>(bytes));
  r->head.store(head + need, std::memory_order_release);
  return absl::OkStatus();
}

absl::StatusOr<bool> ShmStepChannel::Poll(int peer, StepGatherHeader* header, void* payload, int64_t capacity,
                                          int64_t* bytes) {
  if (peer < 0 || peer >= size_ || peer == me_) {
    return absl::InvalidArgumentError(absl::StrCat("shm agreement: peer slot ", peer));
  }
  Ring* r = ring(peer, me_);
  const uint64_t tail = r->tail.load(std::memory_order_relaxed);  // only this member writes it
  const uint64_t head = r->head.load(std::memory_order_acquire);
  if (head == tail) return false;
  uint64_t body = 0;
  CopyOut(r->data, tail, &body, 8);
  // The length word is the peer's: bounded before any arithmetic on it (a length near 2^64 would
  // round `need` to 0, and the message would be read again forever).
  const uint64_t need = body <= static_cast<uint64_t>(kRingBytes) ? (8 + body + 7) / 8 * 8 : 0;
  if (body < sizeof(StepGatherHeader) || body > static_cast<uint64_t>(kRingBytes) || need > head - tail ||
      head - tail > static_cast<uint64_t>(kRingBytes)) {
    return absl::DataLossError(absl::StrCat("shm agreement: a message of ", body, " bytes from peer slot ", peer,
                                            " with ", head - tail, " bytes published"));
  }
  CopyOut(r->data, tail + 8, header, sizeof(StepGatherHeader));
  const int64_t got = static_cast<int64_t>(body - sizeof(StepGatherHeader));
  *bytes = std::min(got, capacity);
  if (*bytes > 0) CopyOut(r->data, tail + 8 + sizeof(StepGatherHeader), payload, static_cast<size_t>(*bytes));
  r->tail.store(tail + need, std::memory_order_release);
  return true;
}

void ShmStepChannel::Idle() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

}  // namespace moe
