// JSON form of the EPLB solver for `moectl eplb solve` (layer-major, as the pinned solver):
//   input  {"weight": [[...] per layer], "num_replicas": N, "num_groups": G, "num_nodes": n,
//           "num_gpus": g}
//   output {"phy2log": [[...]], "log2phy": [[[...]]], "logcnt": [[...]]}
#ifndef MOE_CONTROL_EPLB_IO_H_
#define MOE_CONTROL_EPLB_IO_H_

#include "absl/status/statusor.h"

#include "control/json_util.h"
#include "runtime/placement/eplb.h"

namespace moe {

absl::StatusOr<EplbProblem> ParseEplbProblem(const json::Json& doc);
json::Json EplbSolutionJson(const EplbSolution& solution);

}  // namespace moe

#endif  // MOE_CONTROL_EPLB_IO_H_
