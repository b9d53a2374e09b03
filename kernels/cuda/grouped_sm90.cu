// Hopper grouped GEMMs for the experts' projections (sm_90a): TMA loads into a ring of
// shared-memory stages, warpgroup MMAs (wgmma) reading both operands from shared memory, one
// persistent CTA per SM walking the (expert, row tile, column tile) grid.
//
// Roles in a CTA of 384 threads: one warpgroup is the producer (one thread issues the TMA loads
// of every stage, and in the FP8 kernels the bulk copy of its row scales, while two more lanes of
// its warp copy the weight block scales; its registers go to the others through setmaxnreg), the
// other two are
// consumers (cooperative: each owns a 64-row half of a 128-row tile, or a column half of a
// 64-row tile; ping-pong: each owns every other 128-row tile, of 64 or (wide) 96 gate/up
// columns, see Config). In the FP8 kernels, and the BF16 ones' cooperative tiles with kEpi, the
// producer warpgroup's other three warps are the epilogue warps: the consumers leave each tile's
// values in a shared-memory tile buffer and go on to the next tile while those warps apply
// SwiGLU, quantize (FP8) and store (EpilogueWarps). A stage holds a BM x 64 tile of the rows and
// the weight rows of the column tile, both K-major with the 128-byte swizzle that TMA writes and wgmma reads. Barriers:
// `full[s]` (the producer's expected bytes, completed by TMA; FP8, also an arrival per producer lane once its
// scale copies landed) and `empty[s]` (one arrival per consumer warp after its MMAs on the stage retired;
// FP8, also a named barrier for the stage's scales, Config::kFp8ScaleBar).
//
// Gate/up (kSwiglu): a column tile of BN activation columns loads BN gate rows and the BN up
// rows of the same columns, so the epilogue applies SwiGLU in registers and writes only
// a = bf16(silu(bf16(g)) * bf16(u)) — the rounding points of the unfused path (a BF16 h, then
// the activation in FP32) without h ever reaching memory. Down: y = bf16(a Wd^T).
//
// Segments come from device offsets (expert-major rows, offsets[0..E]); a row tile never
// crosses into the next expert's rows in the output (rows past the segment are computed from
// whatever the load brought and not written). Rows past the operand's end are zero-filled by TMA.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>

#include <cuda_bf16.h>

#include "kernels/cuda/activation.cuh"
#include "kernels/cuda/async_copy.cuh"
#include "kernels/cuda/bf16.cuh"
#include "kernels/cuda/fp8.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/wgmma.cuh"

namespace moe::kernels::cuda {
namespace {

constexpr int kBK = 64;  // K elements a stage: one 128-byte swizzle row of BF16
constexpr int kThreads = 384;
constexpr int kConsumerWarps = 8;
constexpr int kSmemBudget = 192 * 1024;       // stages; the rest: epilogue staging, barriers, tile prefix
constexpr int kEpilogueWarpBytes = 16 * 128;  // a consumer warp's 16 rows x 64 BF16 columns
constexpr int kMaxExperts = 4096;
constexpr int kWideUpN = 96;      // activation columns of a wide ping-pong gate/up tile (kPingPongWide)
constexpr int kTileBufRow = 512;  // bytes a row of the epilogue warps' tile buffer: 256 BF16 values

// Hardware named barrier `id` of `count` threads (a multiple of 32): a warp's arrival without
// waiting (a release), and a warp's arrival and wait for the rest (an acquire). Both are
// aligned: the whole warp executes them together. The producer's syncs follow lane-divergent
// code; ptxas reconverges the warp before them (a WARPSYNC.ALL ahead of each BAR.SYNC, or run
// of them, in the SASS; an explicit __syncwarp() changed the kernels' code, not measured, so
// not taken).
__device__ __forceinline__ void NamedBarArrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
}

__device__ __forceinline__ void NamedBarSync(int id, int count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}

__device__ __forceinline__ void TmaLoad2d(void* dst, const CUtensorMap* map, int32_t inner, int32_t outer,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          SmemAddr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(inner), "r"(outer), "r"(SmemAddr(bar))
      : "memory");
}

// Four bytes from global to shared memory, asynchronously (completion tracked by CpAsyncArrive).
__device__ __forceinline__ void CpAsync4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(SmemAddr(dst)), "l"(src) : "memory");
}

// One arrival on `bar` once every cp.async this thread issued before has landed (counted in the
// barrier's arrivals: .noinc).
__device__ __forceinline__ void CpAsyncArrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(SmemAddr(bar)) : "memory");
}

