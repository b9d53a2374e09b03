// Pieces both decode-sized expert kernel families share (small_batch.cu streams the activation
// rows through L1, small_batch_staged.cu stages them in shared memory): the per-block list of
// experts that have rows, the dot of weight rows with activation rows, and a warp reduction.
#ifndef MOE_KERNELS_CUDA_SMALL_BATCH_COMMON_CUH_
#define MOE_KERNELS_CUDA_SMALL_BATCH_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>

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

// Shared memory CompactActive needs: [E + 1] offsets, then [E] ids (none beyond the cache limit).
__host__ __device__ inline size_t ActiveBytes(int num_experts) {
  return num_experts > kCachedExperts ? 0
                                      : static_cast<size_t>(num_experts + 1) * 8 + static_cast<size_t>(num_experts) * 4;
}

// Called by every thread of a kThreads block; `cache` is ActiveBytes(E) of shared memory.
__device__ inline ActiveExperts CompactActive(const int64_t* __restrict__ offsets, int num_experts, int64_t* cache) {
  if (num_experts > kCachedExperts) return {offsets, nullptr, num_experts};
  int* ids = reinterpret_cast<int*>(cache + num_experts + 1);
  using Scan = cub::BlockScan<int, kThreads>;
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
// constant so accumulators stay in registers; `rows` <= ROWS are valid. Four vectors of every
// weight row are loaded before any use: a lane keeps 64 * NW bytes in flight.
template <int ROWS, int NW, typename XAt>
__device__ __forceinline__ void DotRows(const uint4* const (&w)[NW], XAt&& x_at, int len8, int rows,
                                        float (&acc)[NW][ROWS]) {
  constexpr int kBatch = 4;  // vectors per weight row in flight (more costs registers)
  const int lane = threadIdx.x & 31;
  for (int base = lane; base < len8; base += 32 * kBatch) {
    uint4 wv[NW][kBatch];
#pragma unroll
    for (int n = 0; n < NW; ++n) {
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int i = base + u * 32;
        wv[n][u] = i < len8 ? LoadStreaming(w[n] + i) : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = base + u * 32;
      if (i >= len8) break;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        if (r < rows) {
          const uint4 xv = x_at(r, i);
          const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&xv);
          float2 xf[4];
#pragma unroll
          for (int q = 0; q < 4; ++q) xf[q] = __bfloat1622float2(x2[q]);
#pragma unroll
          for (int n = 0; n < NW; ++n) {
            const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&wv[n][u]);
            float s = 0;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              const float2 wf = __bfloat1622float2(w2[q]);
              s += wf.x * xf[q].x + wf.y * xf[q].y;
            }
            acc[n][r] += s;
          }
        }
      }
    }
  }
}

// Epilogues (lane 0 of the warp writes): a[r0 + r, c] = bf16(silu(gate) * up) with gate and up
// rounded to BF16 first, as the GEMM path does; y[r0 + r, o0 + j] = bf16(acc[j][r]) for o0 + j < d.
template <int ROWS>
__device__ __forceinline__ void StoreActivation(const float (&gu)[2][ROWS], int rows, int64_t r0, int f, int c,
                                                __nv_bfloat16* __restrict__ a) {
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (r < rows) {
      const float gs = __bfloat162float(__float2bfloat16_rn(WarpSum(gu[0][r])));
      const float us = __bfloat162float(__float2bfloat16_rn(WarpSum(gu[1][r])));
      if ((threadIdx.x & 31) == 0) a[(r0 + r) * f + c] = __float2bfloat16_rn(gs / (1.0f + expf(-gs)) * us);
    }
  }
}

template <int ROWS, int NW>
__device__ __forceinline__ void StoreRows(const float (&acc)[NW][ROWS], int rows, int64_t r0, int d, int o0,
                                          __nv_bfloat16* __restrict__ y) {
#pragma unroll
  for (int j = 0; j < NW; ++j) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      if (r < rows) {
        const float v = WarpSum(acc[j][r]);
        if ((threadIdx.x & 31) == 0 && o0 + j < d) y[(r0 + r) * d + o0 + j] = __float2bfloat16_rn(v);
      }
    }
  }
}

// The staged family (small_batch_staged.cu), for chunks of four or eight rows.
cudaError_t LaunchStagedSwiglu(int rows_cap, const uint16_t* x, const int32_t* x_row_index, const int64_t* offsets,
                               int num_experts, int d, int f, const uint16_t* w_gate_up, const uint16_t* w_down,
                               uint16_t* a, uint16_t* y, cudaStream_t stream);
// Its shared-memory bound on a row (bytes).
constexpr size_t kStagedRowBudget = 96 * 1024;

}  // namespace moe::kernels::cuda::small_batch

#endif  // MOE_KERNELS_CUDA_SMALL_BATCH_COMMON_CUH_
