// JSON form of the overlap schedule of spec 0x09 for `moectl overlap --input FILE`:
//   input  {"tasks": [{"name", "units", "stream", "waits_for": [...]}, ...],
//           "buffers": [{"name", "producer", "from_producer_start": false, "consumers": [...]}],
//           "overlap_streams": [["compute"], ["communication"]],            (optional)
//           "schedule": {"<task>": [start, end], ...},                        (optional: checked)
//           "buffer_lifetimes": {"<buffer>": [allocated, released], ...}}      (optional: checked)
//   output {"serialized": {...}, "overlapped": {...}, "makespan": {...}, "hidden_units",
//           "overlap_units", "buffer_lifetimes": {...}, "checked": {...}}
// Units are analytical (0x09C): a dependency argument, not a measured time.
#ifndef MOE_CONTROL_OVERLAP_IO_H_
#define MOE_CONTROL_OVERLAP_IO_H_

#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "control/json_util.h"
#include "runtime/plan/overlap.h"

namespace moe {

struct OverlapInput {
  std::vector<OverlapTask> tasks;
  std::vector<OverlapBuffer> buffers;
  std::set<std::string> streams_a = {"compute"}, streams_b = {"communication"};
  std::optional<std::vector<TaskSpan>> schedule;     // every task's, in task order
  std::optional<std::vector<BufferSpan>> lifetimes;  // every buffer's, in buffer order
};

// INVALID_ARGUMENT naming the field ("tasks[3].units: ...").
absl::StatusOr<OverlapInput> ParseOverlapInput(const json::Json& doc);
// The report; FAILED_PRECONDITION naming the violation when a given schedule or lifetime breaks
// 0x09B / 0x09D.
absl::StatusOr<json::Json> OverlapReport(const OverlapInput& in);

}  // namespace moe

#endif  // MOE_CONTROL_OVERLAP_IO_H_