__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// The accumulators as seen by the compiler: each is "written" here, so no read of them can be
// moved above the wait that precedes this (the MMAs write them asynchronously).
template <int N>
__device__ __forceinline__ void FenceAccumulators(float* acc) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// Shared-memory matrix descriptor of a K-major tile written by TMA with the 128-byte swizzle:
// rows of 128 bytes, 8-row groups 1024 bytes apart (SBO), layout type 1 (128B swizzle).
// Advancing K by 16 elements within the swizzle row adds 32 bytes to the start address.
__device__ __forceinline__ uint64_t SmemDesc(const void* tile) {
  const uint64_t addr = SmemAddr(tile);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

// The same descriptor from its low word (SmemDesc's high word is a constant): a start address
// advanced in 32 bits, so that no carry into the high word is computed (a stage's start
// addresses, >> 4, stay below 2^14).
__device__ __forceinline__ uint32_t SmemDescLo(const void* tile) {
  return ((SmemAddr(tile) & 0x3FFFF) >> 4) | (1u << 16);
}
__device__ __forceinline__ uint64_t DescFromLo(uint32_t lo) { return (uint64_t{(1u << 30) | (1024 >> 4)} << 32) | lo; }

// Four 8x8 BF16 matrices from fragment registers to shared memory; lane l gives the address of
// row l % 8 of matrix l / 8.
__device__ __forceinline__ void StMatrixX4(void* row, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(SmemAddr(row)), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

template <int N>
__device__ __forceinline__ void Wgmma(float* d, uint64_t a, uint64_t b, int scale_d) {
  if constexpr (N == 64) {
    WgmmaM64N64K16(d, a, b, scale_d);
  } else if constexpr (N == 128) {
    WgmmaM64N128K16(d, a, b, scale_d);
  } else if constexpr (N == 192) {
    WgmmaM64N192K16(d, a, b, scale_d);
  } else {
    static_assert(N == 256, "wgmma widths: 64, 128, 192, 256");
    WgmmaM64N256K16(d, a, b, scale_d);
  }
}

__device__ __forceinline__ float Bf16Round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

struct GroupedArgs {
  const int64_t* offsets;  // [num_experts + 1], expert-major rows of the A operand
  int num_experts;
  int k_blocks;       // K / kBK
  int n_tiles;        // output columns / BN
  int b_rows_expert;  // weight rows an expert (2f for gate/up, d for down)
  int up_rows;        // kSwiglu: where an expert's up rows start (f)
  uint16_t* out;      // [rows, ld_out] BF16
  int64_t ld_out;
  // FP8 only: the row operand's scales, one per row and 128 values, column-major
  // [K / 128, a_scale_ld] (Fp8ActivationScaleRows, with Fp8ActivationScaleFloats' padding), and
  // the weights' [E * b_rows_expert / 128, K / 128] (one per 128 x 128 block).
  const float* a_scales = nullptr;
  const float* b_scales = nullptr;
  int64_t a_scale_ld = 0;
  // FP8 gate/up only, when out_q is set: the activation leaves quantized (E4M3 [rows, ld_out],
  // one scale per row and 128 columns in out_q_scales, column-major [f / 128, out_q_scale_ld])
  // instead of as BF16 in `out`. out_q_scales is set either way.
  uint8_t* out_q = nullptr;
  float* out_q_scales = nullptr;
  int64_t out_q_scale_ld = 0;
};

// Schedules. Cooperative: both consumer warpgroups work on one BM x BN tile (each 64 of its
// rows when BM is 128, each half of its columns when BM is 64). Ping-pong: each consumer
// warpgroup owns every other tile of the CTA (128 rows as two 64-row slices, BN columns), so
// one warpgroup's epilogue runs while the other's MMAs keep the tensor cores busy; the stage
// ring is shared in tile order.
//
// FP8 (kFp8): E4M3 operands, 128 K values (128 bytes) a stage, the same swizzle; each stage's
// MMAs go into a partial accumulator that is scaled by its row's and block's scales and added
// to the tile's FP32 accumulator (the scales change every 128 K values). Cooperative 128-row
// tiles only, 256 columns a warpgroup (gate/up: 128 gate and 128 up columns; down: 256). Their
// 128 + 64 accumulators leave no registers for ping-pong tiles, so the epilogue is overlapped
// with the next tile's main loop another way: the epilogue warps (kEpiWarps), from a tile buffer
// that takes a stage's worth of shared memory (three stages instead of four; measured no slower).
// kEpi: the same for the BF16 kernels' cooperative 128-row tiles (128 x 128 gate+up, 128 x 256
// down: 256 MMA columns a warpgroup, as the buffer holds). Against the ping-pong tiles they read
// 25% fewer bytes a FLOP through L2 and still overlap the epilogue: E128 T = 8192 down 590k ->
// 552k cycles, E8 T = 8192 gate/up 8.16M -> 7.74M against the consumers' own epilogue (H200,
// bench/RESULTS.md, 2026-12-04, thirty-ninth session).
template <int BM, int BN, bool kSwiglu, bool kPingPong, bool kFp8 = false, bool kEpi = kFp8>
struct Config {
  static constexpr int kStageK = kFp8 ? 128 : kBK;      // K values a stage (128 bytes a row)
  static constexpr int kBRows = kSwiglu ? 2 * BN : BN;  // weight rows a stage
  static constexpr int kABytes = BM * 128;
  static constexpr int kBBytes = kBRows * 128;
  static constexpr int kStageBytes = kABytes + kBBytes;
  // FP8 (and kEpi): the tile's epilogue runs on the producer warpgroup's three idle warps
  // (EpilogueWarps), from a 64 KB tile buffer of BF16 values the consumers fill; beside it one
  // SM's 227 KB hold three of the 48 KB stages (kSmemBytes' assertion below).
  static constexpr bool kEpiWarps = kEpi;
  static constexpr int kTileBufBytes = kEpiWarps ? BM * kTileBufRow : 0;
  static constexpr int kStages = kEpiWarps ? 3 : kSmemBudget / kStageBytes;
  // FP8: each stage's scales beside it, in slots the producer warp fills with the stage (counted
  // in its full barrier). The row operand's scales reach the kernels column-major
  // (Fp8ActivationScaleRows floats a 128-column block: the gate/up kernel's as LaunchTransposeScales
  // leaves them, the down kernel's as the gate/up epilogue writes them), so a stage's 128 are
  // contiguous and one bulk copy by the TMA unit brings them with the tiles: BM + 4 floats from
  // the tile's first row rounded down to 16 bytes (the consumers' rows shifted by m0 % 4). Near a
  // block's last row the copy reads on into the next block's first rows, past the last block into
  // the 132 floats of padding Fp8ActivationScaleFloats allocates; those rows' results are
  // discarded. Two producer lanes copy the weight block scales of the stage's two 128-column
  // halves (cp.async). The slots: the row scales of every stage, then the block scales of every
  // stage, 16 bytes each. (H200, ncu cycles against the producer warp's 128 cp.async copies of the
  // row scales a stage: down -10.6% at E8 T = 8192, -6.0% at E32 T = 4096, -1.9% at E128
  // T = 8192; gate/up -5.8%, -5.6%, -4.3%.)
  static constexpr int kRowScaleStride = kFp8 ? (BM + 4) * 4 : 0;  // bytes between stages' row scales
  static constexpr int kRowScaleTxBytes = kRowScaleStride;         // a stage's bulk copy
  static constexpr int kBlockScaleStride = 16;
  static constexpr int kBlockScalesAt = kStages * kRowScaleStride;  // where stage 0's block scales start
  static constexpr int kScaleBytes = kFp8 ? kStages * (kRowScaleStride + kBlockScaleStride) : 0;
  static_assert(kRowScaleStride % 16 == 0, "row scale slots on the bulk copy's 16-byte boundaries");
  static_assert(kScaleBytes % 8 == 0, "the stage barriers after the scales");
  // The consumers read the scales with ordinary loads, which lane 0's release of the stage does
  // not order for the other lanes (compute-sanitizer's racecheck reported the pairs): every
  // consumer thread also releases the stage's scales, on the hardware named barrier
  // kFp8ScaleBar + stage (one instruction a warp), once its first MMAs on the stage are issued,
  // and the producer warp syncs on it after the stage's mbarrier, by when it has completed.
  // (Releasing the whole stage that way after the last MMAs, or by every consumer thread's
  // mbarrier arrival, put the release's latency in front of the refill: 2-12% more cycles.)
  // The down kernel's row scales are then overwritten by the TMA unit (the async proxy) rather
  // than by cp.async; as for TMA-filled shared memory read by ordinary loads elsewhere, the
  // barrier's release orders the reads before it, with no proxy fence: a fence.proxy.async
  // before each arrival cost 0.7-1.8% of the down kernel's cycles, and racecheck reports no
  // hazard either way.
  static constexpr int kFp8ScaleBar = 3;  // named barriers 0 (__syncthreads), 1 and 2 (ping-pong order) are taken
  static constexpr int kFp8ScaleThreads = kConsumerWarps * 32 + 32;  // the consumers and the producer warp
  static_assert(!kFp8 || kFp8ScaleBar + kStages <= 16, "named barriers of a CTA");
  // The TMA thread, and (FP8) the two producer lanes that copy the block scales.
  static constexpr int kFullArrivals = kFp8 ? 1 + 2 : 1;
  static constexpr int kSlices = kPingPong ? 2 : 1;                  // 64-row slices a consumer warpgroup computes
  static constexpr int kWgN = kPingPong || BM == 128 ? BN : BN / 2;  // columns a warpgroup computes
  static constexpr int kSliceAcc = (kSwiglu ? 2 : 1) * kWgN / 2;     // gate then up (kSwiglu)
  static constexpr int kAcc = kSlices * kSliceAcc;
  static constexpr int kEmptyArrivals = kPingPong ? kConsumerWarps / 2 : kConsumerWarps;
  // Registers a thread after setmaxnreg (128 x producer + 256 x consumer <= the launch's 384 x
  // 168, below): with epilogue warps (FP8, BF16 kEpi) the producer warpgroup takes 56 (the
  // gate/up epilogue warps keep 16 values a lane in flight; the FP8 producer warp, then copying
  // every row scale, spilled at 40 in the down kernel, which ran 2-4% slower so), the other BF16
  // kernels' lone TMA thread 40.
  // The wide ping-pong gate/up tile's 192 accumulators a thread (128 rows x 96 gate and 96 up
  // columns) take 240, its TMA thread 24.
  static constexpr int kProducerRegs = kEpiWarps ? 56 : kAcc > 128 ? 24 : 40;
  static constexpr int kConsumerRegs = kEpiWarps ? 224 : kAcc > 128 ? 240 : 232;
  // The CTA's registers are those of its launch: __launch_bounds__(kThreads, 1) caps a thread at
  // 64 K / kThreads rounded down to 8 (168), which ptxas allocates (-Xptxas -v: "Used 168
  // registers" for every grouped kernel); a setmaxnreg.inc beyond what the producer's decrease
  // freed waits forever (a 32-register producer with 240-register consumers hung).
  static constexpr int kLaunchRegs = (64 * 1024 / kThreads) & ~7;
  static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= kThreads * kLaunchRegs, "registers of the CTA's launch");

  // Gate/up where a consumer warpgroup computes all BN columns (128-row and ping-pong tiles):
  // its gate rows and up rows lie next to each other in the stage, so one MMA of 2 BN columns
  // covers both and reads the row operand from shared memory once. Cooperative 64-row tiles
  // split the columns between the warpgroups and issue two MMAs (splitting their boxes instead
  // costs a latency-bound small step more in loads than it saves).
  static constexpr bool kJointGateUp = kSwiglu && kWgN == BN;
  static constexpr int kSmemBytes = 1024 + kStages * kStageBytes +
                                    (kEpiWarps ? kTileBufBytes : kConsumerWarps * kEpilogueWarpBytes) + kScaleBytes +
                                    2 * (kStages + 1) * 8 + (kMaxExperts + 1) * 4;
  static_assert(BM == 64 || BM == 128, "row tiles of 64 or 128");
  static_assert(!kPingPong || BM == 128, "ping-pong tiles have 128 rows");
  static_assert(kAcc <= 192, "accumulators of a thread");
  static_assert(!kFp8 || (BM == 128 && !kPingPong), "FP8 runs cooperative 128-row tiles");
  static_assert(!kFp8 || kEpi, "FP8 epilogues run on the epilogue warps");
  static_assert(!kEpi || (BM == 128 && !kPingPong && (kSwiglu ? BN == 128 : BN == 256)),
                "the epilogue warps take cooperative 128-row tiles of 256 MMA columns a warpgroup");
  static_assert(kStages >= 2, "at least two stages");
  static_assert(kWgN % 32 == 0, "the epilogue stages 64 columns at a time, or 32 for the last");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one SM");
  static_assert(kStageBytes % 1024 == 0, "stages keep the swizzle's 1024-byte alignment");
};

// The tile's expert and first row: `prefix[e]` row tiles come before expert e's.
__device__ __forceinline__ int ExpertOfTile(const int32_t* prefix, int num_experts, int mt) {
  int lo = 0, hi = num_experts;  // largest e with prefix[e] <= mt
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (prefix[mid] <= mt) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Tile t of the grid: experts in order; within an expert, bands of kBandRows row tiles walked
// column tile by column tile, so the CTAs in flight share weight tiles (each read by up to
// kBandRows CTAs at once) and row tiles (read by the band's column tiles) through L2.
constexpr int kBandRows = 8;
struct Tile {
  int expert, row_tile, col_tile;
};
__device__ __forceinline__ Tile TileAt(const int32_t* prefix, int num_experts, int n_tiles, int t) {
  Tile tile;
  tile.expert = ExpertOfTile(prefix, num_experts, t / n_tiles);
  const int local = t - prefix[tile.expert] * n_tiles;
  const int m_tiles = prefix[tile.expert + 1] - prefix[tile.expert];
  const int band = local / (kBandRows * n_tiles);
  const int band_rows = min(kBandRows, m_tiles - band * kBandRows);
  const int within = local - band * kBandRows * n_tiles;
  tile.row_tile = band * kBandRows + within % band_rows;
  tile.col_tile = within / band_rows;
  return tile;
}

// SwiGLU of one (gate, up) accumulator pair at the unfused path's rounding points: gate and up
// rounded to BF16, then silu(gate) * up in FP32 (the caller rounds it to BF16). Both gate/up
// epilogues call it, so the BF16 and the quantized activation come from the same values.
__device__ __forceinline__ float SiluMul(float gate_acc, float up_acc) {
  const float g = Bf16Round(gate_acc), u = Bf16Round(up_acc);
  return Silu(g) * u;
}

// A consumer warp's staging tile (16 rows x 128 bytes, 16-byte chunks XOR-swizzled by row) out to
// memory in 16-byte pieces: chunk c of row r (row0 + r < m_end) to dst(row0 + r, c).
template <int kChunks = 8, typename Dst>
__device__ __forceinline__ void StagingToGlobal(const uint8_t* staging, int lane, int64_t row0, int64_t m_end,
                                                Dst&& dst) {
  static_assert(kChunks == 8 || kChunks == 4, "whole rows or their first half");
  constexpr int kShift = kChunks == 8 ? 3 : 2;
#pragma unroll
  for (int it = 0; it < kChunks / 2; ++it) {
    const int idx = it * 32 + lane, row = idx >> kShift, chunk = idx & (kChunks - 1);
    const uint4 v = *reinterpret_cast<const uint4*>(staging + row * 128 + ((chunk ^ (row & 7)) << 4));
    if (row0 + row < m_end) *reinterpret_cast<uint4*>(dst(row0 + row, chunk)) = v;
  }
}

// The epilogue of one 64-row slice of a consumer warpgroup, 64 columns at a time through the
// warp's 16-row staging tile: fragments go in with stmatrix (16-byte chunks XOR-swizzled by
// row, so neither side conflicts), come back as whole chunks and leave in 128-byte row pieces.
// Accumulator (row, column) of fragment j: rows lane / 4 (+ 8), columns 8 j + 2 (lane % 4)
// (+ 1) of the warp's 16 rows; kSwiglu: gate fragments at acc[4 j], up at acc[kN / 2 + 4 j].
template <bool kSwiglu, int kN>
__device__ __forceinline__ void StoreSlice(const float* acc, uint8_t* staging, int lane, int64_t row0, int64_t col0,
                                           int64_t m_end, uint16_t* out, int64_t ld_out) {
  // stmatrix: lane l addresses row l % 8 of matrix l / 8 (matrices: fragment j rows 0-7,
  // rows 8-15, fragment j + 1 rows 0-7, rows 8-15).
  const int st_row = (lane & 7) + 8 * ((lane >> 3) & 1);
  const int st_chunk = lane >> 4;
#pragma unroll
  for (int window = 0; window < (kN + 63) / 64; ++window) {
    // 64 columns a window; a last one of 32 (kN = 96) fills half of each staging row.
    constexpr int kFull = kN / 64;
    const int pairs = window < kFull ? 4 : 2;
#pragma unroll
    for (int jp = 0; jp < pairs; ++jp) {
      uint32_t packed[4];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int j = window * 8 + jp * 2 + h;
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          if constexpr (kSwiglu) {
            v[i] = SiluMul(acc[4 * j + i], acc[kN / 2 + 4 * j + i]);
          } else {
            v[i] = acc[4 * j + i];
          }
        }
        const __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]), hi = __floats2bfloat162_rn(v[2], v[3]);
        packed[2 * h] = *reinterpret_cast<const uint32_t*>(&lo);
        packed[2 * h + 1] = *reinterpret_cast<const uint32_t*>(&hi);
      }
      const int chunk = jp * 2 + st_chunk;
      StMatrixX4(staging + st_row * 128 + ((chunk ^ (st_row & 7)) << 4), packed);
    }
    __syncwarp();
    auto dst = [&](int64_t row, int chunk) { return out + row * ld_out + col0 + window * 64 + chunk * 8; };
    if (window < kFull) {
      StagingToGlobal(staging, lane, row0, m_end, dst);
    } else {
      StagingToGlobal<4>(staging, lane, row0, m_end, dst);
    }
    __syncwarp();
  }
}

