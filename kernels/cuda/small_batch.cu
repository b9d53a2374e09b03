// Decode-sized SwiGLU experts with device-side segment offsets (no host round trip).
//
// Memory-bound by design: with a handful of rows per expert, the cost is reading each hit
// expert's weights once. Every warp streams whole weight rows with 16-byte loads and dots them
// against the expert's rows staged in shared memory (a chunk of up to kMaxRows rows; longer
// segments loop over chunks, so any segment size is correct, just slower). The chunk capacity
// is a template parameter picked from the caller's bound on segment length.
//   GateUpKernel: a[r, c] = bf16(silu(bf16(x_r . Wg_c)) * bf16(x_r . Wu_c))  (gate and up rows
//                 of one column together, activation in the epilogue)
//   DownKernel:   y[r, o] = bf16(a_r . Wd_o)
// Work items are (expert, tile of output rows); blocks stride over them and skip empty experts.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/launch.h"

namespace moe::kernels::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kRowsPerWarp = 2;
constexpr int kTileRows = kWarps * kRowsPerWarp;  // output rows per work item

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Dot of weight row w (len elements, 16B-aligned) with `rows` staged rows in smem (stride len).
// Accumulates per staged row into acc[r].
// Four 16-byte weight loads are issued before any use, so each lane keeps 64 bytes in flight.
// ROWS is the staged-chunk capacity (a compile-time constant keeps accumulators in registers
// and the unrolled code small); `rows` <= ROWS are valid.
template <int ROWS>
__device__ __forceinline__ void DotRows(const uint4* __restrict__ w, const uint4* __restrict__ xs, int len8, int rows,
                                        float (&acc)[ROWS]) {
  const int lane = threadIdx.x & 31;
  for (int base = lane; base < len8; base += 32 * 4) {
    uint4 wv[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = base + u * 32;
      wv[u] = i < len8 ? __ldg(w + i) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = base + u * 32;
      if (i >= len8) break;
      const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&wv[u]);
      float2 wf[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) wf[q] = __bfloat1622float2(w2[q]);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        if (r < rows) {
          const uint4 xv = xs[r * len8 + i];
          const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&xv);
          float s = 0;
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const float2 xf = __bfloat1622float2(x2[q]);
            s += wf[q].x * xf.x + wf[q].y * xf.y;
          }
          acc[r] += s;
        }
      }
    }
  }
}

__device__ __forceinline__ void StageRows(const uint4* __restrict__ src, int len8, int rows, uint4* __restrict__ dst) {
  for (int i = threadIdx.x; i < rows * len8; i += blockDim.x) dst[i] = src[i];
}

template <int ROWS>
__global__ void __launch_bounds__(kWarps * 32) GateUpKernel(const uint4* __restrict__ x, const int64_t* __restrict__ offsets,
                                                           int num_experts, int d8, int f,
                                                           const uint4* __restrict__ w_gate_up, int chunk_rows,
                                                           __nv_bfloat16* __restrict__ a) {
  extern __shared__ uint4 xs[];
  const int tiles = (f + kTileRows - 1) / kTileRows;
  const int warp = threadIdx.x >> 5;
  for (int item = blockIdx.x; item < num_experts * tiles; item += gridDim.x) {
    const int e = item / tiles;
    const int64_t begin = offsets[e], end = offsets[e + 1];
    if (begin == end) continue;
    const int tile = item - e * tiles;
    for (int64_t r0 = begin; r0 < end; r0 += chunk_rows) {
      const int rows = static_cast<int>(end - r0 < chunk_rows ? end - r0 : chunk_rows);
      __syncthreads();  // the previous chunk's readers are done with xs
      StageRows(x + r0 * d8, d8, rows, xs);
      __syncthreads();
#pragma unroll
      for (int j = 0; j < kRowsPerWarp; ++j) {
        const int c = tile * kTileRows + warp * kRowsPerWarp + j;
        if (c >= f) break;
        float g[ROWS] = {}, u[ROWS] = {};
        const uint4* wg = w_gate_up + (static_cast<int64_t>(e) * 2 * f + c) * d8;
        const uint4* wu = w_gate_up + (static_cast<int64_t>(e) * 2 * f + f + c) * d8;
        DotRows<ROWS>(wg, xs, d8, rows, g);
        DotRows<ROWS>(wu, xs, d8, rows, u);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          if (r < rows) {
            const float gs = __bfloat162float(__float2bfloat16_rn(WarpSum(g[r])));
            const float us = __bfloat162float(__float2bfloat16_rn(WarpSum(u[r])));
            if ((threadIdx.x & 31) == 0) a[(r0 + r) * f + c] = __float2bfloat16_rn(gs / (1.0f + expf(-gs)) * us);
          }
        }
      }
    }
  }
}

