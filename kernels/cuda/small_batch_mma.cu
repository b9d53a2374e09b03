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
// memory. Segments of more than 8 rows loop over chunks of 8, or of 16 in the wide variant: two
// mmas (two groups of 8 activation rows) share each weight load. It is chosen per step, when
// the step is expected to give busy experts 8 rows or more (WidePass).
#include <cuda_runtime.h>

#include <cstdlib>

#include <cuda_bf16.h>

#include "kernels/cuda/launch.h"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/small_batch_common.cuh"

namespace moe::kernels::cuda::small_batch {
namespace {

constexpr int kBlocksPerSm = 3;
// 32-k chunks whose loads are in flight together: 128 weight bytes a lane. With two groups of
// activation rows a pass (wide) the batch is halved to stay within the register budget of
// three blocks an SM.
template <int NT>
constexpr int KBatchChunks() {
  return NT == 1 ? 4 : 2;
}

// The tile of 16 weight rows (lo: rows g, hi: rows g + 8 of this lane) times NT groups of 8
// activation rows over this warp's k-chunks, summed over the block's warps: every weight load
// feeds NT mmas. xrow[n] is this lane's row of group n (row g of it), x_valid[n] whether that
// row exists. Returns the full tiles in warp 0 (c[n][0], c[n][1]: weight row g, rows 2t, 2t + 1
// of group n; c[n][2], c[n][3]: weight row g + 8).
template <int NT>
__device__ __forceinline__ void TileProduct(const uint4* lo, const uint4* hi, const uint4* const (&xrow)[NT],
                                            const bool (&x_valid)[NT], int chunk0, int chunk1,
                                            float (*partial)[32][4 * NT], float (&c)[NT][4]) {
  constexpr int kBatch = KBatchChunks<NT>();
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int n = 0; n < NT; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.0f;
  for (int k = chunk0; k < chunk1; k += kBatch) {
    uint4 wl[kBatch], wh[kBatch], xv[NT][kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = (k + b) * 4 + t;
      const bool in = k + b < chunk1;
      wl[b] = in ? LoadStreaming(lo + i) : make_uint4(0, 0, 0, 0);
      wh[b] = in ? LoadStreaming(hi + i) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int n = 0; n < NT; ++n) xv[n][b] = in && x_valid[n] ? __ldg(xrow[n] + i) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
#pragma unroll
      for (int n = 0; n < NT; ++n) MmaChunk(c[n], wl[b], wh[b], xv[n][b]);
  }
  SumTilesOverWarps<NT>(partial, c);
}

// Epilogues of a tile in the mma fragments' layout (c[n][0..1]: weight row g, rows 2t, 2t + 1 of
// group n; c[n][2..3]: weight row g + 8): store(r, lo, hi) for each of this lane's tile rows r
// below `rows`, lo and hi its sums with weight rows g and g + 8.
template <int NT, typename Store>
__device__ __forceinline__ void ForTileRows(const float (&c)[NT][4], int rows, Store&& store) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int r = n * kRowsPerMma + 2 * t + j;
      if (r < rows) store(r, c[n][j], c[n][2 + j]);
    }
  }
}
// Gate/up: a[r0 + r, col] = bf16(silu(bf16(gate)) * bf16(up)), gate and up rounded to BF16 as
// the GEMM path does.
template <int NT>
__device__ __forceinline__ void StoreActivationTile(const float (&c)[NT][4], int rows, int64_t r0, int f, int col,
                                                    __nv_bfloat16* __restrict__ a) {
  ForTileRows<NT>(c, rows, [&](int r, float gate, float up) {
    const float gs = __bfloat162float(__float2bfloat16_rn(gate));
    const float us = __bfloat162float(__float2bfloat16_rn(up));
    a[(r0 + r) * f + col] = __float2bfloat16_rn(Silu(gs) * us);
  });
}
// Down: y[r0 + r, o] and y[r0 + r, o + 8].
template <int NT>
__device__ __forceinline__ void StoreDownTile(const float (&c)[NT][4], int rows, int64_t r0, int d, int o,
                                              __nv_bfloat16* __restrict__ y) {
  ForTileRows<NT>(c, rows, [&](int r, float lo, float hi) {
    y[(r0 + r) * d + o] = __float2bfloat16_rn(lo);
    y[(r0 + r) * d + o + 8] = __float2bfloat16_rn(hi);
  });
}

template <int NT>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    GateUpMmaKernel(const uint4* __restrict__ x, const int32_t* __restrict__ x_row_index,
                    const int64_t* __restrict__ offsets, int num_experts, int d8, int f,
                    const uint4* __restrict__ w_gate_up, __nv_bfloat16* __restrict__ a) {
  __shared__ float partial[kWarps][32][4 * NT];
  WaitForPredecessor();  // the offsets and rows come from the routing / receive kernels
  ReleaseDependents();
  const ActiveExperts act = CompactActive(offsets, num_experts, ActiveCache());
  const int lane = threadIdx.x & 31, g = lane >> 2;
  for (TileWalk w(act, f / 8, d8 / 4); w.More(); w.Next()) {
    const int e = act.ids != nullptr ? act.ids[w.slot] : w.slot;
    const int64_t seg_begin = act.offsets[e], seg_end = act.offsets[e + 1];
    const int col = w.grp * 8 + g;
    const uint4* lo = w_gate_up + (static_cast<int64_t>(e) * 2 * f + col) * d8;  // gate row of column col
    const uint4* hi = lo + static_cast<int64_t>(f) * d8;                         // its up row
    for (int64_t r0 = seg_begin; r0 < seg_end; r0 += NT * kRowsPerMma) {
      const int rows = static_cast<int>(seg_end - r0 < NT * kRowsPerMma ? seg_end - r0 : NT * kRowsPerMma);
      int64_t layout_row[NT];
      bool valid[NT];
      ChunkLanes<NT>(r0, rows, g, layout_row, valid);
      const uint4* xrow[NT];
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const int64_t src = x_row_index != nullptr ? __ldg(x_row_index + layout_row[n]) : layout_row[n];
        xrow[n] = x + src * d8;
      }
      float c[NT][4];
      TileProduct<NT>(lo, hi, xrow, valid, w.chunk0, w.chunk1, partial, c);
      if (threadIdx.x < 32) StoreActivationTile<NT>(c, rows, r0, f, col, a);
    }
  }
}

