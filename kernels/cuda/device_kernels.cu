// Device kernels of the CUDA implementation. Memory-bound work: 16-byte accesses per thread
// where row sizes allow, grid-stride loops, no host round trips.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>

#include <cub/block/block_load.cuh>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/block/block_store.cuh>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "kernels/cuda/activation.cuh"
#include "kernels/cuda/combine.cuh"
#include "kernels/cuda/fp8.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/pdl.cuh"

namespace moe::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// Exclusive sum of n values over a block, THREADS at a time: store(i, value, exclusive) for
// each i < n; returns the total (every thread gets it). Storage is reused between chunks.
template <int THREADS, typename T, typename Load, typename Store>
__device__ T ChunkedExclusiveSum(typename cub::BlockScan<T, THREADS>::TempStorage& storage, int n, Load load,
                                 Store store) {
  T carry = 0;
  for (int base = 0; base < n; base += THREADS) {
    const int i = base + threadIdx.x;
    const T v = i < n ? load(i) : T{0};
    T excl, total;
    cub::BlockScan<T, THREADS>(storage).ExclusiveSum(v, excl, total);
    if (i < n) store(i, v, carry + excl);
    carry += total;
    __syncthreads();
  }
  return carry;
}

int Blocks(int64_t work, int per_block = kThreads) {
  const int64_t b = (work + per_block - 1) / per_block;
  return static_cast<int>(b < 1 ? 1 : (b > 65535LL * 16 ? 65535LL * 16 : b));
}

// ---- gather ---------------------------------------------------------------------------------

template <typename V>
__global__ void GatherRowsKernel(const V* __restrict__ in, int64_t in_rows, const int32_t* __restrict__ index,
                                 int64_t n, int64_t vecs_per_row, V* __restrict__ out, V fill) {
  const int64_t total = n * vecs_per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / vecs_per_row;
    const int64_t v = i - row * vecs_per_row;
    const int32_t src = index[row];
    // NOTE: an index outside the input is padding, never an out-of-bounds read.
    out[i] = (src >= 0 && src < in_rows) ? in[src * vecs_per_row + v] : fill;
  }
}

// 16-byte rows: a warp a row (grid-stride over rows), the index read once a row, kGatherUnroll
// 16-byte loads a lane in flight before their stores. The rows are written with streaming
// stores (evict-first): a gathered copy is read once, by the next kernel. One H200, E128 k8
// d2048 T=8192 (65,536 rows of 4 KiB, expert order): 106 µs against 129 for a thread a vector
// (bench/RESULTS.md).
constexpr int kGatherUnroll = 8;
constexpr int kGatherWarps = kThreads / 32;
__global__ void __launch_bounds__(kThreads)
    GatherRowsVec16Kernel(const uint4* __restrict__ in, int64_t in_rows, const int32_t* __restrict__ index, int64_t n,
                          int64_t vecs_per_row, uint4* __restrict__ out, uint4 fill) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kGatherWarps;
  for (int64_t row = blockIdx.x * static_cast<int64_t>(kGatherWarps) + threadIdx.x / 32; row < n; row += warps) {
    const int32_t src = __ldg(index + row);
    // NOTE: an index outside the input is padding, never an out-of-bounds read.
    const bool valid = src >= 0 && src < in_rows;
    const uint4* from = in + static_cast<int64_t>(valid ? src : 0) * vecs_per_row;
    uint4* to = out + row * vecs_per_row;
    for (int64_t v0 = 0; v0 < vecs_per_row; v0 += 32 * kGatherUnroll) {
      uint4 r[kGatherUnroll];
#pragma unroll
      for (int u = 0; u < kGatherUnroll; ++u) {
        const int64_t v = v0 + u * 32 + lane;
        r[u] = valid && v < vecs_per_row ? __ldg(from + v) : fill;
      }
#pragma unroll
      for (int u = 0; u < kGatherUnroll; ++u) {
        const int64_t v = v0 + u * 32 + lane;
        if (v < vecs_per_row) __stcs(to + v, r[u]);
      }
    }
  }
}

// Scatter (kernels/api.h ScatterParams), 16-byte rows: a warp a source row, kGatherUnroll
// vectors a lane at a time loaded once and stored to each of the row's destinations (streaming
// stores, as the gather's).
__global__ void __launch_bounds__(kThreads)
    ScatterRowsVec16Kernel(const uint4* __restrict__ in, int64_t in_rows, int64_t vecs_per_row, int64_t out_vecs,
                           const int32_t* __restrict__ dest, int fanout, int64_t out_rows, uint4* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kGatherWarps;
  for (int64_t row = blockIdx.x * static_cast<int64_t>(kGatherWarps) + threadIdx.x / 32; row < in_rows; row += warps) {
    const uint4* from = in + row * vecs_per_row;
    const int32_t* to_rows = dest + row * fanout;
    for (int64_t v0 = 0; v0 < vecs_per_row; v0 += 32 * kGatherUnroll) {
      uint4 r[kGatherUnroll];
#pragma unroll
      for (int u = 0; u < kGatherUnroll; ++u) {
        const int64_t v = v0 + u * 32 + lane;
        if (v < vecs_per_row) r[u] = __ldg(from + v);
      }
      for (int j = 0; j < fanout; ++j) {
        const int32_t to = __ldg(to_rows + j);
        if (to < 0 || to >= out_rows) continue;  // the same for the whole warp
        uint4* row_out = out + static_cast<int64_t>(to) * out_vecs;
#pragma unroll
        for (int u = 0; u < kGatherUnroll; ++u) {
          const int64_t v = v0 + u * 32 + lane;
          if (v < vecs_per_row) __stcs(row_out + v, r[u]);
        }
      }
    }
  }
}

// Scatter of 2-byte elements (rows that are not whole 16-byte vectors): a thread an element.
__global__ void ScatterRowsKernel(const uint16_t* __restrict__ in, int64_t in_rows, int64_t per_row, int64_t out_ld,
                                  const int32_t* __restrict__ dest, int fanout, int64_t out_rows,
                                  uint16_t* __restrict__ out) {
  const int64_t total = in_rows * per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / per_row, c = i - row * per_row;
    const uint16_t v = in[i];
    for (int j = 0; j < fanout; ++j) {
      const int32_t to = dest[row * fanout + j];
      if (to >= 0 && to < out_rows) out[static_cast<int64_t>(to) * out_ld + c] = v;
    }
  }
}

__global__ void GatherScalesKernel(const float* __restrict__ in, int64_t in_rows, const int32_t* __restrict__ index,
                                   int64_t n, int64_t per_row, float* __restrict__ out) {
  const int64_t total = n * per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / per_row;
    const int32_t src = index[row];
    out[i] = (src >= 0 && src < in_rows) ? in[src * per_row + (i - row * per_row)] : 1.0f;
  }
}

// ---- histogram + scan ---------------------------------------------------------------------

__global__ void ZeroKernel(int64_t* p, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    p[i] = 0;
}

__global__ void HistogramKernel(const int32_t* __restrict__ keys, int64_t n, int num_bins,
                                unsigned long long* __restrict__ counts) {
  extern __shared__ unsigned int local[];
  for (int b = threadIdx.x; b < num_bins; b += blockDim.x) local[b] = 0;
  __syncthreads();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t k = keys[i];
    if (k >= 0 && k < num_bins) atomicAdd(&local[k], 1u);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < num_bins; b += blockDim.x) {
    if (local[b] != 0) atomicAdd(&counts[b], static_cast<unsigned long long>(local[b]));
  }
}

__global__ void ExclusiveScanKernel(const int64_t* __restrict__ counts, int num_bins, int64_t* __restrict__ offsets) {
  __shared__ typename cub::BlockScan<int64_t, kThreads>::TempStorage storage;
  const int64_t total = ChunkedExclusiveSum<kThreads, int64_t>(
      storage, num_bins, [&](int b) { return counts[b]; }, [&](int b, int64_t, int64_t excl) { offsets[b] = excl; });
  if (threadIdx.x == 0) offsets[num_bins] = total;
}

// ---- route planning -------------------------------------------------------------------------

