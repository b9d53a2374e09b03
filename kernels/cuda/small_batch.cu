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
//     finish, prefetching its first weight rows into L2 before it waits for `a`; or, where a
//     block's share of the down weights fits in shared memory, DownPreloadKernel's small blocks
//     are resident beside the gate/up blocks and load that share while they run (below).
// Longer segments loop over rows: any size is correct. Steps whose experts get more rows take
// the tensor-core family (small_batch_mma.cu) or, for dimensions that are not multiples of 32,
// the staged family (small_batch_staged.cu).
#include <cuda_runtime.h>

#include <mutex>

#include <cuda_bf16.h>

#include "kernels/cuda/async_copy.cuh"
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
template <bool FUSED, int THREADS = kThreads>
__device__ __forceinline__ small_batch::BlockRouting KernelRouting(const LayerRoute& route, const int64_t* offsets,
                                                                   int num_experts) {
  if constexpr (FUSED) {
    return small_batch::RouteInBlock(route.topk, route.routes, route.k, num_experts, small_batch::ActiveCache());
  } else {
    return {small_batch::CompactActive<THREADS>(offsets, num_experts, small_batch::ActiveCache()), nullptr, nullptr};
  }
}

// The fused layer's gates, read into shared memory by every down block for the last block's
// combine (off its critical path; published by the barriers before the combine).
template <int THREADS>
__device__ __forceinline__ void LoadGates(const LayerRoute& route, float* gates) {
  for (int i = threadIdx.x; i < route.routes; i += THREADS) gates[i] = route.gate[i];
}

