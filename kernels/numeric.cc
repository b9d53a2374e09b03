#include "kernels/numeric.h"

#include <algorithm>
#include <cmath>

namespace moe::kernels {
namespace {

double Widen(float v) { return v; }
double Widen(double v) { return v; }
double Widen(uint16_t bf16) { return Bf16ToFloat(bf16); }

// RelativeL2Error of got[i] against want[i], each widened to double.
template <typename Got, typename Want>
double RelativeL2Of(absl::Span<const Got> got, absl::Span<const Want> want) {
  if (got.size() != want.size()) return std::nan("");
  RelativeL2Error e;
  for (size_t i = 0; i < want.size(); ++i) e.Add(Widen(got[i]), Widen(want[i]));
  return e.Value();
}

}  // namespace

double RelativeL2(absl::Span<const float> got, absl::Span<const float> want) { return RelativeL2Of(got, want); }

double RelativeL2Bf16(absl::Span<const uint16_t> got, absl::Span<const uint16_t> want) {
  return RelativeL2Of(got, want);
}

double RelativeL2Bf16(absl::Span<const uint16_t> got, absl::Span<const float> want) { return RelativeL2Of(got, want); }

double RelativeL2Bf16(absl::Span<const uint16_t> got, absl::Span<const double> want) { return RelativeL2Of(got, want); }

float Fp8E4M3ToFloat(uint8_t v) {
  const int sign = v >> 7;
  const int exp = (v >> 3) & 0xf;
  const int man = v & 0x7;
  float mag;
  if (exp == 0xf && man == 0x7) {
    mag = std::nanf("");
  } else if (exp == 0) {
    mag = std::ldexp(static_cast<float>(man), -9);  // subnormal: man * 2^-6 / 8
  } else {
    mag = std::ldexp(1.0f + man / 8.0f, exp - 7);
  }
  return sign ? -mag : mag;
}

uint8_t FloatToFp8E4M3(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  const float a = std::fabs(f);
  if (a >= kFp8E4M3Max) return sign | 0x7e;  // saturate (448)
  // Binary search over the 127 finite non-negative codes, which increase with the code.
  int lo = 0, hi = 0x7e;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (Fp8E4M3ToFloat(static_cast<uint8_t>(mid)) <= a)
      lo = mid;
    else
      hi = mid;
  }
  const float vlo = Fp8E4M3ToFloat(static_cast<uint8_t>(lo));
  const float vhi = Fp8E4M3ToFloat(static_cast<uint8_t>(hi));
  int code;
  if (a - vlo < vhi - a) {
    code = lo;
  } else if (vhi - a < a - vlo) {
    code = hi;
  } else {
    code = (lo % 2 == 0) ? lo : hi;  // tie: even mantissa
  }
  if (a == vhi) code = hi;
  return sign | static_cast<uint8_t>(code);
}

float Fp8GroupScale(float amax, float* inv) {
  *inv = 1.0f;
  if (!(amax > 0)) return 1.0f;  // zero (or NaN): scale 1, as the CUDA kernels
  const float a = std::max(amax, kFp8MinAmax);
  *inv = kFp8E4M3Max / a;
  return a / kFp8E4M3Max;
}

float QuantizeFp8Group(const uint16_t* x, int n, uint8_t* q) {
  float amax = 0;
  for (int c = 0; c < n; ++c) amax = std::max(amax, std::fabs(Bf16ToFloat(x[c])));
  float inv;
  const float scale = Fp8GroupScale(amax, &inv);
  for (int c = 0; c < n; ++c) q[c] = FloatToFp8E4M3(Bf16ToFloat(x[c]) * inv);
  return scale;
}

}  // namespace moe::kernels
