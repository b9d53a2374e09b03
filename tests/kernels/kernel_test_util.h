// Random inputs and a float64 reference for the kernel tests.
#ifndef MOE_TESTS_KERNELS_KERNEL_TEST_UTIL_H_
#define MOE_TESTS_KERNELS_KERNEL_TEST_UTIL_H_

#include <cmath>
#include <random>
#include <vector>

#include "kernels/api.h"
#include "kernels/numeric.h"

namespace moe::kernels::testing {

inline std::vector<uint16_t> RandomBf16(std::mt19937& rng, size_t n, float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = FloatToBf16(dist(rng));
  return v;
}

// Segment sizes with skew and empty experts.
inline std::vector<int64_t> RandomCounts(std::mt19937& rng, int experts, int64_t max_rows) {
  std::vector<int64_t> c(experts);
  for (int e = 0; e < experts; ++e) {
    const int kind = static_cast<int>(rng() % 4);
    c[e] = kind == 0 ? 0 : (kind == 1 ? max_rows : static_cast<int64_t>(rng() % (max_rows + 1)));
  }
  return c;
}

inline std::vector<int64_t> Offsets(const std::vector<int64_t>& counts) {
  std::vector<int64_t> o(counts.size() + 1, 0);
  for (size_t e = 0; e < counts.size(); ++e) o[e + 1] = o[e] + counts[e];
  return o;
}

// float64 SwiGLU of one expert row, from BF16 inputs (no intermediate rounding).
inline std::vector<double> ReferenceSwiglu(const uint16_t* x, const uint16_t* wgu, const uint16_t* wd, int d, int f) {
  std::vector<double> a(f), y(d, 0.0);
  for (int c = 0; c < f; ++c) {
    double g = 0, u = 0;
    for (int i = 0; i < d; ++i) {
      g += static_cast<double>(Bf16ToFloat(x[i])) * Bf16ToFloat(wgu[static_cast<size_t>(c) * d + i]);
      u += static_cast<double>(Bf16ToFloat(x[i])) * Bf16ToFloat(wgu[static_cast<size_t>(f + c) * d + i]);
    }
    a[c] = g / (1.0 + std::exp(-g)) * u;
  }
  for (int o = 0; o < d; ++o) {
    for (int c = 0; c < f; ++c) y[o] += a[c] * Bf16ToFloat(wd[static_cast<size_t>(o) * f + c]);
  }
  return y;
}

// A LocalLayer call's inputs; the outputs (and the runner) are the caller's to set.
inline LocalLayerParams LayerInputs(const ExpertWeights& w, const uint16_t* x, const int32_t* topk, const float* gate,
                                    int64_t tokens, int k) {
  LocalLayerParams p;
  p.weights = w;
  p.x = x;
  p.topk = topk;
  p.gate = gate;
  p.num_tokens = tokens;
  p.k = k;
  return p;
}

}  // namespace moe::kernels::testing

#endif  // MOE_TESTS_KERNELS_KERNEL_TEST_UTIL_H_