__global__ void ComposeIndexKernel(const int32_t* __restrict__ a, int64_t a_n, const int32_t* __restrict__ b, int64_t n,
                                   int32_t* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t j = b[i];
    out[i] = j >= 0 && j < a_n ? a[j] : -1;
  }
}

// kOneBlock: the whole grid is one block, which keeps the status in shared memory and writes it
// at its end (no reset of `status` before the kernel: a decode step's seal is one launch).
// Otherwise `status` holds ~0 (none) on entry.
template <bool kOneBlock>
__global__ void SealRoutesKernel(const int32_t* __restrict__ ids, const float* __restrict__ gates,
                                 const uint8_t* __restrict__ admitted, int64_t routes, int num_experts,
                                 const int32_t* __restrict__ key_of_expert, int32_t* __restrict__ keys,
                                 float* __restrict__ gates_out, const int32_t* __restrict__ local_of_key, int num_keys,
                                 int32_t* __restrict__ local, unsigned long long* status) {
  __shared__ unsigned long long block_status[2];
  unsigned long long* st = status;
  if constexpr (kOneBlock) {
    if (threadIdx.x < 2) block_status[threadIdx.x] = ~0ull;
    __syncthreads();
    st = block_status;
  }
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < routes;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int32_t key = -1;
    float g_out = 0.0f;
    if (admitted == nullptr || admitted[i] != 0) {
      const int32_t e = ids[i];
      const float g = gates[i];
      if (e < 0 || e >= num_experts || !isfinite(g) || g < 0.0f) {
        atomicMin(&st[0], static_cast<unsigned long long>(i));
      } else {
        key = key_of_expert[e];
        g_out = g;
        if (key < 0) atomicMin(&st[1], static_cast<unsigned long long>(i));
      }
    }
    keys[i] = key;
    gates_out[i] = g_out;
    if (local != nullptr) local[i] = key >= 0 && key < num_keys ? local_of_key[key] : -1;
  }
  if constexpr (kOneBlock) {
    __syncthreads();
    if (threadIdx.x < 2) status[threadIdx.x] = block_status[threadIdx.x];
  }
}

constexpr int kRankTile = 256;  // elements per tile: one counting block, one scattering warp

// Element i's key, or -1 (not placed); *bad when the input breaks the contract.
__device__ __forceinline__ int32_t RankKeyOf(const int32_t* __restrict__ raw, int64_t i,
                                             const int32_t* __restrict__ key_map, int map_size, int num_keys,
                                             bool* bad) {
  int32_t key = raw[i];
  *bad = false;
  if (key_map != nullptr) {
    if (key >= 0) {
      *bad = key >= map_size || key_map[key] < 0;
      key = *bad ? -1 : key_map[key];
    } else {
      *bad = key != -1;
    }
  }
  if (key >= num_keys) *bad = true;
  return *bad ? -1 : key;
}

// Per tile: counts of each key, stored key-major (tile_counts[key * tiles + tile]).
__global__ void RankCountKernel(const int32_t* __restrict__ raw, int64_t n, const int32_t* __restrict__ key_map,
                                int map_size, int num_keys, int tiles, int32_t* __restrict__ tile_counts,
                                unsigned long long* status) {
  extern __shared__ int32_t counts[];
  for (int k = threadIdx.x; k < num_keys; k += blockDim.x) counts[k] = 0;
  __syncthreads();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kRankTile + threadIdx.x;
  if (i < n) {
    bool bad;
    const int32_t key = RankKeyOf(raw, i, key_map, map_size, num_keys, &bad);
    if (bad) atomicMin(status, static_cast<unsigned long long>(i));
    if (key >= 0) atomicAdd(&counts[key], 1);
  }
  __syncthreads();
  for (int k = threadIdx.x; k < num_keys; k += blockDim.x) {
    tile_counts[static_cast<int64_t>(k) * tiles + blockIdx.x] = counts[k];
  }
}

// Per key (one block each): an exclusive scan of its tile counts in place (each entry becomes
// where that tile's elements of the key start within the key's segment) and the key's count.
// 2048 entries a round: coalesced loads and stores transposed through shared memory, each
// thread scanning eight consecutive entries. The keys' offsets are a second, one-block scan of
// the counts (ExclusiveScanKernel).
constexpr int kRankScanThreads = 256;
constexpr int kRankScanItems = 8;
__global__ void __launch_bounds__(kRankScanThreads)
    RankScanKernel(int32_t* __restrict__ tile_counts, int tiles, int64_t* __restrict__ counts) {
  using Load = cub::BlockLoad<int32_t, kRankScanThreads, kRankScanItems, cub::BLOCK_LOAD_WARP_TRANSPOSE>;
  using Store = cub::BlockStore<int32_t, kRankScanThreads, kRankScanItems, cub::BLOCK_STORE_WARP_TRANSPOSE>;
  using Scan = cub::BlockScan<int64_t, kRankScanThreads>;
  __shared__ union {
    typename Load::TempStorage load;
    typename Store::TempStorage store;
    typename Scan::TempStorage scan;
  } storage;
  constexpr int kRound = kRankScanThreads * kRankScanItems;
  int32_t* key_counts = tile_counts + static_cast<int64_t>(blockIdx.x) * tiles;
  int64_t carry = 0;
  for (int base = 0; base < tiles; base += kRound) {
    const int valid = tiles - base < kRound ? tiles - base : kRound;
    int32_t v[kRankScanItems];
    Load(storage.load).Load(key_counts + base, v, valid, 0);
    int64_t sum = 0;
#pragma unroll
    for (int q = 0; q < kRankScanItems; ++q) sum += v[q];
    __syncthreads();
    int64_t run, total;
    Scan(storage.scan).ExclusiveSum(sum, run, total);
    run += carry;
#pragma unroll
    for (int q = 0; q < kRankScanItems; ++q) {
      const int32_t c = v[q];
      v[q] = static_cast<int32_t>(run);
      run += c;
    }
    __syncthreads();
    Store(storage.store).Store(key_counts + base, v, valid);
    carry += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) counts[blockIdx.x] = carry;
}

// One warp per tile, 32 elements at a time in index order: an element's place is its key's
// offset, plus its tile's start within the key, plus the elements of that key already placed in
// the tile, plus its rank among the lanes of this round holding the same key. Stable by
// construction.
__global__ void RankScatterKernel(const int32_t* __restrict__ raw, int64_t n, const int32_t* __restrict__ key_map,
                                  int map_size, int num_keys, int tiles, const int32_t* __restrict__ tile_starts,
                                  const int64_t* __restrict__ key_offsets, int32_t* __restrict__ position,
                                  int32_t* __restrict__ order, int order_divisor,
                                  const int32_t* __restrict__ key_values, int32_t* __restrict__ values) {
  extern __shared__ int32_t placed[];
  const int lane = threadIdx.x;
  for (int k = lane; k < num_keys; k += 32) placed[k] = 0;
  __syncwarp();
  const int64_t tile_begin = static_cast<int64_t>(blockIdx.x) * kRankTile;
  // Every round's key and start first (their loads in flight together), then the rounds.
  constexpr int kRounds = kRankTile / 32;
  int32_t keys[kRounds], starts[kRounds];
#pragma unroll
  for (int round = 0; round < kRounds; ++round) {
    const int64_t i = tile_begin + round * 32 + lane;
    keys[round] = -1;
    if (i < n) {
      bool bad;
      keys[round] = RankKeyOf(raw, i, key_map, map_size, num_keys, &bad);
    }
  }
#pragma unroll
  for (int round = 0; round < kRounds; ++round) {
    const int32_t key = keys[round];
    starts[round] =
        key < 0 ? 0
                : static_cast<int32_t>(key_offsets[key]) + tile_starts[static_cast<int64_t>(key) * tiles + blockIdx.x];
  }
#pragma unroll
  for (int round = 0; round < kRounds; ++round) {
    const int64_t i = tile_begin + round * 32 + lane;
    const int32_t key = keys[round];
    const unsigned peers = __match_any_sync(0xffffffffu, key);
    if (key >= 0) {
      const int rank = __popc(peers & ((1u << lane) - 1u));
      const int32_t pos = starts[round] + placed[key] + rank;
      position[i] = pos;
      if (order != nullptr) order[pos] = static_cast<int32_t>(i / order_divisor);
      if (values != nullptr) values[pos] = key_values[key];
    } else if (i < n) {
      position[i] = -1;
    }
    __syncwarp();
    if (key >= 0 && lane == __ffs(peers) - 1) placed[key] += __popc(peers);
    __syncwarp();
  }
}

