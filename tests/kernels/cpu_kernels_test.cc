#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "kernels/api.h"
#include "kernels/cpu/dot_bf16.h"
#include "kernels/numeric.h"
#include "tests/kernels/kernel_test_util.h"

namespace moe::kernels {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::LayerInputs;
using testing::Offsets;
using testing::RandomBf16;
using testing::RandomCounts;
using testing::ReferenceSwiglu;

const float kNaN = std::numeric_limits<float>::quiet_NaN();

TEST(NumericTest, Bf16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.00390625f)), 1.0f);       // tie -> even
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.01171875f)), 1.015625f);  // tie -> even (up)
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(kNaN))));
}

TEST(NumericTest, Fp8E4M3CodesRoundTripAndSaturate) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;  // NaN codes
    const float v = Fp8E4M3ToFloat(static_cast<uint8_t>(c));
    if (c == 0x80) continue;  // -0 encodes as 0x80 and round-trips to 0x80; skip the sign of zero
    EXPECT_EQ(FloatToFp8E4M3(v), c) << "code " << c << " value " << v;
  }
  EXPECT_EQ(Fp8E4M3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(FloatToFp8E4M3(1000.0f), 0x7e);
  EXPECT_EQ(FloatToFp8E4M3(-1000.0f), 0xfe);
  EXPECT_EQ(FloatToFp8E4M3(1.0625f), FloatToFp8E4M3(1.0f));   // tie between 1 and 1.125 -> even
  EXPECT_EQ(FloatToFp8E4M3(1.1875f), FloatToFp8E4M3(1.25f));  // tie between 1.125 and 1.25 -> even
}

struct Experts {
  int e, d, f;
  std::vector<uint16_t> wgu, wd;
  Experts(std::mt19937& rng, int e_, int d_, int f_) : e(e_), d(d_), f(f_) {
    wgu = RandomBf16(rng, static_cast<size_t>(e) * 2 * f * d, 1.0f / std::sqrt(static_cast<float>(d)));
    wd = RandomBf16(rng, static_cast<size_t>(e) * d * f, 1.0f / std::sqrt(static_cast<float>(f)));
  }
  ExpertWeights Weights() const { return {wgu.data(), wd.data(), e, d, f}; }
};

std::vector<uint16_t> RunSwiglu(ExpertKernels& k, const Experts& w, const std::vector<uint16_t>& x,
                                const std::vector<int64_t>& offsets, LayoutParams layout, float padding) {
  std::vector<uint16_t> y(x.size(), FloatToBf16(kNaN));
  SwigluParams p;
  p.layout = layout;
  p.weights = w.Weights();
  p.x = x.data();
  p.rows = offsets.back();
  p.host_offsets = offsets.data();
  p.y = y.data();
  p.padding_value = padding;
  absl::Status s = k.Swiglu(p, nullptr);
  EXPECT_TRUE(s.ok()) << s;
  return y;
}

// The three layouts agree with each other and with a float64 reference on random shapes with
// skewed and empty experts; NaN-poisoned padding / fringe rows never reach the output.
// The reference NaN/Inf scan: the first value whose exponent bits are all ones, -1 for none;
// and host kernels have no device memory to map from another process.
TEST(CpuKernelsTest, FindNonFiniteAndNoIpcMemory) {
  auto cpu = CreateCpuKernels();
  std::vector<uint16_t> x(1000, 0x3f80);  // 1.0
  x[3] = 0x7f7f;                          // the largest finite value
  x[4] = 0xff7f;
  auto none = cpu->FindNonFiniteBf16(x.data(), static_cast<int64_t>(x.size()), nullptr);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, -1);
  x[900] = 0x7f80;  // +infinity
  x[901] = 0x7fc1;  // NaN
  auto first = cpu->FindNonFiniteBf16(x.data(), static_cast<int64_t>(x.size()), nullptr);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(*first, 900);
  x[10] = 0xffc0;
  EXPECT_EQ(*cpu->FindNonFiniteBf16(x.data(), static_cast<int64_t>(x.size()), nullptr), 10);
  EXPECT_EQ(*cpu->FindNonFiniteBf16(x.data(), 10, nullptr), -1);
  const auto ipc = cpu->OpenIpcMemory(std::string(64, 'h'));
  EXPECT_EQ(ipc.status().code(), absl::StatusCode::kFailedPrecondition) << ipc.status();
}

TEST(CpuKernelsTest, SwigluLayoutsAgreeAndMatchReference) {
  std::mt19937 rng(42);
  auto k = CreateCpuKernels();
  for (int trial = 0; trial < 6; ++trial) {
    const int e = 1 + static_cast<int>(rng() % 6);
    const int d = 8 * (1 + static_cast<int>(rng() % 4));
    const int f = 8 * (1 + static_cast<int>(rng() % 6));
    Experts w(rng, e, d, f);
    const std::vector<int64_t> counts = RandomCounts(rng, e, 9);
    const std::vector<int64_t> offsets = Offsets(counts);
    const std::vector<uint16_t> x = RandomBf16(rng, static_cast<size_t>(offsets.back()) * d, 1.0f);
    int64_t cap = 1;
    for (int64_t c : counts) cap = std::max(cap, c);
    auto grouped = RunSwiglu(*k, w, x, offsets, {Layout::kGrouped, 0, 1, 128}, kNaN);
    auto padded = RunSwiglu(*k, w, x, offsets, {Layout::kPaddedDense, cap, 4, 128}, kNaN);
    auto block = RunSwiglu(*k, w, x, offsets, {Layout::kBlockSparse, 0, 1, 4}, kNaN);
    for (int q = 0; q < e; ++q) {
      for (int64_t r = offsets[q]; r < offsets[q + 1]; ++r) {
        const auto ref = ReferenceSwiglu(x.data() + r * d, w.wgu.data() + static_cast<size_t>(q) * 2 * f * d,
                                         w.wd.data() + static_cast<size_t>(q) * d * f, d, f);
        for (const auto* out : {&grouped, &padded, &block}) {
          std::vector<uint16_t> row(out->begin() + r * d, out->begin() + (r + 1) * d);
          EXPECT_LT(RelativeL2Bf16(row, ref), 2e-2) << "trial " << trial << " expert " << q << " row " << r;
        }
      }
    }
    // Row results are independent of the layout's padding: bitwise equal.
    EXPECT_EQ(grouped, padded);
    EXPECT_EQ(grouped, block);
  }
}

