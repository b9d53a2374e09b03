// CPU reference implementation of kernels/api.h: the oracle for the CUDA kernels and the
// implementation CI runs. The projections read the BF16 weights as stored (DotRowsBf16: FP32
// sums in one fixed order per output, AVX2/FMA in the default build); rounding points match the
// CUDA path: the gate/up product is rounded to BF16, the SwiGLU activation is computed in FP32
// from those BF16 values and rounded to BF16, the down product is rounded to BF16.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

#include "kernels/api.h"
#include "kernels/arg_checks.h"
#include "kernels/cpu/dot_bf16.h"
#include "kernels/numeric.h"

namespace moe::kernels {
namespace {

// Every E4M3 code's value (Fp8E4M3ToFloat's), decoded once for the reference's inner loops.
const float* Fp8Values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int v = 0; v < 256; ++v) t[v] = Fp8E4M3ToFloat(static_cast<uint8_t>(v));
    return t;
  }();
  return table.data();
}

// A BF16 row quantized as Quantize does per 128 values and read back.
void QuantizedRow(const uint16_t* x, int n, float* out) {
  uint8_t q[128];
  for (int begin = 0; begin < n; begin += 128) {
    const int len = std::min(n - begin, 128);
    const float scale = QuantizeFp8Group(x + begin, len, q);
    for (int c = 0; c < len; ++c) out[begin + c] = Fp8Values()[q[c]] * scale;
  }
}

// Quantize's 128 x 128 blocks (weights): QuantizeGroup's scale over each block's amax, the
// same multiply a value.
void QuantizeBlocks(const QuantizeParams& p) {
  const int64_t block_cols = (p.d + 127) / 128;
  for (int64_t r0 = 0; r0 < p.rows; r0 += 128) {
    const int64_t r1 = std::min(p.rows, r0 + 128);
    for (int64_t b = 0; b < block_cols; ++b) {
      const int c0 = static_cast<int>(b * 128), c1 = std::min(p.d, c0 + 128);
      float amax = 0;
      for (int64_t r = r0; r < r1; ++r) {
        for (int c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(Bf16ToFloat(p.x[r * p.d + c])));
      }
      float inv;
      p.scales[(r0 / 128) * block_cols + b] = Fp8GroupScale(amax, &inv);
      for (int64_t r = r0; r < r1; ++r) {
        for (int c = c0; c < c1; ++c) p.q[r * p.d + c] = FloatToFp8E4M3(Bf16ToFloat(p.x[r * p.d + c]) * inv);
      }
    }
  }
}

// sum_k x[k] * w[k] * block_scales[k / 128] for a row of E4M3 weights.
float Fp8Dot(const float* x, const uint8_t* w, const float* block_scales, int n) {
  double sum = 0;
  for (int begin = 0; begin < n; begin += 128) {
    double part = 0;
    const float* values = Fp8Values();
    for (int k = begin; k < begin + 128 && k < n; ++k) part += static_cast<double>(x[k]) * values[w[k]];
    sum += part * block_scales[begin / 128];
  }
  return static_cast<float>(sum);
}

void ToFloat(const uint16_t* in, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(in[i]);
}

class CpuKernels final : public ExpertKernels {
 private:
  std::vector<uint16_t> gathered_;
  // One expert's rows widened to FP32 and its intermediate products, kept between calls (fresh
  // allocations every call came back from the OS page by page).
  std::vector<float> x_f32_, h_, a_, y_f32_;
  // Combine's accumulator row, kept between calls the same way.
  std::vector<float> acc_;

 public:
  const char* name() const override { return "cpu"; }