template <int ROWS>
__global__ void __launch_bounds__(kWarps * 32) DownKernel(const uint4* __restrict__ a, const int64_t* __restrict__ offsets,
                                                         int num_experts, int f8, int d,
                                                         const uint4* __restrict__ w_down, int chunk_rows,
                                                         __nv_bfloat16* __restrict__ y) {
  extern __shared__ uint4 as[];
  const int tiles = (d + kTileRows - 1) / kTileRows;
  const int warp = threadIdx.x >> 5;
  for (int item = blockIdx.x; item < num_experts * tiles; item += gridDim.x) {
    const int e = item / tiles;
    const int64_t begin = offsets[e], end = offsets[e + 1];
    if (begin == end) continue;
    const int tile = item - e * tiles;
    for (int64_t r0 = begin; r0 < end; r0 += chunk_rows) {
      const int rows = static_cast<int>(end - r0 < chunk_rows ? end - r0 : chunk_rows);
      __syncthreads();
      StageRows(a + r0 * f8, f8, rows, as);
      __syncthreads();
#pragma unroll
      for (int j = 0; j < kRowsPerWarp; ++j) {
        const int o = tile * kTileRows + warp * kRowsPerWarp + j;
        if (o >= d) break;
        float acc[ROWS] = {};
        DotRows<ROWS>(w_down + (static_cast<int64_t>(e) * d + o) * f8, as, f8, rows, acc);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          if (r < rows) {
            const float v = WarpSum(acc[r]);
            if ((threadIdx.x & 31) == 0) y[(r0 + r) * d + o] = __float2bfloat16_rn(v);
          }
        }
      }
    }
  }
}

constexpr size_t kSmemBudget = 96 * 1024;

int ChunkRows(int rows_cap, int len) {
  const int fit = static_cast<int>(kSmemBudget / (static_cast<size_t>(len) * 2));
  return fit < rows_cap ? (fit < 1 ? 1 : fit) : rows_cap;
}

int Grid(int items, int sms) {
  const int g = sms * 8;
  return items < g ? items : g;
}

template <int ROWS>
cudaError_t Launch(const uint16_t* x, const int64_t* offsets, int num_experts, int d, int f, const uint16_t* w_gate_up,
                   const uint16_t* w_down, uint16_t* a, uint16_t* y, cudaStream_t stream) {
  // Device attributes and the shared-memory opt-in are set once per process and ROWS.
  static int sms = 0;
  static cudaError_t setup = [] {
    int device = 0;
    cudaError_t e = cudaGetDevice(&device);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (e == cudaSuccess) {
      e = cudaFuncSetAttribute(GateUpKernel<ROWS>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmemBudget));
    }
    if (e == cudaSuccess) {
      e = cudaFuncSetAttribute(DownKernel<ROWS>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmemBudget));
    }
    return e;
  }();
  if (setup != cudaSuccess) return setup;
  const int chunk_x = ChunkRows(ROWS, d), chunk_a = ChunkRows(ROWS, f);
  const size_t smem_x = static_cast<size_t>(chunk_x) * d * 2, smem_a = static_cast<size_t>(chunk_a) * f * 2;
  const int items_up = num_experts * ((f + kTileRows - 1) / kTileRows);
  GateUpKernel<ROWS><<<Grid(items_up, sms), kWarps * 32, smem_x, stream>>>(
      reinterpret_cast<const uint4*>(x), offsets, num_experts, d / 8, f, reinterpret_cast<const uint4*>(w_gate_up),
      chunk_x, reinterpret_cast<__nv_bfloat16*>(a));
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  const int items_down = num_experts * ((d + kTileRows - 1) / kTileRows);
  DownKernel<ROWS><<<Grid(items_down, sms), kWarps * 32, smem_a, stream>>>(
      reinterpret_cast<const uint4*>(a), offsets, num_experts, f / 8, d, reinterpret_cast<const uint4*>(w_down), chunk_a,
      reinterpret_cast<__nv_bfloat16*>(y));
  return cudaGetLastError();
}

}  // namespace

bool SmallBatchSupported(int d, int f) {
  // 16-byte rows and at least one staged row inside the shared-memory budget.
  return d % 8 == 0 && f % 8 == 0 && static_cast<size_t>(d) * 2 <= kSmemBudget && static_cast<size_t>(f) * 2 <= kSmemBudget;
}

cudaError_t LaunchSmallBatchSwiglu(const uint16_t* x, const int64_t* offsets, int num_experts, int d, int f,
                                   const uint16_t* w_gate_up, const uint16_t* w_down, uint16_t* a, uint16_t* y,
                                   int64_t max_segment_rows, cudaStream_t stream) {
  // The chunk capacity follows the caller's bound on segment length (rows beyond a chunk loop).
  if (max_segment_rows <= 1) return Launch<1>(x, offsets, num_experts, d, f, w_gate_up, w_down, a, y, stream);
  if (max_segment_rows <= 2) return Launch<2>(x, offsets, num_experts, d, f, w_gate_up, w_down, a, y, stream);
  if (max_segment_rows <= 4) return Launch<4>(x, offsets, num_experts, d, f, w_gate_up, w_down, a, y, stream);
  return Launch<8>(x, offsets, num_experts, d, f, w_gate_up, w_down, a, y, stream);
}

}  // namespace moe::kernels::cuda
