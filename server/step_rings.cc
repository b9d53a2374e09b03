#include "server/step_rings.h"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "spdlog/spdlog.h"

#include "rpc/unix_socket.h"

namespace moe {
namespace {

constexpr absl::Duration kClaimWindow = absl::Seconds(10);
// A claim's 24 bytes, once connected (the client sends them at once, in one write).
constexpr absl::Duration kClaimMessageDeadline = absl::Milliseconds(500);
// Claims read at once (each a connection of a uid that owns an unclaimed ring), per uid and in all.
constexpr int kMaxPendingClaimsPerUid = 16;
constexpr int kMaxPendingClaims = 256;
constexpr int64_t kSleepNs = 100'000'000;  // a sleeping ring thread re-checks its ring every 100 ms

std::string Errno(const char* what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

// Constant-time comparison of two tickets.
bool SameTicket(const std::string& a, const char* b, size_t n) {
  if (a.size() != n) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < n; ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

struct StepRings::Ring {
  ~Ring() {
    if (device_release) device_release();
    if (registered && unregister) unregister(base);
    if (base != nullptr) munmap(base, bytes);
    if (memfd >= 0) close(memfd);
    if (conn >= 0) close(conn);
  }
  uint64_t id = 0;
  uid_t owner = 0;
  std::string ticket;
  absl::Time opened;
  int memfd = -1;
  int conn = -1;  // the engine's claim connection, once claimed
  char* base = nullptr;
  uint64_t bytes = 0;
  bool registered = false;  // with options.register_memory
  std::function<void(void*)> unregister;
  int slots = 0;
  int64_t max_tokens = 0, d = 0, k = 0;
  ring::Geometry geometry;
  char* device_rows = nullptr;  // RingDeviceRows::rows
  void* ready_event = nullptr;
  std::vector<void*> done_events;  // one per slot, or none
  ring::DeviceGeometry device_geometry;
  std::function<void()> device_release;
  std::atomic<bool> stop{false};
  std::thread thread;
  ring::Header* header() const { return reinterpret_cast<ring::Header*>(base); }
  char* slot(uint32_t seq) const { return base + ring::kPage + (seq % slots) * geometry.slot_bytes; }
};

absl::StatusOr<std::unique_ptr<StepRings>> StepRings::Create(StepRingsOptions options, RingServe serve,
                                                             RingAfter after) {
  // Open to every local user: a ring is handed only to the uid that opened it through the
  // engine socket (whose credential check is the gate), and only with its ticket.
  absl::StatusOr<int> listening = ListenUnixSocket(options.socket_path, /*only_owner=*/false, "ring socket");
  if (!listening.ok()) return listening.status();
  const int fd = *listening;
  auto rings = std::unique_ptr<StepRings>(new StepRings(std::move(options), std::move(serve), std::move(after), fd));
  rings->claim_thread_ = std::thread([r = rings.get()] { r->ClaimLoop(); });
  return rings;
}

StepRings::StepRings(StepRingsOptions options, RingServe serve, RingAfter after, int listen_fd)
    : options_(std::move(options)), serve_(std::move(serve)), after_(std::move(after)), listen_fd_(listen_fd) {
  if (pipe2(wake_, O_CLOEXEC) != 0) wake_[0] = wake_[1] = -1;
}

StepRings::~StepRings() {
  if (wake_[1] >= 0) {
    const char c = 0;
    (void)!write(wake_[1], &c, 1);
  }
  if (claim_thread_.joinable()) claim_thread_.join();
  Reap(/*all=*/true);
  close(listen_fd_);
  unlink(options_.socket_path.c_str());
  for (int f : wake_) {
    if (f >= 0) close(f);
  }
}

int StepRings::size() {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(rings_.size());
}

absl::StatusOr<StepRings::Opened> StepRings::Open(uid_t caller, int slots, int64_t max_tokens, int64_t d, int64_t k,
                                                  RingDeviceRows device_rows) {
  // The mapping is released on every refusal below; a ring made here takes it over.
  struct Release {
    std::function<void()> f;
    ~Release() {
      if (f) f();
    }
  } release{std::move(device_rows.release)};
  const bool on_device = device_rows.rows != nullptr;
  if (slots < 1 || slots > ring::kMaxSlots) {
    return absl::InvalidArgumentError(absl::StrCat("slots: ", slots, " outside [1, ", ring::kMaxSlots, "]"));
  }
  if ((slots & (slots - 1)) != 0) {
    // Step n uses slot n mod slots with n a 32-bit counter that wraps: only a power of two keeps
    // the slots in turn across the wrap (with 3, steps 2^32 - 1 and 2^32 would share slot 0).
    return absl::InvalidArgumentError(
        absl::StrCat("slots: ", slots, " is not a power of two (1, 2, 4, 8 or 16; the step counter wraps at 2^32)"));
  }
  ring::Geometry g;
  if (!ring::ComputeGeometry(max_tokens, d, k, slots, &g, on_device) || g.total_bytes > options_.max_ring_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens: a ring of ", slots, " slots of ", max_tokens,
                                                   " rows, d = ", d, ", k = ", k, " exceeds ", options_.max_ring_bytes,
                                                   " bytes (--max_ring_bytes)"));
  }
  Reap(/*all=*/false);
  {
    // Refused before anything is allocated, mapped or pinned; counted as opening until it is
    // added (or refused below).
    absl::MutexLock lock(&mu_);
    if (absl::Status s = CheckRingLimits(caller); !s.ok()) return s;
    ++opening_by_uid_[caller];
  }
  struct Opening {
    StepRings* rings;
    uid_t caller;
    ~Opening() {
      absl::MutexLock lock(&rings->mu_);
      if (--rings->opening_by_uid_[caller] == 0) rings->opening_by_uid_.erase(caller);
    }
  } opening{this, caller};
  auto r = std::make_shared<Ring>();
  r->device_rows = device_rows.rows;
  r->ready_event = device_rows.ready_event;
  if (!device_rows.done_events.empty() && static_cast<int>(device_rows.done_events.size()) != slots) {
    return absl::InternalError("device_rows.done_events: not one event per slot");
  }
  r->done_events = std::move(device_rows.done_events);
  if (on_device && !ring::ComputeDeviceGeometry(max_tokens, d, k, slots, &r->device_geometry)) {
    return absl::InvalidArgumentError("max_tokens: the ring's device slots overflow");
  }
  r->device_release = std::move(release.f);
  release.f = nullptr;
  r->owner = caller;
  r->opened = absl::Now();
  r->slots = slots;
  r->max_tokens = max_tokens;
  r->d = d;
  r->k = k;
  r->geometry = g;
  r->bytes = g.total_bytes;
  r->ticket.resize(16);
  if (getrandom(r->ticket.data(), r->ticket.size(), 0) != 16) return absl::InternalError(Errno("getrandom"));
  r->memfd = memfd_create("moe-step-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (r->memfd < 0) return absl::ResourceExhaustedError(Errno("memfd_create"));
  if (ftruncate(r->memfd, static_cast<off_t>(r->bytes)) != 0) return absl::ResourceExhaustedError(Errno("ftruncate"));
  // Sealed: neither side can change the size, so neither mapping can fault past the end.
  if (fcntl(r->memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return absl::InternalError(Errno("F_ADD_SEALS"));
  }
  void* base = mmap(nullptr, r->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, r->memfd, 0);
  if (base == MAP_FAILED) return absl::ResourceExhaustedError(Errno("mmap"));
  r->base = static_cast<char*>(base);
  if (options_.register_memory) {
    if (absl::Status s = options_.register_memory(base, static_cast<int64_t>(r->bytes)); s.ok()) {
      r->registered = true;
      r->unregister = options_.unregister_memory;
    } else {
      spdlog::warn("step ring: registering its {} bytes for device copies failed ({}); copies are staged", r->bytes,
                   s.ToString());
    }
  }
  ring::Header* h = r->header();
  h->magic = ring::kMagic;
  h->layout_version = ring::kLayoutVersion;
  h->slots = static_cast<uint32_t>(slots);
  h->slot_bytes = g.slot_bytes;
  h->max_tokens = max_tokens;
  h->d = d;
  h->k = k;
  h->hidden_offset = g.hidden_offset;
  h->output_offset = g.output_offset;
  h->ids_offset = g.ids_offset;
  h->weights_offset = g.weights_offset;
  h->admitted_offset = g.admitted_offset;
  h->flags = on_device ? ring::kHeaderDeviceRows : 0;
  absl::MutexLock lock(&mu_);
  r->id = next_id_++;
  rings_[r->id] = r;
  return Opened{r->id, r->ticket, r->bytes};
}

absl::Status StepRings::CheckRingLimits(uid_t caller) {
  int opening = 0, held = 0;  // in all; the caller's, open or opening
  for (const auto& [uid, n] : opening_by_uid_) {
    opening += n;
    if (uid == caller) held += n;
  }
  if (static_cast<int>(rings_.size()) + opening >= options_.max_rings) {
    return absl::ResourceExhaustedError(absl::StrCat("step rings: ", rings_.size(), " open and ", opening,
                                                     " opening, the limit is ", options_.max_rings,
                                                     " (--max_step_rings)"));
  }
  const int per_uid = options_.max_rings_per_uid > 0 ? options_.max_rings_per_uid : options_.max_rings;
  for (const auto& [id, ring] : rings_) held += ring->owner == caller ? 1 : 0;
  if (held >= per_uid) {
    return absl::ResourceExhaustedError(absl::StrCat("step rings: uid ", caller, " holds ", held,
                                                     " (open or opening), the limit a uid is ", per_uid,
                                                     " (--max_step_rings_per_uid)"));
  }
  return absl::OkStatus();
}

absl::Status StepRings::Close(uid_t caller, uint64_t id) {
  std::shared_ptr<Ring> r;
  {
    absl::MutexLock lock(&mu_);
    auto it = rings_.find(id);
    if (it == rings_.end() || it->second->owner != caller) {
      return absl::NotFoundError(absl::StrCat("ring_id: no step ring ", id, " of this caller"));
    }
    r = it->second;
    rings_.erase(it);
  }
  r->stop.store(true);
  ring::FutexWake(&r->header()->submitted.value);
  if (r->thread.joinable()) r->thread.join();
  return absl::OkStatus();
}

// Drops rings whose engine went away (claim connection closed, thread ended) or that were never
// claimed within the window; `all`: every ring.
void StepRings::Reap(bool all) {
  std::vector<std::shared_ptr<Ring>> dropped;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    for (auto it = rings_.begin(); it != rings_.end();) {
      Ring& r = *it->second;
      const bool unclaimed = r.conn < 0 && now - r.opened > kClaimWindow;
      const bool ended = r.conn >= 0 && r.stop.load();
      if (all || unclaimed || ended) {
        dropped.push_back(it->second);
        it = rings_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& r : dropped) {
    r->stop.store(true);
    ring::FutexWake(&r->header()->submitted.value);
    if (r->thread.joinable()) r->thread.join();
  }
}

void StepRings::ClaimLoop() {
  // Claims in progress, each with its own deadline, read as their bytes arrive: a caller holding
  // connections open (or trickling bytes) delays no one else's claim.
  struct Pending {
    int conn;
    uid_t uid;
    char msg[24];
    size_t got;
    absl::Time deadline;
  };
  std::vector<Pending> pending;
  auto refuse = [](int conn) {
    ring::SendReply(conn, 'N', -1);
    close(conn);
  };
  while (true) {
    std::vector<pollfd> fds = {{listen_fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    absl::Time next = absl::Now() + absl::Seconds(1);
    for (const Pending& c : pending) {
      fds.push_back({c.conn, POLLIN, 0});
      next = std::min(next, c.deadline);
    }
    const int64_t wait_ms = std::max<int64_t>(0, absl::ToInt64Milliseconds(next - absl::Now()) + 1);
    const int n = poll(fds.data(), fds.size(), static_cast<int>(wait_ms));
    if (n < 0 && errno != EINTR) break;
    if (fds[1].revents != 0) break;
    Reap(/*all=*/false);
    const absl::Time now = absl::Now();
    std::vector<Pending> still;
    for (size_t i = 0; i < pending.size(); ++i) {
      Pending& c = pending[i];
      bool failed = false;
      if (n > 0 && fds[2 + i].revents != 0) {
        const ssize_t got = recv(c.conn, c.msg + c.got, sizeof(c.msg) - c.got, MSG_DONTWAIT);
        if (got > 0) {
          c.got += static_cast<size_t>(got);
        } else if (got == 0 || (errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK)) {
          failed = true;
        }
      }
      if (c.got == sizeof(c.msg)) {
        Claim(c.conn, c.uid, c.msg);
      } else if (failed || now >= c.deadline) {
        refuse(c.conn);
      } else {
        still.push_back(c);
      }
    }
    pending = std::move(still);
    if (n <= 0 || (fds[0].revents & POLLIN) == 0) continue;
    const int conn = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) continue;
    ucred cred{};
    socklen_t len = sizeof(cred);
    bool expected = getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0;
    if (expected) {
      absl::MutexLock lock(&mu_);
      expected = false;
      for (const auto& [id, ring] : rings_) expected = expected || (ring->conn < 0 && ring->owner == cred.uid);
    }
    // A caller that owns no unclaimed ring is answered before anything is read; the claims in
    // progress are bounded per uid, so that one uid's open connections leave room for another's.
    int of_uid = 0;
    for (const Pending& c : pending) of_uid += c.uid == cred.uid ? 1 : 0;
    if (!expected || of_uid >= kMaxPendingClaimsPerUid || static_cast<int>(pending.size()) >= kMaxPendingClaims) {
      refuse(conn);
      continue;
    }
    timeval tv{2, 0};
    setsockopt(conn, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    pending.push_back(Pending{conn, cred.uid, {}, 0, absl::Now() + kClaimMessageDeadline});
  }
  for (const Pending& c : pending) close(c.conn);
}

// One claim whose message arrived whole: [ring id, 8 bytes][ticket, 16 bytes] from a process of
// the ring's owner uid gets one byte 'K' with the memfd attached; anything else gets 'N' and the
// connection closed.
void StepRings::Claim(int conn, uid_t uid, const char* msg) {
  std::shared_ptr<Ring> r;
  {
    uint64_t id = 0;
    std::memcpy(&id, msg, 8);
    absl::MutexLock lock(&mu_);
    auto it = rings_.find(id);
    if (it != rings_.end() && it->second->conn < 0 && it->second->owner == uid &&
        SameTicket(it->second->ticket, msg + 8, 16)) {
      r = it->second;
      r->conn = conn;
      r->ticket.assign(16, '\0');  // single use
    }
  }
  if (r == nullptr) {
    ring::SendReply(conn, 'N', -1);
    close(conn);
    return;
  }
  if (!ring::SendReply(conn, 'K', r->memfd)) {
    spdlog::warn("step ring {}: handing the memfd over failed: {}", r->id, std::strerror(errno));
    r->stop.store(true);  // reaped; its conn is closed with it
    return;
  }
  // Started under the lock, and only while the ring is still registered: Close and Reap take a
  // ring out under it before they join its thread.
  absl::MutexLock lock(&mu_);
  if (rings_.count(r->id) != 0) r->thread = std::thread([this, raw = r.get()] { Serve(raw); });
}

void StepRings::Serve(Ring* r) {
  ring::Header* h = r->header();
  const ring::Geometry& g = r->geometry;
  std::vector<int32_t> ids;
  std::vector<float> weights;
  std::vector<uint8_t> admitted;
  uint32_t next = 0;
  const absl::Duration spin = absl::Microseconds(options_.spin_us);
  while (!r->stop.load(std::memory_order_relaxed)) {
    uint32_t submitted = h->submitted.value.load(std::memory_order_acquire);
    if (submitted == next) {
      // Doorbell: spin, then sleep on the futex (announced first, so a submit after the
      // announcement sees it and wakes us).
      const absl::Time until = absl::Now() + spin;
      while (submitted == next && absl::Now() < until) {
        submitted = h->submitted.value.load(std::memory_order_acquire);
      }
      if (submitted == next) {
        h->rank_sleeping.value.store(1, std::memory_order_seq_cst);
        submitted = h->submitted.value.load(std::memory_order_seq_cst);
        if (submitted == next) ring::FutexWait(&h->submitted.value, next, kSleepNs);
        h->rank_sleeping.value.store(0, std::memory_order_relaxed);
        // The engine's hold on the ring: a hung-up claim connection ends it.
        pollfd p{r->conn, POLLRDHUP, 0};
        if (poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) break;
        continue;
      }
    }
    if (static_cast<uint32_t>(submitted - next) > static_cast<uint32_t>(r->slots)) {
      spdlog::warn("step ring {}: {} steps outstanding on {} slots; closing the ring", r->id, submitted - next,
                   r->slots);
      break;
    }
    char* slot = r->slot(next);
    RingStep step;
    std::memcpy(&step.desc, slot, sizeof(step.desc));
    const ring::Descriptor& desc = step.desc;
    step.d = r->d;
    if (desc.seq != next) {
      step.status = absl::InvalidArgumentError(absl::StrCat("descriptor.seq: ", desc.seq, ", expected ", next));
    } else if (desc.k < 1 || desc.k > r->k) {
      step.status = absl::InvalidArgumentError(absl::StrCat("descriptor.k: ", desc.k, " outside [1, ", r->k, "]"));
    } else if (desc.tokens < 0 || desc.tokens > r->max_tokens) {
      step.status = absl::InvalidArgumentError(absl::StrCat("descriptor.tokens: ", desc.tokens, " outside [0, ",
                                                            r->max_tokens, "] (the ring's max_tokens)"));
    } else if ((desc.flags & ~(ring::kFlagAdmitted | ring::kFlagDeviceRouting)) != 0) {
      step.status = absl::InvalidArgumentError(absl::StrCat("descriptor.flags: unknown bits ", desc.flags));
    } else if ((desc.flags & ring::kFlagDeviceRouting) != 0 && r->device_rows == nullptr) {
      step.status = absl::InvalidArgumentError(
          "descriptor.flags: device routing on a ring without device rows (OpenStepRingRequest.device_rows)");
    } else {
      // Routing tables are copied once: the engine rewriting them during the step cannot make
      // this rank's checks and plan see different routes.
      const size_t routes = static_cast<size_t>(desc.tokens) * desc.k;
      char* dslot =
          r->device_rows == nullptr ? nullptr : r->device_rows + (next % r->slots) * r->device_geometry.slot_bytes;
      if ((desc.flags & ring::kFlagDeviceRouting) != 0) {
        step.device_topk_ids = reinterpret_cast<const int32_t*>(dslot + r->device_geometry.ids_offset);
        step.device_topk_weights = reinterpret_cast<const float*>(dslot + r->device_geometry.weights_offset);
      } else {
        ids.resize(routes);
        weights.resize(routes);
        std::memcpy(ids.data(), slot + g.ids_offset, routes * 4);
        std::memcpy(weights.data(), slot + g.weights_offset, routes * 4);
        step.topk_ids = ids.data();
        step.topk_weights = weights.data();
      }
      if ((desc.flags & ring::kFlagAdmitted) != 0) {
        admitted.resize(routes);
        std::memcpy(admitted.data(), slot + g.admitted_offset, routes);
        step.admitted = admitted.data();
      }
      if (dslot != nullptr) {
        step.hidden = reinterpret_cast<const uint16_t*>(dslot + r->device_geometry.hidden_offset);
        step.output = reinterpret_cast<uint16_t*>(dslot + r->device_geometry.output_offset);
        step.rows_on_device = true;
        step.ready_event = r->ready_event;
        if (!r->done_events.empty()) step.done_event = r->done_events[next % r->slots];
      } else {
        step.hidden = reinterpret_cast<const uint16_t*>(slot + g.hidden_offset);
        step.output = reinterpret_cast<uint16_t*>(slot + g.output_offset);
      }
    }
    ring::Result result{};
    serve_(step, &result);
    result.seq = next;
    std::memcpy(slot + ring::kResultOffset, &result, sizeof(result));
    ++next;
    h->completed.value.store(next, std::memory_order_seq_cst);
    if (h->engine_sleeping.value.load(std::memory_order_seq_cst) != 0) ring::FutexWake(&h->completed.value);
    if (after_) after_();
  }
  h->closed.value.store(1, std::memory_order_seq_cst);
  ring::FutexWake(&h->completed.value);
  r->stop.store(true);
}

}  // namespace moe