// ---- SwiGLU activation ----------------------------------------------------------------------

__global__ void SwigluActivationKernel(const __nv_bfloat16* __restrict__ h, int64_t rows, int f,
                                       __nv_bfloat16* __restrict__ a) {
  const int64_t total = rows * f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / f;
    const int64_t c = i - r * f;
    const float g = __bfloat162float(h[r * 2 * f + c]);
    const float u = __bfloat162float(h[r * 2 * f + f + c]);
    a[i] = __float2bfloat16_rn(Silu(g) * u);
  }
}

__global__ void SwigluActivationVec8Kernel(const uint4* __restrict__ h, int64_t rows, int f8, uint4* __restrict__ a) {
  // f8 = f / 8: eight BF16 per 16-byte vector.
  const int64_t total = rows * f8;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / f8;
    const int64_t c = i - r * f8;
    const uint4 gv = h[r * 2 * f8 + c];
    const uint4 uv = h[r * 2 * f8 + f8 + c];
    const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&gv);
    const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&uv);
    uint4 out;
    __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 g = __bfloat1622float2(g2[j]);
      const float2 u = __bfloat1622float2(u2[j]);
      o2[j] = __floats2bfloat162_rn(Silu(g.x) * u.x, Silu(g.y) * u.y);
    }
    a[i] = out;
  }
}

// ---- the padded runner of the decode path ------------------------------------------------------
// Expert e's rows sit at [e * C, e * C + count_e) of the padded operands, count_e from the
// device offsets; every padded row is computed by strided-batched GEMMs of fixed shape (so a
// CUDA graph can hold them), and only useful rows reach the output.

__device__ __forceinline__ int64_t SegmentCount(const int64_t* __restrict__ offsets, int e) {
  return offsets[e + 1] - offsets[e];
}

// x_pad[e * C + i] = x[row_index[offsets[e] + i]] (or row offsets[e] + i) for i < count_e; zeros
// past it (padding).
__global__ void GatherPaddedKernel(const uint4* __restrict__ x, const int32_t* __restrict__ row_index,
                                   const int64_t* __restrict__ offsets, int64_t capacity, int64_t total_rows, int d8,
                                   uint4* __restrict__ x_pad) {
  const int64_t total = total_rows * d8;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / d8, v = i - row * d8;
    const int e = static_cast<int>(row / capacity);
    const int64_t slot = row - e * capacity;
    uint4 out = make_uint4(0, 0, 0, 0);
    if (slot < SegmentCount(offsets, e)) {
      const int64_t layout_row = offsets[e] + slot;
      const int64_t src = row_index != nullptr ? row_index[layout_row] : layout_row;
      out = x[src * d8 + v];
    }
    x_pad[i] = out;
  }
}

// a = bf16(silu(gate) * up) of h [C * E, 2f] as SwigluActivationKernel, zero on padding rows (so
// padding never carries what its input rows held, NaN included).
__global__ void SwigluActivationPaddedKernel(const __nv_bfloat16* __restrict__ h, const int64_t* __restrict__ offsets,
                                             int64_t capacity, int64_t total_rows, int f,
                                             __nv_bfloat16* __restrict__ a) {
  const int64_t total = total_rows * f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / f, c = i - r * f;
    const int e = static_cast<int>(r / capacity);
    if (r - e * capacity >= SegmentCount(offsets, e)) {
      a[i] = __float2bfloat16_rn(0.0f);
      continue;
    }
    const float g = __bfloat162float(h[r * 2 * f + c]);
    const float u = __bfloat162float(h[r * 2 * f + f + c]);
    a[i] = __float2bfloat16_rn(Silu(g) * u);
  }
}

// y[r] = y_pad[e * C + (r - offsets[e])] for the useful rows r < offsets[E]; a row past its
// expert's capacity (count_e > C: the caller broke the contract) gets NaN, never a silent zero.
__global__ void ScatterPaddedKernel(const uint4* __restrict__ y_pad, const int64_t* __restrict__ offsets,
                                    int num_experts, int64_t capacity, int64_t rows, int d8, uint4* __restrict__ y) {
  const int64_t used = offsets[num_experts] < rows ? offsets[num_experts] : rows;
  const int64_t total = used * d8;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / d8, v = i - r * d8;
    int lo = 0, hi = num_experts - 1;  // the expert whose segment holds r: offsets[e] <= r < offsets[e + 1]
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (offsets[mid] <= r) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const int64_t slot = r - offsets[lo];
    y[i] = slot < capacity ? y_pad[(lo * capacity + slot) * d8 + v] : make_uint4(~0u, ~0u, ~0u, ~0u);
  }
}

// ---- row checks ------------------------------------------------------------------------------

// The first NaN / infinity (exponent bits all ones) among n BF16 values: each thread scans 8
// values a load (16-byte aligned input) and lowers *first with atomicMin; *first starts at ~0.
__global__ void FindNonFiniteVec8Kernel(const uint4* __restrict__ x, int64_t n8, unsigned long long* first) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n8; i += int64_t{gridDim.x} * blockDim.x) {
    const uint4 v = x[i];
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if ((w[j] & 0x7f80u) == 0x7f80u) {
        atomicMin(first, static_cast<unsigned long long>(i * 8 + 2 * j));
      } else if ((w[j] & 0x7f800000u) == 0x7f800000u) {
        atomicMin(first, static_cast<unsigned long long>(i * 8 + 2 * j + 1));
      }
    }
  }
}

__global__ void FindNonFiniteKernel(const uint16_t* __restrict__ x, int64_t begin, int64_t n,
                                    unsigned long long* first) {
  for (int64_t i = begin + blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    if ((x[i] & 0x7f80u) == 0x7f80u) atomicMin(first, static_cast<unsigned long long>(i));
  }
}

// ---- combine ---------------------------------------------------------------------------------

// A thread per (token, V vectors d8 / V apart): CombineVectors (combine.cuh), K_MAX >= k; V = 1:
// CombineVector, any k (K_MAX routes at a time).
template <int K_MAX, int V>
__global__ void CombineVecsKernel(const uint4* __restrict__ rows, int64_t num_rows, int d8,
                                  const int32_t* __restrict__ row_of_route, const float* __restrict__ gate,
                                  int64_t num_tokens, int k, float* __restrict__ out_fp32,
                                  uint4* __restrict__ out_bf16) {
  WaitForPredecessor();  // the expert rows, routes and gates come from earlier kernels
  ReleaseDependents();
  const int64_t stride = d8 / V;
  const int64_t total = num_tokens * stride;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / stride;
    auto row_at = [&](int32_t row, int64_t c) { return rows[static_cast<int64_t>(row) * d8 + c]; };
    if constexpr (V == 1) {
      CombineVector<K_MAX>(row_at, num_rows, d8, row_of_route, gate, t, i - t * stride, k, out_fp32, out_bf16);
    } else {
      CombineVectors<K_MAX, V>(row_at, num_rows, d8, row_of_route, gate, t, i - t * stride, stride, k, out_fp32,
                               out_bf16);
    }
  }
}

__global__ void CombineKernel(const __nv_bfloat16* __restrict__ rows, int64_t num_rows, int d,
                              const int32_t* __restrict__ row_of_route, const float* __restrict__ gate,
                              int64_t num_tokens, int k, float* __restrict__ out_fp32,
                              __nv_bfloat16* __restrict__ out_bf16) {
  WaitForPredecessor();  // the expert rows, routes and gates come from earlier kernels
  ReleaseDependents();
  const int64_t total = num_tokens * d;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / d;
    const int64_t c = i - t * d;
    float acc = 0;
    for (int j = 0; j < k; ++j) {
      const int32_t row = row_of_route[t * k + j];
      if (row < 0 || row >= num_rows) continue;
      acc += gate[t * k + j] * __bfloat162float(rows[row * d + c]);
    }
    if (out_fp32 != nullptr) out_fp32[i] = acc;
    if (out_bf16 != nullptr) out_bf16[i] = __float2bfloat16_rn(acc);
  }
}