TEST(CpuKernelsTest, SwigluValidatesBeforeCompute) {
  std::mt19937 rng(1);
  auto k = CreateCpuKernels();
  Experts w(rng, 3, 8, 8);
  std::vector<uint16_t> x(5 * 8, 0), y(5 * 8, 0x7fc0);
  SwigluParams p;
  p.weights = w.Weights();
  p.x = x.data();
  p.y = y.data();
  p.rows = 5;
  std::vector<int64_t> bad_order = {0, 3, 2, 5};
  p.host_offsets = bad_order.data();
  EXPECT_THAT(std::string(k->Swiglu(p, nullptr).message()), HasSubstr("host_offsets[2]"));
  std::vector<int64_t> bad_sentinel = {0, 1, 2, 4};
  p.host_offsets = bad_sentinel.data();
  EXPECT_THAT(std::string(k->Swiglu(p, nullptr).message()), HasSubstr("sentinel"));
  std::vector<int64_t> ok = {0, 4, 4, 5};
  p.host_offsets = ok.data();
  p.layout = {Layout::kPaddedDense, 3, 1, 128};
  EXPECT_EQ(k->Swiglu(p, nullptr).code(), absl::StatusCode::kFailedPrecondition);  // capacity 3 < segment of 4
  for (uint16_t v : y) EXPECT_EQ(v, 0x7fc0);                                       // nothing was written
}

