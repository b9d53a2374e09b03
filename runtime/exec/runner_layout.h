// Expert-runner layouts of one destination's received rows (spec 0x04B-0x04E).
//
// The same expert-major rows can be presented to the runner as:
//   kPaddedDense  - every local slot gets C_exec = a * ceil(C / a) rows, a valid-row mask marks
//                   useful rows; a count above the capacity is an error, never a silent drop;
//   kGrouped      - exact segments (row utilization 1), one problem per non-empty slot;
//   kBlockSparse  - each segment rounded up to a multiple of the row block (128 by default).
// Only useful rows keep route identity; padding and block-fringe rows never reach combine.
//
// Thread-safety: value types.
#ifndef MOE_RUNTIME_EXEC_RUNNER_LAYOUT_H_
#define MOE_RUNTIME_EXEC_RUNNER_LAYOUT_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace moe {

enum class RunnerKind { kPaddedDense, kGrouped, kBlockSparse };
const char* RunnerKindName(RunnerKind kind);

struct RunnerLayoutParams {
  RunnerKind kind = RunnerKind::kGrouped;
  int64_t capacity = 0;      // padded: rows admitted per slot (C)
  int64_t alignment = 1;     // padded: kernel row multiple (a)
  int64_t block_rows = 128;  // block-sparse: token-row block (B_r)
};

struct RunnerLayout {
  RunnerKind kind = RunnerKind::kGrouped;
  std::vector<int64_t> counts;            // useful rows per local slot
  std::vector<int64_t> executed_offsets;  // [L + 1], start of each slot's executed segment
  int64_t capacity_rows = 0;              // padded: L * C (before alignment)
  int64_t executed_rows = 0;
  int64_t useful_rows = 0;
  int64_t block_rows = 0;  // block-sparse: B_r

  int num_segments() const { return static_cast<int>(counts.size()); }
  int64_t ExecutedRows(int l) const { return executed_offsets[l + 1] - executed_offsets[l]; }
};

absl::StatusOr<RunnerLayout> MakeRunnerLayout(absl::Span<const int64_t> counts, const RunnerLayoutParams& params);

// Runs one local slot's executed segment: `in` and `out` hold `rows` x d values (FP32).
using SegmentFn = std::function<void(int local_slot, const float* in, int64_t rows, float* out)>;

// Scatters `useful_in` (expert-major useful rows) into the layout, fills padding with `poison`,
// runs `fn` over every executed segment (padding included, as a dense kernel would; grouped
// skips empty slots), and gathers only the useful rows into `useful_out`.
absl::Status RunLayout(const RunnerLayout& layout, const float* useful_in, int d, const SegmentFn& fn,
                       float* useful_out, float poison);

}  // namespace moe

#endif  // MOE_RUNTIME_EXEC_RUNNER_LAYOUT_H_