// The fused layer's end, called by every thread of every down block once the block's rows of y
// are stored: publish them, count the block finished; the last block combines (route order, as
// the combine kernel: the same bits).
template <int THREADS>
__device__ __forceinline__ void CombineInLastBlock(const LayerRoute& route, const small_batch::BlockRouting& routing,
                                                   const float* gates, int d, const __nv_bfloat16* y) {
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
  for (int64_t i = threadIdx.x; i < vectors; i += THREADS) {
    const int64_t t = i / d8;
    CombineVector<8>([&](int32_t row, int64_t c) { return __ldcg(rows + static_cast<int64_t>(row) * d8 + c); },
                     route.routes, d8, routing.row_of_route, gates, t, i - t * d8, route.k, route.out_fp32,
                     route.out_bf16);
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
  if constexpr (FUSED) LoadGates<kThreads>(route, gates);
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
  if constexpr (FUSED) CombineInLastBlock<kThreads>(route, routing, gates, d, y);
}

// The down kernel that loads its weights while the gate/up kernel runs (DownPreloadKernel).
//
// With one row an expert the two kernels read their weights one after the other: the down
// kernel's blocks take SM slots only as the gate/up blocks finish, and then stream their weights
// from DRAM (E=128, d=2048, d_ff=768, one token: 50 MB then 25 MB). Here a down block of 8 warps
// (64 registers: one an SM, beside two gate/up blocks, or three held to 64 registers; registers
// are allocated per SM sub-partition, two warps of each block in each of the four) becomes
// resident as soon as the gate/up kernel has started, and hands its share of the down
// weights to the TMA unit as bulk copies into shared memory; the two reads then share the
// memory's bandwidth. Once the gate/up kernel is done, the block copies the activation rows of
// its experts next to them and runs mma.sync tiles from shared memory alone.
//
// Work: a unit is (active expert, 16 output rows), one mma tile; a block takes a balanced
// contiguous share of at most `tiles_cap` units (the host sizes the shared memory for it), a
// warp every kPreloadWarps-th of them over the whole of k, so each output's dot product is summed in the
// same order whatever the grid (the fused layer and the stages give the same bits). The tile's
// even and odd rows live in two regions 64 bytes apart modulo 128, so the lanes of one
// 8-lane phase of a 16-byte load (rows g, g + 1 at the same k) hit distinct banks. A block
// never stages more than the host sized it for: should the offsets give more busy experts or
// rows than the launch's bound (outside LaunchSmallBatchSwiglu's contract, offsets[E] <= rows),
// it reads the rest from global memory.
constexpr int kTileRows = 16;  // output rows a unit: the mma's m

// The dynamic shared memory of a DownPreloadKernel block: the routing tables, the two barriers,
// the even and odd rows of `tiles` units of weights, `a_rows` activation rows.
struct PreloadLayout {
  size_t bars, even, odd, a, bytes;
  __host__ __device__ PreloadLayout(size_t route_bytes, int tiles, int f, int64_t a_rows) {
    const size_t row = static_cast<size_t>(f) * 2;
    const size_t half = static_cast<size_t>(tiles) * (kTileRows / 2) * row;
    bars = (route_bytes + 15) & ~size_t{15};
    even = (bars + 2 * sizeof(uint64_t) + 127) & ~size_t{127};
    odd = even + half + 64;
    a = (odd + half + 15) & ~size_t{15};
    bytes = a + static_cast<size_t>(a_rows) * row;
  }
};

constexpr int kPreloadWarps = 8;

// c += this lane's part of the tile (weight rows g, g + 8 from w_at(i, &lo, &hi)) times its
// activation row (x_at(i)) over every k-chunk; i = chunk * 4 + t indexes 16-byte vectors.
// UNROLL chunks' loads are in flight together.
template <int UNROLL, typename WAt, typename XAt>
__device__ __forceinline__ void TileDot(float (&c)[4], WAt&& w_at, XAt&& x_at, int chunks) {
  const int t = threadIdx.x & 3;
#pragma unroll UNROLL
  for (int k = 0; k < chunks; ++k) {
    const int i = k * 4 + t;
    uint4 lo, hi;
    w_at(i, &lo, &hi);
    small_batch::MmaChunk(c, lo, hi, x_at(i));
  }
}

template <bool FUSED>
__global__ void __launch_bounds__(kPreloadWarps * 32, 4)  // 64 registers
    DownPreloadKernel(const uint4* __restrict__ a, const int64_t* __restrict__ offsets, int num_experts, int f8, int d,
                      const uint4* __restrict__ w_down, __nv_bfloat16* __restrict__ y, LayerRoute route, int tiles_cap,
                      int a_rows_cap) {
  constexpr int kT = kPreloadWarps * 32;
  // Offsets (or topk) and weights are inputs of the whole launch sequence, complete before the
  // gate/up kernel released this one: route and start the weight copies before waiting for `a`.
  const small_batch::BlockRouting routing = KernelRouting<FUSED, kT>(route, offsets, num_experts);
  const ActiveExperts& act = routing.act;
  __shared__ float gates[FUSED ? small_batch::kBlockRoutes : 1];
  if constexpr (FUSED) LoadGates<kT>(route, gates);
  const int f = f8 * 8;
  const uint32_t row_bytes = static_cast<uint32_t>(f) * 2;
  const PreloadLayout lay(FUSED ? small_batch::RouteInBlockBytes(num_experts, route.routes) : ActiveBytes(num_experts),
                          tiles_cap, f, a_rows_cap);
  char* smem = reinterpret_cast<char*>(small_batch::ActiveCache());
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + lay.bars);  // [0]: the weights, [1]: the activation rows
  uint4* even = reinterpret_cast<uint4*>(smem + lay.even);
  uint4* odd = reinterpret_cast<uint4*>(smem + lay.odd);
  const uint4* a_stage = reinterpret_cast<const uint4*>(smem + lay.a);
  const int groups = d / kTileRows;
  const int64_t units = static_cast<int64_t>(act.count) * groups;
  const int64_t u0 = units * blockIdx.x / gridDim.x, u1 = units * (blockIdx.x + 1) / gridDim.x;
  const int tiles = static_cast<int>(u1 - u0);
  const int staged = tiles < tiles_cap ? tiles : tiles_cap;
  auto expert_of = [&](int64_t u) {
    const int slot = static_cast<int>(u / groups);
    return act.ids != nullptr ? act.ids[slot] : slot;
  };
  if (threadIdx.x == 0) {
    MbarInit(&bar[0], 1);
    MbarInit(&bar[1], 1);
    MbarInitFence();
  }
  __syncthreads();
  if (threadIdx.x < 32 && staged > 0) {
    if (threadIdx.x == 0) MbarExpectTx(&bar[0], static_cast<uint32_t>(staged) * kTileRows * row_bytes);
    __syncwarp();
    for (int r = threadIdx.x; r < staged * kTileRows; r += 32) {
      const int j = r / kTileRows, rr = r - j * kTileRows;
      const int64_t u = u0 + j;
      const int grp = static_cast<int>(u % groups);
      const uint4* src = w_down + (static_cast<int64_t>(expert_of(u)) * d + grp * kTileRows + rr) * f8;
      uint4* dst = ((rr & 1) ? odd : even) + (static_cast<int64_t>(j) * (kTileRows / 2) + rr / 2) * f8;
      BulkLoad(dst, src, row_bytes, &bar[0]);
    }
  }
  WaitForPredecessor();  // `a` comes from the gate/up kernel
  ReleaseDependents();
  // This block's experts' activation rows: contiguous (expert-major), at most a_rows_cap staged.
  int64_t a_r0 = 0, a_rows = 0;
  if (tiles > 0) {
    a_r0 = act.offsets[expert_of(u0)];
    a_rows = act.offsets[expert_of(u1 - 1) + 1] - a_r0;
    a_rows = a_rows < 0 ? 0 : (a_rows < a_rows_cap ? a_rows : a_rows_cap);
  }
  if (threadIdx.x == 0 && a_rows > 0) {
    MbarExpectTx(&bar[1], static_cast<uint32_t>(a_rows) * row_bytes);
    BulkLoad(const_cast<uint4*>(a_stage), a + a_r0 * f8, static_cast<uint32_t>(a_rows) * row_bytes, &bar[1]);
  }
  if (staged > 0) MbarWait(&bar[0], 0);
  if (a_rows > 0) MbarWait(&bar[1], 0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int chunks = f8 / 4;
  for (int j = warp; j < tiles; j += kPreloadWarps) {
    const int64_t u = u0 + j;
    const int e = expert_of(u);
    const int o = static_cast<int>(u % groups) * kTileRows + g;
    const int64_t seg_begin = act.offsets[e], seg_end = act.offsets[e + 1];
    const uint4* lo = ((g & 1) ? odd : even) + (static_cast<int64_t>(j) * (kTileRows / 2) + g / 2) * f8;
    const uint4* hi = lo + (kTileRows / 4) * static_cast<int64_t>(f8);  // row g + 8: 4 rows on in its region
    const uint4* lo_g = w_down + (static_cast<int64_t>(e) * d + o) * f8;
    const uint4* hi_g = lo_g + 8 * static_cast<int64_t>(f8);
    for (int64_t r0 = seg_begin; r0 < seg_end; r0 += small_batch::kRowsPerMma) {
      const int rows =
          static_cast<int>(seg_end - r0 < small_batch::kRowsPerMma ? seg_end - r0 : small_batch::kRowsPerMma);
      const bool valid = g < rows;
      const int64_t row = r0 + (valid ? g : rows - 1);
      float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const bool a_in = r0 >= a_r0 && r0 + rows <= a_r0 + a_rows;  // the whole group staged
      const uint4* x_s = a_stage + (row - a_r0) * f8;
      const uint4* x_g = a + row * f8;
      const uint4 zero = make_uint4(0, 0, 0, 0);
      if (j < staged && a_in) {  // the fast path: shared memory only
        TileDot<4>(
            c,
            [&](int i, uint4* l, uint4* h) {
              *l = lo[i];
              *h = hi[i];
            },
            [&](int i) { return valid ? x_s[i] : zero; }, chunks);
      } else {
        TileDot<1>(
            c,
            [&](int i, uint4* l, uint4* h) {
              *l = j < staged ? lo[i] : small_batch::LoadStreaming(lo_g + i);
              *h = j < staged ? hi[i] : small_batch::LoadStreaming(hi_g + i);
            },
            [&](int i) { return valid ? (a_in ? x_s[i] : __ldg(x_g + i)) : zero; }, chunks);
      }
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int r = 2 * t + q;
        if (r < rows) {
          y[(r0 + r) * d + o] = __float2bfloat16_rn(c[q]);
          y[(r0 + r) * d + o + 8] = __float2bfloat16_rn(c[2 + q]);
        }
      }
    }
  }
  if constexpr (FUSED) CombineInLastBlock<kT>(route, routing, gates, d, y);
}