template <int NT>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    DownMmaKernel(const uint4* __restrict__ a, const int64_t* __restrict__ offsets, int num_experts, int f8, int d,
                  const uint4* __restrict__ w_down, __nv_bfloat16* __restrict__ y) {
  __shared__ float partial[kWarps][32][4 * NT];
  // Offsets are inputs of the whole SwiGLU launch, complete before the gate/up kernel released
  // this one; `a` is read only after the wait.
  const ActiveExperts act = CompactActive(offsets, num_experts, ActiveCache());
  WaitForPredecessor();  // `a` comes from the gate/up kernel
  ReleaseDependents();
  const int lane = threadIdx.x & 31, g = lane >> 2;
  for (TileWalk w(act, d / 16, f8 / 4); w.More(); w.Next()) {
    const int e = act.ids != nullptr ? act.ids[w.slot] : w.slot;
    const int64_t seg_begin = act.offsets[e], seg_end = act.offsets[e + 1];
    const int o = w.grp * 16 + g;
    const uint4* lo = w_down + (static_cast<int64_t>(e) * d + o) * f8;
    const uint4* hi = lo + 8 * static_cast<int64_t>(f8);
    for (int64_t r0 = seg_begin; r0 < seg_end; r0 += NT * kRowsPerMma) {
      const int rows = static_cast<int>(seg_end - r0 < NT * kRowsPerMma ? seg_end - r0 : NT * kRowsPerMma);
      int64_t layout_row[NT];
      bool valid[NT];
      ChunkLanes<NT>(r0, rows, g, layout_row, valid);
      const uint4* arow[NT];
#pragma unroll
      for (int n = 0; n < NT; ++n) arow[n] = a + layout_row[n] * f8;
      float c[NT][4];
      TileProduct<NT>(lo, hi, arow, valid, w.chunk0, w.chunk1, partial, c);
      if (threadIdx.x < 32) StoreDownTile<NT>(c, rows, r0, d, o, y);
    }
  }
}

template <int NT>
cudaError_t Launch(const uint16_t* x, const int32_t* x_row_index, const int64_t* offsets, int num_experts, int d, int f,
                   const uint16_t* w_gate_up, const uint16_t* w_down, uint16_t* a, uint16_t* y, cudaStream_t stream) {
  int sms = 0;
  const cudaError_t setup = SmCount(&sms);
  if (setup != cudaSuccess) return setup;
  const size_t smem = ActiveBytes(num_experts);
  // A unit a block: one for each unit of every expert busy, at most one resident wave.
  const int64_t wave = static_cast<int64_t>(sms) * kBlocksPerSm;
  cudaError_t e = LaunchDependent(GateUpMmaKernel<NT>, dim3(OneWave(static_cast<int64_t>(num_experts) * (f / 8), wave)),
                                  dim3(kThreads), smem, stream, reinterpret_cast<const uint4*>(x), x_row_index, offsets,
                                  num_experts, d / 8, f, reinterpret_cast<const uint4*>(w_gate_up),
                                  reinterpret_cast<__nv_bfloat16*>(a));
  if (e != cudaSuccess) return e;
  return LaunchDependent(DownMmaKernel<NT>, dim3(OneWave(static_cast<int64_t>(num_experts) * (d / 16), wave)),
                         dim3(kThreads), smem, stream, reinterpret_cast<const uint4*>(a), offsets, num_experts, f / 8,
                         d, reinterpret_cast<const uint4*>(w_down), reinterpret_cast<__nv_bfloat16*>(y));
}

}  // namespace

bool MmaSupported(int d, int f) { return d > 0 && f > 0 && d % 32 == 0 && f % 32 == 0; }

// Wide passes pay where segments run past 8 rows: on an H200, E=32 (d=7168, d_ff=2048) 16
// tokens 826 us against 936 (a 9-row segment read once instead of twice), 128 tokens 2.2 ms
// against 3.3; E=128 (d=2048, d_ff=768) 128 tokens 447 us against 466 (graph replay). They cost
// where experts get a row or two (E=128, 16 tokens: 258-289 us against 195): half the weight
// loads in flight a lane. Hence wide from 8 expected rows (twice the mean segment);
// CudaTuning::mma_wide = 0 or 1 forces either (side-by-side measurements; MmaWideForced()).
bool WidePass(int64_t want) {
  const int forced = MmaWideForced();
  return forced >= 0 ? forced == 1 : want >= kRowsPerMma;
}

cudaError_t LaunchMmaSwiglu(bool wide, const uint16_t* x, const int32_t* x_row_index, const int64_t* offsets,
                            int num_experts, int d, int f, const uint16_t* w_gate_up, const uint16_t* w_down,
                            uint16_t* a, uint16_t* y, cudaStream_t stream) {
  if (wide) return Launch<2>(x, x_row_index, offsets, num_experts, d, f, w_gate_up, w_down, a, y, stream);
  return Launch<1>(x, x_row_index, offsets, num_experts, d, f, w_gate_up, w_down, a, y, stream);
}

}  // namespace moe::kernels::cuda::small_batch
