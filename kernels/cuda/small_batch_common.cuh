// Pieces both decode-sized expert kernel families share (small_batch.cu streams the activation
// rows through L1, small_batch_staged.cu stages them in shared memory): the per-block list of
// experts that have rows, and a warp reduction.
#ifndef MOE_KERNELS_CUDA_SMALL_BATCH_COMMON_CUH_
#define MOE_KERNELS_CUDA_SMALL_BATCH_COMMON_CUH_

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

// The staged family (small_batch_staged.cu), for chunks of four or eight rows.
cudaError_t LaunchStagedSwiglu(int rows_cap, const uint16_t* x, const int32_t* x_row_index, const int64_t* offsets,
                               int num_experts, int d, int f, const uint16_t* w_gate_up, const uint16_t* w_down,
                               uint16_t* a, uint16_t* y, cudaStream_t stream);
// Its shared-memory bound on a row (bytes).
constexpr size_t kStagedRowBudget = 96 * 1024;

}  // namespace moe::kernels::cuda::small_batch

#endif  // MOE_KERNELS_CUDA_SMALL_BATCH_COMMON_CUH_