// A kernel's static shared memory and registers, looked up once.
struct KernelFootprint {
  size_t static_smem = 0;
  int regs = 0;
};
template <typename Kernel>
KernelFootprint Footprint(Kernel kernel) {
  cudaFuncAttributes attr = {};
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) {
    cudaGetLastError();
    return {};
  }
  return {attr.sharedSizeBytes, attr.numRegs};
}

// How a step's down kernel runs: preloaded (warps > 0) or streaming after the gate/up kernel.
struct DownPlan {
  bool preload = false;  // false: DownKernel
  int gate_blocks_per_sm = kBlocksPerSm;
  unsigned grid = 0;
  int tiles_cap = 0;
  int a_rows_cap = 0;
  size_t smem = 0;
};

// The SM's limits the plan is checked against, looked up once (a process drives one device).
struct SmLimits {
  int smem_per_sm = 0, smem_optin = 0, reserved = 0, regs = 0;
};
inline SmLimits GetSmLimits() {
  static const SmLimits limits = [] {
    SmLimits l;
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&l.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&l.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&l.reserved, cudaDevAttrReservedSharedMemoryPerBlock, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&l.regs, cudaDevAttrMaxRegistersPerMultiprocessor, device) != cudaSuccess) {
      cudaGetLastError();
      return SmLimits{};
    }
    return l;
  }();
  return limits;
}

