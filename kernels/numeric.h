// Host-side number formats shared by both kernel implementations: BF16 and FP8 E4M3 (OCP
// "e4m3fn": bias 7, max 448, no infinities, NaN = 0x7f/0xff). Conversions round to nearest
// even and saturate FP8 to +-448, matching the device's __nv_cvt_float_to_fp8(.., __NV_SATFINITE,
// __NV_E4M3) and __float2bfloat16_rn, so the CPU oracle and the CUDA kernels agree bit for bit
// on conversions.
#ifndef MOE_KERNELS_NUMERIC_H_
#define MOE_KERNELS_NUMERIC_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "absl/types/span.h"

namespace moe::kernels {

inline uint16_t FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

inline float Bf16ToFloat(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float RoundBf16(float f) { return Bf16ToFloat(FloatToBf16(f)); }

constexpr float kFp8E4M3Max = 448.0f;
// Activations in E4M3 (Quantize): a group of amax > 0 gets scale = a / 448 and q = x * (448 / a),
// a = max(amax, kFp8MinAmax) (so that 448 / a stays finite); an all-zero group scale 1. DeepSeek-V3's
// convention (a multiply by the inverse scale, not a division per value). Weights in 128 x 128
// blocks are quantized by division (hf_writer, the checkpoints' format).
constexpr float kFp8MinAmax = 0x1p-100f;

float Fp8E4M3ToFloat(uint8_t v);
uint8_t FloatToFp8E4M3(float f);  // round to nearest even, saturating

// One scale group by the rule above: returns the scale and sets *inv = 448 / a (1 and 1 for an
// all-zero or NaN amax). The CUDA kernels compute the same two divisions, bit for bit.
float Fp8GroupScale(float amax, float* inv);
// n BF16 values into E4M3 bytes q by their group's scale (returned): q = x * inv, rounded to
// nearest even, saturating.
float QuantizeFp8Group(const uint16_t* x, int n, uint8_t* q);

// Relative L2 error ||got - want|| / ||want||, the check every comparison of a result with its
// reference uses (tests, benches, drivers), summed in double one element at a time.
// Zero rule: when ||want|| is 0 the value is the absolute error ||got - want|| (0 when got is zero
// too), never a division by zero. A NaN in either input makes the value NaN, which fails every
// `<` bound.
class RelativeL2Error {
 public:
  void Add(double got, double want) {
    num_ += (got - want) * (got - want);
    den_ += want * want;
  }
  double Value() const { return den_ == 0 ? std::sqrt(num_) : std::sqrt(num_ / den_); }

 private:
  double num_ = 0, den_ = 0;
};

// RelativeL2Error over whole arrays; BF16 elements are widened exactly. Arrays of different
// lengths give NaN.
double RelativeL2(absl::Span<const float> got, absl::Span<const float> want);
double RelativeL2Bf16(absl::Span<const uint16_t> got, absl::Span<const uint16_t> want);
double RelativeL2Bf16(absl::Span<const uint16_t> got, absl::Span<const float> want);
double RelativeL2Bf16(absl::Span<const uint16_t> got, absl::Span<const double> want);

}  // namespace moe::kernels

#endif  // MOE_KERNELS_NUMERIC_H_
