// Decode-sized SwiGLU experts with FP8 weights on the tensor cores: mma.sync m16n8k32, E4M3 x
// E4M3, FP32 accumulate. The weights carry one FP32 scale per 128 x 128 block and the rows one
// per 128 values (Quantize's formats), as on the Hopper FP8 kernels; the activation between the
// projections is rounded to BF16 and quantized the same way (LaunchQuantizeFp8), so the outputs
// are those kernels' and the CPU reference's up to the order of FP32 additions.
//
// The Hopper FP8 kernels run 128-row tiles: at decode sizes an expert has a row or a few, and a
// step's few CTAs each stream a whole weight tile (E = 128, d = 2048, d_ff = 768, one token: 58 µs
// a layer against 29 µs for the BF16 decode kernels, which read twice the bytes). Here the
// layout of the BF16 tensor-core family (small_batch_mma.cu): a unit is (active expert, 16 weight
// rows), every block of one resident wave takes an equal share of the units, its warps split k.
// A lane (group g = lane / 4, t = lane % 4) loads 16 bytes (k = 16t .. 16t + 15 of a 64-k chunk)
// of weight rows g and g + 8 and of activation row g, and feeds two mmas with them: the k order
// is permuted identically for both operands. The warps split k in whole 128-k scale blocks; a
// block's four mmas go into a partial tile that its scales (the weight block's times the row's)
// take into the running sums. A pass covers 8 activation rows (segments of more loop); steps
// with more rows an expert go to the Hopper kernels (SmallBatchFp8Takes).
#include <cuda_runtime.h>

#include <cuda_bf16.h>

#include "kernels/cuda/launch.h"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/small_batch_common.cuh"

