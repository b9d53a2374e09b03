// C++ client library of the data plane: what an inference engine links to call its rank's
// ExpertLayerService once per layer step.
//
// Thread-safety: one client may be used by several threads (gRPC channels are thread-safe).
#ifndef MOE_SERVER_CLIENT_H_
#define MOE_SERVER_CLIENT_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "proto/moe/v1/expert_layer.grpc.pb.h"
#include "rpc/tls.h"

namespace moe {

struct StepCall {
  uint64_t step_id = 0;
  int64_t layer = 0;
  bool decode = false;
  std::vector<uint16_t> hidden;  // [tokens, d] BF16
  int64_t tokens = 0;
  int d = 0;
  std::vector<int32_t> topk_ids;    // [tokens, k]
  std::vector<float> topk_weights;  // [tokens, k]
  int k = 0;
  std::vector<uint8_t> admitted;    // optional [tokens, k]
  int64_t expected_generation = 0;  // 0: any
};

struct StepAnswer {
  std::vector<uint16_t> output;  // [tokens, d] BF16
  v1::StepRecord record;
  double client_latency_us = 0;
};

struct StepRingOptions {
  int slots = 2;             // steps in flight at once
  int64_t max_tokens = 256;  // rows per step
  int d = 0;                 // hidden columns (BF16)
  int k = 0;                 // routes per row
  int64_t spin_us = 50;      // how long Wait spins before it sleeps on the futex
  // Rows in the engine's GPU memory (docs/api.md "Rows on the engine's GPU"): the CUDA IPC handle
  // of the allocation that holds the ring's device slots, their byte offset in it, and the
  // interprocess event the engine records after writing a step and before Submit (optional:
  // without it the engine's writes must be complete at Submit). The engine writes each slot's
  // rows (and, with StepMeta::device_routing, its routing) at the offsets of
  // ring::ComputeDeviceGeometry; this client never touches device memory.
  struct DeviceRows {
    std::string ipc_handle;   // cudaIpcMemHandle_t, 64 bytes
    uint64_t offset = 0;      // a multiple of 256
    std::string ready_event;  // cudaIpcEventHandle_t, 64 bytes, or empty
    // Ask for the rank's done events (docs/api.md "Completion"): steps are answered once their
    // GPU work is enqueued, and the engine's stream waits on StepRing::done_events()[slot]
    // (cudaIpcOpenEventHandle once, cudaStreamWaitEvent after each Wait) before it reads the
    // output or writes that slot again.
    bool done_events = false;
  };
  std::optional<DeviceRows> device_rows;
};

// A step ring on the engine's co-located rank (docs/api.md "Step rings"; server/step_ring_layout.h):
// the engine writes a step's rows and routing into a shared slot in place, rings a futex
// doorbell, and finds the output rows in the same slot. Opened through ExpertLayerClient::OpenRing
// on the rank's Unix socket.
//
// Thread-safety: one thread drives a ring; separate rings may be driven concurrently. The rank
// serves a ring's steps in submission order, interleaved with its gRPC steps.
class StepRing {
 public:
  ~StepRing();  // closes the ring and the claim connection (the rank tears it down)

  struct Slot {
    uint16_t* hidden;        // [max_tokens, d] BF16: write the step's rows here (null with device rows)
    int32_t* topk_ids;       // [max_tokens, k]: the step's [tokens, k] ids, row-major
    float* topk_weights;     // [max_tokens, k]
    uint8_t* admitted;       // [max_tokens, k]: read only when StepMeta::admitted is set
    const uint16_t* output;  // [max_tokens, d] BF16: the step's output after Wait (null with device rows)
    // With device rows: the byte offset, from the ring's device_rows.offset in the engine's
    // allocation, of this slot's device slot (ring::DeviceGeometry gives the parts inside it).
    uint64_t device_slot_offset;
  };
  struct StepMeta {
    uint64_t step_id = 0;
    int64_t layer = 0;
    bool decode = false;
    int64_t tokens = 0;
    int k = 0;
    bool admitted = false;
    int64_t expected_generation = 0;  // 0: any
    // With device rows: the routing is in the device slot (topk_ids / topk_weights there), not
    // in Slot::topk_ids / topk_weights.
    bool device_routing = false;
  };
  // The slot the next Submit uses; waits (up to `deadline`) while every slot is in flight.
  absl::StatusOr<Slot> NextSlot(absl::Duration deadline = absl::Seconds(60));
  // Submits the step written into NextSlot()'s slot.
  absl::Status Submit(const StepMeta& meta);
  // Waits for the oldest outstanding step: its record, or its error (the rank's status code and
  // message). Its output rows stay in its slot until the slot is submitted again.
  absl::StatusOr<v1::StepRecord> Wait(absl::Duration deadline = absl::Seconds(60), const uint16_t** output = nullptr);
  // One step end to end: the call copied into the next slot, submitted, waited for, copied out.
  absl::StatusOr<StepAnswer> Execute(const StepCall& call, absl::Duration deadline = absl::Seconds(60));
  // CloseStepRing through gRPC (the destructor only hangs up).
  absl::Status Close();

