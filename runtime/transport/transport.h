// Transport: the collectives a layer step needs between the ranks of one process group
// (spec 0x03C; conventions 5). Implementations: loopback (in-process, for unit tests), UCX (host
// memory over shm/tcp), NCCL (GPU; grouped send/recv).
//
// Coordinates are communicator peer slots, never global ranks (0x07B). Every call is collective:
// each member calls it with the same `seq` (e.g. the step id), and calls of one member are made
// in the same order on every member: AllGather and AllToAllV pair by position (a member's n-th
// call with every other member's n-th), `seq` only names the call in errors; StepGather pairs by
// step. A call returns only when this member's part is complete.
//
// Failure outcomes (0x0E): a peer that does not answer by the deadline is DEADLINE_EXCEEDED, a
// peer whose connection failed is UNAVAILABLE; either names the peer slot. Buffers are intact
// for the caller to reuse after any return. After a positional call timed out the members'
// positions differ: the peers it did not complete with are failed (UCX closes their endpoints,
// NCCL aborts the communicator) and later calls with them answer UNAVAILABLE at once. A
// StepGather that times out fails nothing.
//
// Thread-safety: one thread drives a Transport at a time.
#ifndef MOE_RUNTIME_TRANSPORT_TRANSPORT_H_
#define MOE_RUNTIME_TRANSPORT_TRANSPORT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace moe {

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  // This member's peer slot and the group size.
  virtual int slot() const = 0;
  virtual int size() const = 0;
  // Whether `send` / `recv` may be device memory (NCCL); host memory is accepted everywhere.
  virtual bool accepts_device_memory() const { return false; }

  // out[i * bytes, (i + 1) * bytes) = peer slot i's `in` (this member's included).
  virtual absl::Status AllGather(uint64_t seq, const void* in, int64_t bytes, void* out, absl::Duration timeout) = 0;

  // The step agreement's all-gather (runtime/exec/step_exchange.h): as AllGather, but members
  // in different steps answer ABORTED at once, naming both step ids, instead of each waiting out
  // the timeout, and an attempt that fails leaves nothing that a later step could pair with
  // (runtime/transport/step_gather.h). `step` is the step's whole 64-bit identity. The default
  // (NCCL: collectives pair by position, and a timeout aborts the communicator) is AllGather;
  // the caller compares the step ids it gathered.
  virtual absl::Status StepGather(uint64_t step, const void* in, int64_t bytes, void* out, absl::Duration timeout) {
    return AllGather(step, in, bytes, out, timeout);
  }

  // Tells every peer, without waiting, that this member will not take part in `step` (the
  // agreement's LEFT): peers in that step's StepGather answer ABORTED at once, and a peer that
  // enters it later does too. For a member bound to an epoch it has not opened yet, so that the
  // members that opened it do not wait out their timeout for it. Nothing where the agreement
  // pairs by position (the default: NCCL without a host channel).
  virtual void AbandonStep(uint64_t step) { (void)step; }

  // Variable all-to-all: send segment i (send_bytes[i] bytes, packed in peer order from `send`)
  // to peer slot i; receive recv_bytes[i] bytes from peer slot i into `recv` (packed in peer
  // order). Sizes must agree pairwise (the header exchange establishes them).
  virtual absl::Status AllToAllV(uint64_t seq, const void* send, absl::Span<const int64_t> send_bytes, void* recv,
                                 absl::Span<const int64_t> recv_bytes, absl::Duration timeout) = 0;

  // Whether a peer of this transport is failed for good: a positional call timed out with it,
  // its connection broke, or the communicator was aborted. Later calls with it answer
  // UNAVAILABLE at once; only a new process-group epoch (a new transport) heals that, so the
  // executor reports it to the group (LayerExecutor::SetEpochFaultListener). Asked by the thread
  // that drives the transport.
  virtual bool failed() const { return false; }

  // Ends the call in progress and every later one with UNAVAILABLE, from any thread: the
  // process group is being re-formed and this transport will be destroyed. Peers the member was
  // exchanging with see their own failure or timeout. Idempotent.
  void Interrupt() { interrupted_.store(true, std::memory_order_release); }
  bool interrupted() const { return interrupted_.load(std::memory_order_acquire); }
  static absl::Status InterruptedError(uint64_t seq) {
    return absl::UnavailableError(
        absl::StrCat("transport interrupted (seq ", seq, "): the process group is being re-formed"));
  }

 private:
  std::atomic<bool> interrupted_{false};
};

// In-process transport for `size` members driven by different threads.
class LoopbackFabric {
 public:
  explicit LoopbackFabric(int size);
  ~LoopbackFabric();
  // The endpoint of one member; the fabric must outlive it.
  std::unique_ptr<Transport> Endpoint(int slot);

 private:
  friend class LoopbackTransport;
  struct State;
  std::unique_ptr<State> state_;
  int size_;
};

struct UcxOptions {
  int slot = 0;
  // Network devices UCX may use (its NET_DEVICES, e.g. "lo" or "eth0"); empty: the device that
  // holds this member's listener address.
  std::string net_devices;
  // "host:port" of every member's listener, in peer-slot order (this member's included).
  std::vector<std::string> addresses;
  // How long Create() waits for every peer to be reachable.
  absl::Duration connect_timeout = absl::Seconds(30);
};

// UCX (tag API, client-server endpoints over sockaddr). Host memory only.
absl::StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(const UcxOptions& options);

// A UCX listener on `host` with an ephemeral port, created before the peers' addresses are
// known (for rendezvous through files). Pass it to CreateUcxTransportWithListener.
class UcxListenerHandle;
struct UcxListenerDeleter {
  void operator()(UcxListenerHandle* h) const;
};
using UcxListener = std::unique_ptr<UcxListenerHandle, UcxListenerDeleter>;
// `net_devices`: as UcxOptions::net_devices (empty: the interface that holds `host`'s address),
// so that UCX's own TCP listeners bind only there.
absl::StatusOr<UcxListener> CreateUcxListener(const std::string& host, const std::string& net_devices = "");
// The network interface that holds `address` (an IPv4 address or host name), e.g. "lo".
absl::StatusOr<std::string> InterfaceOf(const std::string& address);
std::string UcxListenerAddress(const UcxListenerHandle& listener);
absl::StatusOr<std::unique_ptr<Transport>> CreateUcxTransportWithListener(UcxListener listener,
                                                                          const UcxOptions& options);

// Rendezvous through a directory: writes `address` as <dir>/<slot>.addr and waits until all
// `size` members have written theirs. Returns the addresses in peer-slot order.
absl::StatusOr<std::vector<std::string>> RendezvousAddresses(const std::string& dir, int slot, int size,
                                                             const std::string& address, absl::Duration timeout);

}  // namespace moe

#endif  // MOE_RUNTIME_TRANSPORT_TRANSPORT_H_
