// BF16 bits to FP32 on the device, exact: a BF16 value is the high half of its FP32. The decode
// GEMVs widen weight and activation vectors with Widen; the FP8 epilogue warps widen packed pairs
// with Bf16Lo / Bf16Hi.
#ifndef MOE_KERNELS_CUDA_BF16_CUH_
#define MOE_KERNELS_CUDA_BF16_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace moe::kernels::cuda {

// The low and the high BF16 of a packed pair.
__device__ __forceinline__ float Bf16Lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float Bf16Hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

// Eight BF16 values (a 16-byte vector) to FP32, in memory order.
__device__ __forceinline__ void Widen(const uint4& v, float (&f)[8]) {
  const uint32_t word[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    f[2 * q] = Bf16Lo(word[q]);
    f[2 * q + 1] = Bf16Hi(word[q]);
  }
}

}  // namespace moe::kernels::cuda

#endif  // MOE_KERNELS_CUDA_BF16_CUH_
