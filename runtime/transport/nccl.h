// NCCL implementation of Transport (GPU; grouped ncclSend/ncclRecv for all-to-all-v, ncclAllGather
// for the step header). Built only under --config=cuda.
//
// The step agreement goes over shared memory when the whole group is on one host
// (NcclOptions::host_agreement), else over an NCCL all-gather.
//
// Pointers may be device or host memory: host buffers are staged through a device buffer
// (cudaPointerGetAttributes decides), so the step agreement and host-memory callers work
// unchanged; device buffers go to NCCL directly. Waits poll the stream and the communicator's
// asynchronous error until the deadline; on timeout or error the communicator is aborted (no
// member is left inside a collective) and every later call fails.
#ifndef MOE_RUNTIME_TRANSPORT_NCCL_H_
#define MOE_RUNTIME_TRANSPORT_NCCL_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "runtime/transport/transport.h"

namespace moe {

struct NcclOptions {
  int slot = 0;
  int size = 1;
  int device = 0;
  // The group's NCCL unique id (NewNcclUniqueId of one member, handed to every member by the
  // controller's rendezvous). Empty: member 0 makes one and writes it to `rendezvous_dir`, where
  // the others wait for it.
  std::string unique_id;
  std::string rendezvous_dir;
  absl::Duration connect_timeout = absl::Seconds(60);
  // The step agreement (StepGather) over a shared-memory channel when every member is on this
  // host (runtime/transport/shm_channel.h), with the step_gather.h protocol: members in different
  // steps abort at once. Otherwise, or when false, an NCCL all-gather of the record.
  bool host_agreement = true;
  // How a member waits for its NCCL work: 0 polls the stream without pause (yielding the core
  // between polls; the lowest latency, one core busy for the exchange's length); > 0 sleeps this
  // many microseconds between polls, which frees the core (for an engine on the same cores, or to
  // measure the host's own work) and adds up to about that much to each exchange.
  int wait_poll_us = 0;
};

absl::StatusOr<std::unique_ptr<Transport>> CreateNcclTransport(const NcclOptions& options);

// A new NCCL unique id (ncclGetUniqueId: the bootstrap address of a group's first member), as
// bytes for NcclOptions::unique_id.
absl::StatusOr<std::string> NewNcclUniqueId();

// The communicator (ncclComm_t) and stream (cudaStream_t) behind a transport made by
// CreateNcclTransport, for NCCL calls captured into CUDA graphs next to kernels (fixed-size
// decode buckets). Null for any other transport. Work issued on them is outside the
// transport's deadline and abort handling: the caller synchronizes it.
struct NcclHandles {
  void* comm = nullptr;
  void* stream = nullptr;
  int device = 0;
};
NcclHandles NativeNcclHandles(Transport& transport);
// Whether an NCCL transport agrees on steps over shared memory (false for any other transport).
bool NcclHostAgreement(Transport& transport);

// Waits for the work on the transport's stream with its deadline and abort handling (as its own
// collectives do): DEADLINE_EXCEEDED and an aborted communicator when a peer does not take part.
absl::Status WaitNcclStream(Transport& transport, uint64_t seq, absl::Duration timeout);

}  // namespace moe

#endif  // MOE_RUNTIME_TRANSPORT_NCCL_H_