// The tile buffer (Config::kEpiWarps): a 128-row tile's BF16 values, 512 bytes a row in
// 16-byte chunks XOR-swizzled by row (chunk c of row r at (c ^ (r % 8)) * 16), so that the
// consumers' stmatrix (8 rows of one chunk) and the epilogue warps' row reads (whole rows) are both
// conflict-free. Chunk c holds columns 8 c .. 8 c + 7: gate/up, gate columns in chunks 0-15 and
// the up columns of the same activation columns in 16-31 (both rounded to BF16, the unfused path's
// first rounding); down, the tile's 256 output columns.
__device__ __forceinline__ uint32_t TileBufOffset(int row, int chunk) {
  return static_cast<uint32_t>(row * kTileBufRow + ((chunk ^ (row & 7)) << 4));
}

// A consumer warp's 16 rows of the tile (from `row`), all 256 columns, from its accumulators into
// the tile buffer: fragment J (columns 8 J + 2 (lane % 4), + 1 of rows lane / 4, + 8) is acc[4 J ..
// 4 J + 3], the FP8 main loop's layout for both projections (gate/up: gate J < 16, up J >= 16).
__device__ __forceinline__ void AccToTileBuf(const float* acc, uint8_t* buf, int lane, int row) {
  const int st_row = row + (lane & 7) + 8 * ((lane >> 3) & 1);
  const int st_chunk = lane >> 4;
#pragma unroll
  for (int jp = 0; jp < 16; ++jp) {
    uint32_t packed[4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float* v = acc + 4 * (2 * jp + h);
      const __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]), hi = __floats2bfloat162_rn(v[2], v[3]);
      packed[2 * h] = *reinterpret_cast<const uint32_t*>(&lo);
      packed[2 * h + 1] = *reinterpret_cast<const uint32_t*>(&hi);
    }
    StMatrixX4(buf + TileBufOffset(st_row, 2 * jp + st_chunk), packed);
  }
}

