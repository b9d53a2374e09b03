// Deterministic pseudo-random BF16 fill on the device (benchmark inputs: never zeros).
#include <cuda_bf16.h>

#include "bench/gpu/fill.h"

namespace moe::bench {
namespace {
__global__ void FillKernel(__nv_bfloat16* p, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t x = (static_cast<uint64_t>(i) + 1) * 0x9e3779b97f4a7c15ULL ^ seed;
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 29;
    // Sum of two uniforms in [-1, 1): a triangular distribution, mean 0.
    const float u1 = static_cast<float>(x & 0xffffff) / 16777216.0f;
    const float u2 = static_cast<float>((x >> 24) & 0xffffff) / 16777216.0f;
    p[i] = __float2bfloat16_rn((u1 + u2 - 1.0f) * scale);
  }
}
}  // namespace

cudaError_t FillRandomBf16(void* p, int64_t n, uint64_t seed, float scale, cudaStream_t stream) {
  FillKernel<<<4096, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(p), n, seed, scale);
  return cudaGetLastError();
}
}  // namespace moe::bench
