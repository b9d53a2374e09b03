// Decode-sized SwiGLU experts, staged family: for chunks of four or eight rows per expert.
//
// The expert's rows of a chunk are staged in shared memory once per work item and every warp
// streams whole weight rows with 16-byte loads against them (four vectors of a weight row in
// flight per lane); work items are (active expert, tile of output rows) and the blocks of one
// resident wave stride over them. With several rows per expert this beats reading the rows
// through L1 per weight vector (small_batch.cu): on an H200, E=32, d=7168, d_ff=2048, 16
// tokens, 1.81 ms staged against 2.45 ms.
//   GateUpKernel: a[r, c] = bf16(silu(bf16(x_r . Wg_c)) * bf16(x_r . Wu_c))
//   DownKernel:   y[r, o] = bf16(a_r . Wd_o)
#include <cuda_runtime.h>

#include <cuda_bf16.h>

#include "kernels/cuda/launch.h"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/small_batch_common.cuh"

namespace moe::kernels::cuda::small_batch {
namespace {

// Register cap: three blocks of 256 threads per SM (85 registers) for four rows a chunk, two
// (128) for eight, where more accumulators are live; both without spills. Large d leaves room
// for fewer blocks anyway (the staged rows: up to 96 KiB of shared memory a block).
template <int ROWS>
constexpr int StagedBlocksPerSm() {
  return ROWS <= 4 ? 3 : 2;
}

constexpr int kUpRowsPerWarp = 1;    // gate/up: each column is two weight rows
constexpr int kDownRowsPerWarp = 2;  // down: two output rows per warp, loaded together
constexpr int kUpTile = kWarps * kUpRowsPerWarp;
constexpr int kDownTile = kWarps * kDownRowsPerWarp;

// Stages `rows` rows starting at layout row r0; with `row_index` the rows are gathered from
// their source (e.g. token rows of the hidden state): the permutation is fused into the load.
__device__ __forceinline__ void StageRows(const uint4* __restrict__ src, const int32_t* __restrict__ row_index,
                                          int64_t r0, int len8, int rows, uint4* __restrict__ dst) {
  for (int i = threadIdx.x; i < rows * len8; i += blockDim.x) {
    const int r = i / len8;
    const int64_t row = row_index != nullptr ? row_index[r0 + r] : r0 + r;
    dst[i] = src[row * len8 + (i - r * len8)];
  }
}

// The work loop both kernels share: compact the active experts, then stride over (active
// expert, tile) items; for each, stage the expert's rows chunk by chunk and call
// body(e, tile, r0, rows, staged) with every thread of the block.
template <typename Body>
__device__ __forceinline__ void ForEachStagedChunk(const int64_t* __restrict__ offsets, int num_experts, int tiles,
                                                   const uint4* __restrict__ src, const int32_t* __restrict__ row_index,
                                                   int len8, int chunk_rows, Body&& body) {
  extern __shared__ uint4 smem[];
  const size_t active_vecs = (ActiveBytes(num_experts) + 15) / 16;
  const ActiveExperts act = CompactActive(offsets, num_experts, reinterpret_cast<int64_t*>(smem));
  uint4* staged = smem + active_vecs;
  for (int item = blockIdx.x; item < act.count * tiles; item += gridDim.x) {
    const int e = act.ids != nullptr ? act.ids[item / tiles] : item / tiles;
    const int64_t begin = act.offsets[e], end = act.offsets[e + 1];
    if (begin == end) continue;
    for (int64_t r0 = begin; r0 < end; r0 += chunk_rows) {
      const int rows = static_cast<int>(end - r0 < chunk_rows ? end - r0 : chunk_rows);
      __syncthreads();  // the previous chunk's readers are done with the staged rows
      StageRows(src, row_index, r0, len8, rows, staged);
      __syncthreads();
      body(e, item % tiles, r0, rows, staged);
    }
  }
}

template <int ROWS>
__global__ void __launch_bounds__(kWarps * 32, StagedBlocksPerSm<ROWS>())
    GateUpKernel(const uint4* __restrict__ x, const int32_t* __restrict__ x_row_index,
                 const int64_t* __restrict__ offsets, int num_experts, int d8, int f,
                 const uint4* __restrict__ w_gate_up, int chunk_rows, __nv_bfloat16* __restrict__ a) {
  WaitForPredecessor();
  ReleaseDependents();
  const int warp = threadIdx.x >> 5;
  ForEachStagedChunk(offsets, num_experts, (f + kUpTile - 1) / kUpTile, x, x_row_index, d8, chunk_rows,
                     [&](int e, int tile, int64_t r0, int rows, const uint4* xs) {
#pragma unroll
                       for (int j = 0; j < kUpRowsPerWarp; ++j) {
                         const int c = tile * kUpTile + warp * kUpRowsPerWarp + j;
                         if (c >= f) break;
                         float gu[2][ROWS] = {};
                         const uint4* const w[2] = {w_gate_up + (static_cast<int64_t>(e) * 2 * f + c) * d8,
                                                    w_gate_up + (static_cast<int64_t>(e) * 2 * f + f + c) * d8};
                         DotRows<ROWS, 2, 4>(
                             w, [&](int r, int i) { return xs[r * d8 + i]; }, d8, rows, gu);
                         StoreActivation<ROWS>(gu, rows, r0, f, c, a);
                       }
                     });
}

template <int ROWS>
__global__ void __launch_bounds__(kWarps * 32, StagedBlocksPerSm<ROWS>())
    DownKernel(const uint4* __restrict__ a, const int64_t* __restrict__ offsets, int num_experts, int f8, int d,
               const uint4* __restrict__ w_down, int chunk_rows, __nv_bfloat16* __restrict__ y) {
  WaitForPredecessor();
  ReleaseDependents();
  const int warp = threadIdx.x >> 5;
  ForEachStagedChunk(offsets, num_experts, (d + kDownTile - 1) / kDownTile, a, nullptr, f8, chunk_rows,
                     [&](int e, int tile, int64_t r0, int rows, const uint4* as) {
                       // Two output rows per warp, their weight rows streamed together (clamped at d; the
                       // duplicate rows of a ragged last tile are computed but not written).
                       const int o0 = tile * kDownTile + warp * kDownRowsPerWarp;
                       if (o0 >= d) return;
                       const uint4* w[kDownRowsPerWarp];
#pragma unroll
                       for (int j = 0; j < kDownRowsPerWarp; ++j) {
                         const int o = o0 + j < d ? o0 + j : d - 1;
                         w[j] = w_down + (static_cast<int64_t>(e) * d + o) * f8;
                       }
                       float acc[kDownRowsPerWarp][ROWS] = {};
                       DotRows<ROWS, kDownRowsPerWarp, 4>(
                           w, [&](int r, int i) { return as[r * f8 + i]; }, f8, rows, acc);
                       StoreRows<ROWS, kDownRowsPerWarp>(acc, rows, r0, d, o0, y);
                     });
}

constexpr size_t kSmemBudget = kStagedRowBudget;  // staged rows; the active-expert cache comes on top

int ChunkRows(int rows_cap, int len) {
  const int fit = static_cast<int>(kSmemBudget / (static_cast<size_t>(len) * 2));
  return fit < rows_cap ? (fit < 1 ? 1 : fit) : rows_cap;
}

template <int ROWS>
cudaError_t Launch(const uint16_t* x, const int32_t* x_row_index, const int64_t* offsets, int num_experts, int d, int f,
                   const uint16_t* w_gate_up, const uint16_t* w_down, uint16_t* a, uint16_t* y, cudaStream_t stream) {
  // The shared-memory opt-in is set once per process and ROWS.
  int sms = 0;
  const cudaError_t count = SmCount(&sms);
  if (count != cudaSuccess) return count;
  static cudaError_t setup = [] {
    cudaError_t e = cudaFuncSetAttribute(GateUpKernel<ROWS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(kSmemBudget + ActiveBytes(kCachedExperts) + 16));
    if (e == cudaSuccess) {
      e = cudaFuncSetAttribute(DownKernel<ROWS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(kSmemBudget + ActiveBytes(kCachedExperts) + 16));
    }
    return e;
  }();
  if (setup != cudaSuccess) return setup;
  const int chunk_x = ChunkRows(ROWS, d), chunk_a = ChunkRows(ROWS, f);
  const size_t active = (ActiveBytes(num_experts) + 15) / 16 * 16;
  const size_t smem_x = active + static_cast<size_t>(chunk_x) * d * 2,
               smem_a = active + static_cast<size_t>(chunk_a) * f * 2;
  // One resident wave: blocks stride over the work items.
  int per_sm_up = 1, per_sm_down = 1;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_up, GateUpKernel<ROWS>, kWarps * 32, smem_x);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_down, DownKernel<ROWS>, kWarps * 32, smem_a);
  const int items_up = num_experts * ((f + kUpTile - 1) / kUpTile);
  cudaError_t e = LaunchDependent(GateUpKernel<ROWS>, dim3(OneWave(items_up, sms * (per_sm_up > 0 ? per_sm_up : 1))),
                                  dim3(kThreads), smem_x, stream, reinterpret_cast<const uint4*>(x), x_row_index,
                                  offsets, num_experts, d / 8, f, reinterpret_cast<const uint4*>(w_gate_up), chunk_x,
                                  reinterpret_cast<__nv_bfloat16*>(a));
  if (e != cudaSuccess) return e;
  const int items_down = num_experts * ((d + kDownTile - 1) / kDownTile);
  return LaunchDependent(DownKernel<ROWS>, dim3(OneWave(items_down, sms * (per_sm_down > 0 ? per_sm_down : 1))),
                         dim3(kThreads), smem_a, stream, reinterpret_cast<const uint4*>(a), offsets, num_experts, f / 8,
                         d, reinterpret_cast<const uint4*>(w_down), chunk_a, reinterpret_cast<__nv_bfloat16*>(y));
}

}  // namespace

cudaError_t LaunchStagedSwiglu(int rows_cap, const uint16_t* x, const int32_t* x_row_index, const int64_t* offsets,
                               int num_experts, int d, int f, const uint16_t* w_gate_up, const uint16_t* w_down,
                               uint16_t* a, uint16_t* y, cudaStream_t stream) {
  if (rows_cap <= 4) return Launch<4>(x, x_row_index, offsets, num_experts, d, f, w_gate_up, w_down, a, y, stream);
  return Launch<8>(x, x_row_index, offsets, num_experts, d, f, w_gate_up, w_down, a, y, stream);
}

}  // namespace moe::kernels::cuda::small_batch