namespace moe::kernels::cuda {
namespace {

using small_batch::ActiveBytes;
using small_batch::ActiveCache;
using small_batch::ActiveExperts;
using small_batch::ChunkLanes;
using small_batch::CompactActive;
using small_batch::kRowsPerMma;
using small_batch::kThreads;
using small_batch::kWarps;
using small_batch::LoadStreaming;
using small_batch::OneWave;
using small_batch::SmCount;
using small_batch::SumTilesOverWarps;
using small_batch::TileWalk;

constexpr int kChunk = 64;                  // k values of a lane quad's 16-byte loads
constexpr int kBlockChunks = 128 / kChunk;  // chunks of a 128-k scale block
constexpr int kNT = 1;                      // groups of 8 activation rows a pass
// B scale blocks of k loaded together a warp (96 bytes a lane each: two weight rows' and an
// activation row's two chunks). Short k loops a warp (E = 128, d = 2048: 2 blocks of gate/up,
// 1 of down): one at a time, three blocks an SM (more warps in flight); long ones (d_ff = 14336:
// 14 a warp) two at a time, two blocks an SM (the registers for them). One H200, the layer
// replayed, one block at a time on three blocks an SM against two at a time on two: E = 128 one
// token 34-35 µs against 37-38, 16 tokens 150-157 against 162-168; E = 8, d = 4096,
// d_ff = 14336 one token 140-146 against 112-114.
template <int B>
constexpr int BlocksPerSm() {
  return B == 1 ? 3 : 2;
}
// Scale blocks a warp's share of k from which B = 2 pays.
constexpr int kLongWarpBlocks = 4;

__device__ __forceinline__ void MmaFp8(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                       uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One 64-k chunk: fragment k 4t .. 4t + 3 <- 16t .. 16t + 3 and 16 + 4t .. 16 + 4t + 3 <-
// 16t + 4 .. 16t + 7 in the first mma; the second takes 16t + 8 .. 16t + 15 the same way.
__device__ __forceinline__ void MmaChunkFp8(float (&c)[4], const uint4& lo, const uint4& hi, const uint4& xv) {
  MmaFp8(c, lo.x, hi.x, lo.y, hi.y, xv.x, xv.y);
  MmaFp8(c, lo.z, hi.z, lo.w, hi.w, xv.z, xv.w);
}

// A tile's operands for this lane: weight rows g (lo) and g + 8 (hi) with their block-scale rows
// (one float per 128 k), and for the pass's 8 activation rows the bytes of row g (xrow, x_valid)
// and the scale rows of rows 2t and 2t + 1 (the rows of this lane's sums). Arrays of kNT groups,
// as ChunkLanes and SumTilesOverWarps (shared with the BF16 family) take them.
struct Fp8Tile {
  const uint4* lo;
  const uint4* hi;
  const float* lo_scales;
  const float* hi_scales;
  const uint4* xrow[kNT];
  bool x_valid[kNT];
  const float* x_scales[kNT][2];
};

// The tile's product over this warp's scale blocks [block0, block1) of k, summed over the block's
// warps into warp 0's c (c[n][0], c[n][1]: weight row g, activation rows 2t, 2t + 1 of group n;
// c[n][2], c[n][3]: weight row g + 8). A scale block at a time: its two chunks' bytes and its
// scales are loaded together (the scales are not a second round trip after the bytes), four
// mmas into a partial tile, which the scales take into the sums.
template <int B>
__device__ __forceinline__ void Fp8TileProduct(const Fp8Tile& tile, int block0, int block1,
                                               float (*partial)[32][4 * kNT], float (&c)[kNT][4]) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int n = 0; n < kNT; ++n)
#pragma unroll
    for (int q = 0; q < 4; ++q) c[n][q] = 0.0f;
  for (int kb0 = block0; kb0 < block1; kb0 += B) {
    uint4 wl[B][kBlockChunks], wh[B][kBlockChunks], xv[B][kNT][kBlockChunks];
    float sl[B], sh[B], sx[B][kNT][2];
#pragma unroll
    for (int u = 0; u < B; ++u) {
      const int kb = kb0 + u < block1 ? kb0 + u : block1 - 1;  // past the end: loaded, not used
#pragma unroll
      for (int b = 0; b < kBlockChunks; ++b) {
        const int i = (kb * kBlockChunks + b) * 4 + t;
        wl[u][b] = LoadStreaming(tile.lo + i);
        wh[u][b] = LoadStreaming(tile.hi + i);
#pragma unroll
        for (int n = 0; n < kNT; ++n) {
          xv[u][n][b] = tile.x_valid[n] ? __ldg(tile.xrow[n] + i) : make_uint4(0, 0, 0, 0);
        }
      }
      sl[u] = __ldg(tile.lo_scales + kb);
      sh[u] = __ldg(tile.hi_scales + kb);
#pragma unroll
      for (int n = 0; n < kNT; ++n) {
        sx[u][n][0] = __ldg(tile.x_scales[n][0] + kb);
        sx[u][n][1] = __ldg(tile.x_scales[n][1] + kb);
      }
    }
#pragma unroll
    for (int u = 0; u < B; ++u) {
      if (kb0 + u >= block1) break;
#pragma unroll
      for (int n = 0; n < kNT; ++n) {
        float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int b = 0; b < kBlockChunks; ++b) MmaChunkFp8(part, wl[u][b], wh[u][b], xv[u][n][b]);
        c[n][0] += part[0] * (sl[u] * sx[u][n][0]);
        c[n][1] += part[1] * (sl[u] * sx[u][n][1]);
        c[n][2] += part[2] * (sh[u] * sx[u][n][0]);
        c[n][3] += part[3] * (sh[u] * sx[u][n][1]);
      }
    }
  }
  SumTilesOverWarps<kNT>(partial, c);
}

// The activation rows of a pass: this lane's row g of each group (bytes, from xq with row stride
// xq_ld) and the scale rows of its rows 2t and 2t + 1 (clamped to the pass like ChunkLanes).
__device__ __forceinline__ void PassRows(const uint8_t* __restrict__ xq, int64_t xq_ld, const float* __restrict__ xs,
                                         int64_t xs_ld, int64_t r0, int rows, Fp8Tile& tile) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  int64_t layout_row[kNT];
  ChunkLanes<kNT>(r0, rows, g, layout_row, tile.x_valid);
#pragma unroll
  for (int n = 0; n < kNT; ++n) {
    tile.xrow[n] = reinterpret_cast<const uint4*>(xq + layout_row[n] * xq_ld);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int r = n * kRowsPerMma + 2 * t + j;
      tile.x_scales[n][j] = xs + (r0 + (r < rows ? r : rows - 1)) * xs_ld;
    }
  }
}