  absl::Status Gather(const GatherParams& p, Stream) override {
    absl::Status s = CheckGather(p);
    if (!s.ok()) return s;
    const size_t row_bytes = static_cast<size_t>(p.d) * DTypeBytes(p.dtype);
    const int64_t spr = ScaleCount(p.scales, 1, p.d);  // scales per row
    for (int64_t i = 0; i < p.n; ++i) {
      const int32_t src = p.index[i];
      if (src >= p.in_rows) {
        return absl::InvalidArgumentError(
            absl::StrCat("gather.index[", i, "]: ", src, " outside [0, ", p.in_rows, ")"));
      }
    }
    for (int64_t i = 0; i < p.n; ++i) {
      const int32_t src = p.index[i];
      char* dst = static_cast<char*>(p.out) + i * row_bytes;
      if (src < 0) {
        std::memset(dst, 0, row_bytes);
      } else {
        std::memcpy(dst, static_cast<const char*>(p.in) + src * row_bytes, row_bytes);
      }
      for (int64_t j = 0; j < spr; ++j) p.out_scales[i * spr + j] = src < 0 ? 1.0f : p.in_scales[src * spr + j];
    }
    return absl::OkStatus();
  }

  absl::Status HistogramScan(const HistogramParams& p, Stream) override {
    absl::Status s = CheckHistogram(p);
    if (!s.ok()) return s;
    std::fill(p.counts, p.counts + p.num_bins, 0);
    for (int64_t i = 0; i < p.n; ++i) {
      if (p.keys[i] >= p.num_bins) {
        return absl::InvalidArgumentError(absl::StrCat("histogram.keys[", i, "]: ", p.keys[i], " >= ", p.num_bins));
      }
      if (p.keys[i] >= 0) ++p.counts[p.keys[i]];
    }
    p.offsets[0] = 0;
    for (int b = 0; b < p.num_bins; ++b) p.offsets[b + 1] = p.offsets[b] + p.counts[b];
    return absl::OkStatus();
  }

  absl::Status RouteRows(const RouteRowsParams& p, Stream stream) override {
    absl::Status s = CheckRouteRows(p);
    if (!s.ok()) return s;
    // A stable counting sort (rows of one expert keep (token, slot) order): the reference
    // RankByKey with the expert id as the key; an id outside [0, E) gets row -1.
    int64_t status = -1;
    RankByKeyParams r;
    r.raw = p.topk;
    r.n = p.num_tokens * p.k;
    r.num_keys = p.num_experts;
    r.position = p.row_of_route;
    r.order = p.token_of_row;
    r.order_divisor = p.k;
    r.counts = p.counts;
    r.offsets = p.offsets;
    r.status = &status;
    return RankByKey(r, stream);
  }

  absl::Status Swiglu(const SwigluParams& p_in, Stream) override {
    absl::Status s = CheckSwiglu(p_in);
    if (!s.ok()) return s;
    SwigluParams p = p_in;
    if (p.host_offsets == nullptr) {
      // On the CPU "device" offsets are host memory: validate them like host offsets, with
      // offsets[E] <= rows (rows is the buffers' capacity on this path).
      p.host_offsets = p.device_offsets;
      const int64_t used = p.host_offsets[p.weights.num_experts];
      if (used > p.rows) return absl::InvalidArgumentError("swiglu.device_offsets: sentinel above rows");
      p.rows = used;
      if (p.x_row_index != nullptr) {
        // The fused gather of the decode path, done up front on the CPU.
        gathered_.resize(static_cast<size_t>(used) * p.weights.d);
        for (int64_t r = 0; r < used; ++r) {
          const int32_t src = p.x_row_index[r];
          if (src < 0 || src >= p.x_rows) {
            return absl::InvalidArgumentError(
                absl::StrCat("swiglu.x_row_index[", r, "]: ", src, " outside [0, ", p.x_rows, ")"));
          }
          std::memcpy(gathered_.data() + r * p.weights.d, p.x + static_cast<int64_t>(src) * p.weights.d,
                      sizeof(uint16_t) * p.weights.d);
        }
        p.x = gathered_.data();
        p.x_row_index = nullptr;
      }
      s = CheckSwiglu(p);
      if (!s.ok()) return s;
    }
    const ExpertWeights& w = p.weights;
    const int d = w.d, f = w.d_ff, e_count = w.num_experts;
    for (int e = 0; e < e_count; ++e) {
      // The layouts differ only in the padding rows they execute (CheckSwiglu above checked that a
      // padded capacity holds every segment), and a row's result does not depend on the rows
      // beside it (DotRowsBf16): the useful rows alone are computed, with the same bits in every
      // layout.
      const int64_t m = p.host_offsets[e + 1] - p.host_offsets[e];
      if (m == 0) continue;
      x_f32_.resize(static_cast<size_t>(m) * d);
      h_.resize(static_cast<size_t>(m) * 2 * f);
      a_.resize(static_cast<size_t>(m) * f);
      y_f32_.resize(static_cast<size_t>(m) * d);
      ToFloat(p.x + p.host_offsets[e] * d, m * d, x_f32_.data());
      // Phase: gate and up in one product, rounded to BF16; the activation.
      cpu::DotRowsBf16(x_f32_.data(), m, d, w.w_gate_up + static_cast<int64_t>(e) * 2 * f * d, 2 * f, h_.data());
      for (int64_t r = 0; r < m; ++r) {
        for (int c = 0; c < f; ++c) {
          const float g = RoundBf16(h_[r * 2 * f + c]);
          const float u = RoundBf16(h_[r * 2 * f + f + c]);
          a_[r * f + c] = RoundBf16(g / (1.0f + std::exp(-g)) * u);
        }
      }
      // Phase: down projection, rounded to BF16.
      cpu::DotRowsBf16(a_.data(), m, f, w.w_down + static_cast<int64_t>(e) * d * f, d, y_f32_.data());
      uint16_t* out = p.y + p.host_offsets[e] * d;
      for (int64_t i = 0; i < m * d; ++i) out[i] = FloatToBf16(y_f32_[i]);
    }
    return absl::OkStatus();
  }

