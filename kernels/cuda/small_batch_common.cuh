// Pieces the decode-sized expert kernel families share (small_batch.cu streams the activation
// rows through L1, small_batch_staged.cu stages them in shared memory, small_batch_mma.cu runs
// on the tensor cores): the per-block list of experts that have rows, the FFMA dot of weight rows
// with activation rows, and warp reductions.
#ifndef MOE_KERNELS_CUDA_SMALL_BATCH_COMMON_CUH_
#define MOE_KERNELS_CUDA_SMALL_BATCH_COMMON_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>

#include "kernels/cuda/activation.cuh"
#include "kernels/cuda/bf16.cuh"
#include "kernels/cuda/launch.h"

namespace moe::kernels::cuda::small_batch {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
// Up to this many experts, each block caches the offsets in shared memory and compacts the list
// of experts that have rows, so work exists only for experts with rows.
constexpr int kCachedExperts = 2048;

struct ActiveExperts {
  const int64_t* offsets;  // [E + 1]
  const int* ids;          // active expert ids (nullptr: every expert, in order)
  int count;
};

// The current device's SM count, looked up once per process (a process drives one device).
inline cudaError_t SmCount(int* sms) {
  static int count = 0;
  static const cudaError_t setup = [] {
    int device = 0;
    cudaError_t e = cudaGetDevice(&device);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
    return e;
  }();
  *sms = count;
  return setup;
}

// Blocks of a launch: `blocks` (at least one), at most `resident` (one resident wave: every
// family's blocks take equal shares of the work instead of queueing behind each other).
inline unsigned OneWave(int64_t blocks, int64_t resident) {
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks < resident ? blocks : resident));
}

// The dynamic shared memory of a family's kernel, where its active-expert cache starts.
__device__ __forceinline__ int64_t* ActiveCache() {
  extern __shared__ int64_t cache[];
  return cache;
}

// Shared memory CompactActive needs: [E + 1] offsets, then [E] ids (none beyond the cache limit).
__host__ __device__ inline size_t ActiveBytes(int num_experts) {
  return num_experts > kCachedExperts ? 0
                                      : static_cast<size_t>(num_experts + 1) * 8 + static_cast<size_t>(num_experts) * 4;
}

// Called by every thread of a THREADS block; `cache` is ActiveBytes(E) of shared memory.
template <int THREADS = kThreads>
__device__ inline ActiveExperts CompactActive(const int64_t* __restrict__ offsets, int num_experts, int64_t* cache) {
  if (num_experts > kCachedExperts) return {offsets, nullptr, num_experts};
  int* ids = reinterpret_cast<int*>(cache + num_experts + 1);
  using Scan = cub::BlockScan<int, THREADS>;
  __shared__ typename Scan::TempStorage storage;
  __shared__ int carry;
  for (int i = threadIdx.x; i <= num_experts; i += blockDim.x) cache[i] = offsets[i];
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int e0 = 0; e0 < num_experts; e0 += blockDim.x) {
    const int e = e0 + threadIdx.x;
    const int busy = e < num_experts && cache[e + 1] > cache[e] ? 1 : 0;
    int slot, total;
    Scan(storage).ExclusiveSum(busy, slot, total);
    if (busy) ids[carry + slot] = e;
    __syncthreads();
    if (threadIdx.x == 0) carry += total;
    __syncthreads();
  }
  return {cache, ids, carry};
}

