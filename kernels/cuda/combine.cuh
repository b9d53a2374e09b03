// The gate-weighted combine of one token's 8 output columns (one 16-byte vector of BF16), shared
// by the combine kernel (device_kernels.cu) and the fused local layer's last block
// (small_batch.cu).
#ifndef MOE_KERNELS_CUDA_COMBINE_CUH_
#define MOE_KERNELS_CUDA_COMBINE_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include <cuda_bf16.h>

namespace moe::kernels::cuda {

// Token t's output vector c from its FP32 sums: FP32 and / or BF16 (round to nearest even).
__device__ __forceinline__ void StoreCombined(const float (&acc)[8], int d8, int64_t t, int64_t c,
                                              float* __restrict__ out_fp32, uint4* __restrict__ out_bf16) {
  if (out_fp32 != nullptr) {
    float4* o = reinterpret_cast<float4*>(out_fp32 + t * d8 * 8 + c * 8);
    o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  }
  if (out_bf16 != nullptr) {
    uint4 ob;
    __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&ob);
#pragma unroll
    for (int q = 0; q < 4; ++q) o2[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
    out_bf16[t * d8 + c] = ob;
  }
}

// out[t, 8c .. 8c + 8) = sum_j gate[t, j] * rows[row_of_route[t, j], 8c ..) in FP32, j = 0 .. k-1
// in order; rows outside [0, num_rows) (dropped routes) add nothing. A token's k routes are read
// together: first every row index and gate, then up to K_MAX expert-row vectors in flight
// (row_at(row, c) loads one), then the sums.
template <int K_MAX, typename RowAt>
__device__ __forceinline__ void CombineVector(RowAt&& row_at, int64_t num_rows, int d8, const int32_t* row_of_route,
                                              const float* __restrict__ gate, int64_t t, int64_t c, int k,
                                              float* __restrict__ out_fp32, uint4* __restrict__ out_bf16) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  auto add = [&](float g, const uint4& v) {
    const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float2 x = __bfloat1622float2(v2[q]);
      acc[2 * q] += g * x.x;
      acc[2 * q + 1] += g * x.y;
    }
  };
  for (int j0 = 0; j0 < k; j0 += K_MAX) {
    int32_t row[K_MAX];
    float g[K_MAX];
#pragma unroll
    for (int j = 0; j < K_MAX; ++j) {
      const bool in = j0 + j < k;
      row[j] = in ? row_of_route[t * k + j0 + j] : -1;
      g[j] = in ? gate[t * k + j0 + j] : 0.0f;
    }
    uint4 v[K_MAX];
#pragma unroll
    for (int j = 0; j < K_MAX; ++j)
      v[j] = row[j] >= 0 && row[j] < num_rows ? row_at(row[j], c) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int j = 0; j < K_MAX; ++j) {
      if (row[j] >= 0 && row[j] < num_rows) add(g[j], v[j]);  // dropped routes add nothing
    }
  }
  StoreCombined(acc, d8, t, c, out_fp32, out_bf16);
}

// CombineVector over V vectors of one token, columns c, c + stride, ..., c + (V - 1) stride: the
// k row indices and gates read once, then all K_MAX x V expert-row vectors in flight (a combine
// of few routes a token, k = 2, otherwise has two loads in flight a thread), then the sums in
// the same order as CombineVector's (the same bits). k <= K_MAX.
template <int K_MAX, int V, typename RowAt>
__device__ __forceinline__ void CombineVectors(RowAt&& row_at, int64_t num_rows, int d8, const int32_t* row_of_route,
                                               const float* __restrict__ gate, int64_t t, int64_t c, int64_t stride,
                                               int k, float* __restrict__ out_fp32, uint4* __restrict__ out_bf16) {
  int32_t row[K_MAX];
  float g[K_MAX];
#pragma unroll
  for (int j = 0; j < K_MAX; ++j) {
    const bool in = j < k;
    row[j] = in ? row_of_route[t * k + j] : -1;
    g[j] = in ? gate[t * k + j] : 0.0f;
    if (row[j] >= num_rows) row[j] = -1;  // dropped routes add nothing
  }
  uint4 v[K_MAX][V];
#pragma unroll
  for (int j = 0; j < K_MAX; ++j) {
#pragma unroll
    for (int u = 0; u < V; ++u) v[j][u] = row[j] >= 0 ? row_at(row[j], c + u * stride) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int u = 0; u < V; ++u) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int j = 0; j < K_MAX; ++j) {
      if (row[j] < 0) continue;
      const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(&v[j][u]);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 x = __bfloat1622float2(v2[q]);
        acc[2 * q] += g[j] * x.x;
        acc[2 * q + 1] += g[j] * x.y;
      }
    }
    StoreCombined(acc, d8, t, c + u * stride, out_fp32, out_bf16);
  }
}

}  // namespace moe::kernels::cuda

#endif  // MOE_KERNELS_CUDA_COMBINE_CUH_