  absl::Status Combine(const CombineParams& p, Stream) override {
    absl::Status s = CheckCombine(p);
    if (!s.ok()) return s;
    for (int64_t i = 0; i < p.num_tokens * p.k; ++i) {
      if (p.row_of_route[i] >= p.num_rows) {
        return absl::InvalidArgumentError(
            absl::StrCat("combine.row_of_route[", i, "]: ", p.row_of_route[i], " >= ", p.num_rows, " rows"));
      }
    }
    std::vector<float>& acc = acc_;
    acc.resize(p.d);
    for (int64_t t = 0; t < p.num_tokens; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int j = 0; j < p.k; ++j) {
        const int32_t row = p.row_of_route[t * p.k + j];
        if (row < 0) continue;
        const float g = p.gate[t * p.k + j];
        const uint16_t* r = p.rows + static_cast<int64_t>(row) * p.d;
        for (int c = 0; c < p.d; ++c) acc[c] += g * Bf16ToFloat(r[c]);
      }
      if (p.out_fp32 != nullptr) std::copy(acc.begin(), acc.end(), p.out_fp32 + t * p.d);
      if (p.out_bf16 != nullptr) {
        for (int c = 0; c < p.d; ++c) p.out_bf16[t * p.d + c] = FloatToBf16(acc[c]);
      }
    }
    return absl::OkStatus();
  }

  absl::Status LocalLayer(const LocalLayerParams& p, Stream stream) override {
    return RunLocalLayerInStages(this, p, &layer_stages_, stream);
  }

  // The FP8 reference: every E4M3 value and scale dequantized to FP32, sums in double, the
  // rounding points of the CUDA kernels (BF16 gate and up, BF16 activation quantized per 128
  // values, BF16 output).
  absl::Status SwigluFp8(const SwigluFp8Params& p, Stream) override {
    absl::Status s = CheckSwigluFp8(p);
    if (!s.ok()) return s;
    const Fp8ExpertWeights& w = p.weights;
    const int64_t e_count = w.num_experts;
    for (int64_t e = 0; e < e_count; ++e) {
      KERNEL_INVALID_IF(p.offsets[e] < 0 || p.offsets[e + 1] < p.offsets[e] || p.offsets[e + 1] > p.rows,
                        "swiglu_fp8.offsets[", e + 1, "]: ", p.offsets[e + 1],
                        " breaks 0 <= offsets[e] <= offsets[e + 1] <= rows (", p.rows, ")");
    }
    const int d = w.d, f = w.d_ff, kd = d / 128, kf = f / 128;
    // Kept between calls (no allocation once they have grown).
    std::vector<float>&xq = fp8_.xq, &h = fp8_.h, &aq = fp8_.aq;
    std::vector<uint16_t>& a16 = fp8_.a16;
    xq.resize(d);
    h.resize(2 * static_cast<size_t>(f));
    aq.resize(f);
    a16.resize(f);
    for (int64_t e = 0; e < e_count; ++e) {
      for (int64_t r = p.offsets[e]; r < p.offsets[e + 1]; ++r) {
        if (p.xq != nullptr) {  // quantized by the caller (Quantize's format, rows maybe packed)
          const int64_t ld = p.xq_ld > 0 ? p.xq_ld : d, sld = p.x_scales_ld > 0 ? p.x_scales_ld : kd;
          for (int c = 0; c < d; ++c) xq[c] = Fp8Values()[p.xq[r * ld + c]] * p.x_scales[r * sld + c / 128];
        } else {
          QuantizedRow(p.x + r * d, d, xq.data());
        }
        for (int64_t c = 0; c < 2 * f; ++c) {
          const int64_t row = e * 2 * f + c;
          h[c] = Bf16ToFloat(
              FloatToBf16(Fp8Dot(xq.data(), w.w_gate_up + row * d, w.gate_up_scales + (row / 128) * kd, d)));
        }
        for (int c = 0; c < f; ++c) {
          const float g = h[c], u = h[f + c];
          a16[c] = FloatToBf16(g / (1.0f + std::exp(-g)) * u);
        }
        QuantizedRow(a16.data(), f, aq.data());
        for (int64_t c = 0; c < d; ++c) {
          const int64_t row = e * d + c;
          p.y[r * d + c] = FloatToBf16(Fp8Dot(aq.data(), w.w_down + row * f, w.down_scales + (row / 128) * kf, f));
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status Quantize(const QuantizeParams& p, Stream) override {
    absl::Status s = CheckQuantize(p);
    if (!s.ok()) return s;
    if (p.granularity == ScaleGranularity::kBlock128x128) {
      QuantizeBlocks(p);
      return absl::OkStatus();
    }
    const int group = p.granularity == ScaleGranularity::kPerRow ? p.d : 128;
    const int64_t per_row = ScaleCount(p.granularity, 1, p.d);
    for (int64_t r = 0; r < p.rows; ++r) {
      for (int64_t g = 0; g < per_row; ++g) {
        const int begin = static_cast<int>(g * group), end = std::min(p.d, begin + group);
        p.scales[r * per_row + g] = QuantizeFp8Group(p.x + r * p.d + begin, end - begin, p.q + r * p.d + begin);
      }
    }
    return absl::OkStatus();
  }

  absl::Status Dequantize(const DequantizeParams& p, Stream) override {
    absl::Status s = CheckDequantize(p);
    if (!s.ok()) return s;
    const bool blocks = p.granularity == ScaleGranularity::kBlock128x128;
    const int group = p.granularity == ScaleGranularity::kPerRow ? p.d : 128;
    const int64_t per_row = blocks ? (p.d + 127) / 128 : ScaleCount(p.granularity, 1, p.d);
    for (int64_t r = 0; r < p.rows; ++r) {
      const int64_t scale_row = blocks ? r / 128 : r;
      for (int c = 0; c < p.d; ++c) {
        const float scale = p.scales[scale_row * per_row + c / group];
        p.x[r * p.d + c] = FloatToBf16(Fp8E4M3ToFloat(p.q[r * p.d + c]) * scale);
      }
    }
    return absl::OkStatus();
  }

 private:
  LocalLayerScratch layer_stages_;
  struct Fp8Rows {  // SwigluFp8's per-row values
    std::vector<float> xq, h, aq;
    std::vector<uint16_t> a16;
  } fp8_;
};

}  // namespace

std::unique_ptr<ExpertKernels> CreateCpuKernels() { return std::make_unique<CpuKernels>(); }

}  // namespace moe::kernels
