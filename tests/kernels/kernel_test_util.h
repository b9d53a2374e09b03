// Random inputs and a float64 reference for the kernel tests.
#ifndef MOE_TESTS_KERNELS_KERNEL_TEST_UTIL_H_
#define MOE_TESTS_KERNELS_KERNEL_TEST_UTIL_H_

#include <algorithm>
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

// Random experts [E, 2f, d] / [E, d, f] scaled by 1/sqrt(fan-in), and rows [rows, d] of unit scale.
struct RandomLayer {
  std::vector<uint16_t> wgu, wd, x;
};
inline RandomLayer RandomExperts(std::mt19937& rng, int e, int d, int f, int64_t rows) {
  RandomLayer l;
  l.wgu = RandomBf16(rng, static_cast<size_t>(e) * 2 * f * d, 1.0f / std::sqrt(static_cast<float>(d)));
  l.wd = RandomBf16(rng, static_cast<size_t>(e) * d * f, 1.0f / std::sqrt(static_cast<float>(f)));
  l.x = RandomBf16(rng, static_cast<size_t>(rows) * d, 1.0f);
  return l;
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

// FP8 weights in DeepSeek-V3's format from BF16 ones: [matrices * rows, cols] E4M3 with one scale
// per 128 x 128 block (rows and cols multiples of 128), and the BF16 matrix they stand for.
struct Fp8Blocks {
  std::vector<uint8_t> q;
  std::vector<float> scales;      // [matrices * rows / 128, cols / 128]
  std::vector<uint16_t> dequant;  // BF16 of q * scale
};
inline Fp8Blocks QuantizeBlocks(const std::vector<uint16_t>& w, int64_t rows, int64_t cols) {
  Fp8Blocks b;
  b.q.resize(w.size());
  b.dequant.resize(w.size());
  const int64_t rb = rows / 128, cb = cols / 128;
  b.scales.resize(rb * cb);
  for (int64_t i = 0; i < rb; ++i) {
    for (int64_t j = 0; j < cb; ++j) {
      float amax = 0;
      for (int64_t r = i * 128; r < (i + 1) * 128; ++r) {
        for (int64_t c = j * 128; c < (j + 1) * 128; ++c)
          amax = std::max(amax, std::fabs(Bf16ToFloat(w[r * cols + c])));
      }
      const float scale = amax > 0 ? amax / kFp8E4M3Max : 1.0f;
      b.scales[i * cb + j] = scale;
      for (int64_t r = i * 128; r < (i + 1) * 128; ++r) {
        for (int64_t c = j * 128; c < (j + 1) * 128; ++c) {
          b.q[r * cols + c] = FloatToFp8E4M3(Bf16ToFloat(w[r * cols + c]) / scale);
          b.dequant[r * cols + c] = FloatToBf16(Fp8E4M3ToFloat(b.q[r * cols + c]) * scale);
        }
      }
    }
  }
  return b;
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
