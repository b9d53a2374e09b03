// Decode-sized SwiGLU experts with device-side segment offsets (no host round trip): the entry
// point (LaunchSmallBatchSwiglu, which picks one of three kernel families by the rows per expert
// and the dimensions) and the streaming family for one row per expert.
//
// Memory-bound by design: with one row per expert, the cost is reading each hit expert's
// weights once, so the kernels are built to keep every SM streaming the same number of weight
// bytes from the first cycle to the last:
//   - the work of a kernel is a flat list of units, (active expert, output unit) pairs; the grid
//     is one resident wave and every warp takes a contiguous, equal share of the list, so the
//     load is balanced to one unit per warp whatever the routing (a skewed step costs what a
//     uniform one with the same experts hit costs);
//   - a warp streams whole weight rows with 16-byte loads that bypass L1 and dots them against
//     the expert's rows read through L1 (the few activation rows stay cached there; with
//     x_row_index the gather into expert-major order is fused into these loads);
//   - GateUpKernel: a[r, c] = bf16(silu(bf16(x_r . Wg_c)) * bf16(x_r . Wu_c)), one unit = the
//     gate and up rows of column c (activation in the epilogue);
//     DownKernel: y[r, o] = bf16(a_r . Wd_o), one unit = two output rows;
//   - both are launched as programmatic dependents (pdl.cuh): the gate/up grid is resident
//     before the routing kernel ends, and the down grid takes SM slots as the gate/up blocks
//     finish, prefetching its first weight rows into L2 before it waits for `a`.
// Longer segments loop over rows: any size is correct. Steps whose experts get more rows take
// the tensor-core family (small_batch_mma.cu) or, for dimensions that are not multiples of 32,
// the staged family (small_batch_staged.cu).
#include <cuda_runtime.h>

#include <cuda_bf16.h>

#include "kernels/cuda/combine.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/small_batch_common.cuh"