// A unit's passes of 8 activation rows over its segment [seg_begin, seg_end) (rows from xq /
// xs): the tile's product over the walk's scale blocks, then, in warp 0, store(layout row, sum
// for weight row g, sum for weight row g + 8) for each of the pass's rows.
template <int B, typename Store>
__device__ __forceinline__ void Passes(Fp8Tile& tile, int64_t seg_begin, int64_t seg_end,
                                       const uint8_t* __restrict__ xq, int64_t xq_ld, const float* __restrict__ xs,
                                       int64_t xs_ld, const TileWalk& w, float (*partial)[32][4 * kNT], Store&& store) {
  const int t = threadIdx.x & 3;
  for (int64_t r0 = seg_begin; r0 < seg_end; r0 += kNT * kRowsPerMma) {
    const int rows = static_cast<int>(seg_end - r0 < kNT * kRowsPerMma ? seg_end - r0 : kNT * kRowsPerMma);
    PassRows(xq, xq_ld, xs, xs_ld, r0, rows, tile);
    float c[kNT][4];
    Fp8TileProduct<B>(tile, w.chunk0, w.chunk1, partial, c);  // the walk's "chunks": scale blocks
    if (threadIdx.x < 32) {
#pragma unroll
      for (int n = 0; n < kNT; ++n) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int r = n * kRowsPerMma + 2 * t + j;
          if (r < rows) store(r0 + r, c[n][j], c[n][2 + j]);
        }
      }
    }
  }
}

template <int B>
__global__ void __launch_bounds__(kThreads, BlocksPerSm<B>())
    GateUpFp8Kernel(const uint8_t* __restrict__ xq, int64_t xq_ld, const float* __restrict__ xs, int64_t xs_ld,
                    const int64_t* __restrict__ offsets, int num_experts, int d, int f,
                    const uint8_t* __restrict__ w_gate_up, const float* __restrict__ gate_up_scales,
                    __nv_bfloat16* __restrict__ a) {
  __shared__ float partial[kWarps][32][4 * kNT];
  WaitForPredecessor();  // the offsets and rows come from the routing / receive kernels
  ReleaseDependents();
  const ActiveExperts act = CompactActive(offsets, num_experts, ActiveCache());
  const int g = (threadIdx.x & 31) >> 2;
  const int kd = d / 128;
  for (TileWalk w(act, f / 8, kd); w.More(); w.Next()) {
    const int e = act.ids != nullptr ? act.ids[w.slot] : w.slot;
    const int64_t seg_begin = act.offsets[e], seg_end = act.offsets[e + 1];
    const int col = w.grp * 8 + g;
    const int64_t gate_row = static_cast<int64_t>(e) * 2 * f + col, up_row = gate_row + f;
    Fp8Tile tile;
    tile.lo = reinterpret_cast<const uint4*>(w_gate_up + gate_row * d);
    tile.hi = reinterpret_cast<const uint4*>(w_gate_up + up_row * d);
    tile.lo_scales = gate_up_scales + (gate_row / 128) * kd;
    tile.hi_scales = gate_up_scales + (up_row / 128) * kd;
    Passes<B>(tile, seg_begin, seg_end, xq, xq_ld, xs, xs_ld, w, partial, [&](int64_t row, float gate, float up) {
      // Gate and up rounded to BF16 as the reference does, then the activation.
      const float gs = __bfloat162float(__float2bfloat16_rn(gate));
      const float us = __bfloat162float(__float2bfloat16_rn(up));
      a[row * f + col] = __float2bfloat16_rn(Silu(gs) * us);
    });
  }
}

template <int B>
__global__ void __launch_bounds__(kThreads, BlocksPerSm<B>())
    DownFp8Kernel(const uint8_t* __restrict__ aq, const float* __restrict__ as, const int64_t* __restrict__ offsets,
                  int num_experts, int f, int d, const uint8_t* __restrict__ w_down,
                  const float* __restrict__ down_scales, __nv_bfloat16* __restrict__ y) {
  __shared__ float partial[kWarps][32][4 * kNT];
  // Offsets are inputs of the whole call, complete before the first kernel ran; aq comes from
  // the activation's quantization, read only after the wait.
  const ActiveExperts act = CompactActive(offsets, num_experts, ActiveCache());
  WaitForPredecessor();
  ReleaseDependents();
  const int g = (threadIdx.x & 31) >> 2;
  const int kf = f / 128;
  for (TileWalk w(act, d / 16, kf); w.More(); w.Next()) {
    const int e = act.ids != nullptr ? act.ids[w.slot] : w.slot;
    const int64_t seg_begin = act.offsets[e], seg_end = act.offsets[e + 1];
    const int o = w.grp * 16 + g;
    const int64_t row = static_cast<int64_t>(e) * d + o;  // rows o and o + 8 share a 128-row block
    Fp8Tile tile;
    tile.lo = reinterpret_cast<const uint4*>(w_down + row * f);
    tile.hi = reinterpret_cast<const uint4*>(w_down + (row + 8) * f);
    tile.lo_scales = tile.hi_scales = down_scales + (row / 128) * kf;
    Passes<B>(tile, seg_begin, seg_end, aq, f, as, kf, w, partial, [&](int64_t r, float lo, float hi) {
      y[r * d + o] = __float2bfloat16_rn(lo);
      y[r * d + o + 8] = __float2bfloat16_rn(hi);
    });
  }
}

