// Dispatch handle: the per-step state that pairs one dispatch with exactly one combine
// (spec 0x01D2, 0x02B3, 0x06B).
//
// A handle binds the semantic digest, the placement generation (through a held lease), the
// checkpoint, the process group and its epoch, and the inverse coordinates and gates the
// combine needs. Its lifetime is the eight states of 0x06B:
//   0 router_output -> 1 dispatch_metadata_ready -> 2 dispatch_in_flight -> 3 expert_rows_ready
//   -> 4 expert_output_ready -> 5 combine_in_flight -> 6 origin_rows_ready
//   -> 7 dispatch_state_releasable
// Each transition is legal from exactly one state. Combine before dispatch completes, a second
// combine, or combining under another generation than the handle's are FAILED_PRECONDITION.
// Release (6 -> 7) returns the generation reference; only then may the generation retire.
//
// Thread-safety: a handle belongs to one step and is driven by one thread at a time.
#ifndef MOE_RUNTIME_EXEC_DISPATCH_HANDLE_H_
#define MOE_RUNTIME_EXEC_DISPATCH_HANDLE_H_

#include <memory>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

#include "runtime/ids.h"
#include "runtime/placement/registry.h"
#include "runtime/semantic.h"

namespace moe {

enum class HandleState {
  kRouterOutput = 0,
  kDispatchMetadataReady = 1,
  kDispatchInFlight = 2,
  kExpertRowsReady = 3,
  kExpertOutputReady = 4,
  kCombineInFlight = 5,
  kOriginRowsReady = 6,
  kReleasable = 7,
};
const char* HandleStateName(HandleState s);

// What the combine of this handle needs, per send position of the origin rank.
struct InverseCoordinates {
  std::vector<int32_t> token;  // origin token row of each send position
  std::vector<float> gate;     // combine gate of each send position (FP32)
  int64_t num_tokens = 0;      // rows of the origin's output
};

class DispatchHandle {
 public:
  // Acquires a reference on the registry's ACTIVE generation (state 0). The generation must be
  // bound to `group` (same id and epoch). The registry must outlive the handle. `spare`, a
  // finished step's handle after Reset(), is filled instead of a new one (no allocation a step);
  // on an error it is dropped.
  static absl::StatusOr<std::unique_ptr<DispatchHandle>> Acquire(HandleId id, const FrozenHandoff& handoff,
                                                                 GenerationRegistry* registry,
                                                                 const ProcessGroup& group,
                                                                 std::unique_ptr<DispatchHandle> spare = nullptr);
  // The same on a PREPARED candidate generation, for its shadow and canary steps; the handle's
  // combine then requires the candidate still resident (a promotion mid-step is fine).
  static absl::StatusOr<std::unique_ptr<DispatchHandle>> AcquireTrial(HandleId id, const FrozenHandoff& handoff,
                                                                      GenerationRegistry* registry,
                                                                      const ProcessGroup& group,
                                                                      PlacementVersion candidate,
                                                                      std::unique_ptr<DispatchHandle> spare = nullptr);
  // Back to a fresh handle's state for reuse: the generation lease released (as destroying the
  // handle would), the inverse coordinates dropped (ReleaseInverse first to keep them).
  void Reset();
  bool trial() const { return trial_; }

  HandleId id() const { return id_; }
  HandleState state() const { return state_; }
  PlacementVersion placement_version() const { return version_; }
  const CheckpointVersion& checkpoint() const { return checkpoint_; }
  const ProcessGroupId& process_group() const { return group_; }
  ProcessGroupEpoch epoch() const { return epoch_; }
  // The semantic handoff the handle was acquired for: its fingerprint (its SHA-256 identity is
  // FrozenHandoff::Digest()).
  uint64_t semantic_fingerprint() const { return fingerprint_; }
  const std::shared_ptr<const PlacementManifest>& manifest() const { return lease_.manifest(); }
  const InverseCoordinates& inverse() const { return inverse_; }
  // The bound inverse coordinates moved out, for their memory to serve a later step; the handle
  // keeps empty ones. For its owner once the step is over.
  InverseCoordinates ReleaseInverse() { return std::exchange(inverse_, InverseCoordinates{}); }

  // 0 -> 1: binds the inverse coordinates of the planned dispatch.
  absl::Status BindPlan(InverseCoordinates inverse);
  // 1 -> 2: payload submitted to the transport.
  absl::Status MarkDispatchInFlight();
  // 2 -> 3: the dispatch completion event has fired; expert rows are readable.
  absl::Status MarkExpertRowsReady();
  // 3 -> 4: the local runner produced expert output.
  absl::Status MarkExpertOutputReady();
  // 4 -> 5: starts the combine. Resolves the handle's own generation (never the active one),
  // requires it live, and requires `executor_version` (the generation the caller's buffers and
  // plan belong to) and the live manifest's checkpoint / group to equal the handle's.
  absl::Status BeginCombine(const GenerationRegistry& registry, PlacementVersion executor_version);
  // 5 -> 6: the combine completion event has fired.
  absl::Status MarkOriginRowsReady();
  // 6 -> 7: releases the generation reference. The handle is consumed.
  absl::Status Release();
  // 6 -> 7 for a step answered while its GPU work may still run (device rows with a done event,
  // the engine's stream waiting on it): the generation reference stays held, for TakeLease to
  // hand to whoever returns it once that work has finished. The handle is consumed.
  absl::Status ReleaseAfterWork();
  // The generation reference, moved out: held by the caller from here on (empty if none is held).
  GenerationLease TakeLease() { return std::move(lease_); }

 private:
  DispatchHandle() = default;
  absl::Status Advance(HandleState from, HandleState to, const char* what);

  HandleId id_;
  static absl::StatusOr<std::unique_ptr<DispatchHandle>> FromLease(HandleId id, const FrozenHandoff& handoff,
                                                                   const ProcessGroup& group, GenerationLease lease,
                                                                   bool trial, std::unique_ptr<DispatchHandle> spare);

  HandleState state_ = HandleState::kRouterOutput;
  bool trial_ = false;
  GenerationLease lease_;
  PlacementVersion version_;
  CheckpointVersion checkpoint_;
  ProcessGroupId group_;
  ProcessGroupEpoch epoch_;
  uint64_t fingerprint_ = 0;
  InverseCoordinates inverse_;
};

// Combine of one origin rank through its handle: BeginCombine, gate-weighted scatter-add of
// `returned_rows` ([send positions, d] FP32, in send order) into `out` ([num_tokens, d], FP32,
// accumulated), MarkOriginRowsReady, Release. On a fence error nothing is written.
absl::Status CombineAndRelease(DispatchHandle* handle, const GenerationRegistry& registry,
                               PlacementVersion executor_version, absl::Span<const float> returned_rows, int d,
                               absl::Span<float> out);

}  // namespace moe

#endif  // MOE_RUNTIME_EXEC_DISPATCH_HANDLE_H_