__device__ __forceinline__ float LdsF32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ int LdsS32(uint32_t addr) {
  int v;
  asm volatile("ld.shared.s32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ uint4 LdsU4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// a = bf16(silu(g) * u) of the two BF16 pairs packed in g2 and u2, packed the same way
// (SiluMul's rounding points: the same bits as the consumers' epilogue of the BF16 kernels).
__device__ __forceinline__ uint32_t SiluMulPacked(uint32_t g2, uint32_t u2) {
  const float lo = Silu(Bf16Lo(g2)) * Bf16Lo(u2), hi = Silu(Bf16Hi(g2)) * Bf16Hi(u2);
  const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&p);
}

// The epilogue warps of an FP8 kernel or a BF16 one with kEpi (three warps of the producer
// warpgroup; its first warp's first thread issues the loads): for each tile of the CTA's sequence, once the consumers
// have filled the tile buffer (`buf_full`), its rows leave to memory and the buffer is handed back
// (`buf_empty`), while the consumers run the next tile's main loop. Four rows a warp at a time,
// eight lanes a row, so that each lane has 16 independent values in flight (one warp alone on
// a dependency chain is what bounds this code). Gate/up: lane c of a row takes activation columns
// 16 c .. 16 c + 15, a = bf16(silu(g) * u) from the buffer's BF16 gate and up values; FP8 with out_q set,
// the row's 128 values are one quantization group (fp8.cuh: amax over the row's eight lanes, then
// the quantization kernel's scale and products), else the BF16 activation. Down: a lane a 16-byte
// chunk of each row. Rows past the segment (m_end) are not written.
template <int BM, int BN, bool kSwiglu, bool kFp8>
__device__ __forceinline__ void EpilogueWarps(const GroupedArgs& args, const int32_t* prefix, int total,
                                              const uint8_t* buf, uint64_t* buf_full, uint64_t* buf_empty, int ew,
                                              int lane) {
  constexpr int kEpiWarpCount = 3;
  const uint32_t base = SmemAddr(buf);
  for (int j = 0;; ++j) {
    const int t = static_cast<int>(blockIdx.x + j * gridDim.x);
    if (t >= total) return;
    const Tile tile = TileAt(prefix, args.num_experts, args.n_tiles, t);
    const int64_t m0 = args.offsets[tile.expert] + static_cast<int64_t>(tile.row_tile) * BM;
    const int64_t m_end = args.offsets[tile.expert + 1];
    const int64_t col0 = static_cast<int64_t>(tile.col_tile) * BN;
    MbarWait(buf_full, static_cast<uint32_t>(j & 1));
    if constexpr (kSwiglu) {
      const int c = lane & 7;
      // FP8: the tile's rows of the column-major activation scales (one 128-column block: BN = 128).
      static_assert(BN == 128, "gate/up tiles of the epilogue warps: one quantization block of columns");
      // (FP8 sets out_q_scales even where out_q is not, so that this needs no runtime select: one
      // made ptxas spill; the BF16 kernels have none, a compile-time choice.)
      float* const tile_scales = kFp8 ? args.out_q_scales + tile.col_tile * args.out_q_scale_ld + m0 : nullptr;
      const int rows_left = static_cast<int>(m_end - m0);
#pragma unroll 1
      for (int r = 4 * ew + (lane >> 3); r < BM; r += 4 * kEpiWarpCount) {
        uint32_t a[8];  // the lane's 16 activation values, BF16 pairs
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint4 g = LdsU4(base + TileBufOffset(r, 2 * c + h));
          const uint4 u = LdsU4(base + TileBufOffset(r, 16 + 2 * c + h));
          a[4 * h] = SiluMulPacked(g.x, u.x);
          a[4 * h + 1] = SiluMulPacked(g.y, u.y);
          a[4 * h + 2] = SiluMulPacked(g.z, u.z);
          a[4 * h + 3] = SiluMulPacked(g.w, u.w);
        }
        const int64_t row = m0 + r;
        const bool live = r < rows_left;
        if (kFp8 && args.out_q != nullptr) {
          float amax = 0.0f;
#pragma unroll
          for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fmaxf(fabsf(Bf16Lo(a[i])), fabsf(Bf16Hi(a[i]))));
#pragma unroll
          for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
          float scale, inv;
          GroupScales(amax, &scale, &inv);
          uint32_t q[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            q[i] = static_cast<uint32_t>(Fp8Pair(Bf16Lo(a[2 * i]), Bf16Hi(a[2 * i]), inv)) |
                   static_cast<uint32_t>(Fp8Pair(Bf16Lo(a[2 * i + 1]), Bf16Hi(a[2 * i + 1]), inv)) << 16;
          }
          if (live) {
            *reinterpret_cast<uint4*>(args.out_q + row * args.ld_out + col0 + 16 * c) =
                make_uint4(q[0], q[1], q[2], q[3]);
            if (c == 0) tile_scales[r] = scale;
          }
        } else if (live) {
          uint16_t* dst = args.out + row * args.ld_out + col0 + 16 * c;
          *reinterpret_cast<uint4*>(dst) = make_uint4(a[0], a[1], a[2], a[3]);
          *reinterpret_cast<uint4*>(dst + 8) = make_uint4(a[4], a[5], a[6], a[7]);
        }
      }
    } else {
#pragma unroll 1
      for (int r = 4 * ew; r < BM; r += 4 * kEpiWarpCount) {
        uint4 v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = LdsU4(base + TileBufOffset(r + i, lane));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          if (m0 + r + i < m_end)
            *reinterpret_cast<uint4*>(args.out + (m0 + r + i) * args.ld_out + col0 + 8 * lane) = v[i];
        }
      }
    }
    MbarArrive(buf_empty);
  }
}

