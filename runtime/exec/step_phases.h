// The pure parts of a step's phases (runtime/exec/step.h), as functions with their own tests
// (tests/runtime/step_phases_test.cc). LayerExecutor::RunPass strings them together with the
// stateful parts: the dispatch handle, the agreement and exchanges over the transport, the
// kernels.
#ifndef MOE_RUNTIME_EXEC_STEP_PHASES_H_
#define MOE_RUNTIME_EXEC_STEP_PHASES_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

#include "kernels/api.h"
#include "runtime/exec/decode_graph.h"
#include "runtime/exec/dispatch_handle.h"
#include "runtime/exec/step.h"
#include "runtime/ids.h"
#include "runtime/placement/manifest.h"
#include "runtime/placement/replica_selector.h"
#include "runtime/placement/topology.h"
#include "runtime/plan/route_plan.h"
#include "runtime/semantic.h"

namespace moe {

// validate: the engine's input against a generation of `num_experts` experts. INVALID_ARGUMENT
// naming the field (and the token and choice) otherwise. Routes the router dropped are not
// checked.
absl::Status ValidateStepInput(const LayerStepInput& in, int num_experts);
// The same without the per-route checks (shapes, pointers): what a device-planned step checks on
// the host; its routes are checked where they are keyed (kernels::SealRoutesParams).
absl::Status ValidateStepShape(const LayerStepInput& in);
// The error ValidateStepInput gives for route i (token-major) of `in` (an admitted route whose
// expert or gate is out of range): the same message whichever side found it.
absl::Status RouteInputError(const LayerStepInput& in, int64_t i, int num_experts);
// ... for route i (of k per token) whose expert is e and gate `gate` (read back from the kernels).
absl::Status RouteInputError(int64_t i, int k, int32_t e, float gate, int num_experts);

// validate: the engine's routes as this rank's sealed semantic handoff, token-major; a route the
// router dropped stays in it, unadmitted, with expert 0 and gate 0. `reuse`, when given, is an
// earlier step's handoff whose columns are refilled (their memory kept: no allocation, and no
// page faults, per step).
absl::StatusOr<FrozenHandoff> SealRoutes(const LayerStepInput& in, Rank rank, int num_experts, int num_partitions,
                                         SemanticHandoff* reuse = nullptr);

// plan (device): the slot each logical expert's routes from `me` take when replica selection
// leaves the step no choice: under locality-first, every expert's compatible slots of the best
// route class from `me` are on one rank (the lowest slot id wins the tie then); under least-load
// and hash, every expert has at most one compatible slot (round-robin: never, its cursor lives
// across steps). Entry e is that slot, or -1 when no compatible slot holds e (the step
// fails as the selector would). nullopt: some expert's slot depends on the step's routes (the
// load-aware tie-breaks, the hash of each route), so the host plan runs.
std::optional<std::vector<int32_t>> StaticSlotChoice(const PlacementManifest& m, const ProcessGroup& group,
                                                     const Topology& topology, Rank me, SelectorPolicy policy);

// plan: the admitted routes in semantic order (`ids`, indices into `routes`) with the slot
// replica selection gave each (`accepted`).
void AcceptRoutes(const SemanticHandoff& routes, absl::Span<const PhysicalSlotId> slots, std::vector<int32_t>* ids,
                  std::vector<PhysicalSlotId>* accepted);

// agree: a member's decode-graph manifest (bucket, whether it captures graphs, runner) and the
// step's shape (k routes a token, d; a graph is captured per shape) as one word of the step
// header; members whose words differ serve decode steps eagerly, so no member replays a graph
// shaped for another k than its peers' (its collectives would disagree in size).
uint64_t GraphManifestWord(int64_t rank_tokens, int64_t slot_routes, bool graphs, DecodeRunner runner, int64_t k,
                           int64_t d);

// dispatch: the origin token and gate of every send position (what the handle binds), into
// *out (its vectors keep their memory).
void InverseOf(const SemanticHandoff& routes, absl::Span<const int32_t> accepted_ids, const SourcePlan& source,
               int64_t tokens, InverseCoordinates* out);

// dispatch: bytes to and from every peer slot for rows of `row_bytes` and 4-byte slot metadata,
// into *out (its vectors keep their memory from step to step).
// Per peer: the BF16 rows sent and received (the return exchange runs them reversed), the
// dispatch's payload (the same rows, or packed FP8 rows of `dispatch_row_bytes`), slot metadata.
struct ByteSplits {
  std::vector<int64_t> send, recv, dispatch_send, dispatch_recv, send_meta, recv_meta;
};
void SplitBytes(absl::Span<const int64_t> send_counts, absl::Span<const int64_t> recv_counts, int64_t row_bytes,
                int64_t dispatch_row_bytes, ByteSplits* out);

// 0x0E "inverse permutation is corrupt -> reject output before publish": the combine tables must
// invert the send order, every sent position combined by exactly one route, and that route's
// token (route r is token r / k) the one the position was sent for (`position_token`, the
// handle's inverse coordinates). DATA_LOSS naming the route otherwise. `seen` is scratch.
absl::Status CheckCombineTables(absl::Span<const int32_t> row_of_route, absl::Span<const int32_t> position_token,
                                int64_t k, std::vector<uint8_t>* seen);

// combine: the token-major view of the handle's coordinates the combine kernel reads: route
// (t, j) -> its send position (-1: not sent) and its gate (0 when not sent).
void CombineTables(absl::Span<const int32_t> accepted_ids, const SourcePlan& source,
                   absl::Span<const float> gate_of_position, int64_t routes, std::vector<int32_t>* row_of_route,
                   std::vector<float>* gates);

// release: the route statistics of the record (attempted, accepted, dropped, remote, inter-node)
// from the accepted routes per physical slot of `m` (the counts the agreement carried), in
// O(slots) rather than O(routes).
void CountRoutes(const PlacementManifest& m, const Topology& topology, Rank me, absl::Span<const int64_t> slot_counts,
                 int64_t attempted, StepRecord* record);

// The host tables a step's kernels read (index tables, gates), each at a 16-byte aligned offset
// of one block that goes to kernel memory in one copy: with device kernels one host-to-device
// transfer a step instead of one a table. Host kernels read the tables in place.
class StepTables {
 public:
  // Adds `bytes` at `src` (read at Upload); returns the table's handle for Get.
  int Add(const void* src, int64_t bytes);
  absl::Status Upload(bool device, kernels::ExpertKernels& kern, kernels::KernelBuffer& to, std::vector<uint8_t>& host,
                      kernels::Stream stream);
  // The table where the kernels read it (nullptr: on the device, and nothing was uploaded).
  template <typename T>
  const T* Get(int table) const {
    const Table& t = tables_[table];
    if (!device_) return static_cast<const T*>(t.src);
    return base_ != nullptr ? reinterpret_cast<const T*>(base_ + t.offset) : nullptr;
  }
  int64_t total_bytes() const { return total_; }

 private:
  struct Table {
    const void* src;
    int64_t bytes, offset;
  };
  absl::InlinedVector<Table, 8> tables_;  // a step adds at most a few: no heap
  int64_t total_ = 0;
  bool device_ = false;
  const uint8_t* base_ = nullptr;
};

}  // namespace moe

#endif  // MOE_RUNTIME_EXEC_STEP_PHASES_H_