namespace moe::kernels::cuda {
namespace {

using small_batch::ActiveBytes;
using small_batch::ActiveExperts;
using small_batch::DotRows;
using small_batch::kThreads;
using small_batch::kWarps;

// Bytes of its first unit's weights a down warp prefetches into L2 before waiting for `a`.
constexpr int kPrefetchBytes = 8 * 1024;

// Down units: two output rows, the whole of each in flight at once for d_ff <= 768 (three
// vectors a lane: one round trip a unit). Four-row units with two rounds each left the units of
// a one-token step (E=128, d=2048: 4096 units over 3168 warps) to a third of the warps twice,
// the kernel then running at 1.9 TB/s against the gate/up kernel's 2.7 (ncu, H200); two-row
// units split 8192 over the same warps (at most 3 a warp against a mean of 2.6).
constexpr int kDownRows = 2;
constexpr int kDownBatch = 3;
// Register budget (measured on an H200 at E=128, d=2048, d_ff=768): three blocks of 256 threads
// per SM (85 registers; four blocks spill).
constexpr int kBlocksPerSm = 3;

// This warp's share [begin, end) of `units`, contiguous and balanced over every warp of the grid.
__device__ __forceinline__ void WarpShare(int64_t units, int64_t* begin, int64_t* end) {
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  *begin = units * w / warps;
  *end = units * (w + 1) / warps;
}

// The source row of a layout row; with `row_index` the layout row is read from its source row
// (the permutation fused into the load). SHARED: `row_index` is in shared memory (the fused
// local layer's own routing).
template <bool SHARED>
__device__ __forceinline__ int64_t SourceRow(const int32_t* __restrict__ row_index, int64_t layout_row) {
  if constexpr (SHARED) return row_index[layout_row];
  return row_index != nullptr ? __ldg(row_index + layout_row) : layout_row;
}

// The fused local layer (FUSED kernels): both kernels derive the routing from topk in every
// block (RouteInBlock); the down blocks count themselves finished in `done`, and the last one
// to finish returns it to zero (every other block has counted by then: nothing else touches it
// until the next call) and combines the expert rows into the tokens' outputs. The counter is
// zeroed once, when its scratch is allocated.
struct LayerRoute {
  const int32_t* topk = nullptr;  // [tokens, k]
  int routes = 0;
  int k = 0;
  int tokens = 0;
  const float* gate = nullptr;  // [tokens, k]
  unsigned int* done = nullptr;
  float* out_fp32 = nullptr;
  uint4* out_bf16 = nullptr;
};

// The routing of either kernel: the fused layer's own, or the offsets of a Swiglu call.
template <bool FUSED>
__device__ __forceinline__ small_batch::BlockRouting KernelRouting(const LayerRoute& route, const int64_t* offsets,
                                                                   int num_experts) {
  if constexpr (FUSED) {
    return small_batch::RouteInBlock(route.topk, route.routes, route.k, num_experts, small_batch::ActiveCache());
  } else {
    return {small_batch::CompactActive(offsets, num_experts, small_batch::ActiveCache()), nullptr, nullptr};
  }
}

template <bool FUSED>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    GateUpKernel(const uint4* __restrict__ x, const int32_t* __restrict__ x_row_index,
                 const int64_t* __restrict__ offsets, int num_experts, int d8, int f,
                 const uint4* __restrict__ w_gate_up, __nv_bfloat16* __restrict__ a, LayerRoute route) {
  WaitForPredecessor();  // the offsets (or topk) and rows come from the routing / receive kernels
  ReleaseDependents();
  const small_batch::BlockRouting routing = KernelRouting<FUSED>(route, offsets, num_experts);
  const ActiveExperts& act = routing.act;
  if constexpr (FUSED) x_row_index = routing.token_of_row;
  int64_t begin, end;
  WarpShare(static_cast<int64_t>(act.count) * f, &begin, &end);
  // Walk the share with a (slot, column) cursor: no division per unit.
  int slot = static_cast<int>(begin / f), c = static_cast<int>(begin - static_cast<int64_t>(slot) * f);
  for (int64_t unit = begin; unit < end; ++unit, ++c) {
    if (c == f) {
      c = 0;
      ++slot;
    }
    const int e = act.ids != nullptr ? act.ids[slot] : slot;
    const int64_t seg_begin = act.offsets[e], seg_end = act.offsets[e + 1];
    const uint4* const w[2] = {w_gate_up + (static_cast<int64_t>(e) * 2 * f + c) * d8,
                               w_gate_up + (static_cast<int64_t>(e) * 2 * f + f + c) * d8};
    for (int64_t row = seg_begin; row < seg_end; ++row) {
      const uint4* xp = x + SourceRow<FUSED>(x_row_index, row) * d8;
      float gu[2][1] = {};
      DotRows<1, 2, 4>(
          w, [&](int, int i) { return __ldg(xp + i); }, d8, 1, gu);
      small_batch::StoreActivation<1>(gu, 1, row, f, c, a);
    }
  }
}

template <bool FUSED>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    DownKernel(const uint4* __restrict__ a, const int64_t* __restrict__ offsets, int num_experts, int f8, int d,
               const uint4* __restrict__ w_down, __nv_bfloat16* __restrict__ y, LayerRoute route) {
  // Offsets (or topk) and weights are inputs of the whole launch sequence, complete before the
  // gate/up kernel released this one: read them (and warm L2 with the first weight rows) before
  // `a`.
  const small_batch::BlockRouting routing = KernelRouting<FUSED>(route, offsets, num_experts);
  const ActiveExperts& act = routing.act;
  // The gates, for the last block's combine: off its critical path (published by the barriers
  // below).
  __shared__ float gates[FUSED ? small_batch::kBlockRoutes : 1];
  if constexpr (FUSED) {
    for (int i = threadIdx.x; i < route.routes; i += kThreads) gates[i] = route.gate[i];
  }
  const int units_per_expert = (d + kDownRows - 1) / kDownRows;
  int64_t begin, end;
  WarpShare(static_cast<int64_t>(act.count) * units_per_expert, &begin, &end);
  const int lane = threadIdx.x & 31;
  if (begin < end) {
    const int slot = static_cast<int>(begin / units_per_expert);
    const int o0 = static_cast<int>(begin - static_cast<int64_t>(slot) * units_per_expert) * kDownRows;
    const int e = act.ids != nullptr ? act.ids[slot] : slot;
    if (act.offsets[e + 1] > act.offsets[e]) {
      const char* p = reinterpret_cast<const char*>(w_down + (static_cast<int64_t>(e) * d + o0) * f8);
      const int64_t rows_left = d - o0;
      int64_t bytes = (end - begin) * kDownRows * static_cast<int64_t>(f8) * 16;
      if (bytes > rows_left * f8 * 16) bytes = rows_left * f8 * 16;  // stay inside this expert
      if (bytes > kPrefetchBytes) bytes = kPrefetchBytes;
      for (int64_t off = lane * 128; off < bytes; off += 32 * 128) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + off));
      }
    }
  }
  WaitForPredecessor();  // `a` comes from the gate/up kernel
  ReleaseDependents();
  int slot = static_cast<int>(begin / units_per_expert);
  int o0 = static_cast<int>(begin - static_cast<int64_t>(slot) * units_per_expert) * kDownRows;
  for (int64_t unit = begin; unit < end; ++unit, o0 += kDownRows) {
    if (o0 >= d) {
      o0 = 0;
      ++slot;
    }
    const int e = act.ids != nullptr ? act.ids[slot] : slot;
    const int64_t seg_begin = act.offsets[e], seg_end = act.offsets[e + 1];
    // The rows of a ragged last unit are clamped at d: computed twice, written once.
    const uint4* w[kDownRows];
#pragma unroll
    for (int j = 0; j < kDownRows; ++j) {
      const int o = o0 + j < d ? o0 + j : d - 1;
      w[j] = w_down + (static_cast<int64_t>(e) * d + o) * f8;
    }
    for (int64_t row = seg_begin; row < seg_end; ++row) {
      const uint4* ap = a + row * f8;
      float acc[kDownRows][1] = {};
      DotRows<1, kDownRows, kDownBatch>(
          w, [&](int, int i) { return __ldg(ap + i); }, f8, 1, acc);
      small_batch::StoreRows<1, kDownRows>(acc, 1, row, d, o0, y);
    }
  }
  if constexpr (FUSED) {
    // Publish this block's rows, count it finished; the last block combines (route order, as
    // the combine kernel: the same bits).
    __threadfence();
    __syncthreads();
    __shared__ unsigned int finished_before;
    if (threadIdx.x == 0) finished_before = atomicAdd(route.done, 1u);
    __syncthreads();
    if (finished_before != gridDim.x - 1) return;
    if (threadIdx.x == 0) *route.done = 0;
    __threadfence();
    const int d8 = d / 8;
    const uint4* rows = reinterpret_cast<const uint4*>(y);
    const int64_t vectors = static_cast<int64_t>(route.tokens) * d8;
    for (int64_t i = threadIdx.x; i < vectors; i += kThreads) {
      const int64_t t = i / d8;
      CombineVector<8>([&](int32_t row, int64_t c) { return __ldcg(rows + static_cast<int64_t>(row) * d8 + c); },
                       route.routes, d8, routing.row_of_route, gates, t, i - t * d8, route.k, route.out_fp32,
                       route.out_bf16);
    }
  }
}