  // Whether the ring's rows are in the engine's GPU memory (StepRingOptions::device_rows); then
  // Execute, which copies host rows, is refused: write the device slots and Submit.
  bool device_rows() const { return device_rows_; }
  int64_t max_tokens() const { return max_tokens_; }
  int d() const { return d_; }
  int k() const { return k_; }
  uint64_t id() const { return id_; }
  int outstanding() const { return static_cast<int>(submitted_ - waited_); }
  // With DeviceRows::done_events, the rank's event handles (cudaIpcEventHandle_t, 64 bytes), one
  // per slot; empty without them (or from a rank that does not offer them: its answers then mean
  // the output rows are written). Steps take the slots in turn: the step the last Wait returned
  // used slot last_slot().
  const std::vector<std::string>& done_events() const { return done_events_; }
  int last_slot() const { return waited_ == 0 ? -1 : static_cast<int>((waited_ - 1) % slots_); }
  // Submit to completion of the step the last Wait returned, microseconds.
  double last_client_us() const { return last_client_us_; }

 private:
  friend class ExpertLayerClient;
  StepRing() = default;
  char* slot(uint32_t seq) const;

  v1::ExpertLayerService::Stub* stub_ = nullptr;  // the opening client's, for Close
  uint64_t id_ = 0;
  int conn_ = -1;  // the claim connection: the engine's hold on the ring
  char* base_ = nullptr;
  uint64_t bytes_ = 0;
  int slots_ = 0;
  int64_t max_tokens_ = 0;
  int d_ = 0, k_ = 0;
  int64_t spin_us_ = 50;
  bool device_rows_ = false;
  uint64_t device_slot_bytes_ = 0;
  uint64_t slot_bytes_ = 0, hidden_off_ = 0, output_off_ = 0, ids_off_ = 0, weights_off_ = 0, admitted_off_ = 0;
  uint32_t submitted_ = 0, waited_ = 0;
  std::vector<absl::Time> submit_times_;  // by slot
  std::vector<std::string> done_events_;
  double last_client_us_ = 0;
};

class ExpertLayerClient {
 public:
  // `address`: a gRPC target, "unix:/path/to/engine.sock" (the rank's --engine_socket) or
  // "host:port" (then `token` is the rank's --engine_token_file token, and `tls` this engine's
  // certificate, key and the CA when the rank serves mutual TLS: --tls_*).
  static absl::StatusOr<std::unique_ptr<ExpertLayerClient>> Connect(const std::string& address, absl::Duration timeout,
                                                                    const std::string& token = "",
                                                                    const TlsFiles& tls = {});
  absl::StatusOr<StepAnswer> Execute(const StepCall& call, absl::Duration deadline = absl::Seconds(60));
  // A step ring on this rank (the client must be connected to the rank's Unix socket, and must
  // outlive the ring).
  absl::StatusOr<std::unique_ptr<StepRing>> OpenRing(const StepRingOptions& options);
  // From now on Execute sends the well-formed steps that fit `options` through a ring of its own
  // (one step at a time); larger or malformed ones keep going through gRPC, which checks them
  // and has the rank reject them into the step's agreement.
  absl::Status UseRing(const StepRingOptions& options);
  bool using_ring() const { return ring_ != nullptr; }

 private:
  ExpertLayerClient(std::shared_ptr<grpc::Channel> channel, std::string token)
      : channel_(channel), stub_(v1::ExpertLayerService::NewStub(channel)), token_(std::move(token)) {}
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::ExpertLayerService::Stub> stub_;
  std::string token_;
  absl::Mutex ring_mu_;  // a ring has one driver at a time
  std::unique_ptr<StepRing> ring_;
};

}  // namespace moe

#endif  // MOE_SERVER_CLIENT_H_