// ---- FP8 -------------------------------------------------------------------------------------

struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// The block's amax (each thread's `amax` reduced), its scale stored at *scale by thread 0, and the
// inverse scale every thread of the block multiplies by (GroupScales).
__device__ __forceinline__ float BlockInverseScale(float amax, float* scale) {
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  __shared__ float inv_shared;
  amax = Reduce(storage).Reduce(amax, MaxOp());
  if (threadIdx.x == 0) {
    float s, inv;
    GroupScales(amax, &s, &inv);
    *scale = s;
    inv_shared = inv;
  }
  __syncthreads();
  return inv_shared;
}

__device__ __forceinline__ __nv_fp8_storage_t QuantizeValue(__nv_bfloat16 x, float inv) {
  return __nv_cvt_float_to_fp8(__fmul_rn(__bfloat162float(x), inv), __NV_SATFINITE, __NV_E4M3);
}

// One block per (row, group): block-wide amax, then quantize the group.
__global__ void QuantizeFp8Kernel(const __nv_bfloat16* __restrict__ x, int d, int group, int groups_per_row,
                                  __nv_fp8_storage_t* __restrict__ q, float* __restrict__ scales) {
  const int64_t row = blockIdx.x / groups_per_row;
  const int g = blockIdx.x % groups_per_row;
  const int begin = g * group;
  const int end = min(d, begin + group);
  float amax = 0;
  for (int c = begin + threadIdx.x; c < end; c += blockDim.x)
    amax = fmaxf(amax, fabsf(__bfloat162float(x[row * d + c])));
  const float inv = BlockInverseScale(amax, &scales[blockIdx.x]);
  for (int c = begin + threadIdx.x; c < end; c += blockDim.x) q[row * d + c] = QuantizeValue(x[row * d + c], inv);
}

// One block per 128 x 128 weight block (Quantize's kBlock128x128): the block's amax, then its
// values, each thread over whole 128-byte rows' worth of columns.
__global__ void QuantizeFp8BlockKernel(const __nv_bfloat16* __restrict__ x, int64_t rows, int d, int block_cols,
                                       __nv_fp8_storage_t* __restrict__ q, float* __restrict__ scales) {
  const int64_t r0 = static_cast<int64_t>(blockIdx.x / block_cols) * 128;
  const int c0 = static_cast<int>(blockIdx.x % block_cols) * 128;
  const int n_rows = static_cast<int>(rows - r0 < 128 ? rows - r0 : 128), n_cols = min(128, d - c0);
  float amax = 0;
  for (int i = threadIdx.x; i < n_rows * 128; i += blockDim.x) {
    const int r = i / 128, c = i % 128;
    if (c < n_cols) amax = fmaxf(amax, fabsf(__bfloat162float(x[(r0 + r) * d + c0 + c])));
  }
  const float inv = BlockInverseScale(amax, &scales[blockIdx.x]);
  for (int i = threadIdx.x; i < n_rows * 128; i += blockDim.x) {
    const int r = i / 128, c = i % 128;
    if (c < n_cols) q[(r0 + r) * d + c0 + c] = QuantizeValue(x[(r0 + r) * d + c0 + c], inv);
  }
}

__global__ void DequantizeFp8Kernel(const __nv_fp8_storage_t* __restrict__ q, const float* __restrict__ scales,
                                    int64_t rows, int d, int group, int groups_per_row, int block_rows,
                                    __nv_bfloat16* __restrict__ x) {
  const int64_t total = rows * d;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / d;
    const int c = static_cast<int>(i - r * d);
    const __half_raw hr = __nv_cvt_fp8_to_halfraw(q[i], __NV_E4M3);
    const float v = __half2float(__half(hr));
    x[i] = __float2bfloat16_rn(v * scales[(r / block_rows) * groups_per_row + c / group]);
  }
}

// Sixteen values times `inv` in E4M3 (round to nearest even, saturating), in order.
__device__ __forceinline__ uint4 Fp8Bytes16(const float (&v)[16], float inv) {
  uint4 out;
  uint32_t* o = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    o[i] = Fp8Pair(v[4 * i], v[4 * i + 1], inv) | static_cast<uint32_t>(Fp8Pair(v[4 * i + 2], v[4 * i + 3], inv)) << 16;
  }
  return out;
}

// Per-128 groups of a row-major [rows, d] payload with d % 128 == 0 are contiguous: group g is
// values [128 g, 128 g + 128) and owns scale g. Eight lanes a group, four groups a warp at a
// time: two 16-byte loads and one 16-byte store a lane, the amax in three shuffles, one multiply
// a value (a warp a group with four values a lane and a division a value kept the issue slots
// 75% busy at 2.3 TB/s: bound by instructions, not memory).
// scales_rows_ld > 0: the scales column-major ([groups_per_row, scales_rows_ld]).
__global__ void QuantizeFp8Group128Kernel(const __nv_bfloat16* __restrict__ x, int64_t groups,
                                          __nv_fp8_storage_t* __restrict__ q, float* __restrict__ scales,
                                          int groups_per_row, int64_t scales_rows_ld) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t w = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) >> 5; w * 4 < groups; w += warps) {
    const int64_t g = w * 4 + (lane >> 3);
    const int part = lane & 7;  // values [16 part, 16 part + 16) of the group
    const bool live = g < groups;
    uint4 raw[2] = {};
    if (live) {
      const uint4* src = reinterpret_cast<const uint4*>(x + g * 128 + part * 16);
      raw[0] = src[0];
      raw[1] = src[1];
    }
    float v[16];
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const __nv_bfloat162 pair = reinterpret_cast<const __nv_bfloat162*>(raw)[i];
      v[2 * i] = __low2float(pair);
      v[2 * i + 1] = __high2float(pair);
      amax = fmaxf(amax, fmaxf(fabsf(v[2 * i]), fabsf(v[2 * i + 1])));
    }
    // The group's eight lanes (every lane takes part: a dead group's lanes hold zeros).
    for (int o = 4; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    float scale, inv;
    GroupScales(amax, &scale, &inv);
    if (!live) continue;
    if (part == 0) {
      scales[scales_rows_ld > 0 ? (g % groups_per_row) * scales_rows_ld + g / groups_per_row : g] = scale;
    }
    *reinterpret_cast<uint4*>(q + g * 128 + part * 16) = Fp8Bytes16(v, inv);
  }
}

// PackFp8Rows (kernels/api.h): QuantizeFp8Group128Kernel's groups (eight lanes a group, four
// groups a warp), each group's 128 bytes and scale written into the packed rows of its token's k
// routes, the last group's lanes also zeroing the rows' padding. x needs only 2-byte alignment
// (kAligned: 16-byte loads); out rows are 16-byte aligned (ld a multiple of 16).
template <bool kAligned>
__global__ void PackFp8Kernel(const __nv_bfloat16* __restrict__ x, int64_t groups, int groups_per_row,
                              const int32_t* __restrict__ dest, int k, int64_t out_rows, int64_t ld,
                              uint8_t* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const int d = groups_per_row * 128;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t w = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) >> 5; w * 4 < groups; w += warps) {
    const int64_t g = w * 4 + (lane >> 3);
    const int part = lane & 7;
    const bool live = g < groups;
    float v[16];
    float amax = 0.0f;
    if (kAligned) {
      uint4 raw[2] = {};
      if (live) {
        const uint4* src = reinterpret_cast<const uint4*>(x + g * 128 + part * 16);
        raw[0] = src[0];
        raw[1] = src[1];
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const __nv_bfloat162 pair = reinterpret_cast<const __nv_bfloat162*>(raw)[i];
        v[2 * i] = __low2float(pair);
        v[2 * i + 1] = __high2float(pair);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] = live ? __bfloat162float(x[g * 128 + part * 16 + i]) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(v[i]));
    for (int o = 4; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    float scale, inv;
    GroupScales(amax, &scale, &inv);
    if (!live) continue;
    const uint4 bytes = Fp8Bytes16(v, inv);
    const int64_t token = g / groups_per_row;
    const int gc = static_cast<int>(g - token * groups_per_row);
    for (int j = 0; j < k; ++j) {
      const int32_t to = __ldg(dest + token * k + j);
      if (to < 0 || to >= out_rows) continue;
      uint8_t* row = out + static_cast<int64_t>(to) * ld;
      *reinterpret_cast<uint4*>(row + gc * 128 + part * 16) = bytes;
      if (part == 0) *reinterpret_cast<float*>(row + d + 4 * gc) = scale;
      if (part == 1 && gc == groups_per_row - 1) {
        for (int64_t b = d + 4 * static_cast<int64_t>(groups_per_row); b < ld; b += 4) {
          *reinterpret_cast<uint32_t*>(row + b) = 0u;
        }
      }
    }
  }
}