// A local layer's routing derived inside one block (the fused local layer: every block of both
// kernels derives the same tables from topk instead of reading a routing kernel's output). The
// assignment is deterministic, rows of one expert in route order: route i = t * k + j of expert
// e gets row offsets[e] + #{i' < i : topk[i'] == e}; ids outside [0, E) are dropped (row -1).
// The first warp does it with shuffles (at most 32 routes), one barrier publishes it: only the
// entries of experts with rows are written (all the kernels read).
struct BlockRouting {
  ActiveExperts act;
  const int* row_of_route;  // [routes], shared memory
  const int* token_of_row;  // [routes] (offsets[E] used), shared memory
};
constexpr int kBlockRoutes = 32;  // routes a block routes (one a lane of its first warp)
// Shared memory of RouteInBlock: the active-expert cache, then two [routes] int tables.
__host__ __device__ inline size_t RouteInBlockBytes(int num_experts, int routes) {
  return ActiveBytes(num_experts) + static_cast<size_t>(routes) * 2 * 4;
}
// Every thread of the block; num_experts <= kCachedExperts, routes <= kBlockRoutes.
__device__ inline BlockRouting RouteInBlock(const int32_t* __restrict__ topk, int routes, int k, int num_experts,
                                            int64_t* cache) {
  int* ids = reinterpret_cast<int*>(cache + num_experts + 1);
  int* row_of_route = ids + num_experts;
  int* token_of_row = row_of_route + routes;
  __shared__ int active;
  if (threadIdx.x < 32) {
    const int i = threadIdx.x;
    int e = i < routes ? topk[i] : -1;
    if (e >= num_experts) e = -1;
    const unsigned valid = __ballot_sync(0xffffffffu, e >= 0);
    // Valid routes of a smaller expert; of the same expert before this one; leaders (first
    // routes of their expert) of a smaller expert.
    int below = 0, before = 0;
    for (unsigned m = valid; m != 0; m &= m - 1) {
      const int j = __ffs(m) - 1;
      const int ej = __shfl_sync(0xffffffffu, e, j);
      below += ej < e ? 1 : 0;
      before += ej == e && j < i ? 1 : 0;
    }
    const bool leader = e >= 0 && before == 0;
    const unsigned leaders = __ballot_sync(0xffffffffu, leader);
    int slot = 0, count = 0;
    bool next_active = false;  // then expert e + 1's leader writes offsets[e + 1]
    for (unsigned m = leaders; m != 0; m &= m - 1) {
      const int ej = __shfl_sync(0xffffffffu, e, __ffs(m) - 1);
      slot += ej < e ? 1 : 0;
      next_active = next_active || ej == e + 1;
    }
    for (unsigned m = valid; m != 0; m &= m - 1) count += __shfl_sync(0xffffffffu, e, __ffs(m) - 1) == e ? 1 : 0;
    if (i < routes) {
      row_of_route[i] = e >= 0 ? below + before : -1;
      if (e >= 0) token_of_row[below + before] = i / k;
    }
    if (leader) {
      ids[slot] = e;
      cache[e] = below;
      if (!next_active) cache[e + 1] = below + count;
    }
    if (i == 0) active = __popc(leaders);
  }
  __syncthreads();
  return {{cache, ids, active}, row_of_route, token_of_row};
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// A weight vector: read once, so it bypasses L1 (which keeps the activation rows).
__device__ __forceinline__ uint4 LoadStreaming(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Dots NW weight rows (each `len8` 16-byte vectors) with `rows` activation rows; x_at(r, i) is
// vector i of activation row r (from L1 or shared memory, per family). ROWS is a compile-time
// constant so accumulators stay in registers; `rows` <= ROWS are valid. BATCH vectors of every
// weight row are loaded before any use: a lane keeps 16 * BATCH * NW bytes in flight.
// Each weight vector is widened once and each activation vector once per row, and the products
// go straight into FMA chains: with a few rows per expert the loop is issue-bound (ncu, 16
// tokens at E=128: ~80 instructions per weight vector when every weight vector was widened again
// for each row and summed through a partial, ~60 after). The widened values of whichever side
// has fewer rows in the batch are held, the other side's one at a time.
template <int ROWS, int NW, int BATCH, typename XAt>
__device__ __forceinline__ void DotRows(const uint4* const (&w)[NW], XAt&& x_at, int len8, int rows,
                                        float (&acc)[NW][ROWS]) {
  const int lane = threadIdx.x & 31;
  for (int base = lane; base < len8; base += 32 * BATCH) {
    uint4 wv[NW][BATCH];
#pragma unroll
    for (int n = 0; n < NW; ++n) {
#pragma unroll
      for (int u = 0; u < BATCH; ++u) {
        const int i = base + u * 32;
        wv[n][u] = i < len8 ? LoadStreaming(w[n] + i) : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < BATCH; ++u) {
      const int i = base + u * 32;
      if (i >= len8) break;
      if constexpr (NW <= ROWS) {
        float wf[NW][8];
#pragma unroll
        for (int n = 0; n < NW; ++n) Widen(wv[n][u], wf[n]);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          if (r < rows) {
            float xf[8];
            Widen(x_at(r, i), xf);
#pragma unroll
            for (int n = 0; n < NW; ++n) {
              float s = acc[n][r];
#pragma unroll
              for (int q = 0; q < 8; ++q) s = fmaf(wf[n][q], xf[q], s);
              acc[n][r] = s;
            }
          }
        }
      } else {
        float xf[ROWS][8];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          if (r < rows) Widen(x_at(r, i), xf[r]);
        }
#pragma unroll
        for (int n = 0; n < NW; ++n) {
          float wf[8];
          Widen(wv[n][u], wf);
#pragma unroll
          for (int r = 0; r < ROWS; ++r) {
            if (r < rows) {
              float s = acc[n][r];
#pragma unroll
              for (int q = 0; q < 8; ++q) s = fmaf(wf[q], xf[r][q], s);
              acc[n][r] = s;
            }
          }
        }
      }
    }
  }
}

// Sums each of V values (V a power of two <= 32) over the warp with V - 1 + log2(32 / V)
// shuffles instead of 5 V: every step trades half of the values with the partner lane. Returns
// this lane's sum of value SumIndex(lane); the lanes whose remaining bits are zero (SumLane(j))
// hold value j first.
template <int V>
__device__ __forceinline__ float WarpSumMany(float (&v)[V]) {
  static_assert(V >= 1 && V <= 32 && (V & (V - 1)) == 0, "V must be a power of two up to 32");
  const int lane = threadIdx.x & 31;
  int o = 16;
#pragma unroll
  for (int n = V / 2; n >= 1; n /= 2, o /= 2) {
    const bool upper = (lane & o) != 0;
#pragma unroll
    for (int j = 0; j < n; ++j) {
      const float send = upper ? v[j] : v[j + n];
      const float keep = upper ? v[j + n] : v[j];
      v[j] = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
  }
  float s = v[0];
  for (; o >= 1; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}
// Which value a lane holds after WarpSumMany<V>, and the first lane holding value j.
template <int V>
__device__ __forceinline__ int SumIndex(int lane) {
  int idx = 0;
#pragma unroll
  for (int n = V / 2, o = 16; n >= 1; n /= 2, o /= 2) idx = idx * 2 + ((lane & o) ? 1 : 0);
  return idx;
}
template <int V>
__device__ __forceinline__ int SumLane(int j) {
  int lane = 0;
#pragma unroll
  for (int n = 1, o = 32 / V; n < V; n *= 2, o *= 2) lane |= (j & n) ? o : 0;
  return lane;
}

// Epilogues: a[r0 + r, c] = bf16(silu(gate) * up) with gate and up rounded to BF16 first, as
// the GEMM path does; y[r0 + r, o0 + j] = bf16(acc[j][r]) for o0 + j < d. The warp's NW * ROWS
// sums are reduced together (WarpSumMany) and written by the lanes that hold them.
template <int ROWS>
__device__ __forceinline__ void StoreActivation(const float (&gu)[2][ROWS], int rows, int64_t r0, int f, int c,
                                                __nv_bfloat16* __restrict__ a) {
  constexpr int V = 2 * ROWS;  // value n * ROWS + r
  float v[V];
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) v[n * ROWS + r] = gu[n][r];
  const int lane = threadIdx.x & 31;
  const float sum = WarpSumMany<V>(v);
  const int idx = SumIndex<V>(lane);
  // The gate lanes fetch their row's up sum from the lane that holds it.
  const float up = __shfl_sync(0xffffffffu, sum, SumLane<V>(idx < ROWS ? idx + ROWS : idx));
  if (idx < ROWS && idx < rows && lane == SumLane<V>(idx)) {
    const float gs = __bfloat162float(__float2bfloat16_rn(sum));
    const float us = __bfloat162float(__float2bfloat16_rn(up));
    a[(r0 + idx) * f + c] = __float2bfloat16_rn(Silu(gs) * us);
  }
}

template <int ROWS, int NW>
__device__ __forceinline__ void StoreRows(const float (&acc)[NW][ROWS], int rows, int64_t r0, int d, int o0,
                                          __nv_bfloat16* __restrict__ y) {
  constexpr int V = NW * ROWS;  // value j * ROWS + r
  float v[V];
#pragma unroll
  for (int j = 0; j < NW; ++j)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) v[j * ROWS + r] = acc[j][r];
  const int lane = threadIdx.x & 31;
  const float sum = WarpSumMany<V>(v);
  const int idx = SumIndex<V>(lane);
  const int j = idx / ROWS, r = idx - j * ROWS;
  if (lane == SumLane<V>(idx) && r < rows && o0 + j < d) y[(r0 + r) * d + o0 + j] = __float2bfloat16_rn(sum);
}

// The tensor-core families (small_batch_mma.cu, small_batch_fp8.cu): a unit of work is (active
// expert, a tile of weight rows); each block takes a balanced contiguous share of the units, and
// its warps split the k-chunks.
constexpr int kRowsPerMma = 8;  // activation rows (the mma's n)

// mma.sync m16n8k16, BF16 in, FP32 accumulated in c (the fragments' register layout).
__device__ __forceinline__ void Mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One 32-k chunk: lo / hi = this lane's 16 bytes of weight rows g / g + 8, xv = of activation
// row g. Fragment k (2t, 2t + 1) <- k (8t, 8t + 1) and (2t + 8, 2t + 9) <- (8t + 2, 8t + 3) in
// the first mma; the second takes 8t + 4 .. 8t + 7 the same way.
__device__ __forceinline__ void MmaChunk(float (&c)[4], const uint4& lo, const uint4& hi, const uint4& xv) {
  Mma(c, lo.x, hi.x, lo.y, hi.y, xv.x, xv.y);
  Mma(c, lo.z, hi.z, lo.w, hi.w, xv.z, xv.w);
}

// The activation rows of a chunk [r0, r0 + rows) this lane feeds its NT mmas: row g of each
// group of 8 (clamped to the chunk; `valid` false past it), as layout rows.
template <int NT>
__device__ __forceinline__ void ChunkLanes(int64_t r0, int rows, int g, int64_t (&layout_row)[NT], bool (&valid)[NT]) {
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const int r = n * kRowsPerMma + g;
    valid[n] = r < rows;
    layout_row[n] = r0 + (r < rows ? r : rows - 1);
  }
}

