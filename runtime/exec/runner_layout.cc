#include "runtime/exec/runner_layout.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace moe {

const char* RunnerKindName(RunnerKind kind) {
  switch (kind) {
    case RunnerKind::kPaddedDense:
      return "capacity-padded dense";
    case RunnerKind::kGrouped:
      return "variable grouped GEMM";
    case RunnerKind::kBlockSparse:
      return "block sparse";
  }
  return "unknown";
}

absl::StatusOr<RunnerLayout> MakeRunnerLayout(absl::Span<const int64_t> counts, const RunnerLayoutParams& params) {
  RunnerLayout layout;
  layout.kind = params.kind;
  layout.counts.assign(counts.begin(), counts.end());
  const int l_count = static_cast<int>(counts.size());
  layout.executed_offsets.assign(l_count + 1, 0);
  for (int l = 0; l < l_count; ++l) {
    if (counts[l] < 0) return absl::InvalidArgumentError(absl::StrCat("counts[", l, "]: negative"));
    layout.useful_rows += counts[l];
  }
  switch (params.kind) {
    case RunnerKind::kPaddedDense: {
      if (params.capacity <= 0) return absl::InvalidArgumentError("capacity: must be positive for the padded layout");
      if (params.alignment <= 0) return absl::InvalidArgumentError("alignment: must be positive");
      const int64_t c_exec = params.alignment * ((params.capacity + params.alignment - 1) / params.alignment);
      for (int l = 0; l < l_count; ++l) {
        if (counts[l] > params.capacity) {
          // 0x04G: a capacity below max(n_q) would silently turn overflow into a runner drop.
          return absl::FailedPreconditionError(absl::StrCat("local slot ", l, " has ", counts[l],
                                                            " rows, above the padded capacity ", params.capacity));
        }
        layout.executed_offsets[l + 1] = layout.executed_offsets[l] + c_exec;
      }
      layout.capacity_rows = params.capacity * l_count;
      break;
    }
    case RunnerKind::kGrouped:
      for (int l = 0; l < l_count; ++l) layout.executed_offsets[l + 1] = layout.executed_offsets[l] + counts[l];
      layout.capacity_rows = layout.useful_rows;
      break;
    case RunnerKind::kBlockSparse: {
      if (params.block_rows <= 0) return absl::InvalidArgumentError("block_rows: must be positive");
      const int64_t b = params.block_rows;
      layout.block_rows = b;
      for (int l = 0; l < l_count; ++l) {
        layout.executed_offsets[l + 1] = layout.executed_offsets[l] + b * ((counts[l] + b - 1) / b);
      }
      layout.capacity_rows = layout.executed_offsets[l_count];
      break;
    }
  }
  layout.executed_rows = layout.executed_offsets[l_count];
  return layout;
}

absl::Status RunLayout(const RunnerLayout& layout, const float* useful_in, int d, const SegmentFn& fn,
                       float* useful_out, float poison) {
  if (d <= 0) return absl::InvalidArgumentError("d: must be positive");
  std::vector<float> in(static_cast<size_t>(layout.executed_rows) * d, poison);
  std::vector<float> out(in.size(), poison);
  int64_t useful = 0;
  for (int l = 0; l < layout.num_segments(); ++l) {
    std::memcpy(in.data() + layout.executed_offsets[l] * d, useful_in + useful * d,
                sizeof(float) * layout.counts[l] * d);
    useful += layout.counts[l];
  }
  for (int l = 0; l < layout.num_segments(); ++l) {
    const int64_t rows = layout.ExecutedRows(l);
    if (rows == 0) continue;  // grouped: an empty slot has no problem, but keeps its index
    fn(l, in.data() + layout.executed_offsets[l] * d, rows, out.data() + layout.executed_offsets[l] * d);
  }
  useful = 0;
  for (int l = 0; l < layout.num_segments(); ++l) {
    std::memcpy(useful_out + useful * d, out.data() + layout.executed_offsets[l] * d,
                sizeof(float) * layout.counts[l] * d);
    useful += layout.counts[l];
  }
  return absl::OkStatus();
}

}  // namespace moe