// Eight values a thread (d and the group a multiple of 8, so they share one scale): one 8-byte
// load, pairwise FP8 -> half conversion, one 16-byte store.
__global__ void DequantizeFp8Vec8Kernel(const __nv_fp8_storage_t* __restrict__ q, const float* __restrict__ scales,
                                        int64_t vecs, int d, int group, int groups_per_row, int block_rows,
                                        __nv_bfloat16* __restrict__ x) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < vecs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = i * 8;
    const int64_t r = e / d;
    const int c = static_cast<int>(e - r * d);
    const float scale = scales[(r / block_rows) * groups_per_row + c / group];
    const uint2 raw = reinterpret_cast<const uint2*>(q)[i];
    const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&raw);
    uint4 out;
    uint32_t* o = reinterpret_cast<uint32_t*>(&out);
    for (int k = 0; k < 4; ++k) {
      const __half2 h(__nv_cvt_fp8x2_to_halfraw2(pairs[k], __NV_E4M3));
      const float2 f = __half22float2(h);
      const __nv_bfloat162 b = __floats2bfloat162_rn(f.x * scale, f.y * scale);
      o[k] = *reinterpret_cast<const uint32_t*>(&b);
    }
    reinterpret_cast<uint4*>(x)[i] = out;
  }
}

// ---- local-layer row assignment -------------------------------------------------------------

// Larger steps in two launches (RouteRowsScratchBytes): each block counts its chunk of routes per
// expert in shared memory and stores the counts; the last block to finish (a ticket) turns
// them into each chunk's start within each expert's segment, scans the experts' totals into
// counts and offsets, and returns the ticket to zero. Then each block places its chunk's routes
// from those starts (shared-memory cursors: one global write a route, no global atomics). Rows
// inside a segment are grouped by chunk, in atomic order within one.
constexpr int kRouteThreads = 512;
constexpr int kRouteChunk = kRouteThreads * 4;  // routes a block

__global__ void __launch_bounds__(kRouteThreads)
    RouteCountKernel(const int32_t* __restrict__ topk, int n, int num_experts, int32_t* __restrict__ chunk_counts,
                     unsigned int* __restrict__ ticket, int64_t* __restrict__ counts, int64_t* __restrict__ offsets) {
  __shared__ typename cub::BlockScan<int, kRouteThreads>::TempStorage storage;
  __shared__ bool last;
  extern __shared__ int hist[];  // [E]
  for (int e = threadIdx.x; e < num_experts; e += kRouteThreads) hist[e] = 0;
  __syncthreads();
  const int begin = blockIdx.x * kRouteChunk, end = min(n, begin + kRouteChunk);
  for (int i = begin + threadIdx.x; i < end; i += kRouteThreads) {
    const int32_t e = topk[i];
    if (e >= 0 && e < num_experts) atomicAdd(&hist[e], 1);
  }
  __syncthreads();
  int32_t* mine = chunk_counts + static_cast<int64_t>(blockIdx.x) * num_experts;
  for (int e = threadIdx.x; e < num_experts; e += kRouteThreads) mine[e] = hist[e];
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  // Every chunk has counted: each chunk's start within each expert, and the experts' totals.
  for (int e = threadIdx.x; e < num_experts; e += kRouteThreads) {
    int run = 0;
    for (int c = 0; c < gridDim.x; ++c) {
      int32_t* p = chunk_counts + static_cast<int64_t>(c) * num_experts + e;
      const int v = __ldcg(p);
      *p = run;
      run += v;
    }
    hist[e] = run;
  }
  __syncthreads();
  const int total = ChunkedExclusiveSum<kRouteThreads, int>(
      storage, num_experts, [&](int e) { return hist[e]; },
      [&](int e, int v, int excl) {
        counts[e] = v;
        offsets[e] = excl;
      });
  if (threadIdx.x == 0) {
    offsets[num_experts] = total;
    *ticket = 0;  // every block has taken its ticket: the next launch starts from zero
  }
}

__global__ void __launch_bounds__(kRouteThreads)
    RouteAssignKernel(const int32_t* __restrict__ topk, int n, int k, int num_experts,
                      const int32_t* __restrict__ chunk_starts, const int64_t* __restrict__ offsets,
                      int32_t* __restrict__ row_of_route, int32_t* __restrict__ token_of_row) {
  extern __shared__ int cursor[];  // [E]
  const int32_t* mine = chunk_starts + static_cast<int64_t>(blockIdx.x) * num_experts;
  for (int e = threadIdx.x; e < num_experts; e += kRouteThreads) cursor[e] = static_cast<int>(offsets[e]) + mine[e];
  __syncthreads();
  const int begin = blockIdx.x * kRouteChunk, end = min(n, begin + kRouteChunk);
  for (int i = begin + threadIdx.x; i < end; i += kRouteThreads) {
    const int32_t e = topk[i];
    if (e < 0 || e >= num_experts) {
      row_of_route[i] = -1;
      continue;
    }
    const int row = atomicAdd(&cursor[e], 1);
    row_of_route[i] = row;
    token_of_row[row] = i / k;
  }
}

// One block does the whole step for small inputs: histogram in shared memory, scan, row
// assignment (one launch instead of four). Each thread keeps its (at most two) routes in
// registers between the histogram and the assignment.
constexpr int kRoutesPerThread = 2;
template <int THREADS>
__global__ void __launch_bounds__(THREADS)
    RouteRowsSmallKernel(const int32_t* __restrict__ topk, int64_t num_tokens, int k, int num_experts,
                         int64_t* __restrict__ counts, int64_t* __restrict__ offsets,
                         int32_t* __restrict__ row_of_route, int32_t* __restrict__ token_of_row) {
  __shared__ typename cub::BlockScan<int, THREADS>::TempStorage storage;
  extern __shared__ int shared[];
  int* count = shared;               // [E], then the cursor
  int* base = shared + num_experts;  // [E] exclusive offsets
  const int n = static_cast<int>(num_tokens * k);
  WaitForPredecessor();
  ReleaseDependents();
  int32_t mine[kRoutesPerThread];
#pragma unroll
  for (int q = 0; q < kRoutesPerThread; ++q) {
    const int i = threadIdx.x + q * THREADS;
    const int32_t e = i < n ? topk[i] : -1;
    mine[q] = e >= 0 && e < num_experts ? e : -1;
  }
  for (int b = threadIdx.x; b < num_experts; b += THREADS) count[b] = 0;
  __syncthreads();
#pragma unroll
  for (int q = 0; q < kRoutesPerThread; ++q) {
    if (mine[q] >= 0) atomicAdd(&count[mine[q]], 1);
  }
  __syncthreads();
  const int total = ChunkedExclusiveSum<THREADS, int>(
      storage, num_experts, [&](int b) { return count[b]; },
      [&](int b, int v, int excl) {
        base[b] = excl;
        counts[b] = v;
        offsets[b] = excl;
      });
  if (threadIdx.x == 0) offsets[num_experts] = total;
  for (int b = threadIdx.x; b < num_experts; b += THREADS) count[b] = 0;  // reuse as cursor
  __syncthreads();
#pragma unroll
  for (int q = 0; q < kRoutesPerThread; ++q) {
    const int i = threadIdx.x + q * THREADS;
    if (i >= n) continue;
    if (mine[q] < 0) {
      row_of_route[i] = -1;
      continue;
    }
    const int32_t row = base[mine[q]] + atomicAdd(&count[mine[q]], 1);
    row_of_route[i] = row;
    token_of_row[row] = i / k;
  }
}

}  // namespace