// Registers a warp holds: whole 256-register allocation units.
inline int64_t WarpRegisters(int regs) { return static_cast<int64_t>((regs * 32 + 255) / 256 * 256); }

template <bool FUSED>
bool PlanPreload(int sms, int max_active, int64_t max_rows, int d, int f, size_t route_bytes, DownPlan* plan) {
  static const KernelFootprint gate = Footprint(GateUpKernel<FUSED>);
  static const KernelFootprint down = Footprint(DownPreloadKernel<FUSED>);
  const SmLimits sm = GetSmLimits();
  if (gate.regs == 0 || down.regs == 0 || sm.smem_per_sm == 0) return false;
  const int64_t groups = d / kTileRows;
  const int64_t units = static_cast<int64_t>(max_active) * groups;
  const int64_t grid = units < sms ? units : sms;
  const int64_t tiles = (units + grid - 1) / grid;
  if (tiles > (1 << 20) || max_rows > (1 << 20)) return false;
  const PreloadLayout lay(route_bytes, static_cast<int>(tiles), f, max_rows);
  // Beside it on each SM: as many gate/up blocks as the registers leave (at most kBlocksPerSm),
  // counted in one of the SM's four sub-partitions, which holds a quarter of every block's warps.
  const int64_t part = sm.regs / 4;
  int64_t beside = (part - kPreloadWarps / 4 * WarpRegisters(down.regs)) / (kWarps / 4 * WarpRegisters(gate.regs));
  if (beside > kBlocksPerSm) beside = kBlocksPerSm;
  if (beside < 1) return false;
  const int64_t gate_smem = static_cast<int64_t>(gate.static_smem + route_bytes) + sm.reserved;
  const int64_t down_smem = static_cast<int64_t>(down.static_smem + lay.bytes) + sm.reserved;
  if (static_cast<int64_t>(down.static_smem + lay.bytes) > sm.smem_optin ||
      beside * gate_smem + down_smem > sm.smem_per_sm) {
    return false;
  }
  // The opt-in to this much dynamic shared memory (grown as needed, never shrunk), and the
  // gate/up kernel's preference for the largest shared-memory carve-out, so that an SM running
  // gate/up blocks has room for a down block beside them.
  static std::mutex opt_mu;
  static size_t opted = 0;
  {
    std::lock_guard<std::mutex> lock(opt_mu);
    if (lay.bytes > opted) {
      if (cudaFuncSetAttribute(DownPreloadKernel<FUSED>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(lay.bytes)) != cudaSuccess) {
        cudaGetLastError();
        return false;
      }
      opted = lay.bytes;
    }
  }
  static const bool carveout = cudaFuncSetAttribute(GateUpKernel<FUSED>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                                    cudaSharedmemCarveoutMaxShared) == cudaSuccess ||
                               (cudaGetLastError(), false);
  (void)carveout;
  plan->preload = true;
  plan->gate_blocks_per_sm = static_cast<int>(beside);
  plan->grid = static_cast<unsigned>(grid);
  plan->tiles_cap = static_cast<int>(tiles);
  plan->a_rows_cap = static_cast<int>(max_rows);
  plan->smem = lay.bytes;
  return true;
}