// The BF16 tile's main loop: one group of MMAs in flight; a stage is released once the group
// after it was issued and its own retired (wait_group 1). The last stage stays in *prev, for the
// caller to release after the tile's final wait. kLive: the 64-row slices computed (the
// ping-pong down kernel: 1 where the tile's rows end within its first 64, whose second slice
// would only multiply padding; that slice's accumulators are left as they are and never
// stored). The ping-pong gate/up kernel ran 12% slower so and computes both (bench/RESULTS.md,
// 2026-12-04).
template <typename C, int BN, bool kSwiglu, int kLive = C::kSlices>
__device__ __forceinline__ void MainLoop(uint8_t* smem, uint64_t* full, uint64_t* empty, int64_t pos0, int k_blocks,
                                         int a_off, int b_off, int lane, float* acc, int* prev) {
  int stage = static_cast<int>(pos0 % C::kStages);
  uint32_t phase = static_cast<uint32_t>((pos0 / C::kStages) & 1);
  for (int kb = 0; kb < k_blocks; ++kb) {
    MbarWait(&full[stage], phase);
    const uint8_t* a_tile = smem + stage * C::kStageBytes;
    const uint8_t* b_tile = a_tile + C::kABytes;
    const uint64_t db = SmemDesc(b_tile + b_off);
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      const int scale = (kb > 0 || kk > 0) ? 1 : 0;
#pragma unroll
      for (int sl = 0; sl < kLive; ++sl) {
        const uint64_t da = SmemDesc(a_tile + a_off + sl * 64 * 128);
        float* sacc = acc + sl * C::kSliceAcc;
        if constexpr (C::kJointGateUp) {
          // The gate rows then the up rows: gate columns in sacc[0, kWgN / 2), up columns after.
          Wgmma<2 * C::kWgN>(sacc, da + 2 * kk, db + 2 * kk, scale);
        } else {
          Wgmma<C::kWgN>(sacc, da + 2 * kk, db + 2 * kk, scale);
          if constexpr (kSwiglu) {
            const uint64_t du = SmemDesc(b_tile + BN * 128 + b_off);
            Wgmma<C::kWgN>(sacc + C::kWgN / 2, da + 2 * kk, du + 2 * kk, scale);
          }
        }
      }
    }
    WgmmaCommit();
    WgmmaWait<1>();
    if (*prev >= 0 && lane == 0) MbarArrive(&empty[*prev]);
    *prev = stage;
    if (++stage == C::kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
}

// The columns an FP8 consumer warpgroup's MMAs cover, in 128-column halves (one weight block each).
template <typename C, bool kSwiglu>
__host__ __device__ constexpr int Fp8Halves() {
  return (kSwiglu ? 2 : 1) * C::kWgN / 128;
}

// The producer warp's copies of one FP8 stage's weight block scales (the row scales come by bulk
// copy, Config): lane l < Fp8Halves the block's of half l into `block_dst` (gate/up: the gate then
// the up rows of the tile's columns; down: the tile's rows 128 at a time), then its arrival on
// the stage's full barrier once the copy has landed.
template <typename C, int BN, bool kSwiglu>
__device__ __forceinline__ void Fp8BlockScales(const GroupedArgs& args, const Tile& tile, int kb, int lane,
                                               float* block_dst, uint64_t* full) {
  constexpr int kHalves = Fp8Halves<C, kSwiglu>();
  if (lane < kHalves) {
    const int64_t b_row = static_cast<int64_t>(tile.expert) * args.b_rows_expert + tile.col_tile * BN;
    const int64_t rows = kSwiglu ? b_row + lane * args.up_rows : b_row + lane * 128;
    CpAsync4(block_dst + lane, args.b_scales + (rows / 128) * args.k_blocks + kb);
    CpAsyncArrive(full);
  }
}

// The FP8 tile's main loop (cooperative, 128-row tiles). A consumer warpgroup's 64 rows x
// kWgN columns (gate/up: BN gate then BN up columns) are computed in halves of 128 columns, one
// weight block wide: per stage and half, the MMAs of 128 K values into a partial accumulator
// (E4M3 x E4M3, FP32), then acc += partial x row scale x the half's block scale (the scales
// change every 128 K values, and every 128 weight rows). The scales come with the stage, in
// shared memory (Config's scale slots; `scales` is the shared address of stage 0's): `srow` is
// the thread's first row in the stage's row-scale slot (its second is srow + 8). Brought there by
// the producer warpgroup's bulk copy and copies (Fp8BlockScales), they cost the consumers three
// shared loads a stage (two row scales, the block scales as one pair) instead of four global
// loads a stage ahead and their addresses, and no global load waits at a tile's start.
template <typename C, int BN, bool kSwiglu>
__device__ __forceinline__ void Fp8MainLoop(uint8_t* smem, uint32_t scales, uint64_t* full, uint64_t* empty,
                                            int64_t pos0, int k_blocks, int a_off, int srow, int lane, float* acc) {
  constexpr int kN = (kSwiglu ? 2 : 1) * C::kWgN;  // MMA columns of the warpgroup
  constexpr int kHalves = kN / 128;
  static_assert(kN % 128 == 0 && kHalves <= 2, "FP8 tiles: 128 or 256 columns a warpgroup");
  static_assert(!kSwiglu || C::kJointGateUp, "gate/up halves: the gate rows, then the up rows, of one stage");
  float part[64];
#pragma unroll
  for (int i = 0; i < C::kAcc; ++i) acc[i] = 0.0f;
  // The ring position: counted, not divided, a stage (the loop's issue slots are what the
  // promotion competes for).
  int stage = static_cast<int>(pos0 % C::kStages);
  uint32_t phase = static_cast<uint32_t>((pos0 / C::kStages) & 1);
  // The shared addresses of the stage's row scales of the thread and its block scales: advanced
  // with the stage, not computed from it (which moves the stage count and the MMA descriptors'
  // arithmetic off the uniform datapath).
  uint32_t sa = scales + stage * C::kRowScaleStride + srow * 4;
  uint32_t sb = scales + stage * C::kBlockScaleStride + C::kBlockScalesAt;
  for (int kb = 0; kb < k_blocks; ++kb) {
    MbarWait(&full[stage], phase);
    const uint8_t* a_tile = smem + stage * C::kStageBytes;
    const uint8_t* b_tile = a_tile + C::kABytes;
    const float s0 = LdsF32(sa), s1 = LdsF32(sa + 8 * 4);
    float b_scale[kHalves];
#pragma unroll
    for (int h = 0; h < kHalves; ++h) b_scale[h] = LdsF32(sb + h * 4);
    const uint32_t da = SmemDescLo(a_tile + a_off);
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      const uint32_t db = SmemDescLo(b_tile + h * 128 * 128);
      WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < 128 / 32; ++kk)
        WgmmaM64N128K32E4m3(part, DescFromLo(da + 2 * kk), DescFromLo(db + 2 * kk), kk > 0);
      WgmmaCommit();
      if (h == 0) NamedBarArrive(C::kFp8ScaleBar + stage, C::kFp8ScaleThreads);  // the scales read
      WgmmaWait<0>();
      FenceAccumulators<64>(part);
      // The stage's tiles are released after its last MMAs (which read them in the async proxy,
      // complete once waited for).
      if (h == kHalves - 1 && lane == 0) MbarArrive(&empty[stage]);
      const float g0 = s0 * b_scale[h], g1 = s1 * b_scale[h];
      float* out = acc + h * 64;
#pragma unroll
      for (int j = 0; j < 16; ++j) {  // fragment j: rows row0 (regs 0, 1) and row0 + 8 (2, 3)
        out[4 * j] += part[4 * j] * g0;
        out[4 * j + 1] += part[4 * j + 1] * g0;
        out[4 * j + 2] += part[4 * j + 2] * g1;
        out[4 * j + 3] += part[4 * j + 3] * g1;
      }
    }
    if (++stage == C::kStages) {
      stage = 0;
      phase ^= 1;
      sa -= (C::kStages - 1) * C::kRowScaleStride;
      sb -= (C::kStages - 1) * C::kBlockScaleStride;
    } else {
      sa += C::kRowScaleStride;
      sb += C::kBlockScaleStride;
    }
  }
}

