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
#include <mutex>

#include <cuda_bf16.h>

#include "kernels/cuda/async_copy.cuh"
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

// The streamed variant: the weight tiles by the TMA unit's bulk copies through a ring of shared
// memory stages, so the bytes in flight do not hang on registers or on the per-unit barriers.
//
// The kernels above keep 128 weight bytes a lane in flight and meet at two block barriers a
// unit, with no loads outstanding across them. On an H100, E128 d2048 f768 16 tokens (75 busy
// experts), ncu gave their gate/up kernel 472 MB in 168 us (2.81 TB/s) against 156 us (3.03
// TB/s) for vLLM's Triton kernel on the same routing, with a copy ceiling of 3.01
// (bench/RESULTS.md, 2026-12-07, fifty-sixth session). Here a block (one an SM) walks its
// balanced contiguous share of the units; a stage holds a slice of kc columns of the unit's 16
// weight rows (one bulk copy a row, kc = k up to 2048, else the largest of 2048 / 1024 / 512 /
// 256 dividing k), thread 0 keeps `stages` of them in flight, each warp multiplies its eighth of
// the slice's k and releases the stage on the stage's empty barrier, and at a unit's last slice
// the warps sum their tiles through shared memory, as the kernels above do (so the same split
// of k, but over slices: other bits than theirs where k > kc). Even and odd weight rows sit in
// two regions 64 bytes apart modulo 128, so an 8-lane phase of a 16-byte load (rows g, g + 1)
// hits distinct banks. Segments longer than NT * 8 rows stream the unit once a block of rows.
// (A first version gave every warp its own ring of 256-k slices, 16 copies of 512 bytes a
// stage and no barriers: 193 us for the same 472 MB.)
constexpr int kTileWeightRows = 16;  // the mma's m
constexpr int kMaxSliceK = 2048;
constexpr int kMaxStreamStages = 8;

// The slice of k a stage holds (0: k does not split into 256-multiples).
__host__ __device__ inline int SliceK(int k) {
  if (k <= 0 || k % 256 != 0) return 0;
  if (k <= kMaxSliceK) return k;
  for (int kc = kMaxSliceK; kc >= 256; kc /= 2) {
    if (k % kc == 0) return kc;
  }
  return 256;
}
// A stage: the even rows, 64 bytes, the odd rows, 128-aligned.
__host__ __device__ inline uint32_t OddRegion(int kc) { return 8u * kc * 2 + 64; }
__host__ __device__ inline uint32_t StageBytes(int kc) { return (OddRegion(kc) + 8u * kc * 2 + 127) / 128 * 128; }

// A block's walk over (unit, block of rows, slice); every thread keeps the same.
struct StreamCursor {
  __device__ StreamCursor(const ActiveExperts& act, int groups, int slices, int rows_per_block, int64_t u0, int64_t u1)
      : act(act), groups(groups), slices(slices), rows_per_block(rows_per_block), unit(u0), end(u1) {
    if (unit < end) Load();
  }
  __device__ bool More() const { return unit < end; }
  __device__ void Next() {
    if (++slice < slices) return;
    slice = 0;
    if (++rb < row_blocks) return;
    rb = 0;
    if (++unit < end) Load();
  }
  __device__ void Load() {
    const int slot = static_cast<int>(unit / groups);
    grp = static_cast<int>(unit - static_cast<int64_t>(slot) * groups);
    e = act.ids != nullptr ? act.ids[slot] : slot;
    seg_begin = act.offsets[e];
    seg_end = act.offsets[e + 1];
    const int64_t n = seg_end - seg_begin;
    row_blocks = n > 0 ? static_cast<int>((n + rows_per_block - 1) / rows_per_block) : 1;
  }
  ActiveExperts act;
  int groups, slices, rows_per_block;
  int64_t unit, end;
  int e = 0, grp = 0, rb = 0, slice = 0, row_blocks = 1;
  int64_t seg_begin = 0, seg_end = 0;
};