// The down kernel for a step whose busy experts are at most `max_active` and whose rows are at
// most `max_rows` (DownPreloadForced: the CudaTuning switch).
template <bool FUSED>
DownPlan PlanDown(int sms, int num_experts, int max_active, int64_t max_rows, int d, int f, size_t route_bytes) {
  DownPlan plan;
  const int forced = DownPreloadForced();
  // (Past kCachedExperts the blocks keep no list of busy experts: every expert would count.)
  if (forced == 0 || max_active < 1 || max_rows < 1 || d % kTileRows != 0 || f % 32 != 0 ||
      num_experts > small_batch::kCachedExperts) {
    return plan;
  }
  const bool ok = PlanPreload<FUSED>(sms, max_active, max_rows, d, f, route_bytes, &plan);
  return ok ? plan : DownPlan{};
}

// Both kernels; `max_active` bounds the experts with rows (the grid), `max_rows` the rows (the
// preloaded down kernel's activation rows; the busy experts are at most that many too).
template <bool FUSED>
cudaError_t Launch(const uint16_t* x, const int32_t* x_row_index, const int64_t* offsets, int num_experts,
                   int max_active, int64_t max_rows, int d, int f, const uint16_t* w_gate_up, const uint16_t* w_down,
                   uint16_t* a, uint16_t* y, const LayerRoute& route, cudaStream_t stream) {
  int sms = 0;  // (the streaming kernels' shared memory, at most 24 KiB, needs no opt-in)
  const cudaError_t setup = small_batch::SmCount(&sms);
  if (setup != cudaSuccess) return setup;
  const size_t smem = FUSED ? small_batch::RouteInBlockBytes(num_experts, route.routes) : ActiveBytes(num_experts);
  const int busy = max_rows < max_active ? static_cast<int>(max_rows) : max_active;
  const DownPlan plan = PlanDown<FUSED>(sms, num_experts, busy, max_rows, d, f, smem);
  // A unit a warp: blocks for every unit of `max_active` busy experts, at most one resident wave
  // (of the gate/up blocks that fit beside a preloading down block).
  auto grid = [&](int64_t max_units, int per_sm) {
    return small_batch::OneWave((max_units + kWarps - 1) / kWarps, static_cast<int64_t>(sms) * per_sm);
  };
  const dim3 gate_grid(grid(static_cast<int64_t>(max_active) * f, plan.gate_blocks_per_sm));
  const auto* x4 = reinterpret_cast<const uint4*>(x);
  const auto* wgu4 = reinterpret_cast<const uint4*>(w_gate_up);
  auto* a16 = reinterpret_cast<__nv_bfloat16*>(a);
  const cudaError_t e = LaunchDependent(GateUpKernel<FUSED>, gate_grid, dim3(kThreads), smem, stream, x4, x_row_index,
                                        offsets, num_experts, d / 8, f, wgu4, a16, route);
  if (e != cudaSuccess) return e;
  const auto* a4 = reinterpret_cast<const uint4*>(a);
  const auto* wd4 = reinterpret_cast<const uint4*>(w_down);
  auto* y16 = reinterpret_cast<__nv_bfloat16*>(y);
  if (plan.preload) {
    return LaunchDependent(DownPreloadKernel<FUSED>, dim3(plan.grid), dim3(kPreloadWarps * 32), plan.smem, stream, a4,
                           offsets, num_experts, f / 8, d, wd4, y16, route, plan.tiles_cap, plan.a_rows_cap);
  }
  const int64_t down_units = static_cast<int64_t>(max_active) * ((d + kDownRows - 1) / kDownRows);
  return LaunchDependent(DownKernel<FUSED>, dim3(grid(down_units, kBlocksPerSm)), dim3(kThreads), smem, stream, a4,
                         offsets, num_experts, f / 8, d, wd4, y16, route);
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
    return Launch<false>(x, x_row_index, offsets, num_experts, num_experts, rows, d, f, w_gate_up, w_down, a, y,
                         LayerRoute{}, stream);
  }
  if (small_batch::MmaSupported(d, f)) {
    return small_batch::LaunchMmaSwiglu(small_batch::WidePass(want), x, x_row_index, offsets, num_experts, d, f,
                                        w_gate_up, w_down, a, y, stream);
  }
  return small_batch::LaunchStagedSwiglu(want <= 4 ? 4 : 8, x, x_row_index, offsets, num_experts, d, f, w_gate_up,
                                         w_down, a, y, stream);
}