bool RouteRowsSmall(int64_t routes, int num_experts) {
  // One block: fine for decode-sized steps; beyond that the multi-block path parallelizes.
  return routes <= 1024 * kRoutesPerThread && static_cast<size_t>(num_experts) * 2 * sizeof(int) <= 40 * 1024;
}

cudaError_t LaunchRouteRowsSmall(const int32_t* topk, int64_t num_tokens, int k, int num_experts, int64_t* counts,
                                 int64_t* offsets, int32_t* row_of_route, int32_t* token_of_row, cudaStream_t stream) {
  // A small block for decode steps (fewer warps in the scan and the barriers), 1024 threads up
  // to the single-block limit. A programmatic dependent of the work before it (a lone decode
  // step's SealRoutes), as the expert kernels after it are of it.
  const size_t smem = static_cast<size_t>(num_experts) * 2 * sizeof(int);
  if (num_tokens * k <= 256 * kRoutesPerThread) {
    return LaunchDependent(RouteRowsSmallKernel<256>, dim3(1), dim3(256), smem, stream, topk, num_tokens, k,
                           num_experts, counts, offsets, row_of_route, token_of_row);
  }
  return LaunchDependent(RouteRowsSmallKernel<1024>, dim3(1), dim3(1024), smem, stream, topk, num_tokens, k,
                         num_experts, counts, offsets, row_of_route, token_of_row);
}

int64_t RouteRowsScratchBytes(int64_t routes, int num_experts) {
  const int64_t chunks = std::max<int64_t>(1, (routes + kRouteChunk - 1) / kRouteChunk);
  return 16 + chunks * num_experts * static_cast<int64_t>(sizeof(int32_t));
}

cudaError_t LaunchRouteRows(const int32_t* topk, int64_t num_tokens, int k, int num_experts, int64_t* counts,
                            int64_t* offsets, int32_t* row_of_route, int32_t* token_of_row, void* scratch,
                            cudaStream_t stream) {
  const int64_t n = num_tokens * k;
  if (num_experts <= 0 || num_experts > kMaxRankKeys || n <= 0 || n > INT32_MAX) return cudaErrorInvalidValue;
  const int chunks = static_cast<int>((n + kRouteChunk - 1) / kRouteChunk);
  const size_t shmem = static_cast<size_t>(num_experts) * sizeof(int);
  if (shmem > 32 * 1024) {
    // Up to 48 KiB of counts beside the scan's static storage: past the default 48 KiB a block.
    for (const void* f :
         {reinterpret_cast<const void*>(RouteCountKernel), reinterpret_cast<const void*>(RouteAssignKernel)}) {
      const cudaError_t e =
          cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shmem));
      if (e != cudaSuccess) return e;
    }
  }
  auto* ticket = static_cast<unsigned int*>(scratch);
  auto* chunk_counts = reinterpret_cast<int32_t*>(static_cast<char*>(scratch) + 16);
  RouteCountKernel<<<chunks, kRouteThreads, shmem, stream>>>(topk, static_cast<int>(n), num_experts, chunk_counts,
                                                             ticket, counts, offsets);
  RouteAssignKernel<<<chunks, kRouteThreads, shmem, stream>>>(topk, static_cast<int>(n), k, num_experts, chunk_counts,
                                                              offsets, row_of_route, token_of_row);
  return cudaGetLastError();
}

cudaError_t LaunchGatherRows(const void* in, int64_t in_rows, const int32_t* index, int64_t n, int64_t row_bytes,
                             void* out, uint16_t fill_bf16, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0) {
    const uint32_t f = static_cast<uint32_t>(fill_bf16) | (static_cast<uint32_t>(fill_bf16) << 16);
    const int64_t vecs = row_bytes / 16;
    GatherRowsVec16Kernel<<<Blocks(n, kGatherWarps), kThreads, 0, stream>>>(
        static_cast<const uint4*>(in), in_rows, index, n, vecs, static_cast<uint4*>(out), make_uint4(f, f, f, f));
  } else if (row_bytes % 2 == 0) {
    const int64_t vecs = row_bytes / 2;
    GatherRowsKernel<uint16_t><<<Blocks(n * vecs), kThreads, 0, stream>>>(
        static_cast<const uint16_t*>(in), in_rows, index, n, vecs, static_cast<uint16_t*>(out), fill_bf16);
  } else {
    GatherRowsKernel<uint8_t>
        <<<Blocks(n * row_bytes), kThreads, 0, stream>>>(static_cast<const uint8_t*>(in), in_rows, index, n, row_bytes,
                                                         static_cast<uint8_t*>(out), static_cast<uint8_t>(fill_bf16));
  }
  return cudaGetLastError();
}

cudaError_t LaunchScatterRows(const uint16_t* in, int64_t in_rows, int d, int64_t out_ld, const int32_t* dest,
                              int fanout, int64_t out_rows, uint16_t* out, cudaStream_t stream) {
  if (in_rows == 0 || out_rows == 0) return cudaSuccess;
  if (out_ld <= 0) out_ld = d;
  if (d % 8 == 0 && out_ld % 8 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(out) % 16 == 0) {
    ScatterRowsVec16Kernel<<<Blocks(in_rows, kGatherWarps), kThreads, 0, stream>>>(
        reinterpret_cast<const uint4*>(in), in_rows, d / 8, out_ld / 8, dest, fanout, out_rows,
        reinterpret_cast<uint4*>(out));
  } else {
    ScatterRowsKernel<<<Blocks(in_rows * d), kThreads, 0, stream>>>(in, in_rows, d, out_ld, dest, fanout, out_rows,
                                                                    out);
  }
  return cudaGetLastError();
}

cudaError_t LaunchGatherScales(const float* in, int64_t in_rows, const int32_t* index, int64_t n, int64_t per_row,
                               float* out, cudaStream_t stream) {
  if (n == 0 || per_row == 0) return cudaSuccess;
  GatherScalesKernel<<<Blocks(n * per_row), kThreads, 0, stream>>>(in, in_rows, index, n, per_row, out);
  return cudaGetLastError();
}

cudaError_t LaunchHistogramScan(const int32_t* keys, int64_t n, int num_bins, int64_t* counts, int64_t* offsets,
                                cudaStream_t stream) {
  ZeroKernel<<<Blocks(num_bins), kThreads, 0, stream>>>(counts, num_bins);
  if (n > 0) {
    const size_t shmem = static_cast<size_t>(num_bins) * sizeof(unsigned int);
    if (shmem > 48 * 1024) return cudaErrorInvalidValue;
    HistogramKernel<<<Blocks(n, kThreads * 8), kThreads, shmem, stream>>>(
        keys, n, num_bins, reinterpret_cast<unsigned long long*>(counts));
  }
  ExclusiveScanKernel<<<1, kThreads, 0, stream>>>(counts, num_bins, offsets);
  return cudaGetLastError();
}

cudaError_t LaunchSealRoutes(const int32_t* ids, const float* gates, const uint8_t* admitted, int64_t routes,
                             int num_experts, const int32_t* key_of_expert, int32_t* keys, float* gates_out,
                             const int32_t* local_of_key, int num_keys, int32_t* local, int64_t* status,
                             cudaStream_t stream) {
  auto* st = reinterpret_cast<unsigned long long*>(status);
  constexpr int kOneBlockRoutes = 1024;  // a decode step's routes (128 tokens of k = 8)
  if (routes <= kOneBlockRoutes) {       // no reset first: one launch
    const int threads = routes <= kThreads ? kThreads : kOneBlockRoutes;
    SealRoutesKernel<true><<<1, threads, 0, stream>>>(ids, gates, admitted, routes, num_experts, key_of_expert, keys,
                                                      gates_out, local_of_key, num_keys, local, st);
    return cudaGetLastError();
  }
  cudaError_t e = cudaMemsetAsync(status, 0xff, 2 * sizeof(int64_t), stream);  // -1: none yet
  if (e != cudaSuccess) return e;
  SealRoutesKernel<false><<<Blocks(routes), kThreads, 0, stream>>>(
      ids, gates, admitted, routes, num_experts, key_of_expert, keys, gates_out, local_of_key, num_keys, local, st);
  return cudaGetLastError();
}

