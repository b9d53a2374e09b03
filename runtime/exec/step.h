// One rank's layer step as the engine hands it in and as the executor reports it, and the named
// phases a step runs through (spec 0x03, 0x06H; docs/architecture.md):
//
//   validate -> acquire -> plan -> agree -> dispatch -> experts -> return -> combine -> release
//
// runtime/exec/step_phases.h has the phases' pure parts as functions; LayerExecutor::RunPass
// runs the phases in this order and times each (StepRecord::phase_us).
#ifndef MOE_RUNTIME_EXEC_STEP_H_
#define MOE_RUNTIME_EXEC_STEP_H_

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace moe {

enum class Phase { kPrefill, kDecode };

struct LayerStepInput {
  uint64_t step_id = 0;
  int64_t layer = 0;
  Phase phase = Phase::kPrefill;
  const uint16_t* hidden = nullptr;  // [tokens, d] BF16
  int64_t tokens = 0;
  int d = 0;
  const int32_t* topk_ids = nullptr;    // [tokens, k]
  const float* topk_weights = nullptr;  // [tokens, k]
  int k = 0;
  const uint8_t* admitted = nullptr;  // optional [tokens, k]; 0 = dropped by the router
  int64_t expected_generation = -1;   // -1: any
  // Optional: host memory of [tokens, d] BF16 where the combined rows are written (a step ring's
  // slot); LayerStepResult::output then stays empty. Null: the result owns its rows.
  uint16_t* output = nullptr;
  // The rows are in kernel memory (a co-located engine's GPU buffer, mapped through CUDA IPC):
  // `hidden` is read there and the combined rows are written to `output`, which must be set and
  // be kernel memory too. Only with device-resident kernels (FAILED_PRECONDITION otherwise). The
  // step returns once the output rows are written.
  bool rows_on_device = false;
  // topk_ids and topk_weights are in kernel memory (a co-located engine's GPU buffer; host memory
  // for the CPU reference), `admitted` stays on the host. A step planned on the kernels reads the
  // routing there in place; any other step copies it to the host first. The routing is read on
  // the kernels' stream and the step returns once nothing reads it any more.
  bool routing_on_device = false;
  // Optional, with rows_on_device: an event of the kernels' (ExpertKernels::CreateIpcEvent) that
  // the step records after its last GPU work on the engine's memory. The step then returns once
  // that work is enqueued instead of once the output rows are written; the engine's GPU work
  // waits on the event. A step that fails still returns only after its work settled (the event
  // may then be left unrecorded: its latest record is an earlier step's).
  void* done_event = nullptr;
  // Optional: a check of the input running beside the step's first phases (the service's NaN/Inf
  // scan of a prefill step's rows on worker threads). Awaited before the agreement, also when an
  // earlier phase failed (the rows must outlive it); a failure rejects the step into its
  // agreement like any other invalid input. Must be idempotent (a shadow pass awaits it again).
  std::function<absl::Status()> await_input_check;
  // Optional, with await_input_check: starts that check on the kernels' stream it is given (the
  // service's NaN/Inf scan of rows in device memory, LayerExecutor::StartDeviceRowCheck). The
  // executor calls it once a pass before anything awaits the check: inside a lone decode step's
  // recorded work where it records one (LayerExecutorOptions::lone_decode_graphs), else on the
  // null stream as the pass starts. A failure to start fails the step with that status.
  std::function<absl::Status(void* stream)> start_input_check;
};

// The phases of a step, in the order they run.
enum class StepPhase : int {
  kValidate,  // the engine's input checked against the generation, sealed as a semantic handoff
  kAcquire,   // the generation pinned by a dispatch handle; its weights and plan layout found
  kPlan,      // replica selection and the source plan (accepted routes, semantic order)
  kAgree,     // header and counts agreed with every peer (abort before payload); decode admission
  kDispatch,  // inverse coordinates bound, slot metadata and receive plan, rows packed and sent
  kExperts,   // receive repack, SwiGLU experts, inverse repack
  kReturn,    // the return exchange (splits reversed)
  kCombine,   // the gate-weighted combine into the engine's rows
  kRelease,   // the dispatch handle released, the record filled
};
inline constexpr int kNumStepPhases = 9;
// "validate", "acquire", "plan", "agree", "dispatch", "experts", "return", "combine", "release".
const char* StepPhaseName(StepPhase phase);

struct StepRecord {
  int64_t placement_version = 0;
  int64_t layer = 0;  // the MoE layer whose experts served the step
  // The layer the rank counts the step's load under (metrics, rebalancing): `layer`, or -1 where
  // the generation names no layers and serves every one with one expert set, so that the
  // engine's layer values cannot grow the rank's tables or metric series.
  int64_t load_layer = 0;
  bool graph_replay = false;
  // A lone member's decode step whose GPU work was one launch of a recording
  // (LayerExecutorOptions::lone_decode_graphs); not a decode-graph replay (its path stays eager).
  bool recorded = false;
  // Decode steps the graph did not admit: the first failing admission clause. Empty for replays
  // and for a lone member's decode steps (the local layer by design, no admission).
  std::string fallback_reason;
  int64_t routes_attempted = 0;
  int64_t routes_accepted = 0;
  int64_t routes_dropped = 0;
  int64_t routes_remote = 0;
  int64_t routes_inter_node = 0;
  int64_t bytes_sent = 0;     // payload bytes to other ranks (dispatch + return)
  int64_t routes_served = 0;  // routes this rank's experts computed (from every member's tokens)
  double execute_us = 0;      // wall time inside Execute
  bool canary = false;        // served by the candidate generation (a canary step)
  bool device_plan = false;   // planned by the kernels (LayerExecutorOptions::device_plan)
  // Wall time of each phase (index: StepPhase), microseconds. Work that one launch does for
  // several phases is timed under experts: a replayed decode graph (dispatch through combine)
  // and a lone member's decode step (route, experts and combine in one kernels call).
  std::array<double, kNumStepPhases> phase_us{};
};

// An allocator whose value-initialization leaves elements uninitialized: buffers that are
// written in full before they are read (a rank's expert weights, filled by the loader's threads,
// which fault their pages in in parallel; a step's output rows) are not zeroed first.
template <class T>
struct UninitializedAllocator : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = UninitializedAllocator<U>;
  };
  UninitializedAllocator() = default;
  template <class U>
  UninitializedAllocator(const UninitializedAllocator<U>&) noexcept {}
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
// A step's output rows, written in full by the combine before anyone reads them.
using RowBuffer = std::vector<uint16_t, UninitializedAllocator<uint16_t>>;

struct LayerStepResult {
  RowBuffer output;  // [tokens, d] BF16; empty when the input named its own output
  StepRecord record;
};

// Times consecutive phases into an array indexed by StepPhase: Enter(next) closes the phase
// running (if any) and starts `next`; Stop() closes it. Re-entering a phase adds to its time.
class PhaseClock {
 public:
  explicit PhaseClock(std::array<double, kNumStepPhases>* us) : us_(us), at_(absl::Now()) {}
  void Enter(StepPhase next) {
    Stop();
    current_ = static_cast<int>(next);
  }
  void Stop() {
    const absl::Time now = absl::Now();
    if (current_ >= 0) (*us_)[current_] += absl::ToDoubleMicroseconds(now - at_);
    at_ = now;
    current_ = -1;
  }

 private:
  std::array<double, kNumStepPhases>* us_;
  absl::Time at_;
  int current_ = -1;
};

}  // namespace moe

#endif  // MOE_RUNTIME_EXEC_STEP_H_