int SmallBatchDownPreloadBeside(int num_experts, int d, int f, int64_t rows) {
  int sms = 0;
  if (small_batch::SmCount(&sms) != cudaSuccess || num_experts < 1 || rows < 1) return 0;
  const int busy = rows < num_experts ? static_cast<int>(rows) : num_experts;
  const DownPlan plan = PlanDown<false>(sms, num_experts, busy, rows, d, f, ActiveBytes(num_experts));
  return plan.preload ? plan.gate_blocks_per_sm : 0;
}

bool FusedLocalLayerSupported(int64_t tokens, int k, int num_experts, int d, int f) {
  const int64_t routes = tokens * k;
  if (!(tokens > 0 && SmallBatchSupported(d, f) && routes <= small_batch::kBlockRoutes &&
        num_experts <= small_batch::kCachedExperts && ExpectedSegmentRows(routes, num_experts, tokens) <= 1 &&
        tokens * (d / 8) <= kFusedCombineVectors)) {
    return false;
  }
  // The stages (what a graph of the step replays) must give the same bits: both down kernels
  // preloaded (the same mma tiles, whatever the gate/up kernel's registers) or both streaming.
  int sms = 0;
  if (small_batch::SmCount(&sms) != cudaSuccess) return false;
  const int busy = routes < num_experts ? static_cast<int>(routes) : num_experts;
  const bool fused = PlanDown<true>(sms, num_experts, busy, routes, d, f,
                                    small_batch::RouteInBlockBytes(num_experts, static_cast<int>(routes)))
                         .preload;
  return fused == (SmallBatchDownPreloadBeside(num_experts, d, f, routes) != 0);
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
  return Launch<true>(x, nullptr, nullptr, num_experts, max_active, route.routes, d, f, w_gate_up, w_down, a, y, route,
                      stream);
}

}  // namespace moe::kernels::cuda
