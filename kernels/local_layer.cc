// LocalLayer as its three stages, on any ExpertKernels implementation: what the CPU
// implementation runs, and the CUDA one for steps its fused kernels do not take.
#include "kernels/api.h"

namespace moe::kernels {

namespace {

// Whether the experts read a scattered copy of the rows (LocalLayerScratch).
bool ScatterFirst(const ExpertKernels& kernels, const LocalLayerParams& p) {
  return p.padded_capacity == 0 &&
         kernels.DecodeGemmBeatsPadded(p.weights.num_experts, p.weights.d, p.weights.d_ff, p.num_tokens * p.k);
}

}  // namespace

absl::Status ReserveLocalLayerScratch(ExpertKernels* kernels, const LocalLayerParams& p, LocalLayerScratch* scratch) {
  const ExpertWeights& w = p.weights;
  const int64_t routes = p.num_tokens * p.k;
  const int64_t expert_in = ScatterFirst(*kernels, p) ? 2 * routes * w.d : 0;
  for (auto [buffer, bytes] :
       {std::pair{&scratch->counts, int64_t{8} * w.num_experts},
        std::pair{&scratch->offsets, int64_t{8} * (w.num_experts + 1)}, std::pair{&scratch->row_of_route, 4 * routes},
        std::pair{&scratch->token_of_row, 4 * routes}, std::pair{&scratch->rows, 2 * routes * w.d},
        std::pair{&scratch->expert_in, expert_in}}) {
    absl::Status s = buffer->Reserve(kernels, bytes);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status RunLocalLayerInStages(ExpertKernels* kernels, const LocalLayerParams& p, LocalLayerScratch* scratch,
                                   Stream stream) {
  absl::Status s = CheckLocalLayer(p);
  if (!s.ok()) return s;
  const ExpertWeights& w = p.weights;
  const int64_t routes = p.num_tokens * p.k;
  s = ReserveLocalLayerScratch(kernels, p, scratch);
  if (!s.ok()) return s;
  RouteRowsParams route{p.topk,
                        p.num_tokens,
                        p.k,
                        w.num_experts,
                        scratch->counts.as<int64_t>(),
                        scratch->offsets.as<int64_t>(),
                        scratch->row_of_route.as<int32_t>(),
                        scratch->token_of_row.as<int32_t>()};
  s = kernels->RouteRows(route, stream);
  if (!s.ok()) return s;
  SwigluParams experts;
  experts.weights = w;
  if (ScatterFirst(*kernels, p)) {
    s = kernels->Scatter(
        {w.d, p.x, p.num_tokens, scratch->row_of_route.as<int32_t>(), p.k, scratch->expert_in.as<uint16_t>(), routes},
        stream);
    if (!s.ok()) return s;
    experts.x = scratch->expert_in.as<uint16_t>();
  } else {
    experts.x = p.x;
    experts.x_rows = p.num_tokens;
    experts.x_row_index = scratch->token_of_row.as<int32_t>();
  }
  experts.device_offsets = scratch->offsets.as<int64_t>();
  experts.rows = routes;
  experts.max_segment_rows = p.num_tokens;  // a token's k routes go to distinct experts (else only slower)
  experts.y = scratch->rows.as<uint16_t>();
  if (p.padded_capacity > 0) experts.layout = {Layout::kPaddedDense, p.padded_capacity, 16, 128};
  s = kernels->Swiglu(experts, stream);
  if (!s.ok()) return s;
  const CombineParams combine{scratch->rows.as<uint16_t>(),
                              routes,
                              w.d,
                              scratch->row_of_route.as<int32_t>(),
                              p.gate,
                              p.num_tokens,
                              p.k,
                              p.out_fp32,
                              p.out_bf16};
  return kernels->Combine(combine, stream);
}

}  // namespace moe::kernels
