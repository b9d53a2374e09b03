// SiLU as every CUDA kernel of the experts computes it, so that the paths (Hopper grouped
// kernels, decode GEMVs, the unfused activation pass) give the same bits for the same gate value.
//
// silu(g) = g / (1 + e^-g) in FP32, from the hardware's two special-function approximations and
// nothing else: e^-g = 2^(-g log2 e) by ex2.approx.ftz (relative error about 2^-22, plus the
// rounding of -g log2 e: about |g| 2^-24), then g times rcp.approx.ftz of 1 + e^-g (within 1 ulp).
// Five instructions a value, without branches or range fix-ups: the FP8 gate/up epilogue computes
// 64 of them a thread and tile, and the accurate expf (eight instructions with its range reduction)
// and __fdividef (its divisor-range tests and scalings) made up most of that epilogue's issue
// slots (bench/RESULTS.md). The result is rounded to BF16 after the multiply by up, 2^-9 apart,
// so these errors move a BF16 output only when it lies that close to a rounding boundary. Edge
// values: e^-g past 2^128 (g below about -88.7) is +inf, its reciprocal 0, silu(g) -0 (the true
// value is below 1e-37 in magnitude); e^-g below 2^-126 flushes to 0, silu(g) = g.
#ifndef MOE_KERNELS_CUDA_ACTIVATION_CUH_
#define MOE_KERNELS_CUDA_ACTIVATION_CUH_

#include <cuda_runtime.h>

namespace moe::kernels::cuda {

__device__ __forceinline__ float Silu(float g) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * -1.4426950408889634f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
  return g * r;
}

}  // namespace moe::kernels::cuda

#endif  // MOE_KERNELS_CUDA_ACTIVATION_CUH_
