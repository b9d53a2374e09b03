// The step agreement's all-gather over transports whose messages are matched by tag rather than
// by position (UCX, loopback): a protocol over one FIFO stream of messages per ordered pair of
// members, so that members in different steps find out at once instead of each waiting for a
// message keyed by its own step.
//
// Each attempt at step S sends RECORD(S, payload) to every peer and reads every peer's stream in
// order until it holds each peer's RECORD(S):
//  - RECORD(X), X != S: the peer entered step X. Unless a LEFT(X) follows right behind it (an
//    attempt the peer already gave up), the members are in different steps: ABORTED naming both
//    step ids, and LEFT(S, mismatch X) to every peer.
//  - LEFT(X, mismatch M): the peer gave up X. X == S: this step cannot complete (ABORTED). M == S:
//    the peer left X because this member is in S (ABORTED naming both ids).
// An attempt that fails (ABORTED or DEADLINE_EXCEEDED) sends LEFT(S) to every peer, so its
// RECORD(S) never pairs with a later step; a completed attempt sends nothing more. Messages of
// earlier attempts are consumed by the next one; nothing is keyed by position, so a timeout
// does not shift later steps.
#ifndef MOE_RUNTIME_TRANSPORT_STEP_GATHER_H_
#define MOE_RUNTIME_TRANSPORT_STEP_GATHER_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace moe {

struct StepGatherHeader {
  uint64_t type = 0;  // kRecord or kLeft
  uint64_t step = 0;
  uint64_t mismatch = 0;       // LEFT: 1 when the attempt ended because a peer was in another step
  uint64_t mismatch_step = 0;  // ... that step
  static constexpr uint64_t kRecord = 0x5245434f5244ull;  // "RECORD"
  static constexpr uint64_t kLeft = 0x4c454654ull;        // "LEFT"
};

// The message layer under the protocol: one ordered stream per (peer -> this member).
class StepGatherChannel {
 public:
  virtual ~StepGatherChannel() = default;
  // Sends header + payload to `peer` (fire and forget; ordered after earlier sends to it).
  virtual absl::Status Send(int peer, const StepGatherHeader& header, const void* payload, int64_t bytes) = 0;
  // A message without payload (a LEFT) sent only if it can go at once: a peer that stopped
  // taking its messages must not hold a member that is giving a step up. Send by default.
  virtual absl::Status SendWithoutWaiting(int peer, const StepGatherHeader& header) {
    return Send(peer, header, nullptr, 0);
  }
  // Takes the next message from `peer` when one has arrived: true and the header, with up to
  // `capacity` payload bytes copied to `payload` and their count in `*bytes`. False when none.
  virtual absl::StatusOr<bool> Poll(int peer, StepGatherHeader* header, void* payload, int64_t capacity,
                                    int64_t* bytes) = 0;
  // Lets messages move (progress) when a round of polls found nothing.
  virtual void Idle() = 0;
  // Whether the transport was interrupted (Transport::Interrupt): the gather gives up at once.
  virtual bool Interrupted() const { return false; }
};

// The largest record a StepGather carries (the executor's agreement record is at most ~7 KiB).
// Every message is read whole up to this size, so a record of another length than this
// member's (a peer's next step, taken early into the backlog) keeps its length and is compared
// as it was sent.
inline constexpr int64_t kMaxStepGatherRecordBytes = int64_t{64} << 10;

// Messages taken from the channel but not yet consumed (kept by the transport across calls).
struct StepGatherBacklog {
  struct Message {
    StepGatherHeader header;
    std::string payload;
  };
  std::vector<std::deque<Message>> from;  // per peer slot
  // A call's working state, kept between calls so that a step allocates nothing: which peers'
  // records of the step have arrived, each peer's record of another step, and one message's
  // payload (kMaxStepGatherRecordBytes).
  std::vector<bool> have;
  std::vector<std::optional<uint64_t>> pending;
  std::unique_ptr<char[]> scratch;
};

// out[i * bytes, (i + 1) * bytes) = peer i's payload for `step` (this member's included). Before
// it completes, everything that has already arrived from each peer is looked at: a LEFT of this
// step behind a peer's RECORD (it gave up after sending) aborts the step here too.
absl::Status RunStepGather(StepGatherChannel& channel, StepGatherBacklog& backlog, int me, int size, uint64_t step,
                           const void* in, int64_t bytes, void* out, absl::Duration timeout);

// LEFT(step) to every peer, fire and forget (Transport::AbandonStep): this member gives up `step`
// without having sent its record.
void AbandonStepGather(StepGatherChannel& channel, int me, int size, uint64_t step);

}  // namespace moe

#endif  // MOE_RUNTIME_TRANSPORT_STEP_GATHER_H_