TEST(CpuKernelsTest, DeviceOffsetPathEqualsHostOffsetPath) {
  std::mt19937 rng(5);
  auto k = CreateCpuKernels();
  Experts w(rng, 4, 16, 24);
  const std::vector<int64_t> offsets = {0, 2, 2, 7, 9};
  const auto x = RandomBf16(rng, 12 * 16, 1.0f);  // 12 rows of capacity, 9 used
  std::vector<uint16_t> y1(12 * 16, 0), y2(12 * 16, 0);
  SwigluParams p;
  p.weights = w.Weights();
  p.x = x.data();
  p.rows = 9;
  p.host_offsets = offsets.data();
  p.y = y1.data();
  ASSERT_TRUE(k->Swiglu(p, nullptr).ok());
  p.host_offsets = nullptr;
  p.device_offsets = offsets.data();
  p.rows = 12;
  p.y = y2.data();
  ASSERT_TRUE(k->Swiglu(p, nullptr).ok());
  EXPECT_EQ(y1, y2);
  // Fused gather: layout row r reads source row 11 - r.
  std::vector<uint16_t> source(12 * 16), y3(12 * 16, 0);
  std::vector<int32_t> index(12);
  for (int r = 0; r < 12; ++r) {
    index[r] = 11 - r;
    std::copy_n(x.begin() + r * 16, 16, source.begin() + (11 - r) * 16);
  }
  p.x = source.data();
  p.x_row_index = index.data();
  p.x_rows = 12;
  p.y = y3.data();
  ASSERT_TRUE(k->Swiglu(p, nullptr).ok());
  EXPECT_EQ(std::vector<uint16_t>(y3.begin(), y3.begin() + 9 * 16),
            std::vector<uint16_t>(y1.begin(), y1.begin() + 9 * 16));
  index[3] = 12;
  EXPECT_THAT(std::string(k->Swiglu(p, nullptr).message()), HasSubstr("x_row_index[3]"));
  p.x = x.data();
  p.x_row_index = nullptr;
  // The padded runner on the decode path: the same rows while the capacity holds every segment
  // (5 here), FAILED_PRECONDITION when it does not; block-sparse and a zero capacity are refused.
  std::vector<uint16_t> y4(12 * 16, 0);
  p.y = y4.data();
  p.layout = {Layout::kPaddedDense, 5, 4, 128};
  ASSERT_TRUE(k->Swiglu(p, nullptr).ok());
  EXPECT_EQ(std::vector<uint16_t>(y4.begin(), y4.begin() + 9 * 16),
            std::vector<uint16_t>(y1.begin(), y1.begin() + 9 * 16));
  p.layout = {Layout::kPaddedDense, 4, 1, 128};
  EXPECT_EQ(k->Swiglu(p, nullptr).code(), absl::StatusCode::kFailedPrecondition);
  p.layout = {Layout::kPaddedDense, 0, 1, 128};
  EXPECT_THAT(std::string(k->Swiglu(p, nullptr).message()), HasSubstr("swiglu.layout"));
  p.layout = {Layout::kBlockSparse, 0, 1, 128};
  EXPECT_EQ(k->Swiglu(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

TEST(CpuKernelsTest, RouteRowsIsAStableCountingSort) {
  auto k = CreateCpuKernels();
  const std::vector<int32_t> topk = {2, 0, 1, 2, -1, 2};  // 3 tokens, k = 2; one dropped route
  std::vector<int64_t> counts(3), offsets(4);
  std::vector<int32_t> row_of_route(6), token_of_row(6, -7);
  RouteRowsParams p{topk.data(), 3, 2, 3, counts.data(), offsets.data(), row_of_route.data(), token_of_row.data()};
  ASSERT_TRUE(k->RouteRows(p, nullptr).ok());
  EXPECT_THAT(counts, ElementsAre(1, 1, 3));
  EXPECT_THAT(offsets, ElementsAre(0, 1, 2, 5));
  EXPECT_THAT(row_of_route, ElementsAre(2, 0, 1, 3, -1, 4));
  EXPECT_THAT(token_of_row, ElementsAre(0, 1, 0, 1, 2, -7));
  // Rows are 32-bit: a step of 2^31 routes or more is refused before anything is read.
  p.num_tokens = int64_t{1} << 30;
  const absl::Status big = k->RouteRows(p, nullptr);
  EXPECT_EQ(big.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(big.message()), HasSubstr("route_rows.num_tokens"));
}

TEST(CpuKernelsTest, HistogramIgnoresDroppedKeys) {
  auto k = CreateCpuKernels();
  const std::vector<int32_t> keys = {3, 1, -1, 3, 0};
  std::vector<int64_t> counts(4), offsets(5);
  ASSERT_TRUE(k->HistogramScan({keys.data(), 5, 4, counts.data(), offsets.data()}, nullptr).ok());
  EXPECT_THAT(counts, ElementsAre(1, 1, 0, 2));
  EXPECT_THAT(offsets, ElementsAre(0, 1, 2, 2, 4));
  const std::vector<int32_t> bad = {4};
  EXPECT_EQ(k->HistogramScan({bad.data(), 1, 4, counts.data(), offsets.data()}, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CpuKernelsTest, CombineAppliesGatesOnceInFp32) {
  auto k = CreateCpuKernels();
  // Two rows of d = 2; token 0 takes both (gates 0.25, 0.75), token 1 one route dropped.
  const std::vector<uint16_t> rows = {FloatToBf16(1), FloatToBf16(2), FloatToBf16(3), FloatToBf16(4)};
  const std::vector<int32_t> map = {0, 1, 1, -1};
  const std::vector<float> gate = {0.25f, 0.75f, 0.5f, 9.0f};
  std::vector<float> out(4);
  std::vector<uint16_t> out_bf16(4);
  CombineParams p{rows.data(), 2, 2, map.data(), gate.data(), 2, 2, out.data(), out_bf16.data()};
  ASSERT_TRUE(k->Combine(p, nullptr).ok());
  EXPECT_THAT(out, ElementsAre(2.5f, 3.5f, 1.5f, 2.0f));
  EXPECT_EQ(Bf16ToFloat(out_bf16[1]), 3.5f);
  const std::vector<int32_t> bad = {0, 2, 1, -1};
  p.row_of_route = bad.data();
  EXPECT_THAT(std::string(k->Combine(p, nullptr).message()), HasSubstr("row_of_route[1]"));
}

// The local layer (route, experts, combine in one call) against the float64 semantics:
// out[t] = sum_j gate[t, j] * SwiGLU_{topk[t, j]}(x[t]); dropped routes (-1, ids >= E) add
// nothing; a second call with another routing reuses the scratch.
TEST(CpuKernelsTest, LocalLayerMatchesTheLayerSemantics) {
  std::mt19937 rng(21);
  auto kern = CreateCpuKernels();
  const int e = 6, d = 48, f = 40, k = 3;
  const int64_t t = 5;
  auto wgu = RandomBf16(rng, static_cast<size_t>(e) * 2 * f * d, 0.2f);
  auto wd = RandomBf16(rng, static_cast<size_t>(e) * d * f, 0.2f);
  auto x = RandomBf16(rng, static_cast<size_t>(t) * d, 1.0f);
  std::vector<float> gate(t * k);
  for (auto& g : gate) g = std::uniform_real_distribution<float>(0, 1)(rng);
  for (const std::vector<int32_t>& topk : {std::vector<int32_t>{0, 1, 2, 5, 4, 3, 1, -1, 0, 2, 2, 6, 3, 4, 5},
                                           std::vector<int32_t>{5, 5, 5, 0, -1, -1, 1, 2, 3, 4, 0, 1, 2, 3, 4}}) {
    std::vector<float> out(t * d);
    std::vector<uint16_t> out_bf16(t * d);
    LocalLayerParams p = LayerInputs({wgu.data(), wd.data(), e, d, f}, x.data(), topk.data(), gate.data(), t, k);
    p.out_fp32 = out.data();
    p.out_bf16 = out_bf16.data();
    ASSERT_TRUE(kern->LocalLayer(p, nullptr).ok());
    // The padded runner at the largest segment gives the same bits; below it the call is refused.
    std::vector<int64_t> counts(e, 0);
    for (int32_t id : topk) {
      if (id >= 0 && id < e) ++counts[id];
    }
    std::vector<float> padded(t * d);
    LocalLayerParams pp = p;
    pp.padded_capacity = *std::max_element(counts.begin(), counts.end());
    pp.out_fp32 = padded.data();
    pp.out_bf16 = nullptr;
    ASSERT_TRUE(kern->LocalLayer(pp, nullptr).ok());
    EXPECT_EQ(padded, out);
    --pp.padded_capacity;
    EXPECT_EQ(kern->LocalLayer(pp, nullptr).code(), absl::StatusCode::kFailedPrecondition);
    for (int64_t i = 0; i < t; ++i) {
      std::vector<double> want(d, 0.0);
      for (int j = 0; j < k; ++j) {
        const int32_t id = topk[i * k + j];
        if (id < 0 || id >= e) continue;
        const auto y = ReferenceSwiglu(x.data() + i * d, wgu.data() + static_cast<size_t>(id) * 2 * f * d,
                                       wd.data() + static_cast<size_t>(id) * d * f, d, f);
        for (int c = 0; c < d; ++c) want[c] += gate[i * k + j] * y[c];
      }
      RelativeL2Error error;
      for (int c = 0; c < d; ++c) {
        error.Add(out[i * d + c], want[c]);
        EXPECT_EQ(out_bf16[i * d + c], FloatToBf16(out[i * d + c]));
      }
      EXPECT_LT(error.Value(), 2e-2) << "token " << i;
    }
  }
  LocalLayerParams bad;
  bad.weights = {wgu.data(), wd.data(), e, d, f};
  bad.k = k;
  bad.num_tokens = 1;
  bad.out_fp32 = nullptr;
  EXPECT_THAT(std::string(kern->LocalLayer(bad, nullptr).message()), HasSubstr("local_layer"));
  bad.k = 0;
  EXPECT_THAT(std::string(kern->LocalLayer(bad, nullptr).message()), HasSubstr("local_layer.k"));
  std::vector<float> sink(d);
  bad.k = k;
  bad.num_tokens = 0;
  bad.out_fp32 = sink.data();
  bad.padded_capacity = -1;
  EXPECT_THAT(std::string(kern->LocalLayer(bad, nullptr).message()), HasSubstr("local_layer.padded_capacity"));
}

// The CPU projection (cpu::DotRowsBf16): every output within FP32 rounding of a float64 dot,
// and the same bits for a row whatever batch it comes in (blocks of 6, 4, 2 and 1 rows, pairs of
// weight rows and a lone last one, a k tail past the multiples of 8).
TEST(CpuKernelsTest, DotRowsBf16IsExactPerRowWhateverTheBatch) {
  std::mt19937 rng(17);
  const int n_k = 203, n_out = 7;
  const auto w = RandomBf16(rng, static_cast<size_t>(n_out) * n_k, 0.5f);
  std::vector<float> x(static_cast<size_t>(13) * n_k);
  for (auto& v : x) v = std::uniform_real_distribution<float>(-1, 1)(rng);
  std::vector<float> all(static_cast<size_t>(13) * n_out);
  cpu::DotRowsBf16(x.data(), 13, n_k, w.data(), n_out, all.data());
  for (int64_t r = 0; r < 13; ++r) {
    for (int c = 0; c < n_out; ++c) {
      double want = 0, scale = 0;
      for (int k = 0; k < n_k; ++k) {
        want += static_cast<double>(x[r * n_k + k]) * Bf16ToFloat(w[c * n_k + k]);
        scale += std::fabs(static_cast<double>(x[r * n_k + k]) * Bf16ToFloat(w[c * n_k + k]));
      }
      EXPECT_NEAR(all[r * n_out + c], want, 1e-5 * scale + 1e-7) << "row " << r << " col " << c;
    }
  }
  for (int64_t m : {1, 2, 3, 5, 7}) {
    for (int64_t r0 = 0; r0 + m <= 13; r0 += m) {
      std::vector<float> part(static_cast<size_t>(m) * n_out);
      cpu::DotRowsBf16(x.data() + r0 * n_k, m, n_k, w.data(), n_out, part.data());
      EXPECT_TRUE(std::equal(part.begin(), part.end(), all.begin() + r0 * n_out)) << "rows " << r0 << "+" << m;
    }
  }
}

// Multiplies every 128 x 128 block of a [rows, cols] BF16 matrix by its own power of two in
// [2^-3, 2^3] (exact in BF16), so that the blocks' scales differ by up to 64x.
void SpreadBlocks(std::mt19937& rng, std::vector<uint16_t>* m, int64_t rows, int64_t cols, int64_t block_rows) {
  for (int64_t i = 0; i < rows; i += block_rows) {
    for (int64_t j = 0; j < cols; j += 128) {
      const float factor = std::ldexp(1.0f, static_cast<int>(rng() % 7) - 3);
      for (int64_t r = i; r < std::min(rows, i + block_rows); ++r) {
        for (int64_t c = j; c < j + 128; ++c)
          (*m)[r * cols + c] = FloatToBf16(Bf16ToFloat((*m)[r * cols + c]) * factor);
      }
    }
  }
}

// The FP8 reference against the BF16 layer on the dequantized weights: the only difference is
// the activations' quantization (E4M3 per 128 values), a few percent. The weight blocks and the
// rows' 128-value groups are scaled apart (up to 64x), so a mixed-up scale is far off: the test
// swaps two blocks' scales and requires that to fail the bound. Bad shapes and offsets are
// refused naming the field.
TEST(CpuKernelsTest, SwigluFp8NearTheDequantizedBf16Layer) {
  std::mt19937 rng(77);
  const int e = 3, d = 256, f = 128;
  const std::vector<int64_t> counts = {5, 0, 9};
  const auto offsets = testing::Offsets(counts);
  const int64_t rows = offsets.back() + 2;
  testing::RandomLayer layer = testing::RandomExperts(rng, e, d, f, rows);
  SpreadBlocks(rng, &layer.wgu, static_cast<int64_t>(e) * 2 * f, d, 128);
  SpreadBlocks(rng, &layer.wd, static_cast<int64_t>(e) * d, f, 128);
  SpreadBlocks(rng, &layer.x, rows, d, 1);
  const std::vector<uint16_t>&wgu = layer.wgu, &wd = layer.wd, &x = layer.x;
  const testing::Fp8Blocks qgu = testing::QuantizeBlocks(wgu, static_cast<int64_t>(e) * 2 * f, d);
  const testing::Fp8Blocks qd = testing::QuantizeBlocks(wd, static_cast<int64_t>(e) * d, f);
  auto cpu = CreateCpuKernels();
  const uint16_t sentinel = FloatToBf16(-7.0f);
  std::vector<uint16_t> y8(x.size(), sentinel), y16(x.size(), 0);
  SwigluFp8Params p;
  p.weights = {qgu.q.data(), qgu.scales.data(), qd.q.data(), qd.scales.data(), e, d, f};
  p.x = x.data();
  p.rows = rows;
  p.offsets = offsets.data();
  p.y = y8.data();
  ASSERT_TRUE(cpu->SwigluFp8(p, nullptr).ok());
  SwigluParams b;
  b.weights = {qgu.dequant.data(), qd.dequant.data(), e, d, f};
  b.x = x.data();
  b.rows = offsets.back();
  b.host_offsets = offsets.data();
  b.y = y16.data();
  ASSERT_TRUE(cpu->Swiglu(b, nullptr).ok());
  std::vector<uint16_t> got(y8.begin(), y8.begin() + offsets.back() * d),
      want(y16.begin(), y16.begin() + offsets.back() * d);
  const double rel = RelativeL2Bf16(got, want);
  EXPECT_LT(rel, 0.08);
  for (int64_t i = offsets.back() * d; i < rows * d; ++i) ASSERT_EQ(y8[i], sentinel) << "row past the segments written";
  // The bound catches a mixed-up scale: an expert's gate and up blocks exchange scales.
  std::vector<float> swapped = qgu.scales;
  const int64_t kd = d / 128, up_block = f / 128;  // expert 0's first gate and first up block rows
  for (int64_t j = 0; j < kd; ++j) std::swap(swapped[j], swapped[up_block * kd + j]);
  ASSERT_NE(swapped, qgu.scales) << "the blocks drew the same factor: pick another seed";
  SwigluFp8Params mixed = p;
  mixed.weights.gate_up_scales = swapped.data();
  std::vector<uint16_t> y_mixed(x.size(), sentinel);
  mixed.y = y_mixed.data();
  ASSERT_TRUE(cpu->SwigluFp8(mixed, nullptr).ok());
  std::vector<uint16_t> got_mixed(y_mixed.begin(), y_mixed.begin() + offsets.back() * d);
  EXPECT_GT(RelativeL2Bf16(got_mixed, want), 0.08) << "a swapped gate/up scale went unnoticed";

  // The rows quantized by the caller (Quantize per 128 values, as an FP8 dispatch carries them):
  // the same bits as quantizing inside.
  std::vector<uint8_t> xq(x.size());
  std::vector<float> xs(x.size() / 128);
  ASSERT_TRUE(cpu->Quantize({x.data(), rows, d, ScaleGranularity::kPerBlock128, xq.data(), xs.data(),
                             static_cast<int64_t>(xs.size())},
                            nullptr)
                  .ok());
  SwigluFp8Params pre = p;
  pre.x = nullptr;
  pre.xq = xq.data();
  pre.x_scales = xs.data();
  std::vector<uint16_t> y_pre(x.size(), sentinel);
  pre.y = y_pre.data();
  ASSERT_TRUE(cpu->SwigluFp8(pre, nullptr).ok());
  EXPECT_EQ(y_pre, y8);
  // The same rows packed (an FP8 dispatch's payload: a row's bytes, then its scales, padded to
  // 16 bytes): row strides xq_ld and x_scales_ld.
  const int64_t packed = Fp8PackedRowBytes(d);
  std::vector<uint8_t> rows_packed(rows * packed, 0xee);
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(rows_packed.data() + r * packed, xq.data() + r * d, d);
    std::memcpy(rows_packed.data() + r * packed + d, xs.data() + r * (d / 128), 4 * (d / 128));
  }
  SwigluFp8Params packed_p = pre;
  packed_p.xq = rows_packed.data();
  packed_p.xq_ld = packed;
  packed_p.x_scales = reinterpret_cast<const float*>(rows_packed.data() + d);
  packed_p.x_scales_ld = packed / 4;
  std::vector<uint16_t> y_packed(x.size(), sentinel);
  packed_p.y = y_packed.data();
  ASSERT_TRUE(cpu->SwigluFp8(packed_p, nullptr).ok());
  EXPECT_EQ(y_packed, y8);
  for (int64_t bad_ld : {packed - 8, int64_t{d} - 16}) {
    SwigluFp8Params bad = packed_p;
    bad.xq_ld = bad_ld;
    const absl::Status st = cpu->SwigluFp8(bad, nullptr);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad_ld;
    EXPECT_NE(st.message().find("swiglu_fp8.xq_ld"), std::string::npos) << st;
  }
  SwigluFp8Params strided_bf16 = p;
  strided_bf16.xq_ld = packed;
  EXPECT_EQ(cpu->SwigluFp8(strided_bf16, nullptr).code(), absl::StatusCode::kInvalidArgument);
  SwigluFp8Params both = pre;
  both.x = x.data();
  auto both_st = cpu->SwigluFp8(both, nullptr);
  EXPECT_EQ(both_st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(both_st.message().find("swiglu_fp8.xq"), std::string::npos) << both_st;
  SwigluFp8Params unscaled = pre;
  unscaled.x_scales = nullptr;
  both_st = cpu->SwigluFp8(unscaled, nullptr);
  EXPECT_EQ(both_st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(both_st.message().find("swiglu_fp8.x_scales"), std::string::npos) << both_st;
  SwigluFp8Params skewed = pre;
  skewed.x_scales = reinterpret_cast<const float*>(reinterpret_cast<const char*>(xs.data()) + 2);
  both_st = cpu->SwigluFp8(skewed, nullptr);
  EXPECT_EQ(both_st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(both_st.message().find("x_scales: not 4-byte aligned"), std::string::npos) << both_st;

  SwigluFp8Params bad = p;
  bad.weights.d = 192;
  auto st = cpu->SwigluFp8(bad, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("d (192)"), std::string::npos) << st;
  std::vector<int64_t> beyond = offsets;
  beyond.back() = rows + 1;
  bad = p;
  bad.offsets = beyond.data();
  st = cpu->SwigluFp8(bad, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("swiglu_fp8.offsets[3]"), std::string::npos) << st;
}

// The CPU reference has no decode GEMMs of its own: callers fall back to PaddedDecodeCapacity.
TEST(CpuKernelsTest, NoDecodeGemmBeatsPadded) {
  auto cpu = CreateCpuKernels();
  EXPECT_FALSE(cpu->DecodeGemmBeatsPadded(8, 512, 256, 1024));
}

// When the padded runner pays (kernels::PaddedDecodeCapacity): most experts hit, two rows or
// more on average, padding within 8x the routes, 256 MB of expert weights or more.
TEST(CpuKernelsTest, PaddedDecodeCapacityPicksTheRunner) {
  const int d = 2048, f = 768;
  std::vector<int64_t> four(128, 4);
  four[5] = 11;
  EXPECT_EQ(PaddedDecodeCapacity(four, d, f), 11);                       // E128 T=64-like: padded at the largest
  EXPECT_EQ(PaddedDecodeCapacity(four, 256, 512), 0);                    // small experts: the kernels
  EXPECT_EQ(PaddedDecodeCapacity(std::vector<int64_t>(8, 4), d, f), 0);  // 75 MB of weights
  std::vector<int64_t> one(128, 1);
  EXPECT_EQ(PaddedDecodeCapacity(one, d, f), 0);  // a row an expert
  std::vector<int64_t> sparse(128, 0);
  for (int i = 0; i < 100; ++i) sparse[i] = 6;  // 78% hit
  EXPECT_EQ(PaddedDecodeCapacity(sparse, d, f), 0);
  four[5] = 300;  // a hot expert: 128 x 304 padded rows > 8 x 808
  EXPECT_EQ(PaddedDecodeCapacity(four, d, f), 0);
  std::vector<int64_t> mixtral(8, 30);
  mixtral[3] = 41;
  EXPECT_EQ(PaddedDecodeCapacity(mixtral, 4096, 14336), 41);
  EXPECT_EQ(PaddedDecodeCapacity({}, d, f), 0);
}

// FP8 round trip within the format's bound: |x - x'| <= 2^-4 |x| + 2^-10 scale.
TEST(CpuKernelsTest, Fp8RoundTripWithinFormatBound) {
  std::mt19937 rng(9);
  auto k = CreateCpuKernels();
  const int rows = 7, d = 300;
  std::vector<uint16_t> x = RandomBf16(rng, rows * d, 3.0f);
  x[5] = FloatToBf16(0.0f);
  for (int c = 0; c < d; ++c) x[3 * d + c] = 0;  // an all-zero row (scale 1)
  // Rows near the ends of FP32: amax below kFp8MinAmax (the inverse scale kept finite) and ~1e37.
  for (int c = 0; c < d; ++c) x[6 * d + c] = FloatToBf16(Bf16ToFloat(x[6 * d + c]) * 1e-32f);
  for (int c = 0; c < d; ++c) x[4 * d + c] = FloatToBf16(Bf16ToFloat(x[4 * d + c]) * 1e37f);
  for (ScaleGranularity g :
       {ScaleGranularity::kPerRow, ScaleGranularity::kPerBlock128, ScaleGranularity::kBlock128x128}) {
    const int64_t n_scales = ScaleCount(g, rows, d);
    EXPECT_EQ(n_scales, g == ScaleGranularity::kPerRow ? 7 : g == ScaleGranularity::kPerBlock128 ? 21 : 3);
    std::vector<uint8_t> q(rows * d);
    std::vector<float> scales(n_scales);
    std::vector<uint16_t> back(rows * d);
    ASSERT_TRUE(k->Quantize({x.data(), rows, d, g, q.data(), scales.data(), n_scales}, nullptr).ok());
    ASSERT_TRUE(k->Dequantize({q.data(), scales.data(), n_scales, rows, d, g, back.data()}, nullptr).ok());
    const int group = g == ScaleGranularity::kPerRow ? d : 128;
    for (int r = 0; r < rows; ++r) {
      for (int c = 0; c < d; ++c) {
        const float v = Bf16ToFloat(x[r * d + c]);
        const float s =
            g == ScaleGranularity::kBlock128x128 ? scales[c / 128] : scales[r * (n_scales / rows) + c / group];
        // One FP8 rounding (2^-4 relative or 2^-10 absolute in scaled units) plus the BF16
        // rounding of the dequantized value (2^-8 relative).
        const float bound = std::fabs(v) * (0.0625f + 0.0040f) + s * std::ldexp(1.0f, -10);
        EXPECT_LE(std::fabs(Bf16ToFloat(back[r * d + c]) - v), bound) << r << "," << c;
      }
    }
  }
}

// Weights in 128 x 128 blocks: each block's scale is its amax / 448 (a partial block's too), every
// value is quantized with its block's scale, and a block of zeros keeps scale 1.
TEST(CpuKernelsTest, Fp8BlockScalesCoverEach128By128Block) {
  std::mt19937 rng(11);
  auto k = CreateCpuKernels();
  const int64_t rows = 300;
  const int d = 384;
  std::vector<uint16_t> x = RandomBf16(rng, rows * d, 1.0f);
  for (int64_t r = 128; r < 256; ++r) {
    for (int c = 128; c < 256; ++c) x[r * d + c] = 0;  // block (1, 1)
  }
  x[299 * d + 383] = FloatToBf16(40.0f);  // the last, partial block's amax
  const int64_t n = ScaleCount(ScaleGranularity::kBlock128x128, rows, d);
  ASSERT_EQ(n, 9);
  std::vector<uint8_t> q(rows * d);
  std::vector<float> scales(n);
  ASSERT_TRUE(
      k->Quantize({x.data(), rows, d, ScaleGranularity::kBlock128x128, q.data(), scales.data(), n}, nullptr).ok());
  for (int64_t br = 0; br < 3; ++br) {
    for (int bc = 0; bc < 3; ++bc) {
      float amax = 0;
      for (int64_t r = br * 128; r < std::min<int64_t>(rows, br * 128 + 128); ++r) {
        for (int c = bc * 128; c < bc * 128 + 128; ++c) amax = std::max(amax, std::fabs(Bf16ToFloat(x[r * d + c])));
      }
      EXPECT_EQ(scales[br * 3 + bc], amax > 0 ? amax / 448.0f : 1.0f) << br << "," << bc;
      for (int64_t r = br * 128; r < std::min<int64_t>(rows, br * 128 + 128); ++r) {
        for (int c = bc * 128; c < bc * 128 + 128; ++c) {
          const float v = Bf16ToFloat(x[r * d + c]), inv = amax > 0 ? 448.0f / amax : 1.0f;
          ASSERT_EQ(q[r * d + c], FloatToFp8E4M3(v * inv)) << r << "," << c;
        }
      }
    }
  }
  EXPECT_EQ(scales[2 * 3 + 2], 40.0f / 448.0f);
  // A per-row scale count is refused for block scales, and block scales in a row payload's gather.
  EXPECT_EQ(
      k->Quantize({x.data(), rows, d, ScaleGranularity::kBlock128x128, q.data(), scales.data(), rows}, nullptr).code(),
      absl::StatusCode::kInvalidArgument);
  GatherParams g;
  g.dtype = DType::kFP8E4M3;
  g.d = d;
  g.in = q.data();
  g.in_rows = rows;
  g.scales = ScaleGranularity::kBlock128x128;
  g.in_scales = scales.data();
  g.in_scale_count = n;
  EXPECT_THAT(std::string(k->Gather(g, nullptr).message()), HasSubstr("gather.scales"));
}

// 0x0E: an FP8 scale count that disagrees with the payload is rejected before expert compute.
TEST(CpuKernelsTest, Fp8ScaleCountMismatchIsRejectedBeforeCompute) {
  auto k = CreateCpuKernels();
  std::vector<uint8_t> q(4 * 256, 0x38);
  std::vector<float> scales(4, 1.0f);
  std::vector<uint16_t> out(4 * 256, 0x7fc0);
  absl::Status s =
      k->Dequantize({q.data(), scales.data(), 4, 4, 256, ScaleGranularity::kPerBlock128, out.data()}, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("scale_count"));
  for (uint16_t v : out) ASSERT_EQ(v, 0x7fc0);
  GatherParams g;
  g.dtype = DType::kFP8E4M3;
  g.d = 256;
  g.in = q.data();
  g.in_rows = 4;
  g.scales = ScaleGranularity::kPerBlock128;
  g.in_scales = scales.data();
  g.in_scale_count = 4;
  EXPECT_THAT(std::string(k->Gather(g, nullptr).message()), HasSubstr("in_scale_count"));
}

// 0x0AC: scales are permuted with their rows.
TEST(CpuKernelsTest, GatherPermutesFp8ScalesWithRows) {
  auto k = CreateCpuKernels();
  const int d = 4;
  std::vector<uint8_t> q = {1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};
  std::vector<float> scales = {10, 20, 30};
  const std::vector<int32_t> index = {2, 0, -1, 1};
  std::vector<uint8_t> out(16, 0xee);
  std::vector<float> out_scales(4);
  GatherParams g{DType::kFP8E4M3, d, q.data(),         3, index.data(), 4, out.data(), ScaleGranularity::kPerRow,
                 scales.data(),   3, out_scales.data()};
  ASSERT_TRUE(k->Gather(g, nullptr).ok());
  EXPECT_THAT(out, ElementsAre(3, 3, 3, 3, 1, 1, 1, 1, 0, 0, 0, 0, 2, 2, 2, 2));
  EXPECT_THAT(out_scales, ElementsAre(30, 10, 1, 20));
}

TEST(CpuKernelsTest, CudaIsUnavailableOrReal) {
  auto cuda = CreateCudaKernels();
  if (!cuda.ok()) {
    EXPECT_TRUE(cuda.status().code() == absl::StatusCode::kUnimplemented ||
                cuda.status().code() == absl::StatusCode::kUnavailable)
        << cuda.status();
  } else {
    EXPECT_NE(std::string((*cuda)->name()).find("cuda"), std::string::npos);
  }
}

// The device plan's reference: routes keyed through their expert and checked, then a stable
// counting sort by key with the pack order and each key's value (numbers worked out by hand).
TEST(CpuKernelsTest, RoutePlanningReference) {
  auto k = kernels::CreateCpuKernels();
  // Six routes (three tokens of k = 2) over four experts; expert 3 has no key.
  const std::vector<int32_t> ids = {2, 0, 1, 2, 0, 9};
  const std::vector<float> gates = {0.5f, 0.5f, 0.25f, 0.75f, 1.0f, 0.0f};
  const std::vector<uint8_t> admitted = {1, 1, 1, 1, 1, 0};  // the bad id is not admitted
  const std::vector<int32_t> key_of_expert = {1, 0, 1, -1};
  std::vector<int32_t> keys(6);
  std::vector<float> gates_out(6);
  std::vector<int64_t> status(2);
  kernels::SealRoutesParams seal{ids.data(),  gates.data(),     admitted.data(), 6, 4, key_of_expert.data(),
                                 keys.data(), gates_out.data(), status.data()};
  ASSERT_TRUE(k->SealRoutes(seal, nullptr).ok());
  EXPECT_EQ(keys, (std::vector<int32_t>{1, 1, 0, 1, 1, -1}));
  EXPECT_EQ(gates_out, (std::vector<float>{0.5f, 0.5f, 0.25f, 0.75f, 1.0f, 0.0f}));
  EXPECT_EQ(status, (std::vector<int64_t>{-1, -1}));
  std::vector<int32_t> bad = ids;
  bad[1] = 3;  // no key
  bad[4] = 4;  // out of range
  seal.ids = bad.data();
  ASSERT_TRUE(k->SealRoutes(seal, nullptr).ok());
  EXPECT_EQ(status, (std::vector<int64_t>{4, 1}));
  // The local slots composed in the same pass: -1 for unkeyed and refused routes.
  const std::vector<int32_t> local_of_key = {7, 3};
  std::vector<int32_t> local(6, 99);
  seal.local_of_key = local_of_key.data();
  seal.num_keys = 2;
  seal.local = local.data();
  ASSERT_TRUE(k->SealRoutes(seal, nullptr).ok());
  EXPECT_EQ(local, (std::vector<int32_t>{3, -1, 7, 3, -1, -1}));  // route 1 has no key, route 4 is refused
  seal.ids = ids.data();
  ASSERT_TRUE(k->SealRoutes(seal, nullptr).ok());
  EXPECT_EQ(local, (std::vector<int32_t>{3, 3, 7, 3, 3, -1}));
  seal.local_of_key = nullptr;
  EXPECT_EQ(k->SealRoutes(seal, nullptr).code(), absl::StatusCode::kInvalidArgument);
  seal.local = nullptr;
  seal.num_keys = 0;
  ASSERT_TRUE(k->SealRoutes(seal, nullptr).ok());
  // Keys {1, 1, 0, 1, 1, -1}: key 0 first (route 2), then key 1 in route order.
  const std::vector<int32_t> slot_of_key = {10, 11};
  std::vector<int32_t> position(6), order(5), values(5);
  std::vector<int64_t> counts(2), offsets(3), st(1);
  kernels::RankByKeyParams rank;
  rank.raw = keys.data();
  rank.n = 6;
  rank.num_keys = 2;
  rank.position = position.data();
  rank.order = order.data();
  rank.order_divisor = 2;
  rank.key_values = slot_of_key.data();
  rank.values = values.data();
  rank.counts = counts.data();
  rank.offsets = offsets.data();
  rank.status = st.data();
  ASSERT_TRUE(k->RankByKey(rank, nullptr).ok());
  EXPECT_EQ(position, (std::vector<int32_t>{1, 2, 0, 3, 4, -1}));
  EXPECT_EQ(order, (std::vector<int32_t>{1, 0, 0, 1, 2}));  // tokens
  EXPECT_EQ(values, (std::vector<int32_t>{10, 11, 11, 11, 11}));
  EXPECT_EQ(counts, (std::vector<int64_t>{1, 4}));
  EXPECT_EQ(offsets, (std::vector<int64_t>{0, 1, 5}));
  EXPECT_EQ(st[0], -1);
  // Through a map (slot -> key): slot 5 maps to nothing, and a key past num_keys is refused.
  const std::vector<int32_t> map = {-1, 1, 0, -1, 1, -1};
  std::vector<int32_t> raw = {1, 2, -1, 4};
  rank.raw = raw.data();
  rank.n = 4;
  rank.key_map = map.data();
  rank.map_size = 6;
  rank.order_divisor = 1;
  ASSERT_TRUE(k->RankByKey(rank, nullptr).ok());
  EXPECT_EQ(std::vector<int32_t>(position.begin(), position.begin() + 4), (std::vector<int32_t>{1, 0, -1, 2}));
  EXPECT_EQ(st[0], -1);
  raw = {1, 5, 6, 4};
  ASSERT_TRUE(k->RankByKey(rank, nullptr).ok());
  EXPECT_EQ(st[0], 1);
  raw = {1, 2, -2, 4};
  ASSERT_TRUE(k->RankByKey(rank, nullptr).ok());
  EXPECT_EQ(st[0], 2);
  rank.key_map = nullptr;
  raw = {0, 1, 2, -3};
  ASSERT_TRUE(k->RankByKey(rank, nullptr).ok());
  EXPECT_EQ(st[0], 2);  // key 2 >= num_keys; -3 without a map is simply not placed
  rank.num_keys = 0;
  EXPECT_EQ(k->RankByKey(rank, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

// out[i] = a[b[i]]; b's -1 (not sent) and entries past a give -1.
TEST(CpuKernelsTest, ComposeIndexReference) {
  auto k = kernels::CreateCpuKernels();
  const std::vector<int32_t> a = {4, 0, 3, 1};
  const std::vector<int32_t> b = {2, -1, 0, 3, 4, 1, -7};
  std::vector<int32_t> out(b.size(), 99);
  ComposeIndexParams p{a.data(), 4, b.data(), static_cast<int64_t>(b.size()), out.data()};
  ASSERT_TRUE(k->ComposeIndex(p, nullptr).ok());
  EXPECT_EQ(out, (std::vector<int32_t>{3, -1, 4, 1, -1, 0, -1}));
  p.out = nullptr;
  EXPECT_EQ(k->ComposeIndex(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
  p.out = out.data();
  p.n = -1;
  EXPECT_EQ(k->ComposeIndex(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

// out[dest[i * fanout + j]] = in[i]; -1 and entries past out are skipped, rows no entry names
// keep their contents; sizes are checked and named.
TEST(CpuKernelsTest, ScatterReference) {
  auto k = kernels::CreateCpuKernels();
  const std::vector<uint16_t> in = {1, 2, 10, 20, 100, 200};  // three rows of d = 2
  const std::vector<int32_t> dest = {3, 0, -1, 5, 1, 9};      // fanout 2
  std::vector<uint16_t> out(6 * 2, 7);
  ScatterParams p{2, in.data(), 3, dest.data(), 2, out.data(), 6};
  ASSERT_TRUE(k->Scatter(p, nullptr).ok());
  EXPECT_EQ(out, (std::vector<uint16_t>{1, 2, 100, 200, 7, 7, 1, 2, 7, 7, 10, 20}));
  p.fanout = 0;
  absl::Status s = k->Scatter(p, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("scatter.fanout"));
  p.fanout = 2;
  p.in_rows = int64_t{1} << 30;  // x fanout past 2^31
  s = k->Scatter(p, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("scatter.in_rows"));
  p.in_rows = 3;
  p.out = nullptr;
  EXPECT_EQ(k->Scatter(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
  // Into wider rows (out_ld 3 words): the third word of each row is left alone.
  std::vector<uint16_t> wide(6 * 3, 7);
  p.out = wide.data();
  p.out_ld = 3;
  ASSERT_TRUE(k->Scatter(p, nullptr).ok());
  EXPECT_EQ(wide, (std::vector<uint16_t>{1, 2, 7, 100, 200, 7, 7, 7, 7, 1, 2, 7, 7, 7, 7, 10, 20, 7}));
  p.out_ld = 1;  // narrower than a row
  s = k->Scatter(p, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("scatter.out_ld"));
}

// PackFp8Rows: each token's bytes and scales as Quantize (kPerBlock128) gives them, at each of its
// routes' rows, then zero padding; rows no route names and routes outside [0, out_rows) are left
// alone; bad sizes are refused naming the field.
TEST(CpuKernelsTest, PackFp8RowsIsQuantizeThenScatter) {
  auto k = kernels::CreateCpuKernels();
  std::mt19937 rng(5);
  const int d = 384, tokens = 3, fanout = 2;  // 3 groups: 384 + 12 bytes, padded to 400
  const int64_t packed = Fp8PackedRowBytes(d);
  ASSERT_EQ(packed, 400);
  const std::vector<uint16_t> x = RandomBf16(rng, tokens * d, 3.0f);
  std::vector<uint8_t> q(tokens * d);
  std::vector<float> scales(tokens * 3);
  ASSERT_TRUE(
      k->Quantize({x.data(), tokens, d, ScaleGranularity::kPerBlock128, q.data(), scales.data(), tokens * 3}, nullptr)
          .ok());
  const std::vector<int32_t> dest = {4, 0, -1, 2, 1, 7};  // token 2's second route: past out_rows
  std::vector<uint8_t> out(5 * packed, 0xee);
  PackFp8Params p{x.data(), tokens, d, dest.data(), fanout, out.data(), 5};
  ASSERT_TRUE(k->PackFp8Rows(p, nullptr).ok());
  const int token_of_row[5] = {0, 2, 1, -1, 0};
  for (int r = 0; r < 5; ++r) {
    const uint8_t* row = out.data() + r * packed;
    const int t = token_of_row[r];
    if (t < 0) {
      for (int64_t b = 0; b < packed; ++b) ASSERT_EQ(row[b], 0xee) << "row " << r << " is named by no route";
      continue;
    }
    EXPECT_EQ(std::vector<uint8_t>(row, row + d), std::vector<uint8_t>(q.begin() + t * d, q.begin() + (t + 1) * d))
        << "row " << r;
    std::vector<float> got(3);
    std::memcpy(got.data(), row + d, 12);
    EXPECT_EQ(got, std::vector<float>(scales.begin() + t * 3, scales.begin() + (t + 1) * 3)) << "row " << r;
    EXPECT_EQ(std::vector<uint8_t>(row + d + 12, row + packed), std::vector<uint8_t>(4, 0)) << "row " << r;
  }
  p.d = 200;
  absl::Status s = k->PackFp8Rows(p, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("pack_fp8.d"));
  p.d = d;
  p.tokens = int64_t{1} << 31;
  s = k->PackFp8Rows(p, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("pack_fp8.tokens"));
  p.tokens = tokens;
  p.out = out.data() + 1;
  s = k->PackFp8Rows(p, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("pack_fp8.out"));
}

// Registered host memory: page-aligned, grows (by half again at least), keeps its memory when a
// smaller size is asked for; CopyToHostAsync on host kernels has copied when it returns.
TEST(CpuKernelsTest, RegisteredHostBufferGrowsAndTakesCopies) {
  auto cpu = CreateCpuKernels();
  RegisteredHostBuffer buf;
  ASSERT_TRUE(buf.Reserve(cpu.get(), 10).ok());
  int32_t* first = buf.as<int32_t>();
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % 4096, 0u);
  ASSERT_TRUE(buf.Reserve(cpu.get(), 4096).ok());
  EXPECT_EQ(buf.as<int32_t>(), first);  // a page was taken at least
  ASSERT_TRUE(buf.Reserve(cpu.get(), 3 * 4096 + 1).ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buf.as<int32_t>()) % 4096, 0u);
  const std::vector<int32_t> src = {5, -1, 7, 1 << 30};
  ASSERT_TRUE(cpu->CopyToHostAsync(buf.as<int32_t>() + 3000, src.data(), 16, nullptr).ok());
  EXPECT_EQ(std::vector<int32_t>(buf.as<int32_t>() + 3000, buf.as<int32_t>() + 3004), src);
  EXPECT_EQ(buf.Reserve(cpu.get(), -1).code(), absl::StatusCode::kInvalidArgument);
  auto other = CreateCpuKernels();
  EXPECT_EQ(buf.Reserve(other.get(), 8).code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace moe::kernels