// Each warp's tiles c[n] (its k-chunks' share) summed through shared memory into warp 0's c.
template <int NT>
__device__ __forceinline__ void SumTilesOverWarps(float (*partial)[32][4 * NT], float (&c)[NT][4]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int q = 0; q < 4; ++q) partial[warp][lane][4 * n + q] = c[n][q];
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int w = 1; w < kWarps; ++w)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int q = 0; q < 4; ++q) c[n][q] += partial[w][lane][4 * n + q];
  }
  __syncthreads();  // partials free for the next tile
}

// This warp's k-chunks of `chunks`, split evenly over the block's warps.
__device__ __forceinline__ void WarpChunks(int chunks, int* c0, int* c1) {
  const int warp = threadIdx.x >> 5;
  const int per = (chunks + kWarps - 1) / kWarps;
  *c0 = warp * per < chunks ? warp * per : chunks;
  *c1 = *c0 + per < chunks ? *c0 + per : chunks;
}

// A block's walk over its balanced, contiguous share of the (active slot, group) units, `groups`
// tiles an expert, and this warp's k-chunks of `chunks` (split evenly over the block's warps).
struct TileWalk {
  __device__ TileWalk(const ActiveExperts& act, int groups, int chunks) : groups(groups) {
    const int64_t units = static_cast<int64_t>(act.count) * groups;
    unit = units * blockIdx.x / gridDim.x;
    end = units * (blockIdx.x + 1) / gridDim.x;
    slot = static_cast<int>(unit / groups);
    grp = static_cast<int>(unit - static_cast<int64_t>(slot) * groups);
    WarpChunks(chunks, &chunk0, &chunk1);
  }
  __device__ bool More() const { return unit < end; }
  __device__ void Next() {
    ++unit;
    if (++grp == groups) {
      grp = 0;
      ++slot;
    }
  }
  int64_t unit, end;
  int groups, slot, grp, chunk0, chunk1;
};

