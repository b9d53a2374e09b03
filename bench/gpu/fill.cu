// Benchmark helpers on the device: a deterministic pseudo-random BF16 fill (inputs: never
// zeros) and an L2 scrub (cold-cache timings).
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

// Reads every 16-byte vector of `p` (the sum keeps the loads from being dropped).
__global__ void ReadAllKernel(const uint4* __restrict__ p, int64_t n, unsigned* sink) {
  unsigned s = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint4 v = p[i];
    s += v.x ^ v.y ^ v.z ^ v.w;
  }
  if (s == 0x9e3779b9u) *sink = s;
}
}  // namespace

cudaError_t ScrubL2(cudaStream_t stream) {
  // Four times the L2 of clean lines read through it: whatever the timed work left there is
  // gone, and nothing dirty is left to be written back during the next measurement.
  static uint4* buffer = nullptr;
  static unsigned* sink = nullptr;
  static int64_t vecs = 0;
  if (buffer == nullptr) {
    int device = 0, l2 = 0;
    cudaError_t e = cudaGetDevice(&device);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device);
    if (e == cudaSuccess) e = cudaMalloc(&buffer, 4 * static_cast<size_t>(l2));
    if (e == cudaSuccess) e = cudaMalloc(&sink, sizeof(unsigned));
    if (e == cudaSuccess) e = cudaMemset(buffer, 1, 4 * static_cast<size_t>(l2));
    if (e != cudaSuccess) return e;
    vecs = 4 * static_cast<int64_t>(l2) / 16;
  }
  ReadAllKernel<<<1024, 256, 0, stream>>>(buffer, vecs, sink);
  return cudaGetLastError();
}

cudaError_t FillRandomBf16(void* p, int64_t n, uint64_t seed, float scale, cudaStream_t stream) {
  FillKernel<<<4096, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(p), n, seed, scale);
  return cudaGetLastError();
}
}  // namespace moe::bench
