// Decode-sized SwiGLU experts on the tensor cores (mma.sync m16n8k16, BF16 in, FP32 accumulate).
//
// A decode step reads each hit expert's weights once and multiplies them with a handful of
// rows: a GEMV, memory-bound, and with FFMA the loop runs out of issue slots before it runs out
// of bandwidth once an expert has a few rows (ncu at E=128, 16 tokens: ~60 instructions per
// 512 bytes of weights). Here one mma consumes 512 bytes of weights (16 weight rows x 16 k)
// against up to 8 activation rows, so the loop is a few instructions per 512 bytes.
//
// Operands come straight from global memory in the mma fragments' register layout, with the k
// order permuted identically for both operands (a dot product does not depend on the order): a
// lane (group g = lane / 4, t = lane % 4) loads 16 bytes (k = 8t .. 8t + 7 of a 32-k chunk) of
// weight rows g and g + 8 and of activation row g; the first half feeds one mma, the second
// half the next. Weight loads bypass L1; the activation rows stay there.
//
// Work: a unit is (active expert, 16 weight rows): for gate/up, the gate and up rows of 8
// columns (so a lane ends up holding gate and up of the same column and row, and applies the
// activation itself); for down, 16 output rows. Every block of one resident wave takes an equal
// contiguous share of the units; its 8 warps split k and add their partial tiles through shared
// memory. Segments of more than 8 rows loop over chunks of 8.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/launch.h"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/small_batch_common.cuh"