// Weight row r (0..15) of a unit, as a matrix row of w. Gate/up: rows 0-7 are the gate rows of
// the unit's 8 columns, 8-15 their up rows; down: 16 output rows.
template <bool UP>
__device__ __forceinline__ int64_t UnitRow(int e, int grp, int r, int f, int d) {
  if constexpr (UP) return static_cast<int64_t>(e) * 2 * f + (r >= 8 ? f : 0) + grp * 8 + (r & 7);
  return static_cast<int64_t>(e) * d + grp * kTileWeightRows + r;
}

template <bool UP, int NT>
__global__ void __launch_bounds__(kThreads, 1)
    StreamMmaKernel(const uint4* __restrict__ x, const int32_t* __restrict__ x_row_index,
                    const int64_t* __restrict__ offsets, int num_experts, int k8, int f, int d,
                    const uint4* __restrict__ w, __nv_bfloat16* __restrict__ out, int stages) {
  __shared__ float partial[kWarps][32][4 * NT];
  // Gate/up: offsets and rows come from the routing / receive kernels. Down: offsets are inputs
  // of the whole SwiGLU launch, complete before the gate/up kernel released this one, and the
  // weights are never written; only `x` (the activation rows) waits.
  if constexpr (UP) {
    WaitForPredecessor();
    ReleaseDependents();
  }
  const ActiveExperts act = CompactActive(offsets, num_experts, ActiveCache());
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int kc = SliceK(k8 * 8), kc8 = kc / 8;
  const uint32_t stage_bytes = StageBytes(kc), odd = OddRegion(kc), row_bytes = static_cast<uint32_t>(kc) * 2;
  // Dynamic shared memory: the active-expert cache, full and empty barriers, the ring (128-aligned).
  char* dyn = reinterpret_cast<char*>(ActiveCache()) + ActiveBytes(num_experts);
  dyn += (16 - SmemAddr(dyn) % 16) % 16;
  uint64_t* full = reinterpret_cast<uint64_t*>(dyn);
  uint64_t* empty = full + kMaxStreamStages;
  char* ring = dyn + sizeof(uint64_t) * 2 * kMaxStreamStages;
  ring += (128 - SmemAddr(ring) % 128) % 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      MbarInit(&full[s], 1);
      MbarInit(&empty[s], kWarps);
    }
    MbarInitFence();
  }
  __syncthreads();
  const int groups = UP ? f / 8 : d / kTileWeightRows;
  const int slices = k8 / kc8;
  const int64_t units = static_cast<int64_t>(act.count) * groups;
  const int64_t u0 = units * blockIdx.x / gridDim.x, u1 = units * (blockIdx.x + 1) / gridDim.x;
  constexpr int kRowsPerBlock = NT * kRowsPerMma;
  StreamCursor fill(act, groups, slices, kRowsPerBlock, u0, u1), use = fill;
  // Thread 0: the next item's 16 row slices into `stage`.
  auto issue = [&](int stage) {
    MbarExpectTx(&full[stage], kTileWeightRows * row_bytes);
    char* base = ring + static_cast<size_t>(stage) * stage_bytes;
    for (int r = 0; r < kTileWeightRows; ++r) {
      const uint4* src = w + UnitRow<UP>(fill.e, fill.grp, r, f, d) * k8 + static_cast<int64_t>(fill.slice) * kc8;
      BulkLoad(base + ((r & 1) ? odd : 0) + static_cast<size_t>(r >> 1) * row_bytes, src, row_bytes, &full[stage]);
    }
    fill.Next();
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages && fill.More(); ++s) issue(s);
  }
  __syncwarp();
  if constexpr (!UP) {
    WaitForPredecessor();  // `x` (the activation rows) comes from the gate/up kernel
    ReleaseDependents();
  }
  const int wk8 = kc8 / kWarps;  // this warp's vectors of a slice row: [warp * wk8, + wk8)
  float c[NT][4];
  const uint4* xrow[NT];
  bool valid[NT];
  int64_t r0 = 0;
  int rows = 0;
  for (int64_t q = 0; use.More(); ++q) {
    const int stage = static_cast<int>(q % stages);
    if (threadIdx.x == 0 && q > 0 && fill.More()) {
      // The previous item's stage, once every warp has released it.
      const int64_t p = q - 1;
      const int ps = static_cast<int>(p % stages);
      MbarWait(&empty[ps], static_cast<uint32_t>((p / stages) & 1));
      issue(ps);
    }
    __syncwarp();  // warp 0 whole again before its mma.sync (.aligned: every lane together)
    if (use.slice == 0) {
      r0 = use.seg_begin + static_cast<int64_t>(use.rb) * kRowsPerBlock;
      const int64_t left = use.seg_end - r0;
      rows = static_cast<int>(left < kRowsPerBlock ? left : kRowsPerBlock);
      int64_t layout_row[NT];
      ChunkLanes<NT>(r0, rows, g, layout_row, valid);
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const int64_t src = x_row_index != nullptr ? __ldg(x_row_index + layout_row[n]) : layout_row[n];
        xrow[n] = x + src * k8;
        c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.0f;
      }
    }
    MbarWait(&full[stage], static_cast<uint32_t>((q / stages) & 1));
    __syncwarp();  // (the lanes may leave the wait's loop apart)
    const char* base = ring + static_cast<size_t>(stage) * stage_bytes;
    const uint4* lo =
        reinterpret_cast<const uint4*>(base + ((g & 1) ? odd : 0) + static_cast<size_t>(g >> 1) * row_bytes) +
        warp * wk8;
    const uint4* hi = lo + 4 * kc8;  // row g + 8: 4 rows on in the same region
    const int64_t xbase = static_cast<int64_t>(use.slice) * kc8 + warp * wk8;
    const int chunks = wk8 / 4;  // kc / 256 32-k chunks a warp (3 at k = 768)
    for (int ch = 0; ch < chunks; ch += 2) {
      uint4 wl[2], wh[2], xv[NT][2];
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int i = (ch + b) * 4 + t;
        const bool in = ch + b < chunks;
        const uint4 zero = make_uint4(0, 0, 0, 0);
        wl[b] = in ? lo[i] : zero;
        wh[b] = in ? hi[i] : zero;
#pragma unroll
        for (int n = 0; n < NT; ++n) xv[n][b] = in && valid[n] ? __ldg(xrow[n] + xbase + i) : zero;
      }
