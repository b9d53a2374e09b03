// SiLU as every CUDA kernel of the experts computes it, so that the paths (Hopper grouped
// kernels, decode GEMVs, the unfused activation pass) give the same bits for the same gate value.
//
// silu(g) = g / (1 + e^-g) in FP32: e^-g from expf (the accurate, branch-free sequence), the
// quotient from __fdividef (the hardware reciprocal times g, within 2 ulp). The IEEE division it
// replaces carries a slow-path call behind a branch and a convergence barrier for every element,
// which keeps the compiler from interleaving an epilogue's elements (64 a thread in the FP8 gate/up
// tile; the FP8 layer ran 4-5% faster without it, bench/RESULTS.md). The divisor is at least 1;
// past 2^126 (g below about -87.3, where silu(g) is below 1e-36 in magnitude) __fdividef gives 0.
#ifndef MOE_KERNELS_CUDA_ACTIVATION_CUH_
#define MOE_KERNELS_CUDA_ACTIVATION_CUH_

#include <cuda_runtime.h>

namespace moe::kernels::cuda {

__device__ __forceinline__ float Silu(float g) { return __fdividef(g, 1.0f + expf(-g)); }

}  // namespace moe::kernels::cuda

#endif  // MOE_KERNELS_CUDA_ACTIVATION_CUH_