namespace moe::kernels::cuda::small_batch {
namespace {

constexpr int kBlocksPerSm = 3;
constexpr int kBatchChunks = 4;  // 32-k chunks whose loads are in flight together: 128 weight bytes a lane
constexpr int kRowsPerMma = 8;   // activation rows (the mma's n)

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

__device__ __forceinline__ int64_t* ActiveCache() {
  extern __shared__ int64_t cache[];
  return cache;
}

// The tile of 16 weight rows (lo: rows g, hi: rows g + 8 of this lane) times activation rows
// [r0, r0 + rows) over this warp's k-chunks, summed over the block's warps. Returns the full
// tile in warp 0 (c[0], c[1]: row g, activation rows 2t, 2t + 1; c[2], c[3]: row g + 8).
__device__ __forceinline__ void TileProduct(const uint4* lo, const uint4* hi, const uint4* xrow, bool x_valid, int chunk0,
                                            int chunk1, float (*partial)[32][4], float (&c)[4]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
  c[0] = c[1] = c[2] = c[3] = 0.0f;
  for (int k = chunk0; k < chunk1; k += kBatchChunks) {
    uint4 wl[kBatchChunks], wh[kBatchChunks], xv[kBatchChunks];
#pragma unroll
    for (int b = 0; b < kBatchChunks; ++b) {
      const int i = (k + b) * 4 + t;
      const bool in = k + b < chunk1;
      wl[b] = in ? LoadStreaming(lo + i) : make_uint4(0, 0, 0, 0);
      wh[b] = in ? LoadStreaming(hi + i) : make_uint4(0, 0, 0, 0);
      xv[b] = in && x_valid ? __ldg(xrow + i) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int b = 0; b < kBatchChunks; ++b) MmaChunk(c, wl[b], wh[b], xv[b]);
  }
#pragma unroll
  for (int q = 0; q < 4; ++q) partial[warp][lane][q] = c[q];
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int w = 1; w < kWarps; ++w)
#pragma unroll
      for (int q = 0; q < 4; ++q) c[q] += partial[w][lane][q];
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

__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    GateUpMmaKernel(const uint4* __restrict__ x, const int32_t* __restrict__ x_row_index,
                    const int64_t* __restrict__ offsets, int num_experts, int d8, int f,
                    const uint4* __restrict__ w_gate_up, __nv_bfloat16* __restrict__ a) {
  __shared__ float partial[kWarps][32][4];
  WaitForPredecessor();  // the offsets and rows come from the routing / receive kernels
  ReleaseDependents();
  const ActiveExperts act = CompactActive(offsets, num_experts, ActiveCache());
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  for (TileWalk w(act, f / 8, d8 / 4); w.More(); w.Next()) {
    const int e = act.ids != nullptr ? act.ids[w.slot] : w.slot;
    const int64_t seg_begin = act.offsets[e], seg_end = act.offsets[e + 1];
    const int col = w.grp * 8 + g;
    const uint4* lo = w_gate_up + (static_cast<int64_t>(e) * 2 * f + col) * d8;  // gate row of column col
    const uint4* hi = lo + static_cast<int64_t>(f) * d8;                          // its up row
    for (int64_t r0 = seg_begin; r0 < seg_end; r0 += kRowsPerMma) {
      const int rows = static_cast<int>(seg_end - r0 < kRowsPerMma ? seg_end - r0 : kRowsPerMma);
      const int64_t layout_row = r0 + (g < rows ? g : rows - 1);
      const int64_t src = x_row_index != nullptr ? __ldg(x_row_index + layout_row) : layout_row;
      float c[4];
      TileProduct(lo, hi, x + src * d8, g < rows, w.chunk0, w.chunk1, partial, c);
      if (threadIdx.x < 32) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int n = 2 * t + j;
          if (n < rows) {
            // Gate and up rounded to BF16 as the GEMM path does, then the activation.
            const float gs = __bfloat162float(__float2bfloat16_rn(c[j]));
            const float us = __bfloat162float(__float2bfloat16_rn(c[2 + j]));
            a[(r0 + n) * f + col] = __float2bfloat16_rn(gs / (1.0f + expf(-gs)) * us);
          }
        }
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    DownMmaKernel(const uint4* __restrict__ a, const int64_t* __restrict__ offsets, int num_experts, int f8, int d,
                  const uint4* __restrict__ w_down, __nv_bfloat16* __restrict__ y) {
  __shared__ float partial[kWarps][32][4];
  // Offsets are inputs of the whole SwiGLU launch, complete before the gate/up kernel released
  // this one; `a` is read only after the wait.
  const ActiveExperts act = CompactActive(offsets, num_experts, ActiveCache());
  WaitForPredecessor();  // `a` comes from the gate/up kernel
  ReleaseDependents();
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  for (TileWalk w(act, d / 16, f8 / 4); w.More(); w.Next()) {
    const int e = act.ids != nullptr ? act.ids[w.slot] : w.slot;
    const int64_t seg_begin = act.offsets[e], seg_end = act.offsets[e + 1];
    const int o = w.grp * 16 + g;
    const uint4* lo = w_down + (static_cast<int64_t>(e) * d + o) * f8;
    const uint4* hi = lo + 8 * static_cast<int64_t>(f8);
    for (int64_t r0 = seg_begin; r0 < seg_end; r0 += kRowsPerMma) {
      const int rows = static_cast<int>(seg_end - r0 < kRowsPerMma ? seg_end - r0 : kRowsPerMma);
      float c[4];
      TileProduct(lo, hi, a + (r0 + (g < rows ? g : rows - 1)) * f8, g < rows, w.chunk0, w.chunk1, partial, c);
      if (threadIdx.x < 32) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int n = 2 * t + j;
          if (n < rows) {
            y[(r0 + n) * d + o] = __float2bfloat16_rn(c[j]);
            y[(r0 + n) * d + o + 8] = __float2bfloat16_rn(c[2 + j]);
          }
        }
      }
    }
  }
}

}  // namespace

bool MmaSupported(int d, int f) { return d > 0 && f > 0 && d % 32 == 0 && f % 32 == 0; }

cudaError_t LaunchMmaSwiglu(const uint16_t* x, const int32_t* x_row_index, const int64_t* offsets, int num_experts, int d,
                            int f, const uint16_t* w_gate_up, const uint16_t* w_down, uint16_t* a, uint16_t* y,
                            cudaStream_t stream) {
  int sms = 0;
  const cudaError_t setup = SmCount(&sms);
  if (setup != cudaSuccess) return setup;
  const size_t smem = ActiveBytes(num_experts);
  // One resident wave, or fewer blocks when every expert busy would not fill it.
  auto grid = [&](int64_t max_units) {
    const int64_t wave = static_cast<int64_t>(sms) * kBlocksPerSm;
    return dim3(static_cast<unsigned>(max_units < wave ? (max_units < 1 ? 1 : max_units) : wave));
  };
  cudaError_t e = LaunchDependent(GateUpMmaKernel, grid(static_cast<int64_t>(num_experts) * (f / 8)), dim3(kThreads), smem,
                                  stream, reinterpret_cast<const uint4*>(x), x_row_index, offsets, num_experts, d / 8, f,
                                  reinterpret_cast<const uint4*>(w_gate_up), reinterpret_cast<__nv_bfloat16*>(a));
  if (e != cudaSuccess) return e;
  return LaunchDependent(DownMmaKernel, grid(static_cast<int64_t>(num_experts) * (d / 16)), dim3(kThreads), smem, stream,
                         reinterpret_cast<const uint4*>(a), offsets, num_experts, f / 8, d,
                         reinterpret_cast<const uint4*>(w_down), reinterpret_cast<__nv_bfloat16*>(y));
}

}  // namespace moe::kernels::cuda::small_batch