cudaError_t LaunchComposeIndex(const int32_t* a, int64_t a_n, const int32_t* b, int64_t n, int32_t* out,
                               cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  ComposeIndexKernel<<<Blocks(n), kThreads, 0, stream>>>(a, a_n, b, n, out);
  return cudaGetLastError();
}

int64_t RankByKeyScratchBytes(int64_t n, int num_keys) {
  const int64_t tiles = std::max<int64_t>(1, (n + kRankTile - 1) / kRankTile);
  return tiles * num_keys * static_cast<int64_t>(sizeof(int32_t));
}

cudaError_t LaunchRankByKey(const int32_t* raw, int64_t n, const int32_t* key_map, int map_size, int num_keys,
                            int32_t* position, int32_t* order, int order_divisor, const int32_t* key_values,
                            int32_t* values, int64_t* counts, int64_t* offsets, int64_t* status, int32_t* scratch,
                            cudaStream_t stream) {
  if (num_keys <= 0 || num_keys > kMaxRankKeys) return cudaErrorInvalidValue;
  cudaError_t e = cudaMemsetAsync(status, 0xff, sizeof(int64_t), stream);
  if (e != cudaSuccess) return e;
  const int tiles = static_cast<int>(std::max<int64_t>(1, (n + kRankTile - 1) / kRankTile));
  const size_t shmem = static_cast<size_t>(num_keys) * sizeof(int32_t);
  if (n == 0) {
    e = cudaMemsetAsync(scratch, 0, static_cast<size_t>(num_keys) * sizeof(int32_t), stream);
    if (e != cudaSuccess) return e;
  } else {
    RankCountKernel<<<tiles, kRankTile, shmem, stream>>>(raw, n, key_map, map_size, num_keys, tiles, scratch,
                                                         reinterpret_cast<unsigned long long*>(status));
  }
  RankScanKernel<<<num_keys, kRankScanThreads, 0, stream>>>(scratch, tiles, counts);
  ExclusiveScanKernel<<<1, kThreads, 0, stream>>>(counts, num_keys, offsets);
  if (n > 0) {
    RankScatterKernel<<<tiles, 32, shmem, stream>>>(raw, n, key_map, map_size, num_keys, tiles, scratch, offsets,
                                                    position, order, order_divisor, key_values, values);
  }
  return cudaGetLastError();
}

cudaError_t LaunchGatherPadded(const uint16_t* x, const int32_t* row_index, const int64_t* offsets, int num_experts,
                               int64_t capacity, int d, uint16_t* x_pad, cudaStream_t stream) {
  const int64_t rows = num_experts * capacity;
  if (rows == 0) return cudaSuccess;
  GatherPaddedKernel<<<Blocks(rows * (d / 8)), kThreads, 0, stream>>>(
      reinterpret_cast<const uint4*>(x), row_index, offsets, capacity, rows, d / 8, reinterpret_cast<uint4*>(x_pad));
  return cudaGetLastError();
}

cudaError_t LaunchSwigluActivationPadded(const uint16_t* h, const int64_t* offsets, int num_experts, int64_t capacity,
                                         int f, uint16_t* a, cudaStream_t stream) {
  const int64_t rows = num_experts * capacity;
  if (rows == 0) return cudaSuccess;
  SwigluActivationPaddedKernel<<<Blocks(rows * f), kThreads, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(h), offsets, capacity, rows, f, reinterpret_cast<__nv_bfloat16*>(a));
  return cudaGetLastError();
}

cudaError_t LaunchScatterPadded(const uint16_t* y_pad, const int64_t* offsets, int num_experts, int64_t capacity, int d,
                                int64_t rows, uint16_t* y, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  ScatterPaddedKernel<<<Blocks(rows * (d / 8)), kThreads, 0, stream>>>(
      reinterpret_cast<const uint4*>(y_pad), offsets, num_experts, capacity, rows, d / 8, reinterpret_cast<uint4*>(y));
  return cudaGetLastError();
}

cudaError_t LaunchSwigluActivation(const uint16_t* h, int64_t rows, int f, uint16_t* a, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (f % 8 == 0 && reinterpret_cast<uintptr_t>(h) % 16 == 0 && reinterpret_cast<uintptr_t>(a) % 16 == 0) {
    SwigluActivationVec8Kernel<<<Blocks(rows * f / 8), kThreads, 0, stream>>>(reinterpret_cast<const uint4*>(h), rows,
                                                                              f / 8, reinterpret_cast<uint4*>(a));
  } else {
    SwigluActivationKernel<<<Blocks(rows * f), kThreads, 0, stream>>>(reinterpret_cast<const __nv_bfloat16*>(h), rows,
                                                                      f, reinterpret_cast<__nv_bfloat16*>(a));
  }
  return cudaGetLastError();
}

cudaError_t LaunchFindNonFiniteBf16(const uint16_t* x, int64_t n, unsigned long long* first, cudaStream_t stream) {
  cudaError_t e = cudaMemsetAsync(first, 0xff, sizeof(unsigned long long), stream);
  if (e != cudaSuccess || n == 0) return e;
  constexpr int kMaxBlocks = 1024;  // a grid-stride loop: enough blocks to fill the GPU
  int64_t vec = 0;
  if (reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    vec = n / 8 * 8;
    if (vec > 0) {
      FindNonFiniteVec8Kernel<<<std::min(Blocks(vec / 8), kMaxBlocks), kThreads, 0, stream>>>(
          reinterpret_cast<const uint4*>(x), vec / 8, first);
    }
  }
  if (vec < n) {
    FindNonFiniteKernel<<<std::min(Blocks(n - vec), kMaxBlocks), kThreads, 0, stream>>>(x, vec, n, first);
  }
  return cudaGetLastError();
}

// Bytes copied by the GPU's threads (to host memory mapped into the device's address space): in
// recorded work a kernel node, which costs the launch less than a copy node (bench/gpu/graph_launch.cu).
template <typename T>
__global__ void CopyKernel(const T* __restrict__ src, T* __restrict__ dst, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = src[i];
  }
}

template <typename T>
cudaError_t LaunchCopy(const void* src, void* dst, int64_t n, cudaStream_t stream) {
  constexpr int kMaxBlocks = 64;  // small copies (a step's read-back): a few blocks
  CopyKernel<T>
      <<<std::min(Blocks(n), kMaxBlocks), kThreads, 0, stream>>>(static_cast<const T*>(src), static_cast<T*>(dst), n);
  return cudaGetLastError();
}

cudaError_t LaunchCopyBytes(void* dst, const void* src, int64_t bytes, cudaStream_t stream) {
  if (bytes <= 0) return cudaSuccess;
  if (reinterpret_cast<uintptr_t>(dst) % 4 == 0 && reinterpret_cast<uintptr_t>(src) % 4 == 0 && bytes % 4 == 0) {
    return LaunchCopy<uint32_t>(src, dst, bytes / 4, stream);  // as 4-byte words
  }
  return LaunchCopy<uint8_t>(src, dst, bytes, stream);
}