template <int BM, int BN, bool kSwiglu, bool kPingPong, bool kFp8, bool kEpi>
__global__ void __launch_bounds__(kThreads, 1)
    GroupedGemmKernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                      GroupedArgs args) {
  using C = Config<BM, BN, kSwiglu, kPingPong, kFp8, kEpi>;
  static_assert(!kFp8 || Fp8Halves<C, kSwiglu>() == C::kFullArrivals - 1, "FP8: two block-scale lanes");
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint8_t* epilogue = smem + C::kStages * C::kStageBytes;  // staging tiles, or (kEpiWarps) the tile buffer
  float* scales =
      reinterpret_cast<float*>(epilogue + (C::kEpiWarps ? C::kTileBufBytes : kConsumerWarps * kEpilogueWarpBytes));
  uint64_t* full = reinterpret_cast<uint64_t*>(reinterpret_cast<uint8_t*>(scales) + C::kScaleBytes);
  uint64_t* empty = full + C::kStages;
  uint64_t* buf_full = empty + C::kStages;  // kEpiWarps: the tile buffer filled, then drained
  uint64_t* buf_empty = buf_full + 1;
  int32_t* prefix = reinterpret_cast<int32_t*>(buf_empty + 1);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int E = args.num_experts;

  if (threadIdx.x == 0) {
    for (int s = 0; s < C::kStages; ++s) {
      MbarInit(&full[s], C::kFullArrivals);
      MbarInit(&empty[s], C::kEmptyArrivals);
    }
    MbarInit(buf_full, 2 * 128);  // every consumer thread, after its rows' stmatrix
    MbarInit(buf_empty, 3 * 32);  // every epilogue warp thread, after its reads
    MbarInitFence();
  }
  if (warp == 1) {  // row tiles before each expert (inclusive warp scans, 32 experts at a time)
    int carry = 0;
    for (int base = 0; base < E; base += 32) {
      const int e = base + lane;
      int v = 0;
      if (e < E) v = static_cast<int>((args.offsets[e + 1] - args.offsets[e] + BM - 1) / BM);
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += n;
      }
      if (e < E) prefix[e + 1] = carry + v;
      carry += __shfl_sync(0xffffffffu, v, 31);
    }
    if (lane == 0) prefix[0] = 0;
  }
  __syncthreads();
  // Tiles of the grid. The kernels with epilogue warps read the count again in each role, after its setmaxnreg
  // (an ordered shared load): a value live across the producer's 56-register cut was spilled.
  const int all_tiles = prefix[E] * args.n_tiles;
  auto tiles_after_setmaxnreg = [&] { return C::kEpiWarps ? LdsS32(SmemAddr(prefix + E)) * args.n_tiles : all_tiles; };

  // The producer warpgroup: the first, or (kEpiWarps) the last. The place makes no difference to
  // the speed (measured); with the FP8 kernels' epilogue warps ptxas spills 16-64 bytes a thread
  // when it is the first, none when it is the last (CUDA 13.0).
  constexpr int kProducerWg = C::kEpiWarps ? 2 : 0;
  if (warp / 4 == kProducerWg) {  // one thread loads every stage in tile order
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(C::kProducerRegs));
    const int total = tiles_after_setmaxnreg();
    if constexpr (C::kEpiWarps) {
      if (warp % 4 > 0) {
        EpilogueWarps<BM, BN, kSwiglu, kFp8>(args, prefix, total, epilogue, buf_full, buf_empty, warp % 4 - 1, lane);
        return;
      }
    }
    // The first warp: its first thread issues the TMA loads (FP8: and the row scales' bulk copy,
    // two lanes copy the block scales, and all lanes take the scale slots' named barriers).
    if (warp % 4 != 0 || (!kFp8 && lane != 0)) return;
    int stage = 0;
    uint32_t phase = 0;
    int64_t loads = 0;  // stages filled (FP8: past the ring's first round, the scales are released too)
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
      const Tile tile = TileAt(prefix, E, args.n_tiles, t);
      const int64_t m0 = args.offsets[tile.expert] + static_cast<int64_t>(tile.row_tile) * BM;
      const int a_row = static_cast<int>(m0);
      const int b_row = tile.expert * args.b_rows_expert + tile.col_tile * BN;
      for (int kb = 0; kb < args.k_blocks; ++kb) {
        MbarWait(&empty[stage], phase ^ 1);
        // FP8: the stage's scales, once every consumer thread has released the slot's last ones.
        // Gate/up copies them after the tiles' loads are issued, down the block scales before and
        // the row scales after (the orders measured fastest, H200 ncu at T = 8192).
        float* row_scales = scales + stage * (C::kRowScaleStride / 4);
        auto stage_scales = [&] {
          if (loads >= C::kStages) NamedBarSync(C::kFp8ScaleBar + stage, C::kFp8ScaleThreads);
          Fp8BlockScales<C, BN, kSwiglu>(args, tile, kb, lane,
                                         scales + (C::kBlockScalesAt + stage * C::kBlockScaleStride) / 4, &full[stage]);
        };
        auto row_scales_copy = [&] {
          BulkLoad(row_scales, args.a_scales + kb * args.a_scale_ld + (a_row & ~3), C::kRowScaleTxBytes, &full[stage]);
        };
        if constexpr (kFp8 && !kSwiglu) stage_scales();
        if (lane == 0) {
          uint8_t* a_tile = smem + stage * C::kStageBytes;
          uint8_t* b_tile = a_tile + C::kABytes;
          MbarExpectTx(&full[stage], C::kStageBytes + C::kRowScaleTxBytes);
          TmaLoad2d(a_tile, &map_a, kb * C::kStageK, a_row, &full[stage]);
          TmaLoad2d(b_tile, &map_b, kb * C::kStageK, b_row, &full[stage]);
          if constexpr (kSwiglu) {
            TmaLoad2d(b_tile + BN * 128, &map_b, kb * C::kStageK, b_row + args.up_rows, &full[stage]);
          }
          if constexpr (kFp8 && !kSwiglu) row_scales_copy();
        }
        if constexpr (kFp8 && kSwiglu) {
          stage_scales();
          if (lane == 0) row_scales_copy();
        }
        if (++stage == C::kStages) {
          stage = 0;
          phase ^= 1;
        }
        ++loads;
      }
    }
    if constexpr (kFp8) {
      // The last stages' scale releases are taken too, oldest first, so that no named barrier is
      // left with arrivals at the CTA's exit.
      const int pending = loads < C::kStages ? static_cast<int>(loads) : C::kStages;
      for (int i = 0, s = (stage - pending + C::kStages) % C::kStages; i < pending; ++i) {
        NamedBarSync(C::kFp8ScaleBar + s, C::kFp8ScaleThreads);
        if (++s == C::kStages) s = 0;
      }
    }
    return;
  }

  // The consumers' code is compiled to this budget (the launch bound's 168 registers a thread
  // hold until here): the FP8 tiles keep a 128-float accumulator and a 64-float partial.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(C::kConsumerRegs));
  const int total = tiles_after_setmaxnreg();
  const int cwarp = kProducerWg == 0 ? warp - 4 : warp;  // consumer warp 0-7
  const int cw = cwarp / 4;                              // consumer warpgroup 0 or 1
  const int wl = cwarp % 4;                              // warp within it
  // Cooperative: where this warpgroup's rows and columns start within the tile.
  const int a_off = !kPingPong && BM == 128 ? cw * 64 * 128 : 0;
  const int b_off = !kPingPong && BM == 64 ? cw * C::kWgN * 128 : 0;
  const int row_off = !kPingPong && BM == 128 ? cw * 64 : 0;
  const int col_off = !kPingPong && BM == 64 ? cw * C::kWgN : 0;
  const int tile_step = kPingPong ? 2 : 1;  // tiles of the CTA's sequence a warpgroup takes
  uint8_t* staging = epilogue + cwarp * kEpilogueWarpBytes;
  float acc[C::kAcc];
  // A tile's expert and rows: the next tile's are read before the current tile's epilogue, so
  // the latency of its offsets (global loads the main loop's first stage would otherwise wait
  // for) runs under that epilogue. The consumers of the kernels with epilogue warps (kEpiWarps)
  // read them after handing their tile to those warps, which takes them only the stmatrix of
  // AccToTileBuf (FP8: their scales come with each stage).
  struct TileRows {
    Tile tile;
    int64_t m0, m_end;
  };
  auto rows_of = [&](int t) {
    TileRows r;
    r.tile = TileAt(prefix, E, args.n_tiles, t);
    r.m0 = args.offsets[r.tile.expert] + static_cast<int64_t>(r.tile.row_tile) * BM;
    r.m_end = args.offsets[r.tile.expert + 1];
    return r;
  };
  int j = kPingPong ? cw : 0;
  if (static_cast<int>(blockIdx.x + j * gridDim.x) >= total) return;
  TileRows cur = rows_of(blockIdx.x + j * gridDim.x);
  for (;; j += tile_step) {
    const Tile& tile = cur.tile;
    const int64_t m0 = cur.m0, m_end = cur.m_end;
    // The ring position of the tile's first stage: every tile before it in the CTA's sequence
    // used k_blocks stages.
    const int64_t pos0 = static_cast<int64_t>(j) * args.k_blocks;
    // Ping-pong: this tile's MMAs start once the previous tile's (the other warpgroup's) are all
    // issued: named barrier 1 + cw, which the other warpgroup's 128 threads arrive on after their
    // MMA loop. Besides alternating the tensor cores between the warpgroups, this keeps a
    // warpgroup within one phase of the stages it waits on (the barriers' parity is only
    // unambiguous that close).
    if constexpr (kPingPong) {
      if (j > 0) NamedBarSync(1 + cw, 256);
    }
    int prev = -1;  // the stage whose MMAs may still run (released after them)
    if constexpr (kFp8) {
      // (A stage's row scales start at the tile's first row rounded down to 16 bytes.)
      const int scale_row = row_off + wl * 16 + lane / 4 + static_cast<int>(m0 & 3);
      Fp8MainLoop<C, BN, kSwiglu>(smem, SmemAddr(scales), full, empty, pos0, args.k_blocks, a_off, scale_row, lane,
                                  acc);
    } else if (kPingPong && !kSwiglu && m_end - m0 <= 64) {
      MainLoop<C, BN, kSwiglu, 1>(smem, full, empty, pos0, args.k_blocks, a_off, b_off, lane, acc, &prev);
    } else {
      MainLoop<C, BN, kSwiglu>(smem, full, empty, pos0, args.k_blocks, a_off, b_off, lane, acc, &prev);
    }
    if constexpr (kPingPong) {
      // The next tile of the sequence (the other warpgroup's) may start, if there is one: every
      // arrival is matched by the other warpgroup's wait.
      if (static_cast<int>(blockIdx.x + (j + 1) * gridDim.x) < total) NamedBarArrive(1 + (cw ^ 1), 256);
    }
    WgmmaWait<0>();
    FenceAccumulators<C::kAcc>(acc);
    if (prev >= 0 && lane == 0) MbarArrive(&empty[prev]);
    const int t_next = static_cast<int>(blockIdx.x + (j + tile_step) * gridDim.x);
    const bool more = t_next < total;
    if constexpr (C::kEpiWarps) {
      static_assert(C::kSlices == 1 && C::kAcc == 128, "epilogue warps: 64 rows x 256 columns a warpgroup");
      // The buffer is free once the epilogue warps have read the previous tile out of it; the
      // first tile's wait (parity 1 of a fresh barrier) passes at once.
      MbarWait(buf_empty, static_cast<uint32_t>((j & 1) ^ 1));
      AccToTileBuf(acc, epilogue, lane, row_off + wl * 16);
      MbarArrive(buf_full);
      if (!more) break;
      cur = rows_of(t_next);
      continue;
    }
    TileRows next = cur;
    if (more) next = rows_of(t_next);
    const int64_t col0 = static_cast<int64_t>(tile.col_tile) * BN + col_off;
    if constexpr (!C::kEpiWarps) {
#pragma unroll
      for (int sl = 0; sl < C::kSlices; ++sl) {
        if (sl > 0 && m0 + row_off + sl * 64 >= m_end) break;  // no rows of the segment (ping-pong down: nor MMAs)
        StoreSlice<kSwiglu, C::kWgN>(acc + sl * C::kSliceAcc, staging, lane, m0 + row_off + sl * 64 + wl * 16, col0,
                                     m_end, args.out, args.ld_out);
      }
    }
    if (!more) break;
    cur = next;
  }
}

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiledFn EncodeTiled() {
  static EncodeTiledFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      return static_cast<EncodeTiledFn>(nullptr);
    }
    return reinterpret_cast<EncodeTiledFn>(p);
  }();
  return fn;
}

