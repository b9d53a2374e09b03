// The activations' E4M3 group quantization rule on the device, shared by the quantization
// kernels (device_kernels.cu) and the FP8 gate/up epilogue that quantizes in registers
// (grouped_sm90.cu). It is the CPU's (kernels/numeric.h Fp8GroupScale), bit for bit: scale =
// a / 448 and q = satfinite_rne(x * (448 / a)), a = max(amax, 2^-100); an all-zero (or NaN)
// amax keeps scale 1.
#ifndef MOE_KERNELS_CUDA_FP8_CUH_
#define MOE_KERNELS_CUDA_FP8_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include <cuda_fp8.h>

namespace moe::kernels::cuda {

constexpr float kMinAmax = 0x1p-100f;  // kFp8MinAmax

__device__ __forceinline__ void GroupScales(float amax, float* scale, float* inv) {
  *scale = 1.0f;
  *inv = 1.0f;
  if (amax > 0) {
    const float a = fmaxf(amax, kMinAmax);
    *scale = __fdiv_rn(a, 448.0f);
    *inv = __fdiv_rn(448.0f, a);
  }
}

// Two values times `inv` in E4M3 (round to nearest even, saturating): `lo` in the low byte.
__device__ __forceinline__ uint16_t Fp8Pair(float lo, float hi, float inv) {
  return static_cast<uint16_t>(
      __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(lo, inv), __fmul_rn(hi, inv)), __NV_SATFINITE, __NV_E4M3));
}

}  // namespace moe::kernels::cuda

#endif  // MOE_KERNELS_CUDA_FP8_CUH_