cudaError_t LaunchCombine(const uint16_t* rows, int64_t num_rows, int d, const int32_t* row_of_route, const float* gate,
                          int64_t num_tokens, int k, float* out_fp32, uint16_t* out_bf16, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  if (d % 8 == 0 && reinterpret_cast<uintptr_t>(rows) % 16 == 0 && reinterpret_cast<uintptr_t>(out_bf16) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(out_fp32) % 16 == 0) {
    // About eight expert-row loads in flight a thread: k = 2 combines four vectors of a token a
    // thread. One H200, E8 k2 d4096 T=8192: see bench/RESULTS.md.
    const int d8 = d / 8;
    const auto* in = reinterpret_cast<const uint4*>(rows);
    auto* out = reinterpret_cast<uint4*>(out_bf16);
    auto launch = [&](auto kernel, int v) {
      return LaunchDependent(kernel, dim3(Blocks(num_tokens * (d8 / v))), dim3(kThreads), 0, stream, in, num_rows, d8,
                             row_of_route, gate, num_tokens, k, out_fp32, out);
    };
    if (k == 1 && d8 % 8 == 0) return launch(CombineVecsKernel<1, 8>, 8);
    if (k <= 2 && d8 % 4 == 0) return launch(CombineVecsKernel<2, 4>, 4);
    if (k <= 4 && d8 % 2 == 0) return launch(CombineVecsKernel<4, 2>, 2);
    return launch(CombineVecsKernel<8, 1>, 1);
  }
  return LaunchDependent(CombineKernel, dim3(Blocks(num_tokens * d)), dim3(kThreads), 0, stream,
                         reinterpret_cast<const __nv_bfloat16*>(rows), num_rows, d, row_of_route, gate, num_tokens, k,
                         out_fp32, reinterpret_cast<__nv_bfloat16*>(out_bf16));
}

cudaError_t LaunchPackFp8(const uint16_t* x, int64_t tokens, int d, const int32_t* dest, int k, int64_t out_rows,
                          uint8_t* out, cudaStream_t stream) {
  if (tokens == 0 || out_rows == 0) return cudaSuccess;
  if (d % 128 != 0 || reinterpret_cast<uintptr_t>(out) % 16 != 0) return cudaErrorInvalidValue;
  const int groups_per_row = d / 128;
  const int64_t groups = tokens * groups_per_row;
  const int64_t ld = (static_cast<int64_t>(d) + 4 * groups_per_row + 15) / 16 * 16;
  const auto* xb = reinterpret_cast<const __nv_bfloat16*>(x);
  const unsigned blocks = Blocks((groups + 3) / 4 * 32);
  if (reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    PackFp8Kernel<true><<<blocks, kThreads, 0, stream>>>(xb, groups, groups_per_row, dest, k, out_rows, ld, out);
  } else {
    PackFp8Kernel<false><<<blocks, kThreads, 0, stream>>>(xb, groups, groups_per_row, dest, k, out_rows, ld, out);
  }
  return cudaGetLastError();
}

// kWidth groups a thread, in the output's order: one, or four (one 16-byte load of a row, where
// rows start on 16-byte boundaries and the groups come in fours); the column stores coalesced
// either way, a warp's loads 32 rows' scales of its groups (each sector of a row read again by
// the next groups' warps, from L1/L2). `units`, `ld` in loads (kWidth floats).
template <int kWidth>
__global__ void TransposeScalesKernel(const float* __restrict__ in, int64_t rows, int units, int64_t ld,
                                      float* __restrict__ out, int64_t out_ld) {
  const int64_t n = rows * units;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t u = i / rows, r = i - u * rows;
    float* col = out + kWidth * u * out_ld + r;
    if constexpr (kWidth == 4) {
      const float4 v = reinterpret_cast<const float4*>(in)[r * ld + u];
      col[0] = v.x;
      col[out_ld] = v.y;
      col[2 * out_ld] = v.z;
      col[3 * out_ld] = v.w;
    } else {
      static_assert(kWidth == 1, "one or four groups a thread");
      col[0] = in[r * ld + u];
    }
  }
}

cudaError_t LaunchTransposeScales(const float* in, int64_t rows, int groups, int64_t ld, float* out, int64_t out_ld,
                                  cudaStream_t stream) {
  if (rows <= 0 || groups <= 0) return cudaSuccess;
  if (ld < groups || out_ld < rows) return cudaErrorInvalidValue;
  if (groups % 4 == 0 && ld % 4 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0) {
    TransposeScalesKernel<4>
        <<<Blocks(rows * (groups / 4)), kThreads, 0, stream>>>(in, rows, groups / 4, ld / 4, out, out_ld);
  } else {
    TransposeScalesKernel<1><<<Blocks(rows * groups), kThreads, 0, stream>>>(in, rows, groups, ld, out, out_ld);
  }
  return cudaGetLastError();
}

cudaError_t LaunchQuantizeFp8(const uint16_t* x, int64_t rows, int d, int group, uint8_t* q, float* scales,
                              cudaStream_t stream, int block_rows, int64_t scales_rows_ld) {
  if (rows == 0) return cudaSuccess;
  const int groups_per_row = (d + group - 1) / group;
  const bool group128 = group == 128 && d % 128 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                        reinterpret_cast<uintptr_t>(q) % 16 == 0;
  if (scales_rows_ld != 0 && (block_rows != 1 || !group128 || scales_rows_ld < rows)) return cudaErrorInvalidValue;
  if (block_rows != 1) {
    if (block_rows != 128 || group != 128) return cudaErrorInvalidValue;
    const int64_t blocks = (rows + 127) / 128 * groups_per_row;
    if (blocks >= (int64_t{1} << 31)) return cudaErrorInvalidValue;
    QuantizeFp8BlockKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        reinterpret_cast<const __nv_bfloat16*>(x), rows, d, groups_per_row, reinterpret_cast<__nv_fp8_storage_t*>(q),
        scales);
    return cudaGetLastError();
  }
  if (group128) {
    const int64_t groups = rows * groups_per_row;
    QuantizeFp8Group128Kernel<<<Blocks((groups + 3) / 4 * 32), kThreads, 0, stream>>>(
        reinterpret_cast<const __nv_bfloat16*>(x), groups, reinterpret_cast<__nv_fp8_storage_t*>(q), scales,
        groups_per_row, scales_rows_ld);
    return cudaGetLastError();
  }
  QuantizeFp8Kernel<<<static_cast<unsigned>(rows * groups_per_row), kThreads, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(x), d, group, groups_per_row, reinterpret_cast<__nv_fp8_storage_t*>(q),
      scales);
  return cudaGetLastError();
}

cudaError_t LaunchDequantizeFp8(const uint8_t* q, const float* scales, int64_t rows, int d, int group, uint16_t* x,
                                cudaStream_t stream, int block_rows) {
  if (rows == 0) return cudaSuccess;
  const int groups_per_row = (d + group - 1) / group;
  if (d % 8 == 0 && group % 8 == 0 && reinterpret_cast<uintptr_t>(q) % 8 == 0 &&
      reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    const int64_t vecs = rows * d / 8;
    DequantizeFp8Vec8Kernel<<<Blocks(vecs), kThreads, 0, stream>>>(reinterpret_cast<const __nv_fp8_storage_t*>(q),
                                                                   scales, vecs, d, group, groups_per_row, block_rows,
                                                                   reinterpret_cast<__nv_bfloat16*>(x));
    return cudaGetLastError();
  }
  DequantizeFp8Kernel<<<Blocks(rows * d), kThreads, 0, stream>>>(reinterpret_cast<const __nv_fp8_storage_t*>(q), scales,
                                                                 rows, d, group, groups_per_row, block_rows,
                                                                 reinterpret_cast<__nv_bfloat16*>(x));
  return cudaGetLastError();
}

namespace {
std::atomic<bool> launch_pdl{true};
std::atomic<int> launch_mma_wide{-1};
std::atomic<int> launch_down_preload{-1};
}  // namespace

void SetLaunchSwitches(bool pdl, int mma_wide, int down_preload) {
  launch_pdl.store(pdl, std::memory_order_relaxed);
  launch_mma_wide.store(mma_wide, std::memory_order_relaxed);
  launch_down_preload.store(down_preload, std::memory_order_relaxed);
}
bool PdlEnabled() { return launch_pdl.load(std::memory_order_relaxed); }
int MmaWideForced() { return launch_mma_wide.load(std::memory_order_relaxed); }
int DownPreloadForced() { return launch_down_preload.load(std::memory_order_relaxed); }

}  // namespace moe::kernels::cuda