// Both kernels; `max_active` bounds the experts with rows (the grid).
template <bool FUSED>
cudaError_t Launch(const uint16_t* x, const int32_t* x_row_index, const int64_t* offsets, int num_experts,
                   int max_active, int d, int f, const uint16_t* w_gate_up, const uint16_t* w_down, uint16_t* a,
                   uint16_t* y, const LayerRoute& route, cudaStream_t stream) {
  int sms = 0;  // (the shared memory, at most 24 KiB, needs no opt-in)
  const cudaError_t setup = small_batch::SmCount(&sms);
  if (setup != cudaSuccess) return setup;
  const size_t smem = FUSED ? small_batch::RouteInBlockBytes(num_experts, route.routes) : ActiveBytes(num_experts);
  // A unit a warp: blocks for every unit of `max_active` busy experts, at most one resident wave.
  auto grid = [&](int64_t max_units) {
    return small_batch::OneWave((max_units + kWarps - 1) / kWarps, static_cast<int64_t>(sms) * kBlocksPerSm);
  };
  cudaError_t e =
      LaunchDependent(GateUpKernel<FUSED>, dim3(grid(static_cast<int64_t>(max_active) * f)), dim3(kThreads), smem,
                      stream, reinterpret_cast<const uint4*>(x), x_row_index, offsets, num_experts, d / 8, f,
                      reinterpret_cast<const uint4*>(w_gate_up), reinterpret_cast<__nv_bfloat16*>(a), route);
  if (e != cudaSuccess) return e;
  const int64_t down_units = static_cast<int64_t>(max_active) * ((d + kDownRows - 1) / kDownRows);
  return LaunchDependent(DownKernel<FUSED>, dim3(grid(down_units)), dim3(kThreads), smem, stream,
                         reinterpret_cast<const uint4*>(a), offsets, num_experts, f / 8, d,
                         reinterpret_cast<const uint4*>(w_down), reinterpret_cast<__nv_bfloat16*>(y), route);
}

