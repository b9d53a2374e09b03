#include "runtime/exec/runner_layout.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

#include "kernels/api.h"

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

namespace {
kernels::Layout ToKernelLayout(RunnerKind kind) {
  switch (kind) {
    case RunnerKind::kPaddedDense:
      return kernels::Layout::kPaddedDense;
    case RunnerKind::kGrouped:
      return kernels::Layout::kGrouped;
    case RunnerKind::kBlockSparse:
      return kernels::Layout::kBlockSparse;
  }
  return kernels::Layout::kGrouped;
}
}  // namespace

absl::StatusOr<RunnerLayout> MakeRunnerLayout(absl::Span<const int64_t> counts, const RunnerLayoutParams& params) {
  RunnerLayout layout;
  layout.kind = params.kind;
  layout.counts.assign(counts.begin(), counts.end());
  // The executed-segment arithmetic is the kernels' own, so plans and runners cannot disagree.
  const kernels::LayoutParams kp{ToKernelLayout(params.kind), params.capacity, params.alignment, params.block_rows};
  absl::Status s = kernels::ExecutedOffsets(kp, counts, &layout.executed_offsets);
  if (!s.ok()) return s;
  for (int64_t c : counts) layout.useful_rows += c;
  layout.executed_rows = layout.executed_offsets.back();
  switch (params.kind) {
    case RunnerKind::kPaddedDense:
      layout.capacity_rows = params.capacity * static_cast<int64_t>(counts.size());
      break;
    case RunnerKind::kGrouped:
      layout.capacity_rows = layout.useful_rows;
      break;
    case RunnerKind::kBlockSparse:
      layout.block_rows = params.block_rows;
      layout.capacity_rows = layout.executed_rows;
      break;
  }
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
