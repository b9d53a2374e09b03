#include "kernels/cpu/dot_bf16.h"

#include <cmath>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace moe::kernels::cpu {
namespace {

inline float Widen(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// The partial sums' fixed reduction (p[j] + p[j + 4], then the pairs two apart, then the last
// two), then the tail in k order.
inline float Finish(const float (&p)[8], const float* x, const uint16_t* w, int k0, int n_k) {
  const float q0 = p[0] + p[4], q1 = p[1] + p[5], q2 = p[2] + p[6], q3 = p[3] + p[7];
  float s = (q0 + q2) + (q1 + q3);
  for (int k = k0; k < n_k; ++k) s += x[k] * Widen(w[k]);
  return s;
}

#if defined(__AVX2__) && defined(__FMA__)

inline __m256 Widen8(const uint16_t* w) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Finish's reduction in registers: (j, j + 4), (j, j + 2), (0, 1).
inline float Reduce8(__m256 v) {
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}

// R rows of x against C weight rows at a time: each weight vector is widened once for R rows,
// each x vector loaded once for C weight rows (R x C accumulators in registers).
template <int R, int C>
void Tile(const float* x, int n_k, const uint16_t* w, int c0, int n_out, float* out) {
  const int k8 = n_k / 8 * 8;
  // (Fully unrolled, so the accumulators stay in registers.)
  const uint16_t* wc[C];
#pragma GCC unroll 8
  for (int j = 0; j < C; ++j) wc[j] = w + static_cast<int64_t>(c0 + j) * n_k;
  __m256 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int k = 0; k < k8; k += 8) {
    __m256 wv[C];
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) wv[j] = Widen8(wc[j] + k);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + static_cast<int64_t>(r) * n_k + k);
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const float* xr = x + static_cast<int64_t>(r) * n_k;
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) {
      float sum = Reduce8(acc[r][j]);
      for (int k = k8; k < n_k; ++k) sum = std::fma(xr[k], Widen(wc[j][k]), sum);
      out[static_cast<int64_t>(r) * n_out + c0 + j] = sum;
    }
  }
}

// R rows against every weight row, two weight rows a tile (the x vectors loaded once for
// both), a lone last one.
template <int R>
void Block(const float* x, int n_k, const uint16_t* w, int n_out, float* out) {
  int c = 0;
  for (; c + 2 <= n_out; c += 2) Tile<R, 2>(x, n_k, w, c, n_out, out);
  for (; c < n_out; ++c) Tile<R, 1>(x, n_k, w, c, n_out, out);
}

#else

// The same order without vectors: eight partial sums (multiply-adds, fused only where the
// compiler contracts them: the bits are fixed within a build).
template <int R>
void Block(const float* x, int n_k, const uint16_t* w, int n_out, float* out) {
  const int k8 = n_k / 8 * 8;
  for (int c = 0; c < n_out; ++c) {
    const uint16_t* wc = w + static_cast<int64_t>(c) * n_k;
    for (int r = 0; r < R; ++r) {
      const float* xr = x + static_cast<int64_t>(r) * n_k;
      float p[8] = {};
      for (int k = 0; k < k8; k += 8) {
        for (int j = 0; j < 8; ++j) p[j] += xr[k + j] * Widen(wc[k + j]);
      }
      out[static_cast<int64_t>(r) * n_out + c] = Finish(p, xr, wc, k8, n_k);
    }
  }
}

#endif

}  // namespace

void DotRowsBf16(const float* x, int64_t m, int n_k, const uint16_t* w, int n_out, float* out) {
  // Tiles of 6, 4, 2 and single rows (plain loops: 4 and 1): the blocking changes only the
  // speed, never an output's sums.
  int64_t r = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; r + 6 <= m; r += 6) Block<6>(x + r * n_k, n_k, w, n_out, out + r * n_out);
#endif
  for (; r + 4 <= m; r += 4) Block<4>(x + r * n_k, n_k, w, n_out, out + r * n_out);
#if defined(__AVX2__) && defined(__FMA__)
  for (; r + 2 <= m; r += 2) Block<2>(x + r * n_k, n_k, w, n_out, out + r * n_out);
#endif
  for (; r < m; ++r) Block<1>(x + r * n_k, n_k, w, n_out, out + r * n_out);
}

}  // namespace moe::kernels::cpu