// Rows per expert a step is expected to give each busy expert: twice the mean segment when the
// rows spread over every expert, within the caller's bound on any segment (0 = none).
int64_t ExpectedSegmentRows(int64_t rows, int num_experts, int64_t max_segment_rows) {
  const int64_t spread = rows < num_experts ? rows : num_experts;
  const int64_t mean = spread > 0 ? (rows + spread - 1) / spread : 1;
  const int64_t want = 2 * mean;
  return max_segment_rows > 0 && want > max_segment_rows ? max_segment_rows : want;
}

// The fused layer's last block combines at most this many 16-byte output vectors: one round of
// its threads (one token of d <= 2048). Beyond it the combine's serial tail costs more than the
// kernel boundaries fusing saves: one token of the Mixtral-like shape (d = 4096, two rounds) took
// 182-184 us fused against 179-180 us in stages (CUDA graph, H200).
constexpr int64_t kFusedCombineVectors = kThreads;

}  // namespace

bool SmallBatchSupported(int d, int f) {
  // 16-byte rows, and one row of either projection inside the staged family's budget.
  return d > 0 && f > 0 && d % 8 == 0 && f % 8 == 0 && static_cast<size_t>(d) * 2 <= small_batch::kStagedRowBudget &&
         static_cast<size_t>(f) * 2 <= small_batch::kStagedRowBudget;
}

cudaError_t LaunchSmallBatchSwiglu(const uint16_t* x, const int32_t* x_row_index, const int64_t* offsets,
                                   int num_experts, int d, int f, const uint16_t* w_gate_up, const uint16_t* w_down,
                                   uint16_t* a, uint16_t* y, int64_t rows, int64_t max_segment_rows,
                                   cudaStream_t stream) {
  // Rows per expert expected: twice the mean segment when the rows spread over every expert,
  // within the caller's bound on any segment. One row (a single token, or one token's k routes
  // to distinct experts): this family, latency-bound, where the tensor-core family's per-tile
  // barriers cost more than its instructions save (H200, E=128 d=2048 d_ff=768 one token: graph
  // replay 32-33 us here, 37 us there). More rows: the tensor-core family when d and d_ff allow
  // (16 tokens: 204 us against 288 us here), else the staged family.
  const int64_t want = ExpectedSegmentRows(rows, num_experts, max_segment_rows);
  if (want <= 1) {
    return Launch<false>(x, x_row_index, offsets, num_experts, num_experts, d, f, w_gate_up, w_down, a, y, LayerRoute{},
                         stream);
  }
  if (small_batch::MmaSupported(d, f)) {
    return small_batch::LaunchMmaSwiglu(small_batch::WidePass(want), x, x_row_index, offsets, num_experts, d, f,
                                        w_gate_up, w_down, a, y, stream);
  }
  return small_batch::LaunchStagedSwiglu(want <= 4 ? 4 : 8, x, x_row_index, offsets, num_experts, d, f, w_gate_up,
                                         w_down, a, y, stream);
}

bool FusedLocalLayerSupported(int64_t tokens, int k, int num_experts, int d, int f) {
  const int64_t routes = tokens * k;
  return tokens > 0 && SmallBatchSupported(d, f) && routes <= small_batch::kBlockRoutes &&
         num_experts <= small_batch::kCachedExperts && ExpectedSegmentRows(routes, num_experts, tokens) <= 1 &&
         tokens * (d / 8) <= kFusedCombineVectors;
}

cudaError_t LaunchFusedLocalLayer(const uint16_t* x, const int32_t* topk, const float* gate, int64_t tokens, int k,
                                  int num_experts, int d, int f, const uint16_t* w_gate_up, const uint16_t* w_down,
                                  uint16_t* a, uint16_t* y, unsigned int* done, float* out_fp32, uint16_t* out_bf16,
                                  cudaStream_t stream) {
  LayerRoute route;
  route.topk = topk;
  route.routes = static_cast<int>(tokens * k);
  route.k = k;
  route.tokens = static_cast<int>(tokens);
  route.gate = gate;
  route.done = done;
  route.out_fp32 = out_fp32;
  route.out_bf16 = reinterpret_cast<uint4*>(out_bf16);
  const int max_active = route.routes < num_experts ? route.routes : num_experts;
  return Launch<true>(x, nullptr, nullptr, num_experts, max_active, d, f, w_gate_up, w_down, a, y, route, stream);
}

}  // namespace moe::kernels::cuda