// A row-major BF16 (or, `fp8`, one-byte) matrix [outer, inner] read in boxes of box_outer rows
// by 128 bytes with the 128-byte swizzle; rows `ld_bytes` apart (0: inner's bytes).
cudaError_t MapRows(CUtensorMap* map, const void* base, int64_t inner, int64_t outer, int box_outer, bool fp8,
                    int64_t ld_bytes = 0) {
  EncodeTiledFn encode = EncodeTiled();
  if (encode == nullptr) return cudaErrorNotSupported;
  const int elem_bytes = fp8 ? 1 : 2;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(outer)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld_bytes > 0 ? ld_bytes : inner * elem_bytes)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(128 / elem_bytes), static_cast<cuuint32_t>(box_outer)};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult rc =
      encode(map, fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base),
             dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return rc == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

int SmCount() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 132;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) return 132;
  return sms;
}

template <int BM, int BN, bool kSwiglu, bool kPingPong, bool kFp8 = false, bool kEpi = kFp8>
cudaError_t Launch(const void* a, int64_t rows, int64_t k, const void* b, int64_t b_rows, const GroupedArgs& args,
                   cudaStream_t stream, int64_t a_ld_bytes = 0) {
  using C = Config<BM, BN, kSwiglu, kPingPong, kFp8, kEpi>;
  auto* kernel = GroupedGemmKernel<BM, BN, kSwiglu, kPingPong, kFp8, kEpi>;
  // The shared-memory opt-in is a property of the function on each device: set it once a device
  // (a process may drive several GPUs).
  static std::mutex mu;
  static uint64_t prepared = 0;  // bit d: done on device d (devices past 63: every launch)
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  {
    std::lock_guard<std::mutex> lock(mu);
    const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
    if ((prepared & bit) == 0 || bit == 0) {
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
      if (err != cudaSuccess) return err;
      prepared |= bit;
    }
  }
  CUtensorMap map_a, map_b;
  err = MapRows(&map_a, a, k, rows, BM, kFp8, a_ld_bytes);
  if (err != cudaSuccess) return err;
  err = MapRows(&map_b, b, k, b_rows, BN, kFp8);
  if (err != cudaSuccess) return err;
  // Row tiles: at most rows / BM + one partial tile an expert. The kernel counts tiles and rows
  // in 32 bits.
  const int64_t tiles = (rows / BM + args.num_experts) * args.n_tiles;
  if (tiles >= (int64_t{1} << 31) || rows + BM >= (int64_t{1} << 31)) return cudaErrorInvalidValue;
  const int grid = static_cast<int>(tiles < SmCount() ? tiles : SmCount());
  kernel<<<grid, kThreads, C::kSmemBytes, stream>>>(map_a, map_b, args);
  return cudaGetLastError();
}