#pragma unroll
      for (int b = 0; b < 2; ++b)
#pragma unroll
        for (int n = 0; n < NT; ++n) MmaChunk(c[n], wl[b], wh[b], xv[n][b]);
    }
    __syncwarp();  // every lane's reads of the stage are done
    if (lane == 0) MbarArrive(&empty[stage]);
    if (use.slice == slices - 1) {
      SumTilesOverWarps<NT>(partial, c);
      if (warp == 0) {
        if constexpr (UP) {
          StoreActivationTile<NT>(c, rows, r0, f, use.grp * 8 + g, out);
        } else {
          StoreDownTile<NT>(c, rows, r0, d, use.grp * kTileWeightRows + g, out);
        }
      }
    }
    use.Next();
  }
}

// Dynamic shared memory of a StreamMmaKernel block with `stages` stages of slices of kc.
size_t StreamSmem(int num_experts, int kc, int stages) {
  return ActiveBytes(num_experts) + 16 + sizeof(uint64_t) * 2 * kMaxStreamStages + 128 +
         static_cast<size_t>(stages) * StageBytes(kc);
}

// The device's opt-in shared memory a block, looked up once.
int SmemOptin() {
  static int optin = -1;
  static std::once_flag once;
  std::call_once(once, [] {
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
      cudaGetLastError();
      optin = 0;
    }
  });
  return optin;
}

// Stages of a projection of k that fit (0: fewer than two, or k does not split): as many as the
// shared memory holds, at most kMaxStreamStages (three of 64 KiB at k >= 2048, eight of 24 KiB at
// k = 768). The static shared memory (partials, the scan's storage) is under 10 KiB.
int StreamStages(int num_experts, int k) {
  const int kc = SliceK(k);
  if (kc == 0) return 0;
  for (int s = kMaxStreamStages; s >= 2; --s) {
    if (StreamSmem(num_experts, kc, s) + 10 * 1024 <= static_cast<size_t>(SmemOptin())) return s;
  }
  return 0;
}

