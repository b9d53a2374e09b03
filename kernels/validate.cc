#include <algorithm>
#include <cstdint>
#include <limits>

#include "absl/strings/str_cat.h"

#include "kernels/api.h"
#include "kernels/arg_checks.h"

namespace moe::kernels {

int DTypeBytes(DType t) {
  switch (t) {
    case DType::kBF16:
      return 2;
    case DType::kFP32:
      return 4;
    case DType::kFP8E4M3:
      return 1;
  }
  return 0;
}

const char* LayoutName(Layout l) {
  switch (l) {
    case Layout::kPaddedDense:
      return "padded";
    case Layout::kGrouped:
      return "grouped";
    case Layout::kBlockSparse:
      return "block-sparse";
  }
  return "unknown";
}

int64_t ScaleCount(ScaleGranularity g, int64_t rows, int d) {
  switch (g) {
    case ScaleGranularity::kNone:
      return 0;
    case ScaleGranularity::kPerRow:
      return rows;
    case ScaleGranularity::kPerBlock128:
      return rows * ((d + 127) / 128);
    case ScaleGranularity::kBlock128x128:
      return ((rows + 127) / 128) * ((d + 127) / 128);
  }
  return 0;
}

absl::Status ValidateOffsets(absl::Span<const int64_t> offsets, int64_t rows, const char* field) {
  KERNEL_INVALID_IF(offsets.empty(), field, ": needs E + 1 entries");
  KERNEL_INVALID_IF(offsets[0] != 0, field, "[0]: ", offsets[0], ", must be 0");
  for (size_t i = 1; i < offsets.size(); ++i) {
    KERNEL_INVALID_IF(offsets[i] < offsets[i - 1], field, "[", i, "]: ", offsets[i], " < ", field, "[", i - 1,
                      "] = ", offsets[i - 1]);
  }
  KERNEL_INVALID_IF(offsets.back() != rows, field, ": sentinel ", offsets.back(), " does not equal the ", rows,
                    " rows");
  return absl::OkStatus();
}

namespace {

// The executed layout of useful segment sizes count(0) .. count(n - 1): emit(e, executed rows of
// segment e) in order, or the first error.
template <typename Count, typename Emit>
absl::Status WalkExecuted(const LayoutParams& p, size_t n, Count count, Emit emit) {
  int64_t c_exec = 0;
  if (p.layout == Layout::kPaddedDense) {
    KERNEL_INVALID_IF(p.capacity <= 0, "capacity: must be positive for the padded layout");
    KERNEL_INVALID_IF(p.alignment <= 0, "alignment: must be positive");
    c_exec = p.alignment * ((p.capacity + p.alignment - 1) / p.alignment);
  }
  KERNEL_INVALID_IF(p.layout == Layout::kBlockSparse && p.block_rows <= 0, "block_rows: must be positive");
  for (size_t e = 0; e < n; ++e) {
    const int64_t c = count(e);
    KERNEL_INVALID_IF(c < 0, "counts[", e, "]: negative");
    int64_t executed = c;
    if (p.layout == Layout::kPaddedDense) {
      if (c > p.capacity) {
        return absl::FailedPreconditionError(
            absl::StrCat("segment ", e, " has ", c, " rows, above the padded capacity ", p.capacity));
      }
      executed = c_exec;
    } else if (p.layout == Layout::kBlockSparse) {
      executed = p.block_rows * ((c + p.block_rows - 1) / p.block_rows);
    }
    emit(e, executed);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ExecutedOffsets(const LayoutParams& p, absl::Span<const int64_t> counts, std::vector<int64_t>* out) {
  out->assign(counts.size() + 1, 0);  // keeps a reused vector's capacity: no allocation a step
  return WalkExecuted(
      p, counts.size(), [&](size_t e) { return counts[e]; },
      [&](size_t e, int64_t executed) { (*out)[e + 1] = (*out)[e] + executed; });
}

absl::Status CheckExecutedLayout(const LayoutParams& p, absl::Span<const int64_t> offsets) {
  if (offsets.empty()) return absl::OkStatus();
  return WalkExecuted(
      p, offsets.size() - 1, [&](size_t e) { return offsets[e + 1] - offsets[e]; }, [](size_t, int64_t) {});
}

absl::Status CheckGather(const GatherParams& p) {
  KERNEL_INVALID_IF(p.d <= 0, "gather.d: must be positive");
  KERNEL_INVALID_IF(p.n < 0 || p.in_rows < 0, "gather: negative row count");
  KERNEL_INVALID_IF(p.n > 0 && (p.index == nullptr || p.out == nullptr || (p.in_rows > 0 && p.in == nullptr)),
                    "gather: null buffer");
  KERNEL_INVALID_IF(p.scales == ScaleGranularity::kBlock128x128,
                    "gather.scales: 128 x 128 block scales are for weights, not row payloads");
  if (p.scales != ScaleGranularity::kNone) {
    KERNEL_INVALID_IF(p.dtype != DType::kFP8E4M3, "gather.scales: only FP8 payloads carry scales");
    const int64_t want = ScaleCount(p.scales, p.in_rows, p.d);
    KERNEL_INVALID_IF(p.in_scale_count != want, "gather.in_scale_count: ", p.in_scale_count, ", the payload of ",
                      p.in_rows, " rows x ", p.d, " needs ", want);
    KERNEL_INVALID_IF(p.n > 0 && (p.in_scales == nullptr || p.out_scales == nullptr), "gather: null scale buffer");
  } else {
    KERNEL_INVALID_IF(p.dtype == DType::kFP8E4M3, "gather.scales: an FP8 payload needs its scales");
  }
  return absl::OkStatus();
}

absl::Status CheckHistogram(const HistogramParams& p) {
  KERNEL_INVALID_IF(p.num_bins <= 0, "histogram.num_bins: must be positive");
  KERNEL_INVALID_IF(p.n < 0, "histogram.n: negative");
  KERNEL_INVALID_IF(p.counts == nullptr || p.offsets == nullptr || (p.n > 0 && p.keys == nullptr),
                    "histogram: null buffer");
  return absl::OkStatus();
}

absl::Status CheckRouteRows(const RouteRowsParams& p) {
  KERNEL_INVALID_IF(p.num_experts <= 0 || p.k <= 0 || p.num_tokens < 0,
                    "route_rows: num_experts and k must be positive");
  KERNEL_INVALID_IF(p.num_tokens > std::numeric_limits<int32_t>::max() / p.k,
                    "route_rows.num_tokens: num_tokens x k must be below 2^31 (rows are 32-bit)");
  KERNEL_INVALID_IF(p.counts == nullptr || p.offsets == nullptr, "route_rows: null counts/offsets");
  KERNEL_INVALID_IF(p.num_tokens > 0 && (p.topk == nullptr || p.row_of_route == nullptr || p.token_of_row == nullptr),
                    "route_rows: null buffer");
  return absl::OkStatus();
}

absl::Status CheckSealRoutes(const SealRoutesParams& p) {
  KERNEL_INVALID_IF(p.num_experts <= 0, "seal_routes.num_experts: must be positive");
  KERNEL_INVALID_IF(p.routes < 0 || p.routes > std::numeric_limits<int32_t>::max(),
                    "seal_routes.routes: outside [0, 2^31)");
  KERNEL_INVALID_IF(p.status == nullptr || p.key_of_expert == nullptr, "seal_routes: null status or key table");
  KERNEL_INVALID_IF(
      p.routes > 0 && (p.ids == nullptr || p.gates == nullptr || p.keys == nullptr || p.gates_out == nullptr),
      "seal_routes: null buffer");
  KERNEL_INVALID_IF(p.num_keys < 0, "seal_routes.num_keys: negative");
  KERNEL_INVALID_IF(p.local != nullptr && p.num_keys > 0 && p.local_of_key == nullptr,
                    "seal_routes.local_of_key: null with local");
  return absl::OkStatus();
}

absl::Status CheckRankByKey(const RankByKeyParams& p) {
  KERNEL_INVALID_IF(p.num_keys <= 0, "rank_by_key.num_keys: must be positive");
  KERNEL_INVALID_IF(p.n < 0 || p.n > std::numeric_limits<int32_t>::max(), "rank_by_key.n: outside [0, 2^31)");
  KERNEL_INVALID_IF(p.order_divisor <= 0, "rank_by_key.order_divisor: must be positive");
  KERNEL_INVALID_IF(p.key_map != nullptr && p.map_size <= 0, "rank_by_key.map_size: must be positive with a map");
  KERNEL_INVALID_IF(p.n > 0 && p.values != nullptr && p.key_values == nullptr, "rank_by_key.values: need key_values");
  KERNEL_INVALID_IF(p.counts == nullptr || p.offsets == nullptr || p.status == nullptr,
                    "rank_by_key: null counts, offsets or status");
  KERNEL_INVALID_IF(p.n > 0 && (p.raw == nullptr || p.position == nullptr), "rank_by_key: null buffer");
  return absl::OkStatus();
}

absl::Status CheckComposeIndex(const ComposeIndexParams& p) {
  KERNEL_INVALID_IF(p.n < 0 || p.n > std::numeric_limits<int32_t>::max(), "compose_index.n: outside [0, 2^31)");
  KERNEL_INVALID_IF(p.a_n < 0 || p.a_n > std::numeric_limits<int32_t>::max(), "compose_index.a_n: outside [0, 2^31)");
  KERNEL_INVALID_IF(p.n > 0 && (p.b == nullptr || p.out == nullptr), "compose_index: null buffer");
  KERNEL_INVALID_IF(p.a_n > 0 && p.a == nullptr, "compose_index: null a");
  return absl::OkStatus();
}

absl::Status CheckScatter(const ScatterParams& p) {
  KERNEL_INVALID_IF(p.d <= 0, "scatter.d: must be positive");
  KERNEL_INVALID_IF(p.fanout <= 0, "scatter.fanout: must be positive");
  KERNEL_INVALID_IF(p.in_rows < 0 || p.in_rows > std::numeric_limits<int32_t>::max() / p.fanout,
                    "scatter.in_rows: ", p.in_rows, " x fanout ", p.fanout, " outside [0, 2^31)");
  KERNEL_INVALID_IF(p.out_rows < 0 || p.out_rows > std::numeric_limits<int32_t>::max(),
                    "scatter.out_rows: outside [0, 2^31)");
  KERNEL_INVALID_IF(p.in_rows > 0 && (p.in == nullptr || p.dest == nullptr), "scatter: null in or dest");
  KERNEL_INVALID_IF(p.out_rows > 0 && p.out == nullptr, "scatter: null out");
  KERNEL_INVALID_IF(p.out_ld != 0 && (p.out_ld < p.d || p.out_ld >= (int64_t{1} << 31)), "scatter.out_ld: ", p.out_ld,
                    " outside [d (", p.d, "), 2^31)");
  return absl::OkStatus();
}

absl::Status CheckPackFp8(const PackFp8Params& p) {
  KERNEL_INVALID_IF(p.d <= 0 || p.d % 128 != 0, "pack_fp8.d: ", p.d, " must be a positive multiple of 128");
  KERNEL_INVALID_IF(p.k <= 0, "pack_fp8.k: must be positive");
  KERNEL_INVALID_IF(p.tokens < 0 || p.tokens > std::numeric_limits<int32_t>::max() / p.k, "pack_fp8.tokens: ", p.tokens,
                    " x k ", p.k, " outside [0, 2^31)");
  KERNEL_INVALID_IF(p.out_rows < 0 || p.out_rows > std::numeric_limits<int32_t>::max(),
                    "pack_fp8.out_rows: outside [0, 2^31)");
  KERNEL_INVALID_IF(p.tokens > 0 && (p.x == nullptr || p.dest == nullptr), "pack_fp8: null x or dest");
  KERNEL_INVALID_IF(p.out_rows > 0 && p.out == nullptr, "pack_fp8: null out");
  KERNEL_INVALID_IF((reinterpret_cast<uintptr_t>(p.out) & 15) != 0, "pack_fp8.out: not 16-byte aligned");
  return absl::OkStatus();
}

absl::Status CheckSwiglu(const SwigluParams& p) {
  const ExpertWeights& w = p.weights;
  KERNEL_INVALID_IF(w.num_experts <= 0 || w.d <= 0 || w.d_ff <= 0,
                    "swiglu.weights: num_experts, d and d_ff must be positive");
  KERNEL_INVALID_IF(w.w_gate_up == nullptr || w.w_down == nullptr, "swiglu.weights: null");
  KERNEL_INVALID_IF(p.rows > 0 && (p.x == nullptr || p.y == nullptr), "swiglu: null x or y");
  KERNEL_INVALID_IF(p.x_row_index != nullptr && p.host_offsets != nullptr,
                    "swiglu.x_row_index: only with device_offsets (the decode path)");
  if (p.host_offsets == nullptr) {
    KERNEL_INVALID_IF(p.device_offsets == nullptr, "swiglu: host_offsets or device_offsets required");
    KERNEL_INVALID_IF(p.layout.layout == Layout::kBlockSparse,
                      "swiglu.device_offsets: the decode path runs the grouped or the padded layout, not block-sparse");
    KERNEL_INVALID_IF(p.layout.layout == Layout::kPaddedDense && (p.layout.capacity <= 0 || p.layout.alignment <= 0),
                      "swiglu.layout: the padded layout on the decode path needs a positive capacity and alignment");
    return absl::OkStatus();
  }
  absl::Status s =
      ValidateOffsets(absl::MakeConstSpan(p.host_offsets, w.num_experts + 1), p.rows, "swiglu.host_offsets");
  if (!s.ok()) return s;
  return CheckExecutedLayout(p.layout, absl::MakeConstSpan(p.host_offsets, w.num_experts + 1));
}

absl::Status CheckSwigluFp8(const SwigluFp8Params& p) {
  const Fp8ExpertWeights& w = p.weights;
  KERNEL_INVALID_IF(w.num_experts <= 0 || w.d <= 0 || w.d_ff <= 0,
                    "swiglu_fp8.weights: num_experts, d and d_ff must be positive");
  KERNEL_INVALID_IF(w.d % 128 != 0 || w.d_ff % 128 != 0, "swiglu_fp8.weights: d (", w.d, ") and d_ff (", w.d_ff,
                    ") must be multiples of 128, the scale blocks");
  KERNEL_INVALID_IF(
      w.w_gate_up == nullptr || w.gate_up_scales == nullptr || w.w_down == nullptr || w.down_scales == nullptr,
      "swiglu_fp8.weights: null weights or scales");
  KERNEL_INVALID_IF(p.rows < 0 || p.rows >= (int64_t{1} << 31), "swiglu_fp8.rows: ", p.rows, " outside [0, 2^31)");
  auto misaligned = [](const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) != 0; };
  KERNEL_INVALID_IF(misaligned(w.w_gate_up) || misaligned(w.w_down), "swiglu_fp8.weights: not 16-byte aligned");
  KERNEL_INVALID_IF(misaligned(p.x) || misaligned(p.xq) || misaligned(p.y),
                    "swiglu_fp8: x, xq or y not 16-byte aligned");
  KERNEL_INVALID_IF(p.offsets == nullptr, "swiglu_fp8.offsets: null");
  KERNEL_INVALID_IF(p.x != nullptr && p.xq != nullptr, "swiglu_fp8.xq: given with x (one of the two)");
  KERNEL_INVALID_IF((p.xq == nullptr) != (p.x_scales == nullptr),
                    "swiglu_fp8.x_scales: ", p.xq == nullptr ? "given without xq" : "null with xq");
  KERNEL_INVALID_IF((reinterpret_cast<uintptr_t>(p.x_scales) & 3) != 0, "swiglu_fp8.x_scales: not 4-byte aligned");
  KERNEL_INVALID_IF((p.xq_ld != 0 || p.x_scales_ld != 0) && p.xq == nullptr,
                    "swiglu_fp8.xq_ld: row strides are for xq (quantized rows)");
  KERNEL_INVALID_IF(p.xq_ld != 0 && (p.xq_ld < w.d || p.xq_ld % 16 != 0 || p.xq_ld >= (int64_t{1} << 31)),
                    "swiglu_fp8.xq_ld: ", p.xq_ld, " must be a multiple of 16 in [d (", w.d, "), 2^31)");
  KERNEL_INVALID_IF(p.x_scales_ld != 0 && (p.x_scales_ld < w.d / 128 || p.x_scales_ld >= (int64_t{1} << 31)),
                    "swiglu_fp8.x_scales_ld: ", p.x_scales_ld, " outside [d / 128 (", w.d / 128, "), 2^31)");
  KERNEL_INVALID_IF(p.rows > 0 && ((p.x == nullptr && p.xq == nullptr) || p.y == nullptr),
                    "swiglu_fp8: null x (or xq) or y");
  return absl::OkStatus();
}

absl::Status CheckCombine(const CombineParams& p) {
  KERNEL_INVALID_IF(p.d <= 0 || p.k <= 0, "combine: d and k must be positive");
  KERNEL_INVALID_IF(p.num_tokens < 0 || p.num_rows < 0, "combine: negative size");
  KERNEL_INVALID_IF(p.out_fp32 == nullptr && p.out_bf16 == nullptr, "combine: no output");
  KERNEL_INVALID_IF(p.num_tokens > 0 && (p.row_of_route == nullptr || p.gate == nullptr),
                    "combine: null route map or gates");
  return absl::OkStatus();
}

absl::Status CheckLocalLayer(const LocalLayerParams& p) {
  const ExpertWeights& w = p.weights;
  KERNEL_INVALID_IF(w.num_experts <= 0 || w.d <= 0 || w.d_ff <= 0,
                    "local_layer.weights: num_experts, d and d_ff must be positive");
  KERNEL_INVALID_IF(w.w_gate_up == nullptr || w.w_down == nullptr, "local_layer.weights: null");
  KERNEL_INVALID_IF(p.k <= 0, "local_layer.k: must be positive");
  KERNEL_INVALID_IF(p.num_tokens < 0, "local_layer.num_tokens: negative");
  KERNEL_INVALID_IF(p.out_fp32 == nullptr && p.out_bf16 == nullptr, "local_layer: no output");
  KERNEL_INVALID_IF(p.num_tokens > 0 && (p.x == nullptr || p.topk == nullptr || p.gate == nullptr),
                    "local_layer: null x, topk or gate");
  KERNEL_INVALID_IF(p.num_tokens * p.k > std::numeric_limits<int32_t>::max(),
                    "local_layer.num_tokens: num_tokens * k must fit 32-bit row indices");
  KERNEL_INVALID_IF(p.padded_capacity < 0, "local_layer.padded_capacity: negative");
  return absl::OkStatus();
}

int64_t PaddedDecodeCapacity(absl::Span<const int64_t> counts, int d, int d_ff) {
  const int64_t experts = static_cast<int64_t>(counts.size());
  if (experts == 0 || experts * 6 * d * static_cast<int64_t>(d_ff) < (int64_t{256} << 20)) return 0;
  int64_t routes = 0, hit = 0, most = 0;
  for (int64_t c : counts) {
    routes += c;
    hit += c > 0 ? 1 : 0;
    most = std::max(most, c);
  }
  const int64_t capacity = (most + 15) / 16 * 16;  // the runner's alignment
  if (10 * hit < 9 * experts || routes < 2 * experts || experts * capacity > 8 * routes) return 0;
  return most;
}

namespace {
absl::Status CheckScales(ScaleGranularity g, int64_t count, int64_t rows, int d, const char* what) {
  KERNEL_INVALID_IF(g == ScaleGranularity::kNone, what, ".granularity: FP8 needs scales");
  const int64_t want = ScaleCount(g, rows, d);
  KERNEL_INVALID_IF(count != want, what, ".scale_count: ", count, ", the payload of ", rows, " rows x ", d, " needs ",
                    want);
  return absl::OkStatus();
}
}  // namespace

absl::Status CheckQuantize(const QuantizeParams& p) {
  KERNEL_INVALID_IF(p.d <= 0 || p.rows < 0, "quantize: bad shape");
  KERNEL_INVALID_IF(p.rows > 0 && (p.x == nullptr || p.q == nullptr || p.scales == nullptr), "quantize: null buffer");
  return CheckScales(p.granularity, p.scale_count, p.rows, p.d, "quantize");
}

absl::Status CheckDequantize(const DequantizeParams& p) {
  KERNEL_INVALID_IF(p.d <= 0 || p.rows < 0, "dequantize: bad shape");
  KERNEL_INVALID_IF(p.rows > 0 && (p.x == nullptr || p.q == nullptr || p.scales == nullptr), "dequantize: null buffer");
  return CheckScales(p.granularity, p.scale_count, p.rows, p.d, "dequantize");
}

}  // namespace moe::kernels