// The BF16 operands of both projections.
struct Operands {
  const uint16_t* x;
  int64_t rows;
  const int64_t* offsets;
  int num_experts, d, f;
  const uint16_t *w_gate_up, *w_down;
  uint16_t *a, *y;
};

// One projection's tiles: BM rows by BN columns (gate/up: activation columns), ping-pong or
// cooperative, the epilogue in the consumers or (kEpi) on the epilogue warps.
template <int BM_, int BN_, bool kPingPong_, bool kEpi_ = false>
struct Tiles {
  static constexpr int BM = BM_, BN = BN_;
  static constexpr bool kPingPong = kPingPong_, kEpi = kEpi_;
};

// Gate/up (SwiGLU epilogue) into a on Up's tiles, then down into y on Down's.
// (Column tiles must divide the projections: kWideUpN does not divide every f.)
template <typename Up, typename Down>
cudaError_t UpThenDown(const Operands& o, cudaStream_t stream) {
  if (o.f % Up::BN != 0 || o.d % Down::BN != 0) return cudaErrorInvalidValue;
  const GroupedArgs up{o.offsets, o.num_experts, o.d / kBK, o.f / Up::BN, 2 * o.f, o.f, o.a, o.f};
  const GroupedArgs down{o.offsets, o.num_experts, o.f / kBK, o.d / Down::BN, o.d, 0, o.y, o.d};
  const cudaError_t err = Launch<Up::BM, Up::BN, true, Up::kPingPong, false, Up::kEpi>(
      o.x, o.rows, o.d, o.w_gate_up, static_cast<int64_t>(o.num_experts) * 2 * o.f, up, stream);
  if (err != cudaSuccess) return err;
  return Launch<Down::BM, Down::BN, false, Down::kPingPong, false, Down::kEpi>(
      o.a, o.rows, o.f, o.w_down, static_cast<int64_t>(o.num_experts) * o.d, down, stream);
}

}  // namespace

bool GroupedSm90Supported(int num_experts, int d, int f) {
  if (num_experts < 1 || num_experts > kMaxExperts || d % 256 != 0 || f % 128 != 0) return false;
  // Weight rows are addressed with 32-bit TMA coordinates.
  return static_cast<int64_t>(num_experts) * 2 * f < (int64_t{1} << 31) &&
         static_cast<int64_t>(num_experts) * d < (int64_t{1} << 31) && EncodeTiled() != nullptr;
}

cudaError_t LaunchGroupedSm90Swiglu(const uint16_t* x, int64_t rows, const int64_t* offsets, int num_experts, int d,
                                    int f, const uint16_t* w_gate_up, const uint16_t* w_down, uint16_t* a, uint16_t* y,
                                    Sm90Schedule schedule, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (rows >= (int64_t{1} << 31) || !GroupedSm90Supported(num_experts, d, f)) return cudaErrorInvalidValue;
  const Operands o{x, rows, offsets, num_experts, d, f, w_gate_up, w_down, a, y};
  switch (schedule) {
    case Sm90Schedule::kRows64:
      return UpThenDown<Tiles<64, 128, false>, Tiles<64, 256, false>>(o, stream);
    case Sm90Schedule::kRows128:
      return UpThenDown<Tiles<128, 128, false>, Tiles<128, 256, false>>(o, stream);
    case Sm90Schedule::kPingPong:
      return UpThenDown<Tiles<128, 64, true>, Tiles<128, 128, true>>(o, stream);
    case Sm90Schedule::kPingPongWide:
      return UpThenDown<Tiles<128, kWideUpN, true>, Tiles<128, 128, true>>(o, stream);
    case Sm90Schedule::kRows128Epi:
      return UpThenDown<Tiles<128, 128, false, true>, Tiles<128, 256, false, true>>(o, stream);
    case Sm90Schedule::kWideEpiDown:
      return UpThenDown<Tiles<128, kWideUpN, true>, Tiles<128, 256, false, true>>(o, stream);
  }
  return cudaErrorInvalidValue;
}

bool GroupedSm90WideSupported(int f) { return f % kWideUpN == 0; }

bool GroupedSm90Fp8Supported(int num_experts, int d, int f) {
  return GroupedSm90Supported(num_experts, d, f) && d % 128 == 0 && f % 128 == 0;
}

cudaError_t LaunchGroupedSm90SwigluFp8(const uint8_t* xq, int64_t xq_ld, const float* x_scales, int64_t x_scales_ld,
                                       int64_t rows, const int64_t* offsets, int num_experts, int d, int f,
                                       const uint8_t* w_gate_up, const float* gate_up_scales, const uint8_t* w_down,
                                       const float* down_scales, float* x_scales_t, uint16_t* a, uint8_t* aq,
                                       float* a_scales, uint16_t* y, cudaStream_t stream, bool quantize_in_epilogue) {
  if (rows <= 0) return cudaSuccess;
  if (!Fp8RowOperandsValid(rows, d, xq_ld, x_scales == nullptr ? d / 128 : x_scales_ld)) return cudaErrorInvalidValue;
  if (!quantize_in_epilogue && a == nullptr) return cudaErrorInvalidValue;
  // The down kernel's bulk copies of the activation scales, and the quantization kernel's vectors.
  if (a_scales == nullptr || reinterpret_cast<uintptr_t>(a_scales) % 16 != 0 || x_scales_t == nullptr ||
      reinterpret_cast<uintptr_t>(x_scales_t) % 16 != 0 || reinterpret_cast<uintptr_t>(aq) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(a) % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  // The rows' scales column-major, as the kernels' bulk copies read them (x_scales null: the
  // caller wrote them there).
  cudaError_t err = cudaSuccess;
  if (x_scales != nullptr) {
    err = LaunchTransposeScales(x_scales, rows, d / 128, x_scales_ld, x_scales_t, Fp8ActivationScaleRows(rows), stream);
    if (err != cudaSuccess) return err;
  }
  GroupedArgs up{offsets, num_experts, d / 128, f / 128, 2 * f, f, a, f};
  up.a_scales = x_scales_t;
  up.a_scale_ld = Fp8ActivationScaleRows(rows);
  up.b_scales = gate_up_scales;
  if (quantize_in_epilogue) up.out_q = aq;
  up.out_q_scales = a_scales;  // written only with out_q (EpilogueWarps)
  up.out_q_scale_ld = Fp8ActivationScaleRows(rows);
  err = Launch<128, 128, true, false, true>(xq, rows, d, w_gate_up, static_cast<int64_t>(num_experts) * 2 * f, up,
                                            stream, xq_ld);
  if (err != cudaSuccess) return err;
  if (!quantize_in_epilogue) {
    err = LaunchQuantizeFp8(a, rows, f, 128, aq, a_scales, stream, 1, Fp8ActivationScaleRows(rows));
    if (err != cudaSuccess) return err;
  }
  GroupedArgs down{offsets, num_experts, f / 128, d / 256, d, 0, y, d};
  down.a_scales = a_scales;
  down.a_scale_ld = Fp8ActivationScaleRows(rows);
  down.b_scales = down_scales;
  return Launch<128, 256, false, false, true>(aq, rows, f, w_down, static_cast<int64_t>(num_experts) * d, down, stream);
}

}  // namespace moe::kernels::cuda