// The gate/up kernel with B = GB, the down kernel with B = DB (scale blocks loaded together).
template <int GB, int DB>
cudaError_t Launch(const uint8_t* xq, int64_t xq_ld, const float* xs, int64_t xs_ld, int64_t rows,
                   const int64_t* offsets, int num_experts, int d, int f, const uint8_t* w_gate_up,
                   const float* gate_up_scales, const uint8_t* w_down, const float* down_scales, uint16_t* a,
                   uint8_t* aq, float* as, uint16_t* y, cudaStream_t stream) {
  int sms = 0;
  const cudaError_t setup = SmCount(&sms);
  if (setup != cudaSuccess) return setup;
  const size_t smem = ActiveBytes(num_experts);
  cudaError_t e = LaunchDependent(
      GateUpFp8Kernel<GB>,
      dim3(OneWave(static_cast<int64_t>(num_experts) * (f / 8), static_cast<int64_t>(sms) * BlocksPerSm<GB>())),
      dim3(kThreads), smem, stream, xq, xq_ld, xs, xs_ld, offsets, num_experts, d, f, w_gate_up, gate_up_scales,
      reinterpret_cast<__nv_bfloat16*>(a));
  if (e != cudaSuccess) return e;
  e = LaunchQuantizeFp8(a, rows, f, 128, aq, as, stream);
  if (e != cudaSuccess) return e;
  return LaunchDependent(
      DownFp8Kernel<DB>,
      dim3(OneWave(static_cast<int64_t>(num_experts) * (d / 16), static_cast<int64_t>(sms) * BlocksPerSm<DB>())),
      dim3(kThreads), smem, stream, aq, as, offsets, num_experts, f, d, w_down, down_scales,
      reinterpret_cast<__nv_bfloat16*>(y));
}

}  // namespace

// A step expected to give its busy experts fewer than 8 rows (twice the mean segment): one pass
// of 8 rows covers a segment. With more, the Hopper FP8 kernels won every cell measured (one
// H200, the layer replayed, µs: E = 128, d = 2048, d_ff = 768, 64 tokens 245 against 355 here
// with passes of 16 rows; E = 32, d = 7168, d_ff = 2048, 16 tokens 455 against 550).
bool SmallBatchFp8Takes(int64_t rows, int num_experts) {
  if (num_experts <= 0 || rows <= 0) return num_experts > 0;
  const int64_t spread = rows < num_experts ? rows : num_experts;
  return 2 * ((rows + spread - 1) / spread) < kRowsPerMma;
}

cudaError_t LaunchSmallBatchSwigluFp8(const uint8_t* xq, int64_t xq_ld, const float* x_scales, int64_t x_scales_ld,
                                      int64_t rows, const int64_t* offsets, int num_experts, int d, int f,
                                      const uint8_t* w_gate_up, const float* gate_up_scales, const uint8_t* w_down,
                                      const float* down_scales, uint16_t* a, uint8_t* aq, float* a_scales, uint16_t* y,
                                      cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (!Fp8RowOperandsValid(rows, d, xq_ld, x_scales_ld) || d % 128 != 0 || f % 128 != 0) return cudaErrorInvalidValue;
  // Each kernel's k loop a warp: d / 128 (gate/up) and d_ff / 128 (down) scale blocks over the
  // block's warps.
  const bool long_up = d / 128 >= kLongWarpBlocks * kWarps, long_down = f / 128 >= kLongWarpBlocks * kWarps;
  auto launch = long_up ? (long_down ? Launch<2, 2> : Launch<2, 1>) : (long_down ? Launch<1, 2> : Launch<1, 1>);
  return launch(xq, xq_ld, x_scales, x_scales_ld, rows, offsets, num_experts, d, f, w_gate_up, gate_up_scales, w_down,
                down_scales, a, aq, a_scales, y, stream);
}

}  // namespace moe::kernels::cuda
