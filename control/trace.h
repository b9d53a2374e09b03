// Offline layer-step traces for `moectl plan` (format: docs/trace-format.md).
//
// A trace names the topology, the process group (optional peer-slot order), the placement
// manifest, the routes (source rank, token, route slot, logical expert, gate, optional physical
// slot), the hidden rows of every source rank and a scalar per logical expert for the teaching
// expert E_e(x) = s_e x. PlanTrace plans it, runs the rows through the physical path under all
// three runner layouts, checks them against the direct semantic computation and returns every
// ledger as JSON. Parsing errors are INVALID_ARGUMENT naming the field; routes the manifest
// cannot serve are FAILED_PRECONDITION naming the route.
#ifndef MOE_CONTROL_TRACE_H_
#define MOE_CONTROL_TRACE_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "control/json_util.h"
#include "runtime/exec/runner_layout.h"
#include "runtime/placement/manifest.h"
#include "runtime/placement/replica_selector.h"
#include "runtime/placement/topology.h"
#include "runtime/plan/ledgers.h"
#include "runtime/plan/oracle.h"
#include "runtime/semantic.h"

namespace moe {

struct Trace {
  int d = 0;
  int d_ff = 0;
  std::optional<Topology> topology;
  std::optional<ProcessGroup> group;
  std::shared_ptr<const PlacementManifest> manifest;
  SemanticHandoff routes;
  std::vector<std::string> route_names;
  std::vector<PhysicalSlotId> slots;  // empty when the trace leaves selection to the runtime
  PartitionRows hidden;
  std::vector<float> expert_scale;
  int64_t capacity = 0;  // padded runner; 0 = max slot count
  int64_t alignment = 1;
  int64_t block_rows = 128;
  int block_cols = 0;  // 0 = d_ff
  LedgerWidths widths;
};

absl::StatusOr<Trace> ParseTrace(const json::Json& doc);

// Plans and executes the trace. `selector` chooses slots for routes that carry none.
absl::StatusOr<json::Json> PlanTrace(const Trace& trace, SelectorPolicy selector);

// Human-readable rendering of PlanTrace's result.
std::string RenderPlanText(const json::Json& report);

}  // namespace moe

#endif  // MOE_CONTROL_TRACE_H_