// The staged family (small_batch_staged.cu), for chunks of four or eight rows.
cudaError_t LaunchStagedSwiglu(int rows_cap, const uint16_t* x, const int32_t* x_row_index, const int64_t* offsets,
                               int num_experts, int d, int f, const uint16_t* w_gate_up, const uint16_t* w_down,
                               uint16_t* a, uint16_t* y, cudaStream_t stream);
// The tensor-core family (small_batch_mma.cu), for d and d_ff multiples of 32. `wide`: 16
// activation rows a pass over each weight tile instead of 8; WidePass says whether for a step
// expected to give its busy experts `want` rows.
bool MmaSupported(int d, int f);
bool WidePass(int64_t want);
cudaError_t LaunchMmaSwiglu(bool wide, const uint16_t* x, const int32_t* x_row_index, const int64_t* offsets,
                            int num_experts, int d, int f, const uint16_t* w_gate_up, const uint16_t* w_down,
                            uint16_t* a, uint16_t* y, cudaStream_t stream);
// The staged family's shared-memory bound on a row (bytes).
constexpr size_t kStagedRowBudget = 96 * 1024;

}  // namespace moe::kernels::cuda::small_batch

#endif  // MOE_KERNELS_CUDA_SMALL_BATCH_COMMON_CUH_
