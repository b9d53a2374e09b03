// Step rings on moe-rankd: low-latency step submission for an engine on the rank's host, beside
// the gRPC API (layout and protocol: server/step_ring_layout.h; docs/api.md "Step rings").
//
// A ring is a memfd the rank creates, sized once and sealed against shrinking and growing (so
// the engine cannot make the rank's mapping fault), opened through gRPC (OpenStepRing, engine
// Unix-socket callers only) and handed over on the rank's ring socket: the engine connects,
// sends the ring id and the single-use ticket from the gRPC answer, and receives the memfd
// (SCM_RIGHTS) if its uid is the one that opened the ring. That connection is the engine's hold
// on the ring: when it closes (the engine exits), the ring is torn down, as on CloseStepRing.
// A ring not claimed within 10 s is dropped.
//
// Each claimed ring has a serving thread: it waits for the doorbell (spinning `spin_us`, then
// sleeping on the futex), copies the descriptor and routing tables out of the shared pages,
// checks them against the ring's own geometry and hands the step to `serve`, whose result it
// publishes in the slot.
//
// Thread-safety: every public method is safe to call concurrently; `serve` is called from the
// rings' threads (one step at a time per ring, rings concurrently).
#ifndef MOE_SERVER_STEP_RINGS_H_
#define MOE_SERVER_STEP_RINGS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <sys/types.h>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

#include "server/step_ring_layout.h"

namespace moe {

struct StepRingsOptions {
  std::string socket_path;  // the ring socket (moe-rankd: --engine_socket + ".ring")
  int max_rings = 8;        // open (claimed or not) at once
  // Of those, the most one caller's uid may hold (or be opening) at once, so that one engine
  // cannot take every ring from the others; 0: max_rings (one admitted uid).
  int max_rings_per_uid = 0;
  uint64_t max_ring_bytes = uint64_t{4} << 30;
  int64_t spin_us = 50;  // the serving thread's spin before it sleeps on the futex
  // Workers of the NaN/Inf check of a step's rows, which runs beside the executor's first phases
  // (FiniteCheckPool: from 256 Ki values; smaller steps are checked in line).
  int check_threads = 8;
  // Called with each ring's mapping after it is made, and before it is unmapped (the executor's
  // RegisterHostMemory: device copies from and to the slots without staging). Optional; a
  // failed registration is logged and the ring serves without it.
  std::function<absl::Status(void* p, int64_t bytes)> register_memory;
  std::function<void(void* p)> unregister_memory;
};

// A ring's rows in the engine's GPU memory (OpenStepRingRequest.device_rows), already mapped:
// device slot s at rows + s x DeviceGeometry::slot_bytes (server/step_ring_layout.h).
// `ready_event`, when set, is the engine's (opaque here) event that steps wait for. `release`
// unmaps both; it runs once the ring is torn down (or refused).
struct RingDeviceRows {
  char* rows = nullptr;
  void* ready_event = nullptr;
  // DeviceRows.done_events: one event of the rank's per slot, recorded after each step's GPU work.
  std::vector<void*> done_events;
  std::function<void()> release;
};

// One step read from a ring: the descriptor and routing tables are private copies, the rows are
// the slot's, or the engine's GPU memory's (read and written in place).
struct RingStep {
  absl::Status status;  // the descriptor checked against the ring; an error is still served (rejected)
  ring::Descriptor desc{};
  int64_t d = 0;
  const uint16_t* hidden = nullptr;  // [tokens, d] BF16, in the ring
  uint16_t* output = nullptr;        // [tokens, d] BF16, in the ring
  const int32_t* topk_ids = nullptr;
  const float* topk_weights = nullptr;
  const uint8_t* admitted = nullptr;  // null when the descriptor does not set kFlagAdmitted
  bool rows_on_device = false;        // hidden and output are in the engine's GPU memory
  // kFlagDeviceRouting: topk_ids / topk_weights are in the engine's GPU memory (the step reads
  // them there: LayerStepInput::routing_on_device); the host pointers above are null.
  const int32_t* device_topk_ids = nullptr;
  const float* device_topk_weights = nullptr;
  void* ready_event = nullptr;  // RingDeviceRows::ready_event: the step's kernels wait for it first
  void* done_event = nullptr;   // RingDeviceRows::done_events[slot]: recorded after the step's GPU work
};
using RingServe = std::function<void(const RingStep& step, ring::Result* result)>;
// Runs on the ring's thread right after a step's answer is published: the serving side's
// bookkeeping (metrics) off the engine's path.
using RingAfter = std::function<void()>;

class StepRings {
 public:
  static absl::StatusOr<std::unique_ptr<StepRings>> Create(StepRingsOptions options, RingServe serve,
                                                           RingAfter after = nullptr);
  ~StepRings();  // tears every ring down, removes the socket

  struct Opened {
    uint64_t id = 0;
    std::string ticket;  // 16 bytes
    uint64_t bytes = 0;
  };
  // A ring for `caller` (the engine's uid). Sizes are checked with checked arithmetic. With
  // device_rows.rows set, the slots carry no rows (the caller checked that the mapping holds
  // slots x ring::DeviceGeometry::slot_bytes from there); its release runs whatever the outcome.
  absl::StatusOr<Opened> Open(uid_t caller, int slots, int64_t max_tokens, int64_t d, int64_t k,
                              RingDeviceRows device_rows = {});
  // Tears the ring down (its thread finishes the step it is serving first).
  absl::Status Close(uid_t caller, uint64_t id);
  int size();
  const std::string& socket_path() const { return options_.socket_path; }

 private:
  struct Ring;
  StepRings(StepRingsOptions options, RingServe serve, RingAfter after, int listen_fd);
  void ClaimLoop();
  void Claim(int conn, uid_t uid, const char* msg);
  void Serve(Ring* ring);
  void Reap(bool all);

  const StepRingsOptions options_;
  const RingServe serve_;
  const RingAfter after_;
  const int listen_fd_;
  int wake_[2] = {-1, -1};
  std::thread claim_thread_;
  absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, std::shared_ptr<Ring>> rings_ ABSL_GUARDED_BY(mu_);
  // Rings being made (Open between its check and its insertion), by uid: counted against the
  // limits, so that concurrent opens cannot all pass the check and each map and pin a ring
  // before they are refused.
  std::map<uid_t, int> opening_by_uid_ ABSL_GUARDED_BY(mu_);
  // RESOURCE_EXHAUSTED when another ring for `caller` would pass a limit.
  absl::Status CheckRingLimits(uid_t caller) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

}  // namespace moe

#endif  // MOE_SERVER_STEP_RINGS_H_
