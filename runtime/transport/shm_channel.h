// The step agreement's message channel (step_gather.h) between the members of a group that share
// one host: a POSIX shared-memory segment with one single-producer single-consumer byte ring per
// ordered pair of members. A message is a 64-bit length, the StepGatherHeader and the payload,
// padded to 8 bytes; the producer publishes it by moving its ring's head past it (release), the
// consumer takes it and moves the tail (release). Nothing is exchanged through the device or the
// kernel: an agreement of two ranks on one host costs a few microseconds of the ranks' own
// cores, where an NCCL all-gather of host memory costs two copies, a collective and a stream wait
// (~35-45 µs on the H200 machine).
//
// The NCCL transport uses it for StepGather when every member could open the group's segment
// (runtime/transport/nccl.cc); members on different hosts keep the NCCL all-gather.
//
// Thread-safety: one thread drives a member's channel at a time (the transport's rule).
#ifndef MOE_RUNTIME_TRANSPORT_SHM_CHANNEL_H_
#define MOE_RUNTIME_TRANSPORT_SHM_CHANNEL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "runtime/transport/step_gather.h"

namespace moe {

class ShmStepChannel final : public StepGatherChannel {
 public:
  // Bytes of each ordered pair's ring (an executor's agreement record is at most ~7 KiB).
  static constexpr int64_t kRingBytes = int64_t{256} << 10;

  // Member 0 creates the segment `name` (a POSIX shm name, "/..."; an existing one is an error)
  // before any other member opens it; the others wait up to `timeout` for it to be ready.
  static absl::StatusOr<std::unique_ptr<ShmStepChannel>> Create(const std::string& name, int size);
  static absl::StatusOr<std::unique_ptr<ShmStepChannel>> Open(const std::string& name, int me, int size,
                                                              absl::Duration timeout);
  // Removes the name (the mappings stay): once every member has opened it.
  static void Unlink(const std::string& name);
  ~ShmStepChannel() override;

  // UNAVAILABLE when the peer has not taken older messages for a while (a dead peer's full ring).
  absl::Status Send(int peer, const StepGatherHeader& header, const void* payload, int64_t bytes) override;
  // UNAVAILABLE at once when the peer's ring is full.
  absl::Status SendWithoutWaiting(int peer, const StepGatherHeader& header) override;
  absl::StatusOr<bool> Poll(int peer, StepGatherHeader* header, void* payload, int64_t capacity,
                            int64_t* bytes) override;
  void Idle() override;
  bool Interrupted() const override { return interrupted_ != nullptr && interrupted_(); }
  // What Interrupted() asks (the owning transport's Transport::interrupted).
  void set_interrupted(std::function<bool()> f) { interrupted_ = std::move(f); }

  int me() const { return me_; }
  int size() const { return size_; }

 private:
  struct Ring;
  static size_t SegmentBytes(int size);
  ShmStepChannel(void* base, size_t bytes, int me, int size) : base_(base), bytes_(bytes), me_(me), size_(size) {}
  Ring* ring(int from, int to) const;
  absl::Status SendOnRing(int peer, const StepGatherHeader& header, const void* payload, int64_t bytes,
                          absl::Duration wait);

  void* base_;
  size_t bytes_;
  int me_, size_;
  std::function<bool()> interrupted_;
};

}  // namespace moe

#endif  // MOE_RUNTIME_TRANSPORT_SHM_CHANNEL_H_