template <bool UP, int NT>
cudaError_t OptIn(size_t smem) {
  static std::mutex mu;
  static size_t opted = 0;
  std::lock_guard<std::mutex> lock(mu);
  if (smem <= opted) return cudaSuccess;
  const cudaError_t e = cudaFuncSetAttribute(StreamMmaKernel<UP, NT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(smem));
  if (e == cudaSuccess) opted = smem;
  return e;
}

template <int NT>
cudaError_t LaunchStream(int64_t max_active, const uint16_t* x, const int32_t* x_row_index, const int64_t* offsets,
                         int num_experts, int d, int f, const uint16_t* w_gate_up, const uint16_t* w_down, uint16_t* a,
                         uint16_t* y, cudaStream_t stream) {
  int sms = 0;
  cudaError_t e = SmCount(&sms);
  if (e != cudaSuccess) return e;
  const int up_stages = StreamStages(num_experts, d), down_stages = StreamStages(num_experts, f);
  if (up_stages == 0 || down_stages == 0) return cudaErrorInvalidValue;
  const size_t up_smem = StreamSmem(num_experts, SliceK(d), up_stages);
  const size_t down_smem = StreamSmem(num_experts, SliceK(f), down_stages);
  if ((e = OptIn<true, NT>(up_smem)) != cudaSuccess || (e = OptIn<false, NT>(down_smem)) != cudaSuccess) return e;
  // A block an SM, or one a unit of the busy experts where they have fewer.
  auto grid = [&](int64_t units) { return dim3(OneWave(units, sms)); };
  e = LaunchDependent(StreamMmaKernel<true, NT>, grid(max_active * (f / 8)), dim3(kThreads), up_smem, stream,
                      reinterpret_cast<const uint4*>(x), x_row_index, offsets, num_experts, d / 8, f, d,
                      reinterpret_cast<const uint4*>(w_gate_up), reinterpret_cast<__nv_bfloat16*>(a), up_stages);
  if (e != cudaSuccess) return e;
  return LaunchDependent(StreamMmaKernel<false, NT>, grid(max_active * (d / kTileWeightRows)), dim3(kThreads),
                         down_smem, stream, reinterpret_cast<const uint4*>(a), static_cast<const int32_t*>(nullptr),
                         offsets, num_experts, f / 8, f, d, reinterpret_cast<const uint4*>(w_down),
                         reinterpret_cast<__nv_bfloat16*>(y), down_stages);
}

}  // namespace

bool MmaSupported(int d, int f) { return d > 0 && f > 0 && d % 32 == 0 && f % 32 == 0; }

// The streamed variant where both projections' k split into 256-multiples and the rings fit,
// when CudaTuning::mma_stream = 1 (MmaStreamForced()). Off by default: this form of it has not
// run on a GPU yet (bench/RESULTS.md, 2026-12-07, fifty-sixth session); a rule for when it pays
// comes with its measurements.
bool StreamChosen(int num_experts, int d, int f) {
  if (MmaStreamForced() != 1 || d <= 0 || f <= 0 || num_experts > kCachedExperts) return false;
  return StreamStages(num_experts, d) != 0 && StreamStages(num_experts, f) != 0;
}

cudaError_t LaunchStreamSwiglu(bool wide, const uint16_t* x, const int32_t* x_row_index, const int64_t* offsets,
                               int num_experts, int d, int f, const uint16_t* w_gate_up, const uint16_t* w_down,
                               uint16_t* a, uint16_t* y, int64_t rows, cudaStream_t stream) {
  const int64_t busy = rows < num_experts ? rows : num_experts;
  if (wide) return LaunchStream<2>(busy, x, x_row_index, offsets, num_experts, d, f, w_gate_up, w_down, a, y, stream);
  return LaunchStream<1>(busy, x, x_row_index, offsets, num_experts, d, f, w_gate_up, w_down, a, y, stream);
}

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
