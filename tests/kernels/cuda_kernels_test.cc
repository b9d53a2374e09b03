// CUDA implementation vs the CPU reference on random shapes, skewed and empty experts.
// Tagged gpu: runs on the GPU machine, also under compute-sanitizer (memcheck, racecheck).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "kernels/api.h"
#include "kernels/cuda/launch.h"
#include "kernels/numeric.h"
#include "tests/kernels/kernel_test_util.h"

namespace moe::kernels {
namespace {

using testing::LayerInputs;
using testing::Offsets;
using testing::RandomBf16;
using testing::RandomCounts;

template <typename T>
class DeviceVector {
 public:
  explicit DeviceVector(const std::vector<T>& host) : n_(host.size()) {
    EXPECT_EQ(cudaMalloc(&ptr_, std::max<size_t>(1, n_) * sizeof(T)), cudaSuccess);
    if (n_ > 0) {
      EXPECT_EQ(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  explicit DeviceVector(size_t n, T fill = T()) : DeviceVector(std::vector<T>(n, fill)) {}
  ~DeviceVector() { cudaFree(ptr_); }
  T* get() { return ptr_; }
  void Upload(const std::vector<T>& host) {  // as many elements as the vector holds
    ASSERT_EQ(host.size(), n_);
    if (n_ > 0) EXPECT_EQ(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<T> Host() const {
    std::vector<T> out(n_);
    if (n_ > 0) {
      EXPECT_EQ(cudaMemcpy(out.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return out;
  }

 private:
  T* ptr_ = nullptr;
  size_t n_;
};

class CudaKernelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // MOE_CUDA_TUNING (kernels/api.h CudaTuning) runs the suite under other switches, e.g. mma_wide=1.
    if (const char* spec = std::getenv("MOE_CUDA_TUNING"); spec != nullptr) {
      auto tuning = ParseCudaTuning(spec);
      ASSERT_TRUE(tuning.ok()) << tuning.status();
      SetCudaTuning(*tuning);
    }
    auto k = CreateCudaKernels();
    ASSERT_TRUE(k.ok()) << k.status();
    gpu_ = std::move(*k);
    cpu_ = CreateCpuKernels();
  }
  std::unique_ptr<ExpertKernels> gpu_, cpu_;
  std::mt19937 rng_{1234};
};

// The largest |a - b| (INFINITY when either holds a NaN); *rel = RelativeL2Bf16(a, b).
float MaxAbsDiffBf16(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, double* rel) {
  *rel = RelativeL2Bf16(a, b);
  float worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const float x = Bf16ToFloat(a[i]), y = Bf16ToFloat(b[i]);
    if (std::isnan(x) || std::isnan(y)) return INFINITY;
    worst = std::max(worst, std::fabs(x - y));
  }
  return worst;
}

// Large pageable copies to the device go through the pinned bounce buffers in chunks (a partial
// last chunk here), small ones the driver's way: every byte arrives either way, and a copy's
// source may be overwritten as soon as CopyToKernel returns.
TEST_F(CudaKernelsTest, LargePageableCopiesArriveWhole) {
  for (size_t bytes : {size_t{1} << 20, (size_t{11} << 20) + 12345, size_t{8} << 20}) {
    std::vector<uint8_t> src(bytes), back(bytes, 0);
    for (size_t i = 0; i < bytes; ++i) src[i] = static_cast<uint8_t>(rng_());
    const std::vector<uint8_t> want = src;
    auto dev = gpu_->Allocate(static_cast<int64_t>(bytes));
    ASSERT_TRUE(dev.ok()) << dev.status();
    ASSERT_TRUE(gpu_->CopyToKernel(*dev, src.data(), static_cast<int64_t>(bytes), nullptr).ok());
    std::fill(src.begin(), src.end(), 0);  // the source may be reused at once
    ASSERT_TRUE(gpu_->CopyToHost(back.data(), *dev, static_cast<int64_t>(bytes), nullptr).ok());
    EXPECT_EQ(back, want) << bytes << " bytes";
    gpu_->Free(*dev);
  }
}

TEST_F(CudaKernelsTest, SwigluMatchesCpuInEveryLayout) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // Trials 8 and 9: at most four rows per expert, which the grouped layout runs through the
  // decode kernels (and d_ff = 72 in trial 9: not a multiple of 32, the staged family).
  for (int trial = 0; trial < 10; ++trial) {
    const int e = 1 + static_cast<int>(rng_() % 12);
    const int d = 64 * (1 + static_cast<int>(rng_() % 4));
    const int f = trial == 9 ? 72 : 32 * (1 + static_cast<int>(rng_() % 6));
    const auto counts = RandomCounts(rng_, e, trial >= 8 ? 4 : 1 + static_cast<int64_t>(rng_() % 70));
    const auto offsets = Offsets(counts);
    const int64_t rows = offsets.back();
    auto wgu = RandomBf16(rng_, static_cast<size_t>(e) * 2 * f * d, 1.0f / std::sqrt(static_cast<float>(d)));
    auto wd = RandomBf16(rng_, static_cast<size_t>(e) * d * f, 1.0f / std::sqrt(static_cast<float>(f)));
    auto x = RandomBf16(rng_, static_cast<size_t>(rows) * d, 1.0f);
    int64_t cap = 1;
    for (int64_t c : counts) cap = std::max(cap, c);
    DeviceVector<uint16_t> dwgu(wgu), dwd(wd), dx(x);
    for (LayoutParams layout :
         {LayoutParams{Layout::kGrouped, 0, 1, 128}, LayoutParams{Layout::kPaddedDense, cap, 8, 128},
          LayoutParams{Layout::kBlockSparse, 0, 1, 16}}) {
      std::vector<uint16_t> ref(x.size(), 0);
      SwigluParams p;
      p.layout = layout;
      p.weights = {wgu.data(), wd.data(), e, d, f};
      p.x = x.data();
      p.rows = rows;
      p.host_offsets = offsets.data();
      p.y = ref.data();
      p.padding_value = nan;
      ASSERT_TRUE(cpu_->Swiglu(p, nullptr).ok());
      DeviceVector<uint16_t> dy(x.size(), FloatToBf16(nan));
      p.weights = {dwgu.get(), dwd.get(), e, d, f};
      p.x = dx.get();
      p.y = dy.get();
      ASSERT_TRUE(gpu_->Swiglu(p, nullptr).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      double rel = 0;
      const float worst = MaxAbsDiffBf16(dy.Host(), ref, &rel);
      EXPECT_LT(rel, 1e-2) << LayoutName(layout.layout) << " trial " << trial << " e=" << e << " d=" << d << " f=" << f;
      EXPECT_TRUE(std::isfinite(worst)) << "padding reached the output (" << LayoutName(layout.layout) << ")";
    }
  }
}

// The Hopper grouped kernels (TMA + wgmma), both row tiles, against the CPU reference: segments
// of 0, 1, one below / at / above each tile and several tiles, weights and rows of several
// column and K blocks. Rows before the first segment and after the last are never written, and
// through the Swiglu API (gemm=auto, grouped and block layouts) the same holds as for cuBLAS.
TEST_F(CudaKernelsTest, GroupedSm90MatchesCpu) {
  struct Shape {
    int d, f;
    int segments = 0;  // 1: 128-511 rows an expert on average, 2: 512 or more (auto's other schedules)
  };
  for (const Shape shape : {Shape{256, 128}, Shape{512, 384}, Shape{768, 256}, Shape{256, 256}, Shape{256, 384},
                            Shape{512, 384, 1}, Shape{512, 384, 2}, Shape{768, 256, 1}, Shape{768, 256, 2}}) {
    const int d = shape.d, f = shape.f;
    std::vector<int64_t> counts = {0, 1, 63, 64, 65, 127, 128, 129, 300, 0, 2, 257};
    if (shape.segments == 1) {
      // Through the API below, auto takes wide_epi (f = 384) or pingpong (f = 256) here, and
      // rows128_epi at 512 rows or more (segments == 2).
      counts = {150, 0, 300, 129, 200};
    } else if (shape.segments == 2) {
      counts = {600, 530, 0, 700, 513};
    } else if (d == 256 && f >= 256) {
      // 70 experts: the kernels' tile prefix scans 32 experts at a time (three rounds here), and
      // the grid's CTAs take several tiles each (f = 384: the wide gate/up tiles too).
      counts.clear();
      for (int i = 0; i < 70; ++i) counts.push_back(i % 7 == 0 ? 0 : static_cast<int64_t>(rng_() % 150));
    }
    const int e = static_cast<int>(counts.size());
    ASSERT_TRUE(cuda::GroupedSm90Supported(e, d, f));
    std::vector<int64_t> offsets = Offsets(counts);
    const int64_t lead = 5, tail = 7;  // rows outside every segment
    for (int64_t& o : offsets) o += lead;
    const int64_t rows = offsets.back() + tail;
    const testing::RandomLayer layer = testing::RandomExperts(rng_, e, d, f, rows);
    const std::vector<uint16_t>&wgu = layer.wgu, &wd = layer.wd, &x = layer.x;
    std::vector<uint16_t> ref(x.size(), 0);
    {
      SwigluParams p;
      p.layout = LayoutParams{Layout::kGrouped, 0, 1, 128};
      p.weights = {wgu.data(), wd.data(), e, d, f};
      p.x = x.data() + lead * d;
      p.rows = offsets.back() - lead;
      const std::vector<int64_t> plain = Offsets(counts);
      p.host_offsets = plain.data();
      p.y = ref.data() + lead * d;
      ASSERT_TRUE(cpu_->Swiglu(p, nullptr).ok());
    }
    DeviceVector<uint16_t> dwgu(wgu), dwd(wd), dx(x);
    DeviceVector<int64_t> doff(offsets);
    const uint16_t sentinel = FloatToBf16(-12345.0f);
    std::vector<uint16_t> rows128_y;  // kRows128's output, which kRows128Epi's must equal bit for bit
    for (cuda::Sm90Schedule tile :
         {cuda::Sm90Schedule::kRows64, cuda::Sm90Schedule::kRows128, cuda::Sm90Schedule::kPingPong,
          cuda::Sm90Schedule::kPingPongWide, cuda::Sm90Schedule::kRows128Epi, cuda::Sm90Schedule::kWideEpiDown}) {
      DeviceVector<uint16_t> da(static_cast<size_t>(rows) * f, 0), dy(x.size(), sentinel);
      ASSERT_EQ(cuda::GroupedSm90WideSupported(f), f % 96 == 0);
      const bool wide = tile == cuda::Sm90Schedule::kPingPongWide || tile == cuda::Sm90Schedule::kWideEpiDown;
      if (wide && f % 96 != 0) {
        // 96-column gate/up tiles: refused where they do not divide f, nothing written.
        EXPECT_EQ(cuda::LaunchGroupedSm90Swiglu(dx.get(), rows, doff.get(), e, d, f, dwgu.get(), dwd.get(), da.get(),
                                                dy.get(), tile, nullptr),
                  cudaErrorInvalidValue);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        for (uint16_t v : dy.Host()) ASSERT_EQ(v, sentinel);
        continue;
      }
      ASSERT_EQ(cuda::LaunchGroupedSm90Swiglu(dx.get(), rows, doff.get(), e, d, f, dwgu.get(), dwd.get(), da.get(),
                                              dy.get(), tile, nullptr),
                cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      std::vector<uint16_t> got = dy.Host();
      // The epilogue warps' tiles run the same MMAs as the cooperative 128-row tiles, and their
      // SwiGLU rounds where the consumers' does: the same bits.
      if (tile == cuda::Sm90Schedule::kRows128) rows128_y = got;
      if (tile == cuda::Sm90Schedule::kRows128Epi) {
        ASSERT_EQ(rows128_y.size(), got.size());
        for (size_t i = 0; i < got.size(); ++i) {
          ASSERT_EQ(got[i], rows128_y[i]) << "rows128_epi differs from rows128 at " << i << " d=" << d << " f=" << f;
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        if (r >= lead && r < offsets.back()) continue;
        for (int c = 0; c < d; ++c) {
          ASSERT_EQ(got[r * d + c], sentinel)
              << "row " << r << " outside every segment was written (schedule " << static_cast<int>(tile) << ")";
        }
      }
      std::vector<uint16_t> got_rows(got.begin() + lead * d, got.begin() + offsets.back() * d);
      std::vector<uint16_t> want_rows(ref.begin() + lead * d, ref.begin() + offsets.back() * d);
      double rel = 0;
      const float worst = MaxAbsDiffBf16(got_rows, want_rows, &rel);
      EXPECT_LT(rel, 1e-2) << "schedule " << static_cast<int>(tile) << " d=" << d << " f=" << f;
      EXPECT_LT(worst, 0.05f) << "schedule " << static_cast<int>(tile) << " d=" << d << " f=" << f;
    }
    // Through the API on the executed layouts (block-sparse rounds segments to 64 rows).
    const std::vector<int64_t> plain = Offsets(counts);
    const int64_t used = plain.back();
    for (LayoutParams layout :
         {LayoutParams{Layout::kGrouped, 0, 1, 128}, LayoutParams{Layout::kBlockSparse, 0, 1, 64}}) {
      DeviceVector<uint16_t> dy(static_cast<size_t>(used) * d, sentinel);
      SwigluParams p;
      p.layout = layout;
      p.weights = {dwgu.get(), dwd.get(), e, d, f};
      p.x = dx.get() + lead * d;
      p.rows = used;
      p.host_offsets = plain.data();
      p.y = dy.get();
      ASSERT_TRUE(gpu_->Swiglu(p, nullptr).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      std::vector<uint16_t> want_rows(ref.begin() + lead * d, ref.begin() + offsets.back() * d);
      double rel = 0;
      const float worst = MaxAbsDiffBf16(dy.Host(), want_rows, &rel);
      EXPECT_LT(rel, 1e-2) << LayoutName(layout.layout) << " d=" << d << " f=" << f;
      EXPECT_LT(worst, 0.05f) << LayoutName(layout.layout) << " d=" << d << " f=" << f;
    }
  }
}

// A SwigluFp8 case: a random layer with block-quantized FP8 weights, `lead` rows before the
// segments of `counts` and `tail` after them; `ref` is the CPU reference's output on the BF16
// rows (kFp8Sentinel outside the segments), and the operands are copied to the device for the
// GPU's calls (Device(): x BF16, offsets and weights on the device, y = dy).
constexpr uint16_t kFp8Sentinel = 0xc0e0;  // BF16 -7.0
struct Fp8Case {
  Fp8Case(std::mt19937& rng, ExpertKernels& cpu, int e_, int d_, int f_, const std::vector<int64_t>& counts_,
          int64_t lead_, int64_t tail)
      : e(e_),
        d(d_),
        f(f_),
        lead(lead_),
        counts(counts_),
        offsets(Shifted(Offsets(counts_), lead_)),
        rows(offsets.back() + tail),
        layer(testing::RandomExperts(rng, e, d, f, rows)),
        qgu(testing::QuantizeBlocks(layer.wgu, static_cast<int64_t>(e) * 2 * f, d)),
        qd(testing::QuantizeBlocks(layer.wd, static_cast<int64_t>(e) * d, f)),
        ref(layer.x.size(), kFp8Sentinel),
        dqgu(qgu.q),
        dqd(qd.q),
        dsgu(qgu.scales),
        dsd(qd.scales),
        dx(layer.x),
        dy(layer.x.size(), kFp8Sentinel),
        doff(offsets) {
    SwigluFp8Params p;
    p.weights = {qgu.q.data(), qgu.scales.data(), qd.q.data(), qd.scales.data(), e, d, f};
    p.x = layer.x.data();
    p.rows = rows;
    p.offsets = offsets.data();
    p.y = ref.data();
    reference = cpu.SwigluFp8(p, nullptr);
  }
  static std::vector<int64_t> Shifted(std::vector<int64_t> o, int64_t by) {
    for (int64_t& v : o) v += by;
    return o;
  }
  SwigluFp8Params Device() {
    SwigluFp8Params p;
    p.weights = {dqgu.get(), dsgu.get(), dqd.get(), dsd.get(), e, d, f};
    p.x = dx.get();
    p.rows = rows;
    p.offsets = doff.get();
    p.y = dy.get();
    return p;
  }
  // The rows x quantized on the GPU (Quantize per 128 values) into dxq / dxs, and those laid out
  // as packed rows (the FP8 dispatch's payload): each row's bytes, then its scales,
  // Fp8PackedRowBytes(d) apart, 0xee in the padding (which the experts must not read).
  std::vector<uint8_t> QuantizeRows(ExpertKernels& gpu, DeviceVector<uint8_t>& dxq, DeviceVector<float>& dxs) {
    const int64_t groups = rows * (d / 128);
    EXPECT_TRUE(
        gpu.Quantize({dx.get(), rows, d, ScaleGranularity::kPerBlock128, dxq.get(), dxs.get(), groups}, nullptr).ok());
    const std::vector<uint8_t> q = dxq.Host();
    const std::vector<float> scales = dxs.Host();
    const int64_t packed = Fp8PackedRowBytes(d);
    std::vector<uint8_t> out(rows * packed, 0xee);
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(out.data() + r * packed, q.data() + r * d, d);
      std::memcpy(out.data() + r * packed + d, scales.data() + r * (d / 128), 4 * (d / 128));
    }
    return out;
  }
  // `got` (the GPU's output for every row): rows outside the segments untouched, and the
  // segments within 1e-2 relative L2 and 0.1 of the CPU reference (the order of FP32 additions).
  void ExpectMatchesReference(const std::vector<uint16_t>& got, const std::string& what) const {
    for (int64_t r = 0; r < rows; ++r) {
      if (r >= lead && r < offsets.back()) continue;
      for (int c = 0; c < d; ++c) ASSERT_EQ(got[r * d + c], kFp8Sentinel) << what << " row " << r;
    }
    const std::vector<uint16_t> got_rows = Segments(got), want_rows = Segments(ref);
    double rel = 0;
    const float worst = MaxAbsDiffBf16(got_rows, want_rows, &rel);
    EXPECT_LT(rel, 1e-2) << what;
    EXPECT_LT(worst, 0.1f) << what;
  }
  std::vector<uint16_t> Segments(const std::vector<uint16_t>& y) const {
    return std::vector<uint16_t>(y.begin() + lead * d, y.begin() + offsets.back() * d);
  }

  const int e, d, f;
  const int64_t lead;
  const std::vector<int64_t> counts, offsets;
  const int64_t rows;
  const testing::RandomLayer layer;
  const testing::Fp8Blocks qgu, qd;
  std::vector<uint16_t> ref;
  absl::Status reference;
  DeviceVector<uint8_t> dqgu, dqd;
  DeviceVector<float> dsgu, dsd;
  DeviceVector<uint16_t> dx, dy;
  DeviceVector<int64_t> doff;
};

// SwigluFp8 from packed rows (`packed`: QuantizeRows' layout) into a fresh output.
SwigluFp8Params PackedParams(SwigluFp8Params p, DeviceVector<uint8_t>& packed, DeviceVector<uint16_t>& y, int d) {
  p.x = nullptr;
  p.xq = packed.get();
  p.xq_ld = Fp8PackedRowBytes(d);
  p.x_scales = reinterpret_cast<const float*>(packed.get() + d);
  p.x_scales_ld = Fp8PackedRowBytes(d) / 4;
  p.y = y.get();
  return p;
}

// FP8 experts on the Hopper kernels against the CPU's FP8 reference (same quantization, same
// rounding points: only the summation order differs) and, loosely, against the BF16 layer on
// the dequantized weights. Rows outside the segments stay as they were.
TEST_F(CudaKernelsTest, SwigluFp8MatchesCpu) {
  for (const int f : {256, 384}) {
    const int e = 6, d = 512;
    Fp8Case c(rng_, *cpu_, e, d, f, {0, 1, 100, 129, 3, 200}, 5, 4);
    ASSERT_TRUE(c.reference.ok()) << c.reference;
    const SwigluFp8Params p = c.Device();
    ASSERT_TRUE(gpu_->SwigluFp8(p, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<uint16_t> got = c.dy.Host();
    {  // The rows quantized first (Quantize, as an FP8 dispatch carries them): the same bits.
      DeviceVector<uint8_t> dxq(c.layer.x.size());
      DeviceVector<float> dxs(c.layer.x.size() / 128);
      DeviceVector<uint8_t> dpacked(c.QuantizeRows(*gpu_, dxq, dxs));
      DeviceVector<uint16_t> dy_pre(c.layer.x.size(), kFp8Sentinel);
      SwigluFp8Params pre = p;
      pre.x = nullptr;
      pre.xq = dxq.get();
      pre.x_scales = dxs.get();
      pre.y = dy_pre.get();
      ASSERT_TRUE(gpu_->SwigluFp8(pre, nullptr).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(dy_pre.Host(), got) << "f=" << f;
      // Packed rows (a row's bytes, then its scales; the FP8 dispatch's payload): the same bits.
      DeviceVector<uint16_t> dy_packed(c.layer.x.size(), kFp8Sentinel);
      ASSERT_TRUE(gpu_->SwigluFp8(PackedParams(p, dpacked, dy_packed, d), nullptr).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(dy_packed.Host(), got) << "f=" << f << " packed rows";
    }
    ASSERT_NO_FATAL_FAILURE(c.ExpectMatchesReference(got, "f=" + std::to_string(f)));
    // Against BF16 on the dequantized weights: the activations' quantization only.
    SwigluParams b;
    b.layout = LayoutParams{Layout::kGrouped, 0, 1, 128};
    b.weights = {c.qgu.dequant.data(), c.qd.dequant.data(), e, d, f};
    b.x = c.layer.x.data() + c.lead * d;
    b.rows = c.offsets.back() - c.lead;
    const std::vector<int64_t> plain = Offsets(c.counts);
    b.host_offsets = plain.data();
    std::vector<uint16_t> bf16(static_cast<size_t>(b.rows) * d);
    b.y = bf16.data();
    ASSERT_TRUE(cpu_->Swiglu(b, nullptr).ok());
    EXPECT_LT(RelativeL2Bf16(c.Segments(got), bf16), 0.08) << "f=" << f;
  }
  // A shape the Hopper kernels do not take (d not a multiple of 256) is refused past decode
  // sizes, not approximated (decode-sized steps take the tensor-core GEMVs: the next test).
  SwigluFp8Params odd;
  alignas(16) static uint8_t one[16];
  alignas(16) static float s1[4];
  alignas(16) static uint16_t rows16[8];
  odd.weights = {one, s1, one, s1, 1, 384, 128};
  std::vector<int64_t> off = {0, 100};
  odd.offsets = off.data();
  odd.rows = 100;
  odd.x = rows16;
  odd.y = rows16;
  EXPECT_EQ(gpu_->SwigluFp8(odd, nullptr).code(), absl::StatusCode::kUnimplemented);
}

// The Hopper FP8 kernels' column-major copy of the rows' scales, against the host's: four
// groups a thread (rows on 16-byte boundaries, groups in fours) and one (otherwise), rows past
// `rows` in the output left alone.
TEST_F(CudaKernelsTest, TransposeScalesMatchesHost) {
  struct Case {
    int64_t rows;
    int groups;
    int64_t ld;
  };
  for (const Case c : {Case{301, 8, 8}, Case{301, 4, 20}, Case{77, 3, 5}, Case{1, 2, 2}, Case{130, 56, 72}}) {
    const int64_t out_ld = cuda::Fp8ActivationScaleRows(c.rows);
    std::vector<float> in(static_cast<size_t>(c.rows * c.ld));
    for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(i) * 0.5f + 1.0f;
    DeviceVector<float> din(in), dout(static_cast<size_t>(out_ld * c.groups), -7.0f);
    ASSERT_EQ(cuda::LaunchTransposeScales(din.get(), c.rows, c.groups, c.ld, dout.get(), out_ld, nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> out = dout.Host();
    for (int g = 0; g < c.groups; ++g) {
      for (int64_t r = 0; r < out_ld; ++r) {
        const float want = r < c.rows ? in[r * c.ld + g] : -7.0f;
        ASSERT_EQ(out[g * out_ld + r], want)
            << "rows " << c.rows << " groups " << c.groups << " ld " << c.ld << ": group " << g << " row " << r;
      }
    }
  }
  // A destination narrower than the rows is refused.
  DeviceVector<float> d(16);
  EXPECT_EQ(cuda::LaunchTransposeScales(d.get(), 8, 2, 2, d.get(), 4, nullptr), cudaErrorInvalidValue);
}

// The FP8 gate/up kernel's epilogue quantizes the activation in registers (the default): its
// bytes and scales are those of the BF16 activation quantized by the quantization kernel after
// the gate/up kernel (fp8_epilogue_quant=0), bit for bit, on every segment row, and so is the
// down kernel's output; rows outside the segments are left alone. d_ff of three 128-column groups,
// segments of every length against the 128-row tiles, and a row of zeros (scale 1). Through the
// API both settings give the same output too.
TEST_F(CudaKernelsTest, Fp8ActivationQuantizedInTheEpilogueIsTheKernelsBytes) {
  const int e = 5, d = 512, f = 384;
  Fp8Case c(rng_, *cpu_, e, d, f, {1, 127, 0, 129, 300}, 3, 5);
  ASSERT_TRUE(c.reference.ok()) << c.reference;
  ASSERT_TRUE(cuda::GroupedSm90Fp8Supported(e, d, f));
  // A row of zeros (its activation all zero), on both sides.
  std::vector<uint16_t> x = c.layer.x;
  std::fill_n(x.begin() + (c.lead + 40) * d, d, uint16_t{0});
  c.dx.Upload(x);
  std::fill(c.ref.begin(), c.ref.end(), kFp8Sentinel);
  SwigluFp8Params host;
  host.weights = {c.qgu.q.data(), c.qgu.scales.data(), c.qd.q.data(), c.qd.scales.data(), e, d, f};
  host.x = x.data();
  host.rows = c.rows;
  host.offsets = c.offsets.data();
  host.y = c.ref.data();
  ASSERT_TRUE(cpu_->SwigluFp8(host, nullptr).ok());
  DeviceVector<uint8_t> dxq(x.size());
  DeviceVector<float> dxs(x.size() / 128);
  c.QuantizeRows(*gpu_, dxq, dxs);
  const int64_t rows = c.rows, lo = c.lead, hi = c.offsets.back(), ld = cuda::Fp8ActivationScaleRows(rows);
  constexpr uint8_t kByte = 0x5a;
  std::vector<std::vector<uint8_t>> q(2);
  std::vector<std::vector<float>> scales(2);
  std::vector<std::vector<uint16_t>> y(2);
  for (int fused = 0; fused < 2; ++fused) {
    DeviceVector<uint16_t> da(static_cast<size_t>(rows) * f, 0), dy(static_cast<size_t>(rows) * d, kFp8Sentinel);
    DeviceVector<uint8_t> daq(std::vector<uint8_t>(static_cast<size_t>(rows) * f, kByte));
    // The activation scales column-major: [f / 128, ld].
    DeviceVector<float> das(std::vector<float>(cuda::Fp8ActivationScaleFloats(rows, f), -3.0f));
    DeviceVector<float> dxst(cuda::Fp8ActivationScaleFloats(rows, d));
    ASSERT_EQ(
        cuda::LaunchGroupedSm90SwigluFp8(dxq.get(), d, dxs.get(), d / 128, rows, c.doff.get(), e, d, f, c.dqgu.get(),
                                         c.dsgu.get(), c.dqd.get(), c.dsd.get(), dxst.get(), fused ? nullptr : da.get(),
                                         daq.get(), das.get(), dy.get(), nullptr, fused == 1),
        cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    q[fused] = daq.Host();
    scales[fused] = das.Host();
    y[fused] = dy.Host();
    if (fused == 1) {  // rows outside the segments: not written
      for (int64_t r = 0; r < rows; ++r) {
        if (r >= lo && r < hi) continue;
        for (int col = 0; col < f; ++col) ASSERT_EQ(q[1][r * f + col], kByte) << "row " << r;
        for (int g = 0; g < f / 128; ++g) ASSERT_EQ(scales[1][g * ld + r], -3.0f) << "row " << r;
      }
    }
  }
  auto segment = [&](const auto& v, int64_t width) {
    return std::vector<std::decay_t<decltype(v[0])>>(v.begin() + lo * width, v.begin() + hi * width);
  };
  EXPECT_EQ(segment(q[1], f), segment(q[0], f)) << "quantized activation";
  for (int g = 0; g < f / 128; ++g) {
    const auto block = [&](const std::vector<float>& v) {
      return std::vector<float>(v.begin() + g * ld + lo, v.begin() + g * ld + hi);
    };
    EXPECT_EQ(block(scales[1]), block(scales[0])) << "activation scales, block " << g;
    EXPECT_EQ(scales[1][g * ld + lo + 40], 1.0f) << "the zero row's scale";
  }
  EXPECT_EQ(segment(y[1], d), segment(y[0], d)) << "down output";
  ASSERT_NO_FATAL_FAILURE(c.ExpectMatchesReference(y[1], "epilogue quantization"));
  // Through the API: the other setting, in a kernels object of its own, gives the same output.
  const CudaTuning saved = GetCudaTuning();
  CudaTuning other = saved;
  other.fp8_epilogue_quant = !saved.fp8_epilogue_quant;
  SetCudaTuning(other);
  auto k = CreateCudaKernels();
  SetCudaTuning(saved);
  ASSERT_TRUE(k.ok()) << k.status();
  std::vector<std::vector<uint16_t>> api(2);
  for (int i = 0; i < 2; ++i) {
    SwigluFp8Params p = c.Device();
    DeviceVector<uint16_t> dy(static_cast<size_t>(rows) * d, kFp8Sentinel);
    p.y = dy.get();
    ASSERT_TRUE((i == 0 ? *gpu_ : **k).SwigluFp8(p, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    api[i] = dy.Host();
  }
  EXPECT_EQ(api[0], api[1]) << "fp8_epilogue_quant=0 and 1 through SwigluFp8";
  EXPECT_EQ(segment(api[0], d), segment(y[1], d)) << "SwigluFp8 against the direct launch";
}

// The Hopper FP8 kernels with several tiles a CTA (more tiles than SMs in both projections), so
// that the consumers and the epilogue warps pass the tile buffer back and forth in both parities:
// 300 experts of 0 to 130 rows (most a single partial row tile, some two), against the CPU, with
// the activation quantized in the epilogue and as BF16 quantized after.
TEST_F(CudaKernelsTest, GroupedSm90Fp8WithSeveralTilesACtaMatchesCpu) {
  const int e = 300, d = 256, f = 256;
  std::vector<int64_t> counts(e);
  for (int i = 0; i < e; ++i) counts[i] = i % 5 == 0 ? 0 : (i % 7 == 0 ? 130 : 1 + i % 3);
  Fp8Case c(rng_, *cpu_, e, d, f, counts, 2, 3);
  ASSERT_TRUE(c.reference.ok()) << c.reference;
  ASSERT_TRUE(cuda::GroupedSm90Fp8Supported(e, d, f));
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  int64_t row_tiles = 0;
  for (const int64_t n : counts) row_tiles += (n + 127) / 128;
  ASSERT_GT(row_tiles, sms) << "down tiles (one column tile): more than one a CTA";
  DeviceVector<uint8_t> dxq(c.layer.x.size());
  DeviceVector<float> dxs(c.layer.x.size() / 128);
  c.QuantizeRows(*gpu_, dxq, dxs);
  for (int fused = 0; fused < 2; ++fused) {
    DeviceVector<uint16_t> da(static_cast<size_t>(c.rows) * f, 0), dy(c.layer.x.size(), kFp8Sentinel);
    DeviceVector<uint8_t> daq(static_cast<size_t>(c.rows) * f);
    DeviceVector<float> das(cuda::Fp8ActivationScaleFloats(c.rows, f));
    DeviceVector<float> dxst(cuda::Fp8ActivationScaleFloats(c.rows, d));
    ASSERT_EQ(
        cuda::LaunchGroupedSm90SwigluFp8(dxq.get(), d, dxs.get(), d / 128, c.rows, c.doff.get(), e, d, f, c.dqgu.get(),
                                         c.dsgu.get(), c.dqd.get(), c.dsd.get(), dxst.get(), fused ? nullptr : da.get(),
                                         daq.get(), das.get(), dy.get(), nullptr, fused == 1),
        cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_NO_FATAL_FAILURE(
        c.ExpectMatchesReference(dy.Host(), fused ? "quantized in the epilogue" : "BF16 activation"));
  }
}

// Decode-sized FP8 steps (fewer than 4 rows an expert on average) run the tensor-core GEMVs
// (small_batch_fp8.cu): against the CPU's FP8 reference, with a row or two an expert and with
// hot experts (segments of 9 and 20 rows: more than one pass of 8), for d not a multiple of 256
// too; packed rows give the same bits, rows outside the segments stay as they were, and a
// replayed CUDA graph gives the eager bits.
TEST_F(CudaKernelsTest, SwigluFp8DecodeMatchesCpu) {
  const std::vector<std::vector<int64_t>> trials = {{0, 1, 0, 2, 1, 0, 3, 1, 0, 0, 1, 2, 0, 1, 0, 4},
                                                    {20, 0, 1, 3, 0, 9, 1, 0, 2, 0, 0, 1, 0, 2, 0, 1}};
  for (const int d : {384, 512}) {
    for (const int f : {256, 384}) {
      for (size_t trial = 0; trial < trials.size(); ++trial) {
        const std::vector<int64_t>& counts = trials[trial];
        const std::string what =
            "d=" + std::to_string(d) + " f=" + std::to_string(f) + " trial " + std::to_string(trial);
        Fp8Case c(rng_, *cpu_, static_cast<int>(counts.size()), d, f, counts, 3, 2);
        ASSERT_TRUE(c.reference.ok()) << c.reference;
        const SwigluFp8Params p = c.Device();
        ASSERT_TRUE(gpu_->SwigluFp8(p, nullptr).ok()) << what;
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
        const std::vector<uint16_t> got = c.dy.Host();
        ASSERT_NO_FATAL_FAILURE(c.ExpectMatchesReference(got, what));
        // Packed rows (bytes, then scales, padded to 16 bytes), eager and replayed.
        DeviceVector<uint8_t> dxq(c.layer.x.size());
        DeviceVector<float> dxs(c.layer.x.size() / 128);
        DeviceVector<uint8_t> dpacked(c.QuantizeRows(*gpu_, dxq, dxs));
        DeviceVector<uint16_t> dy_packed(c.layer.x.size(), kFp8Sentinel);
        const SwigluFp8Params pk = PackedParams(p, dpacked, dy_packed, d);
        ASSERT_TRUE(gpu_->SwigluFp8(pk, nullptr).ok()) << what;
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        EXPECT_EQ(dy_packed.Host(), got) << what << " packed rows";
        cudaStream_t st;
        ASSERT_EQ(cudaStreamCreate(&st), cudaSuccess);
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        ASSERT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
        ASSERT_TRUE(gpu_->SwigluFp8(pk, st).ok()) << what;
        ASSERT_EQ(cudaStreamEndCapture(st, &graph), cudaSuccess);
        ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
        ASSERT_EQ(cudaMemset(dy_packed.get(), 0, c.layer.x.size() * 2), cudaSuccess);
        ASSERT_EQ(cudaGraphLaunch(exec, st), cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
        std::vector<uint16_t> replayed = dy_packed.Host();
        for (int64_t r = 0; r < c.rows; ++r) {  // the memset's zeros outside the segments
          if (r >= c.lead && r < c.offsets.back()) continue;
          for (int col = 0; col < d; ++col) replayed[r * d + col] = kFp8Sentinel;
        }
        EXPECT_EQ(replayed, got) << what << " graph replay";
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
        cudaStreamDestroy(st);
      }
    }
  }
}

// Decode path: offsets read on the device, segments longer than one chunk included. The kernel
// family follows the rows per expert and the dimensions: trials with a bound of one row
// (trial % 3 == 1) take the streaming family, other trials with d and d_ff multiples of 32 the
// tensor-core one, trial 8 (d_ff = 72, many rows) the staged one. Trial 6 has more experts than
// the kernels cache per block (the uncompacted path), trial 7 a decode step's shape (128
// experts, a few of them hit by one row each).
TEST_F(CudaKernelsTest, DeviceOffsetSwigluMatchesCpu) {
  for (int trial = 0; trial < 9; ++trial) {
    const int e = trial == 6 ? 2100 : (trial == 7 ? 128 : 1 + static_cast<int>(rng_() % 20));
    const int d = trial == 0 ? 7168 : (trial == 7 ? 2048 : (trial == 6 ? 64 : 64 * (1 + static_cast<int>(rng_() % 8))));
    const int f = trial == 7 ? 96 : (trial == 6 ? 40 : (trial == 8 ? 72 : 64 * (1 + static_cast<int>(rng_() % 8))));
    auto counts = RandomCounts(rng_, e, trial < 3 ? 5 : 40);
    if (trial >= 6) {
      std::fill(counts.begin(), counts.end(), 0);
      for (int hit = 0; hit < 8; ++hit) counts[rng_() % e] += trial == 6 ? 1 + rng_() % 3 : 1;
    }
    const auto offsets = Offsets(counts);
    const int64_t rows = offsets.back() + 3;  // capacity above the used rows
    auto wgu = RandomBf16(rng_, static_cast<size_t>(e) * 2 * f * d, 1.0f / std::sqrt(static_cast<float>(d)));
    auto wd = RandomBf16(rng_, static_cast<size_t>(e) * d * f, 1.0f / std::sqrt(static_cast<float>(f)));
    auto x = RandomBf16(rng_, static_cast<size_t>(rows) * d, 1.0f);
    std::vector<uint16_t> ref(x.size(), 0);
    SwigluParams p;
    p.weights = {wgu.data(), wd.data(), e, d, f};
    p.x = x.data();
    p.rows = rows;
    p.device_offsets = offsets.data();  // host memory is the CPU's "device"
    p.y = ref.data();
    ASSERT_TRUE(cpu_->Swiglu(p, nullptr).ok());
    DeviceVector<uint16_t> dwgu(wgu), dwd(wd), dx(x), dy(x.size(), 0);
    DeviceVector<int64_t> doff(offsets);
    p.weights = {dwgu.get(), dwd.get(), e, d, f};
    p.x = dx.get();
    p.y = dy.get();
    p.device_offsets = doff.get();
    // A hint below the real segment length must only cost speed (chunks loop), never rows.
    p.max_segment_rows = (trial % 3 == 0) ? 0 : (trial % 3 == 1 ? 1 : 4);
    ASSERT_TRUE(gpu_->Swiglu(p, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    auto got = dy.Host();
    // The same with the gather fused into the operand load: rows come from a shuffled source.
    std::vector<int32_t> index(rows);
    for (int64_t r = 0; r < rows; ++r) index[r] = static_cast<int32_t>(rows - 1 - r);
    std::vector<uint16_t> source(x.size());
    for (int64_t r = 0; r < rows; ++r) std::copy_n(x.begin() + r * d, d, source.begin() + index[r] * d);
    DeviceVector<uint16_t> dsource(source), dy2(x.size(), 0);
    DeviceVector<int32_t> dindex(index);
    p.x = dsource.get();
    p.x_row_index = dindex.get();
    p.x_rows = rows;
    p.y = dy2.get();
    ASSERT_TRUE(gpu_->Swiglu(p, nullptr).ok());
    auto fused = dy2.Host();
    fused.resize(offsets.back() * d);
    got.resize(offsets.back() * d);
    EXPECT_EQ(fused, got);
    ref.resize(offsets.back() * d);
    double rel = 0;
    EXPECT_TRUE(std::isfinite(MaxAbsDiffBf16(got, ref, &rel)));
    EXPECT_LT(rel, 1e-2) << "trial " << trial << " e=" << e << " d=" << d << " f=" << f;
  }
}

// One row an expert with the down weights preloaded into shared memory while the gate/up kernel
// runs (CudaTuning::down_preload, small_batch.cu), against the streaming down kernel and the CPU:
// switched on and by default a down block an SM preloads beside two gate/up blocks, both match
// the CPU within rounding as the streaming kernel does, and the gather fused into the gate/up
// load gives the same bits as direct rows. Cases: the Qwen3-30B-A3B decode shape (8 of
// 128 experts, 8 tiles a block), a two-row segment with capacity above the rows, and three k-chunks of 32 with experts
// skipped between busy ones.
TEST_F(CudaKernelsTest, DeviceOffsetSwigluDownPreloadMatchesCpu) {
  struct Case {
    int e, d, f;
    std::vector<int64_t> counts;  // rows an expert (empty: 8 distinct random experts, one row each)
    int64_t declared;             // p.rows (0: the used rows + 2)
  };
  const std::vector<Case> cases = {
      {128, 2048, 768, {}, 8},  // rows as LocalLayer's stages declare them: the routes
      {16, 256, 64, {0, 0, 0, 2, 0, 0, 0, 1}, 0},
      {8, 512, 96, {1, 0, 1, 1, 1, 0, 0, 1}, 0},
  };
  const CudaTuning saved = GetCudaTuning();
  for (const Case& tc : cases) {
    const int e = tc.e, d = tc.d, f = tc.f;
    std::vector<int64_t> counts(e, 0);
    if (tc.counts.empty()) {
      std::vector<int> all(e);
      for (int q = 0; q < e; ++q) all[q] = q;
      std::shuffle(all.begin(), all.end(), rng_);
      for (int q = 0; q < 8; ++q) counts[all[q]] = 1;
    } else {
      std::copy(tc.counts.begin(), tc.counts.end(), counts.begin());
    }
    const auto offsets = Offsets(counts);
    const int64_t used = offsets.back(), held = used + 2;  // x and y hold `held` rows
    const int64_t declared = tc.declared > 0 ? tc.declared : held;
    SCOPED_TRACE(::testing::Message() << "E=" << e << " d=" << d << " f=" << f << " rows " << used << " declared "
                                      << declared);
    const testing::RandomLayer layer = testing::RandomExperts(rng_, e, d, f, held);
    std::vector<uint16_t> ref(layer.x.size(), 0);
    SwigluParams p;
    p.weights = {layer.wgu.data(), layer.wd.data(), e, d, f};
    p.x = layer.x.data();
    p.rows = held;
    p.device_offsets = offsets.data();
    p.y = ref.data();
    ASSERT_TRUE(cpu_->Swiglu(p, nullptr).ok());
    ref.resize(used * d);
    DeviceVector<uint16_t> dwgu(layer.wgu), dwd(layer.wd), dx(layer.x);
    DeviceVector<int64_t> doff(offsets);
    std::vector<int32_t> index(held);
    for (int64_t r = 0; r < held; ++r) index[r] = static_cast<int32_t>(held - 1 - r);
    std::vector<uint16_t> source(layer.x.size());
    for (int64_t r = 0; r < held; ++r) std::copy_n(layer.x.begin() + r * d, d, source.begin() + index[r] * d);
    DeviceVector<uint16_t> dsource(source);
    DeviceVector<int32_t> dindex(index);
    std::vector<std::vector<uint16_t>> outs;
    for (int preload : {0, 1, -1}) {
      CudaTuning tuning = saved;
      tuning.down_preload = preload;
      SetCudaTuning(tuning);
      auto gpu = CreateCudaKernels();  // sets the process's launch switches
      ASSERT_TRUE(gpu.ok()) << gpu.status();
      // The gate/up blocks an SM beside each preloading down block (0: the streaming one).
      EXPECT_EQ(cuda::SmallBatchDownPreloadBeside(e, d, f, declared), preload == 0 ? 0 : 2)
          << "down_preload=" << preload;
      SwigluParams g = p;
      g.weights = {dwgu.get(), dwd.get(), e, d, f};
      g.rows = declared;
      g.device_offsets = doff.get();
      g.max_segment_rows = 1;  // the streaming family whatever the segments
      DeviceVector<uint16_t> dy(layer.x.size(), 0), dy2(layer.x.size(), 0);
      g.x = dx.get();
      g.y = dy.get();
      ASSERT_TRUE((*gpu)->Swiglu(g, nullptr).ok());
      g.x = dsource.get();
      g.x_row_index = dindex.get();
      g.x_rows = held;
      g.y = dy2.get();
      ASSERT_TRUE((*gpu)->Swiglu(g, nullptr).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      auto got = dy.Host(), gathered = dy2.Host();
      got.resize(used * d);
      gathered.resize(used * d);
      EXPECT_EQ(gathered, got) << "down_preload=" << preload;
      double rel = 0;
      EXPECT_TRUE(std::isfinite(MaxAbsDiffBf16(got, ref, &rel))) << "down_preload=" << preload;
      EXPECT_LT(rel, 1e-2) << "down_preload=" << preload;
      outs.push_back(std::move(got));
    }
    EXPECT_EQ(outs[1], outs[2]) << "down_preload=1 and the default";
  }
  SetCudaTuning(saved);
  ASSERT_TRUE(CreateCudaKernels().ok());  // the fixture's switches back
}

// The tensor-core family's passes of 8 and 16 activation rows over a weight tile (a step takes
// 16 a pass when its experts are expected to get 8 rows or more; the bound on segments steers it
// here: 4 -> 8-row passes; 16, or none (mean 17 rows) -> 16). Each row's mmas run in the same k
// order either way, so both give the same bits. Five experts with the same weights: expert 0
// has rows x0..x7, the others repeat them, 13 rows (one ragged 16-row pass), 16, none and 45
// (ragged last passes of both widths): each row must also equal expert 0's row of the same
// source, and the CPU within rounding. (MOE_CUDA_TUNING=mma_wide=0|1 in the environment forces one
// width for all three calls.)
// The decode path (device offsets) with segments averaging 4+ rows on a shape the Hopper
// kernels take: gemm=auto runs them (rows gathered through the index first), gemm=cublas the
// decode kernels; both match the CPU, and the gathered run equals the direct one bit for bit.
TEST_F(CudaKernelsTest, DeviceOffsetSwigluOnHopperKernelsMatchesCpu) {
  const int e = 8, d = 512, f = 256;
  const std::vector<int64_t> counts = {0, 5, 40, 64, 65, 3, 0, 130};
  const auto offsets = Offsets(counts);
  const int64_t rows = offsets.back() + 3;  // capacity above the used rows
  ASSERT_TRUE(cuda::GroupedSm90Supported(e, d, f));
  const testing::RandomLayer layer = testing::RandomExperts(rng_, e, d, f, rows);
  const std::vector<uint16_t>&wgu = layer.wgu, &wd = layer.wd, &x = layer.x;
  std::vector<uint16_t> ref(x.size(), 0);
  SwigluParams p;
  p.weights = {wgu.data(), wd.data(), e, d, f};
  p.x = x.data();
  p.rows = rows;
  p.device_offsets = offsets.data();
  p.y = ref.data();
  ASSERT_TRUE(cpu_->Swiglu(p, nullptr).ok());
  ref.resize(offsets.back() * d);
  std::vector<int32_t> index(rows);
  for (int64_t r = 0; r < rows; ++r) index[r] = static_cast<int32_t>(rows - 1 - r);
  std::vector<uint16_t> source(x.size());
  for (int64_t r = 0; r < rows; ++r) std::copy_n(x.begin() + r * d, d, source.begin() + index[r] * d);
  DeviceVector<uint16_t> dwgu(wgu), dwd(wd), dx(x), dsource(source);
  DeviceVector<int64_t> doff(offsets);
  DeviceVector<int32_t> dindex(index);
  const CudaTuning saved = GetCudaTuning();
  for (const char* spec : {"gemm=auto", "gemm=cublas"}) {
    auto tuning = ParseCudaTuning(spec);
    ASSERT_TRUE(tuning.ok());
    SetCudaTuning(*tuning);
    auto k = CreateCudaKernels();
    ASSERT_TRUE(k.ok()) << k.status();
    // What the executor's --decode_runner auto asks: here the Hopper kernels run (auto only).
    const bool hopper = std::string(spec) == "gemm=auto";
    EXPECT_EQ((*k)->DecodeGemmBeatsPadded(e, d, f, rows), hopper) << spec;
    EXPECT_FALSE((*k)->DecodeGemmBeatsPadded(e, d, f, 4 * e - 1)) << spec << ": under four rows an expert";
    EXPECT_FALSE((*k)->DecodeGemmBeatsPadded(e, d, 96, rows)) << spec << ": d_ff not a multiple of 128";
    std::vector<std::vector<uint16_t>> outs;
    for (bool gathered : {false, true}) {
      DeviceVector<uint16_t> dy(x.size(), 0);
      SwigluParams g;
      g.weights = {dwgu.get(), dwd.get(), e, d, f};
      g.x = gathered ? dsource.get() : dx.get();
      g.x_row_index = gathered ? dindex.get() : nullptr;
      g.x_rows = gathered ? rows : 0;
      g.rows = rows;
      g.device_offsets = doff.get();
      g.y = dy.get();
      ASSERT_TRUE((*k)->Swiglu(g, nullptr).ok()) << spec;
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      auto got = dy.Host();
      got.resize(offsets.back() * d);
      double rel = 0;
      EXPECT_LT(MaxAbsDiffBf16(got, ref, &rel), 0.05f) << spec << (gathered ? " gathered" : "");
      EXPECT_LT(rel, 1e-2) << spec << (gathered ? " gathered" : "");
      outs.push_back(std::move(got));
    }
    EXPECT_EQ(outs[0], outs[1]) << spec << ": the gathered rows differ from the direct ones";
    if (hopper) {
      // The API call ran the Hopper kernels: its bits are those of a direct launch (64-row tiles
      // at these segment sizes), not merely close to the reference.
      DeviceVector<uint16_t> dy(x.size(), 0), da(static_cast<size_t>(rows) * f, 0);
      ASSERT_EQ(cuda::LaunchGroupedSm90Swiglu(dx.get(), rows, doff.get(), e, d, f, dwgu.get(), dwd.get(), da.get(),
                                              dy.get(), cuda::Sm90Schedule::kRows64, nullptr),
                cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      auto direct = dy.Host();
      direct.resize(offsets.back() * d);
      EXPECT_EQ(outs[0], direct) << "gemm=auto did not run the Hopper kernels";
    }
  }
  SetCudaTuning(saved);
}

TEST_F(CudaKernelsTest, DeviceOffsetSwigluPassesOfEveryWidthAgree) {
  const int e = 5, d = 256, f = 160;
  const std::vector<int64_t> counts = {8, 13, 16, 0, 45};
  const auto offsets = Offsets(counts);
  const int64_t rows = offsets.back();
  auto wgu0 = RandomBf16(rng_, static_cast<size_t>(2) * f * d, 1.0f / std::sqrt(static_cast<float>(d)));
  auto wd0 = RandomBf16(rng_, static_cast<size_t>(d) * f, 1.0f / std::sqrt(static_cast<float>(f)));
  std::vector<uint16_t> wgu, wd;
  for (int i = 0; i < e; ++i) {
    wgu.insert(wgu.end(), wgu0.begin(), wgu0.end());
    wd.insert(wd.end(), wd0.begin(), wd0.end());
  }
  const auto x8 = RandomBf16(rng_, static_cast<size_t>(8) * d, 1.0f);
  std::vector<uint16_t> x(static_cast<size_t>(rows) * d);
  for (int ex = 0; ex < e; ++ex) {
    for (int64_t r = 0; r < counts[ex]; ++r)
      std::copy_n(x8.begin() + (r % 8) * d, d, x.begin() + (offsets[ex] + r) * d);
  }
  std::vector<uint16_t> ref(x.size(), 0);
  SwigluParams p;
  p.weights = {wgu.data(), wd.data(), e, d, f};
  p.x = x.data();
  p.rows = rows;
  p.device_offsets = offsets.data();
  p.y = ref.data();
  ASSERT_TRUE(cpu_->Swiglu(p, nullptr).ok());
  DeviceVector<uint16_t> dwgu(wgu), dwd(wd), dx(x);
  DeviceVector<int64_t> doff(offsets);
  p.weights = {dwgu.get(), dwd.get(), e, d, f};
  p.x = dx.get();
  p.device_offsets = doff.get();
  std::vector<std::vector<uint16_t>> outputs;
  for (const int64_t bound : {4, 16, 0}) {
    DeviceVector<uint16_t> dy(x.size(), 0xFFFF);
    p.max_segment_rows = bound;
    p.y = dy.get();
    ASSERT_TRUE(gpu_->Swiglu(p, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    outputs.push_back(dy.Host());
    const auto& got = outputs.back();
    for (int ex = 1; ex < e; ++ex) {
      for (int64_t r = 0; r < counts[ex]; ++r) {
        const auto row = got.begin() + (offsets[ex] + r) * d;
        EXPECT_TRUE(std::equal(row, row + d, got.begin() + (r % 8) * d))
            << "bound " << bound << " expert " << ex << " row " << r;
      }
    }
    double rel = 0;
    EXPECT_TRUE(std::isfinite(MaxAbsDiffBf16(got, ref, &rel))) << "bound " << bound;  // 0xFFFF (NaN): a row missed
    EXPECT_LT(rel, 1e-2) << "bound " << bound;
  }
  EXPECT_EQ(outputs[0], outputs[1]);
  EXPECT_EQ(outputs[0], outputs[2]);
}

// The decode path's padded runner (device offsets, padded layout): every expert computed at the
// layout's capacity by strided-batched GEMMs, the gather from the source rows fused, padding
// zeroed, only useful rows written. Against the CPU (which runs the grouped semantics) and the
// decode kernels on the same input; rows of y past offsets[E] keep their poison, source rows no
// route reads are NaN. Segments: empty, one row, exactly the capacity (before alignment), and
// long ones (the GEMMs' tiles). Then a segment above the capacity: its extra rows come out NaN,
// never silently zero or dropped.
TEST_F(CudaKernelsTest, DeviceOffsetSwigluPaddedRunnerMatchesCpu) {
  const int e = 6, d = 512, f = 256;
  const std::vector<int64_t> counts = {0, 1, 37, 40, 19, 8};
  const int64_t capacity = 40;
  const auto offsets = Offsets(counts);
  const int64_t used = offsets.back(), rows = used + 5, x_rows = used + 7;
  auto wgu = RandomBf16(rng_, static_cast<size_t>(e) * 2 * f * d, 1.0f / std::sqrt(static_cast<float>(d)));
  auto wd = RandomBf16(rng_, static_cast<size_t>(e) * d * f, 1.0f / std::sqrt(static_cast<float>(f)));
  auto source = RandomBf16(rng_, static_cast<size_t>(x_rows) * d, 1.0f);
  std::vector<int32_t> index(rows);
  for (int64_t r = 0; r < rows; ++r) index[r] = static_cast<int32_t>((r * 7 + 3) % used);  // source rows below `used`
  for (int64_t r = used; r < x_rows; ++r) std::fill_n(source.begin() + r * d, d, uint16_t{0x7FC0});  // NaN, never read
  SwigluParams p;
  p.weights = {wgu.data(), wd.data(), e, d, f};
  p.x = source.data();
  p.x_rows = x_rows;
  p.x_row_index = index.data();
  p.rows = rows;
  p.device_offsets = offsets.data();
  std::vector<uint16_t> ref(static_cast<size_t>(rows) * d, 0);
  p.y = ref.data();
  ASSERT_TRUE(cpu_->Swiglu(p, nullptr).ok());
  DeviceVector<uint16_t> dwgu(wgu), dwd(wd), dsource(source), padded(ref.size(), 0x1234), kernels(ref.size(), 0x1234);
  DeviceVector<int64_t> doff(offsets);
  DeviceVector<int32_t> dindex(index);
  p.weights = {dwgu.get(), dwd.get(), e, d, f};
  p.x = dsource.get();
  p.x_row_index = dindex.get();
  p.device_offsets = doff.get();
  p.y = kernels.get();
  ASSERT_TRUE(gpu_->Swiglu(p, nullptr).ok());
  p.layout.layout = Layout::kPaddedDense;
  p.layout.capacity = capacity;
  p.layout.alignment = 16;
  p.y = padded.get();
  ASSERT_TRUE(gpu_->Swiglu(p, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  auto got = padded.Host(), other = kernels.Host();
  for (size_t i = static_cast<size_t>(used) * d; i < got.size(); ++i) ASSERT_EQ(got[i], 0x1234) << "row " << i / d;
  got.resize(used * d);
  other.resize(used * d);
  ref.resize(used * d);
  double rel = 0;
  EXPECT_TRUE(std::isfinite(MaxAbsDiffBf16(got, ref, &rel)));
  EXPECT_LT(rel, 1e-2);
  EXPECT_TRUE(std::isfinite(MaxAbsDiffBf16(got, other, &rel)));
  EXPECT_LT(rel, 1e-2);

  // Capacity 32 < 37 and 40: the contract broken. Rows past it are NaN; the rest still right.
  p.layout.capacity = 32;
  p.layout.alignment = 1;
  DeviceVector<uint16_t> over(static_cast<size_t>(rows) * d, 0);
  p.y = over.get();
  ASSERT_TRUE(gpu_->Swiglu(p, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto broken = over.Host();
  std::vector<uint16_t> kept, kept_ref;
  for (int ex = 0; ex < e; ++ex) {
    for (int64_t i = 0; i < counts[ex]; ++i) {
      const int64_t r = offsets[ex] + i;
      if (i < 32) {
        kept.insert(kept.end(), broken.begin() + r * d, broken.begin() + (r + 1) * d);
        kept_ref.insert(kept_ref.end(), ref.begin() + r * d, ref.begin() + (r + 1) * d);
      } else {
        EXPECT_TRUE(std::all_of(broken.begin() + r * d, broken.begin() + (r + 1) * d,
                                [](uint16_t v) { return std::isnan(Bf16ToFloat(v)); }))
            << "expert " << ex << " row " << i << " past the capacity";
      }
    }
  }
  EXPECT_TRUE(std::isfinite(MaxAbsDiffBf16(kept, kept_ref, &rel)));
  EXPECT_LT(rel, 1e-2);
  // The CPU refuses the same call up front.
  p.weights = {wgu.data(), wd.data(), e, d, f};
  p.x = source.data();
  p.x_row_index = index.data();
  p.device_offsets = offsets.data();
  std::vector<uint16_t> cpu_out(static_cast<size_t>(rows) * d);
  p.y = cpu_out.data();
  EXPECT_EQ(cpu_->Swiglu(p, nullptr).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(CudaKernelsTest, RouteRowsWithManyExperts) {
  // More experts than one block's routing holds (past the single-block path), up to the CUDA
  // limit of 12288 (48 KiB of counts a block): an empty step gives empty segments, and a step
  // of 2400 routes the CPU's counts and offsets.
  for (const int e : {6000, 12288}) {
    DeviceVector<int64_t> dcounts(std::vector<int64_t>(e, 7)), doffsets(std::vector<int64_t>(e + 1, 7));
    DeviceVector<int32_t> dtopk(std::vector<int32_t>(1, 0)), drow(std::vector<int32_t>(1, 0)),
        dtok(std::vector<int32_t>(1, 0));
    ASSERT_TRUE(
        gpu_->RouteRows({dtopk.get(), 0, 8, e, dcounts.get(), doffsets.get(), drow.get(), dtok.get()}, nullptr).ok())
        << e;
    EXPECT_EQ(dcounts.Host(), std::vector<int64_t>(e, 0)) << e;
    EXPECT_EQ(doffsets.Host(), std::vector<int64_t>(e + 1, 0)) << e;
    const int64_t t = 300;
    const int k = 8;
    std::vector<int32_t> topk(t * k);
    for (auto& id : topk) id = static_cast<int32_t>(rng_() % e);
    std::vector<int64_t> counts(e), offsets(e + 1);
    std::vector<int32_t> row_of_route(t * k), token_of_row(t * k);
    ASSERT_TRUE(
        cpu_->RouteRows({topk.data(), t, k, e, counts.data(), offsets.data(), row_of_route.data(), token_of_row.data()},
                        nullptr)
            .ok());
    DeviceVector<int32_t> gtopk(topk), grow(t * k, -9), gtok(t * k, -1);
    ASSERT_TRUE(
        gpu_->RouteRows({gtopk.get(), t, k, e, dcounts.get(), doffsets.get(), grow.get(), gtok.get()}, nullptr).ok())
        << e;
    EXPECT_EQ(dcounts.Host(), counts) << e;
    EXPECT_EQ(doffsets.Host(), offsets) << e;
    const auto rows = grow.Host();
    for (int64_t i = 0; i < t * k; ++i) {
      ASSERT_GE(rows[i], offsets[topk[i]]) << e;
      ASSERT_LT(rows[i], offsets[topk[i] + 1]) << e;
    }
  }
}

TEST_F(CudaKernelsTest, RouteRowsGatherAndCombineMatchCpu) {
  // k = 11: the combine takes a token's routes eight at a time (a second, partial batch); k = 1,
  // 2 and 4 combine 8, 4 and 2 vectors a thread where d / 8 divides (even trials), one otherwise.
  const int ks[] = {1, 11, 2, 4, 3, 8, 2, 1, 4};
  for (int trial = 0; trial < 9; ++trial) {
    const int e = 1 + static_cast<int>(rng_() % 40);
    const int k = ks[trial];
    const int64_t t = trial == 0 ? 5000 : static_cast<int64_t>(rng_() % 300);  // 40k routes: the multi-kernel path
    const int d =
        trial % 2 == 0 ? 64 * (1 + static_cast<int>(rng_() % 8)) : 8 * (1 + 2 * static_cast<int>(rng_() % 20));
    std::vector<int32_t> topk(t * k);
    for (auto& id : topk) id = rng_() % 10 == 0 ? -1 : static_cast<int32_t>(rng_() % std::min(e, 3 + trial));  // skewed
    std::vector<int64_t> counts(e), offsets(e + 1);
    std::vector<int32_t> row_of_route(t * k), token_of_row(t * k, -1);
    ASSERT_TRUE(
        cpu_->RouteRows({topk.data(), t, k, e, counts.data(), offsets.data(), row_of_route.data(), token_of_row.data()},
                        nullptr)
            .ok());
    DeviceVector<int32_t> dtopk(topk), drow(t * k, -9), dtok(t * k, -1);
    DeviceVector<int64_t> dcounts(e), doffsets(e + 1);
    ASSERT_TRUE(
        gpu_->RouteRows({dtopk.get(), t, k, e, dcounts.get(), doffsets.get(), drow.get(), dtok.get()}, nullptr).ok());
    EXPECT_EQ(dcounts.Host(), counts);
    EXPECT_EQ(doffsets.Host(), offsets);
    // Rows inside a segment may be ordered differently; each route must land in its expert's
    // segment, rows must be a permutation, and token_of_row must invert row_of_route.
    const auto grow = drow.Host();
    const auto gtok = dtok.Host();
    std::vector<int> seen(offsets[e], 0);
    for (int64_t i = 0; i < t * k; ++i) {
      if (topk[i] < 0) {
        EXPECT_EQ(grow[i], -1);
        continue;
      }
      ASSERT_GE(grow[i], offsets[topk[i]]);
      ASSERT_LT(grow[i], offsets[topk[i] + 1]);
      ++seen[grow[i]];
      EXPECT_EQ(gtok[grow[i]], i / k);
    }
    for (int v : seen) EXPECT_EQ(v, 1);

    // Gather rows into the device layout, then combine with random gates.
    auto hidden = RandomBf16(rng_, static_cast<size_t>(t) * d, 1.0f);
    std::vector<float> gate(t * k);
    for (auto& g : gate) g = std::uniform_real_distribution<float>(0, 1)(rng_);
    DeviceVector<uint16_t> dhidden(hidden), dpacked(static_cast<size_t>(offsets[e]) * d);
    GatherParams g;
    g.d = d;
    g.in = dhidden.get();
    g.in_rows = t;
    g.index = dtok.get();
    g.n = offsets[e];
    g.out = dpacked.get();
    ASSERT_TRUE(gpu_->Gather(g, nullptr).ok());
    DeviceVector<float> dgate(gate), dout(t * d, -1.0f);
    DeviceVector<uint16_t> dout16(t * d);
    CombineParams c{dpacked.get(), offsets[e], d, drow.get(), dgate.get(), t, k, dout.get(), dout16.get()};
    ASSERT_TRUE(gpu_->Combine(c, nullptr).ok());
    // CPU: gather by its own stable rows, combine.
    std::vector<uint16_t> packed(static_cast<size_t>(offsets[e]) * d);
    g.in = hidden.data();
    g.index = token_of_row.data();
    g.out = packed.data();
    ASSERT_TRUE(cpu_->Gather(g, nullptr).ok());
    std::vector<float> out(t * d);
    CombineParams cc{packed.data(), offsets[e], d, row_of_route.data(), gate.data(), t, k, out.data(), nullptr};
    ASSERT_TRUE(cpu_->Combine(cc, nullptr).ok());
    const auto got = dout.Host();
    for (size_t i = 0; i < out.size(); ++i) ASSERT_FLOAT_EQ(got[i], out[i]) << i;  // same order of FP32 adds
    // The BF16 output is the FP32 one rounded, element for element.
    std::vector<uint16_t> want16(got.size());
    for (size_t i = 0; i < got.size(); ++i) want16[i] = FloatToBf16(got[i]);
    EXPECT_EQ(dout16.Host(), want16) << "k " << k << " d " << d;
  }
}

// The local layer: the fused kernels (one token, eager) against the same layer run in stages on
// the GPU (bit for bit: same dot products, combine in route order) and against the CPU; repeated
// calls with new routings in between (the fused kernels keep a counter); a captured call (the
// stages) replayed with new routings.
TEST_F(CudaKernelsTest, LocalLayerFusedEqualsStagesAndMatchesCpu) {
  struct Case {
    int e, k, d, f;
    int64_t t;
    std::vector<int32_t> topk;  // empty: distinct random experts
  };
  const std::vector<Case> cases = {
      {64, 8, 512, 192, 1, {}},
      {8, 2, 1024, 256, 1, {}},
      // Repeated experts (a two-row segment), a dropped route and an id past E (dropped too).
      {16, 6, 256, 64, 1, {3, 3, -1, 7, 16, 3}},
      {300, 4, 2048, 8, 1, {}},  // E > 256; the widest fused combine (one round of the last block)
      {64, 32, 256, 32, 1, {}},  // 32 routes: the most one warp routes
      {8, 2, 4096, 64, 1, {}},   // d above the fused combine's one round: the stages
      {32, 4, 256, 96, 5, {}},   // more tokens: the stages
      // Four routes an expert (repeated ids): the stages' experts run on the Hopper kernels, so
      // the eager call must take the stages too (the fused kernels would give other bits).
      {8, 32, 512, 256, 1, {0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7,
                            0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7}},
  };
  for (const Case& tc : cases) {
    const int e = tc.e, k = tc.k, d = tc.d, f = tc.f;
    const int64_t t = tc.t;
    SCOPED_TRACE(::testing::Message() << "E=" << e << " k=" << k << " d=" << d << " f=" << f << " T=" << t);
    auto wgu = RandomBf16(rng_, static_cast<size_t>(e) * 2 * f * d, 1.0f / std::sqrt(static_cast<float>(d)));
    auto wd = RandomBf16(rng_, static_cast<size_t>(e) * d * f, 1.0f / std::sqrt(static_cast<float>(f)));
    DeviceVector<uint16_t> dwgu(wgu), dwd(wd);
    auto routing = [&] {
      if (!tc.topk.empty()) return tc.topk;
      std::vector<int32_t> ids(static_cast<size_t>(t) * k);
      for (int64_t i = 0; i < t; ++i) {
        std::vector<int32_t> all(e);
        for (int q = 0; q < e; ++q) all[q] = q;
        std::shuffle(all.begin(), all.end(), rng_);
        std::copy(all.begin(), all.begin() + k, ids.begin() + i * k);
      }
      return ids;
    };
    std::vector<int32_t> topk = routing();
    auto x = RandomBf16(rng_, static_cast<size_t>(t) * d, 1.0f);
    std::vector<float> gate(t * k);
    for (auto& g : gate) g = std::uniform_real_distribution<float>(0, 1)(rng_);
    DeviceVector<uint16_t> dx(x), dout16(t * d), dstage16(t * d);
    DeviceVector<int32_t> dtopk(topk);
    DeviceVector<float> dgate(gate), dout(t * d, -1.0f), dstage(t * d, -2.0f);
    LocalLayerParams p = LayerInputs({dwgu.get(), dwd.get(), e, d, f}, dx.get(), dtopk.get(), dgate.get(), t, k);
    p.out_fp32 = dout.get();
    p.out_bf16 = dout16.get();
    LocalLayerParams staged = p;
    staged.out_fp32 = dstage.get();
    staged.out_bf16 = dstage16.get();
    LocalLayerScratch scratch;
    auto check = [&](const std::vector<int32_t>& ids, const char* what) {
      SCOPED_TRACE(what);
      ASSERT_TRUE(RunLocalLayerInStages(gpu_.get(), staged, &scratch, nullptr).ok());
      EXPECT_EQ(dout.Host(), dstage.Host());
      EXPECT_EQ(dout16.Host(), dstage16.Host());
      std::vector<float> out(t * d);
      LocalLayerParams c = p;
      c.weights = {wgu.data(), wd.data(), e, d, f};
      c.x = x.data();
      c.topk = ids.data();
      c.gate = gate.data();
      c.out_fp32 = out.data();
      c.out_bf16 = nullptr;
      ASSERT_TRUE(cpu_->LocalLayer(c, nullptr).ok());
      const auto got = dout.Host();
      for (size_t i = 0; i < out.size(); ++i) ASSERT_TRUE(std::isfinite(got[i])) << i;
      EXPECT_LT(RelativeL2(got, out), 1e-2);
    };
    ASSERT_TRUE(gpu_->LocalLayer(p, nullptr).ok());
    check(topk, "first call");
    // A second call with another routing (and gates): nothing left over from the first.
    if (tc.topk.empty()) topk = routing();
    std::reverse(gate.begin(), gate.end());
    ASSERT_EQ(cudaMemcpy(dtopk.get(), topk.data(), topk.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dgate.get(), gate.data(), gate.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_TRUE(gpu_->LocalLayer(p, nullptr).ok());
    check(topk, "second call");
    // Back-to-back calls (no host sync: the fused kernels chain) into three poisoned outputs:
    // every call must find its own last block (the counter returns to zero each time).
    {
      std::vector<std::unique_ptr<DeviceVector<uint16_t>>> outs;
      LocalLayerParams chained = p;
      chained.out_fp32 = nullptr;
      for (int i = 0; i < 3; ++i) {
        outs.push_back(std::make_unique<DeviceVector<uint16_t>>(t * d, uint16_t{0x7fc0}));
        chained.out_bf16 = outs.back()->get();
        ASSERT_TRUE(gpu_->LocalLayer(chained, nullptr).ok());
      }
      const auto want = dstage16.Host();
      for (int i = 0; i < 3; ++i) EXPECT_EQ(outs[i]->Host(), want) << "chained call " << i;
    }
    // Captured once, replayed with new routings written into the same buffers.
    cudaStream_t st;
    ASSERT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    ASSERT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    ASSERT_TRUE(gpu_->LocalLayer(p, st).ok());
    ASSERT_EQ(cudaStreamEndCapture(st, &graph), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    for (int replay = 0; replay < 3; ++replay) {
      if (tc.topk.empty()) topk = routing();
      ASSERT_EQ(cudaMemcpy(dtopk.get(), topk.data(), topk.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemset(dout.get(), 0xff, t * d * 4), cudaSuccess);
      ASSERT_EQ(cudaGraphLaunch(exec, st), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
      check(topk, "graph replay");
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(st);
  }
}

// LocalLayer with the padded runner (the caller's capacity: the largest expert's routes, as a
// lone executor member counts them) against the decode kernels and the CPU's padded layer:
// every token within rounding, nothing NaN (a missed row would be).
TEST_F(CudaKernelsTest, LocalLayerPaddedRunnerMatchesDecodeKernels) {
  const int e = 16, d = 512, f = 256, k = 4;
  const int64_t t = 24;
  auto wgu = RandomBf16(rng_, static_cast<size_t>(e) * 2 * f * d, 1.0f / std::sqrt(static_cast<float>(d)));
  auto wd = RandomBf16(rng_, static_cast<size_t>(e) * d * f, 1.0f / std::sqrt(static_cast<float>(f)));
  auto x = RandomBf16(rng_, static_cast<size_t>(t) * d, 1.0f);
  std::vector<int32_t> topk(t * k);
  std::vector<float> gate(t * k);
  std::vector<int64_t> counts(e, 0);
  for (int64_t i = 0; i < t; ++i) {
    for (int j = 0; j < k; ++j) {
      topk[i * k + j] = static_cast<int32_t>((i * 5 + j * 3 + (i % 3)) % e);  // distinct within a token
      gate[i * k + j] = 0.25f + 0.05f * j;
      ++counts[topk[i * k + j]];
    }
  }
  const int64_t most = *std::max_element(counts.begin(), counts.end());
  LocalLayerParams p = LayerInputs({wgu.data(), wd.data(), e, d, f}, x.data(), topk.data(), gate.data(), t, k);
  p.padded_capacity = most;
  std::vector<float> cpu_out(t * d);
  p.out_fp32 = cpu_out.data();
  ASSERT_TRUE(cpu_->LocalLayer(p, nullptr).ok());
  DeviceVector<uint16_t> dwgu(wgu), dwd(wd), dx(x);
  DeviceVector<int32_t> dtopk(topk);
  DeviceVector<float> dgate(gate), padded(t * d, 0.0f), kernels(t * d, 0.0f);
  p.weights = {dwgu.get(), dwd.get(), e, d, f};
  p.x = dx.get();
  p.topk = dtopk.get();
  p.gate = dgate.get();
  p.out_fp32 = padded.get();
  ASSERT_TRUE(gpu_->LocalLayer(p, nullptr).ok());
  p.padded_capacity = 0;
  p.out_fp32 = kernels.get();
  ASSERT_TRUE(gpu_->LocalLayer(p, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got = padded.Host(), other = kernels.Host();
  for (size_t i = 0; i < got.size(); ++i) ASSERT_TRUE(std::isfinite(got[i])) << "element " << i;
  EXPECT_LT(RelativeL2(got, other), 1e-2);
  EXPECT_LT(RelativeL2(got, cpu_out), 1e-2);
}

TEST_F(CudaKernelsTest, LocalLayerRejectsBadParamsBeforeLaunch) {
  LocalLayerParams p;
  p.weights = {nullptr, nullptr, 8, 64, 32};
  EXPECT_EQ(gpu_->LocalLayer(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

// PackFp8Rows on the GPU gives the CPU reference's bytes, scales and zero padding, from rows at
// any 2-byte offset (the unaligned loads) and from 16-byte aligned ones; rows no route names stay.
TEST_F(CudaKernelsTest, PackFp8RowsMatchesCpuBitForBit) {
  for (const int d : {384, 2048, 7168}) {
    for (const int shift : {0, 1}) {  // x at a 16-byte boundary, or 2 bytes past one
      const int64_t tokens = 37, fanout = 3, out_rows = tokens * fanout + 5;
      const int64_t packed = Fp8PackedRowBytes(d);
      std::vector<uint16_t> x = RandomBf16(rng_, (tokens + 1) * d, 2.0f);
      for (int c = 0; c < d; ++c) x[shift + c] = 0;  // an all-zero token: scale 1
      // Distinct destinations (two routes naming one row: either may win), some negative and some
      // past out_rows (skipped).
      std::vector<int32_t> dest(out_rows + 4);
      std::iota(dest.begin(), dest.end(), -2);
      std::shuffle(dest.begin(), dest.end(), rng_);
      dest.resize(tokens * fanout);
      std::vector<uint8_t> want(out_rows * packed, 0xee);
      PackFp8Params p{x.data() + shift, tokens, d, dest.data(), static_cast<int>(fanout), want.data(), out_rows};
      ASSERT_TRUE(cpu_->PackFp8Rows(p, nullptr).ok());
      DeviceVector<uint16_t> dx(x);
      DeviceVector<int32_t> ddest(dest);
      DeviceVector<uint8_t> dout(want.size(), 0xee);
      p.x = dx.get() + shift;
      p.dest = ddest.get();
      p.out = dout.get();
      ASSERT_TRUE(gpu_->PackFp8Rows(p, nullptr).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(dout.Host(), want) << "d=" << d << " shift " << shift;
    }
  }
}

TEST_F(CudaKernelsTest, Fp8MatchesCpuBitForBit) {
  for (ScaleGranularity gr :
       {ScaleGranularity::kPerRow, ScaleGranularity::kPerBlock128, ScaleGranularity::kBlock128x128}) {
    // Block scales: three block rows, the last partial.
    const int64_t rows = gr == ScaleGranularity::kBlock128x128 ? 300 : 37;
    const int d = 7168;
    auto x = RandomBf16(rng_, rows * d, 2.0f);
    // Edge rows: all zero (scale 1), an amax below kFp8MinAmax (inverse scale kept finite), ~1e37,
    // a 128-value group of zeros inside a row.
    for (int c = 0; c < d; ++c) {
      x[c] = 0;
      x[d + c] = FloatToBf16(Bf16ToFloat(x[d + c]) * 1e-32f);
      x[2 * d + c] = FloatToBf16(Bf16ToFloat(x[2 * d + c]) * 1e37f);
    }
    for (int c = 256; c < 384; ++c) x[3 * d + c] = 0;
    const int64_t ns = ScaleCount(gr, rows, d);
    std::vector<uint8_t> q(rows * d);
    std::vector<float> scales(ns);
    ASSERT_TRUE(cpu_->Quantize({x.data(), rows, d, gr, q.data(), scales.data(), ns}, nullptr).ok());
    DeviceVector<uint16_t> dx(x), dback(rows * d);
    DeviceVector<uint8_t> dq(rows * d);
    DeviceVector<float> dscales(ns);
    ASSERT_TRUE(gpu_->Quantize({dx.get(), rows, d, gr, dq.get(), dscales.get(), ns}, nullptr).ok());
    EXPECT_EQ(dq.Host(), q);
    EXPECT_EQ(dscales.Host(), scales);
    std::vector<uint16_t> back(rows * d);
    ASSERT_TRUE(cpu_->Dequantize({q.data(), scales.data(), ns, rows, d, gr, back.data()}, nullptr).ok());
    ASSERT_TRUE(gpu_->Dequantize({dq.get(), dscales.get(), ns, rows, d, gr, dback.get()}, nullptr).ok());
    EXPECT_EQ(dback.Host(), back);
    // A wrong scale count is rejected before anything is launched.
    EXPECT_EQ(gpu_->Dequantize({dq.get(), dscales.get(), ns - 1, rows, d, gr, dback.get()}, nullptr).code(),
              absl::StatusCode::kInvalidArgument);
  }
}

TEST_F(CudaKernelsTest, HistogramScanStaysOnDevice) {
  std::vector<int32_t> keys(100000);
  for (auto& k : keys) k = static_cast<int32_t>(rng_() % 300) - 10;  // -10..-1 are dropped routes
  std::vector<int64_t> counts(290), offsets(291);
  ASSERT_TRUE(
      cpu_->HistogramScan({keys.data(), static_cast<int64_t>(keys.size()), 290, counts.data(), offsets.data()}, nullptr)
          .ok());
  DeviceVector<int32_t> dkeys(keys);
  DeviceVector<int64_t> dcounts(290), doffsets(291);
  ASSERT_TRUE(
      gpu_->HistogramScan({dkeys.get(), static_cast<int64_t>(keys.size()), 290, dcounts.get(), doffsets.get()}, nullptr)
          .ok());
  EXPECT_EQ(dcounts.Host(), counts);
  EXPECT_EQ(doffsets.Host(), offsets);
}

// The device NaN/Inf scan answers what the CPU reference answers: the first bad index (in the
// 16-byte vectors or in the tail, aligned or not), -1 for finite rows.
TEST_F(CudaKernelsTest, FindNonFiniteMatchesCpu) {
  const int64_t n = (int64_t{1} << 20) + 13;
  std::vector<uint16_t> x = RandomBf16(rng_, n, 1.0f);
  DeviceVector<uint16_t> dx(x.size() + 1);
  auto scan = [&](const std::vector<uint16_t>& v, int64_t shift) {
    EXPECT_EQ(cudaMemcpy(dx.get() + shift, v.data(), v.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    auto got = gpu_->FindNonFiniteBf16(dx.get() + shift, static_cast<int64_t>(v.size()), nullptr);
    auto want = cpu_->FindNonFiniteBf16(v.data(), static_cast<int64_t>(v.size()), nullptr);
    EXPECT_TRUE(got.ok() && want.ok());
    EXPECT_EQ(*got, *want) << "shift " << shift;
    return got.ok() ? *got : -2;
  };
  for (int64_t shift : {0, 1}) {  // 16-byte aligned, then not
    EXPECT_EQ(scan(x, shift), -1);
    for (int64_t bad : {int64_t{0}, int64_t{7}, int64_t{777777}, n - 1}) {
      std::vector<uint16_t> y = x;
      y[bad] = 0x7fc0;                       // NaN
      if (bad + 5 < n) y[bad + 5] = 0xff80;  // -infinity after it: the first one is reported
      EXPECT_EQ(scan(y, shift), bad);
    }
  }
  std::vector<uint16_t> inf = x;
  inf[12345] = 0x7f80;
  EXPECT_EQ(scan(inf, 0), 12345);
  auto zero = gpu_->FindNonFiniteBf16(dx.get(), 0, nullptr);
  ASSERT_TRUE(zero.ok());
  EXPECT_EQ(*zero, -1);
}

// ComposeIndex on the GPU against the reference: permutations, -1 entries and entries past a.
TEST_F(CudaKernelsTest, ComposeIndexMatchesCpu) {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{300}, int64_t{65536 + 7}}) {
    const int64_t a_n = n + 5;
    std::vector<int32_t> a(a_n), b(n);
    for (int64_t i = 0; i < a_n; ++i) a[i] = static_cast<int32_t>((i * 7919) % (a_n + 3)) - 1;
    std::uniform_int_distribution<int64_t> pick(-2, a_n + 2);
    for (int64_t i = 0; i < n; ++i) b[i] = static_cast<int32_t>(pick(rng_));
    std::vector<int32_t> want(n, 99);
    kernels::ComposeIndexParams p{a.data(), a_n, b.data(), n, want.data()};
    ASSERT_TRUE(cpu_->ComposeIndex(p, nullptr).ok());
    DeviceVector<int32_t> d_a(a), d_b(b), d_out(std::vector<int32_t>(n, 99));
    p = {d_a.get(), a_n, d_b.get(), n, d_out.get()};
    ASSERT_TRUE(gpu_->ComposeIndex(p, nullptr).ok());
    EXPECT_EQ(d_out.Host(), want) << "n " << n;
  }
}

// Scatter equals the CPU reference: rows of whole 16-byte vectors (a warp a row, more than one
// unrolled pass at d = 2056) and of odd sizes (an element a thread), fan-outs 1 to 8, destinations
// -1 and past the output skipped, unnamed rows untouched.
TEST_F(CudaKernelsTest, ScatterMatchesCpu) {
  for (int d : {8, 2048, 2056, 7}) {
    for (int fanout : {1, 2, 8}) {
      const int64_t in_rows = 300, out_rows = in_rows * fanout - 5;
      const auto in = RandomBf16(rng_, static_cast<size_t>(in_rows) * d, 1.0f);
      // A permutation of the output rows over the entries, a few entries skipped.
      std::vector<int32_t> dest(in_rows * fanout);
      for (int64_t i = 0; i < in_rows * fanout; ++i) dest[i] = static_cast<int32_t>((i * 7919) % (in_rows * fanout));
      std::shuffle(dest.begin(), dest.end(), rng_);
      for (int64_t i = 3; i < in_rows * fanout; i += 17) dest[i] = i % 2 == 0 ? -1 : static_cast<int32_t>(out_rows + i);
      std::vector<uint16_t> want(static_cast<size_t>(out_rows) * d, uint16_t{0x7fc0});
      ScatterParams p{d, in.data(), in_rows, dest.data(), fanout, want.data(), out_rows};
      ASSERT_TRUE(cpu_->Scatter(p, nullptr).ok());
      DeviceVector<uint16_t> din(in), dout(want.size(), uint16_t{0x7fc0});
      DeviceVector<int32_t> ddest(dest);
      p = {d, din.get(), in_rows, ddest.get(), fanout, dout.get(), out_rows};
      ASSERT_TRUE(gpu_->Scatter(p, nullptr).ok());
      EXPECT_EQ(dout.Host(), want) << "d " << d << " fanout " << fanout;
      // Into wider rows (out_ld: 8 more words, or 1 more), the rest of each row left alone.
      for (int64_t ld : {int64_t{d} + 8, int64_t{d} + 1}) {
        std::vector<uint16_t> wide(static_cast<size_t>(out_rows) * ld, uint16_t{0x7fc0});
        ScatterParams w{d, in.data(), in_rows, dest.data(), fanout, wide.data(), out_rows, ld};
        ASSERT_TRUE(cpu_->Scatter(w, nullptr).ok());
        DeviceVector<uint16_t> dwide(wide.size(), uint16_t{0x7fc0});
        w = {d, din.get(), in_rows, ddest.get(), fanout, dwide.get(), out_rows, ld};
        ASSERT_TRUE(gpu_->Scatter(w, nullptr).ok());
        EXPECT_EQ(dwide.Host(), wide) << "d " << d << " fanout " << fanout << " out_ld " << ld;
      }
    }
  }
}

// The device plan's calls equal the CPU reference element for element: keys, gates, positions
// (a stable order), pack order, slot values, counts, offsets and the first bad element, over
// tile boundaries (256), many keys, a key map, and inputs with bad routes.
TEST_F(CudaKernelsTest, RoutePlanningMatchesCpu) {
  for (int64_t routes : {int64_t{0}, int64_t{1}, int64_t{255}, int64_t{257}, int64_t{16384 + 3}, int64_t{65536}}) {
    for (int num_keys : {1, 37, 300, 5000}) {
      const int experts = num_keys + 3;  // three experts without a key
      std::uniform_int_distribution<int> pick(0, experts - 1);
      std::vector<int32_t> ids(routes), key_of_expert(experts), slot_of_key(num_keys);
      std::vector<float> gates(routes);
      std::vector<uint8_t> admitted(routes);
      for (int e = 0; e < experts; ++e) key_of_expert[e] = e < num_keys ? (e * 7919) % num_keys : -1;
      for (int k = 0; k < num_keys; ++k) slot_of_key[k] = 3 * k + 1;
      for (int64_t i = 0; i < routes; ++i) {
        ids[i] = pick(rng_) % std::max(1, num_keys);  // keyed experts only
        gates[i] = static_cast<float>(i % 97) / 97.0f;
        admitted[i] = i % 11 != 0;
      }
      // Each key's local slot (every third key has none), composed in the seal's pass.
      std::vector<int32_t> local_of_key(num_keys);
      for (int k = 0; k < num_keys; ++k) local_of_key[k] = k % 3 == 2 ? -1 : k / 3;
      auto seal_both = [&](const std::vector<int32_t>& id, const std::vector<float>& g) {
        DeviceVector<int32_t> d_ids(id), d_key_of_expert(key_of_expert), d_keys(routes), d_local_of_key(local_of_key),
            d_local(routes);
        DeviceVector<float> d_gates(g), d_gates_out(routes);
        DeviceVector<uint8_t> d_admitted(admitted);
        DeviceVector<int64_t> d_status(2);
        std::vector<int32_t> keys(routes), local(routes);
        std::vector<float> gates_out(routes);
        std::vector<int64_t> status(2);
        kernels::SealRoutesParams p{id.data(),   g.data(),         admitted.data(),
                                    routes,      experts,          key_of_expert.data(),
                                    keys.data(), gates_out.data(), status.data()};
        EXPECT_TRUE(cpu_->SealRoutes(p, nullptr).ok());
        // The status starts as garbage on the GPU: the one-block seal must not need a reset.
        std::vector<int64_t> garbage = {5, 7};
        d_status.Upload(garbage);
        p = {d_ids.get(),           d_gates.get(), d_admitted.get(),  routes,        experts,
             d_key_of_expert.get(), d_keys.get(),  d_gates_out.get(), d_status.get()};
        EXPECT_TRUE(gpu_->SealRoutes(p, nullptr).ok());
        EXPECT_EQ(d_keys.Host(), keys);
        EXPECT_EQ(d_gates_out.Host(), gates_out);
        EXPECT_EQ(d_status.Host(), status);
        // With the local slots: the same keys, gates and status, and ComposeIndex's local slots.
        p.local_of_key = d_local_of_key.get();
        p.num_keys = num_keys;
        p.local = d_local.get();
        d_status.Upload(garbage);
        EXPECT_TRUE(gpu_->SealRoutes(p, nullptr).ok());
        for (int64_t i = 0; i < routes; ++i) {
          local[i] = keys[i] >= 0 && keys[i] < num_keys ? local_of_key[keys[i]] : -1;
        }
        EXPECT_EQ(d_local.Host(), local);
        EXPECT_EQ(d_keys.Host(), keys);
        EXPECT_EQ(d_status.Host(), status);
        return std::make_pair(keys, status);
      };
      auto [keys, status] = seal_both(ids, gates);
      EXPECT_EQ(status, (std::vector<int64_t>{-1, -1}));
      if (routes > 200) {
        std::vector<int32_t> bad_ids = ids;
        std::vector<float> bad_gates = gates;
        bad_ids[150] = experts;          // out of range
        bad_gates[170] = std::nanf("");  // NaN
        bad_ids[122] = num_keys;         // a valid expert without a key (route 121 is unadmitted)
        bad_ids[110] = -5;               // unadmitted: not checked
        admitted[110] = 0;
        auto [k2, s2] = seal_both(bad_ids, bad_gates);
        EXPECT_EQ(s2, (std::vector<int64_t>{150, 122}));
        admitted[110] = 1;
      }
      // Rank the keys, with the pack order (routes of 2) and the slot values.
      auto rank_both = [&](const std::vector<int32_t>& raw, const std::vector<int32_t>* map, int divisor) {
        const int64_t n = static_cast<int64_t>(raw.size());
        std::vector<int32_t> pos(n), order(n, -7), values(n, -7);
        std::vector<int64_t> counts(num_keys), offsets(num_keys + 1), st(1);
        kernels::RankByKeyParams p;
        p.raw = raw.data();
        p.n = n;
        p.key_map = map != nullptr ? map->data() : nullptr;
        p.map_size = map != nullptr ? static_cast<int>(map->size()) : 0;
        p.num_keys = num_keys;
        p.position = pos.data();
        p.order = order.data();
        p.order_divisor = divisor;
        p.key_values = slot_of_key.data();
        p.values = values.data();
        p.counts = counts.data();
        p.offsets = offsets.data();
        p.status = st.data();
        const absl::Status cpu_status = cpu_->RankByKey(p, nullptr);
        EXPECT_TRUE(cpu_status.ok()) << cpu_status;
        DeviceVector<int32_t> d_raw(raw), d_pos(n), d_order(std::vector<int32_t>(n, -7)),
            d_values(std::vector<int32_t>(n, -7)), d_slot_of_key(slot_of_key),
            d_map(map != nullptr ? *map : std::vector<int32_t>{});
        DeviceVector<int64_t> d_counts(num_keys), d_offsets(num_keys + 1), d_st(1);
        p.raw = d_raw.get();
        p.key_map = map != nullptr ? d_map.get() : nullptr;
        p.position = d_pos.get();
        p.order = d_order.get();
        p.key_values = d_slot_of_key.get();
        p.values = d_values.get();
        p.counts = d_counts.get();
        p.offsets = d_offsets.get();
        p.status = d_st.get();
        EXPECT_TRUE(gpu_->RankByKey(p, nullptr).ok());
        EXPECT_EQ(d_st.Host(), st) << "routes " << routes << " keys " << num_keys;
        if (st[0] < 0) {
          EXPECT_EQ(d_pos.Host(), pos) << "routes " << routes << " keys " << num_keys;
          EXPECT_EQ(d_order.Host(), order);
          EXPECT_EQ(d_values.Host(), values);
          EXPECT_EQ(d_counts.Host(), counts);
          EXPECT_EQ(d_offsets.Host(), offsets);
        }
        return st[0];
      };
      EXPECT_EQ(rank_both(keys, nullptr, 2), -1);
      // Through a map: raw slot ids 3k + 1 back to keys; -1 is "no key".
      std::vector<int32_t> map(3 * num_keys + 2, -1), raw(keys.size());
      for (int k = 0; k < num_keys; ++k) map[3 * k + 1] = k;
      for (size_t i = 0; i < keys.size(); ++i) raw[i] = keys[i] < 0 ? -1 : 3 * keys[i] + 1;
      EXPECT_EQ(rank_both(raw, &map, 1), -1);
      if (routes > 200) {
        raw[180] = 0;  // a slot the map does not hold
        raw[199] = static_cast<int32_t>(map.size());
        EXPECT_EQ(rank_both(raw, &map, 1), 180);
      }
    }
  }
}

// A memory or event handle that names nothing is refused, not mapped, and the process stays
// usable. (compute-sanitizer reports the refused driver calls as API errors: run it on the
// other tests.)
TEST_F(CudaKernelsTest, IpcRefusesBadHandles) {
  EXPECT_EQ(gpu_->OpenIpcMemory(std::string(10, 'x')).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu_->OpenIpcMemory(std::string(64, '\0')).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu_->OpenIpcEvent(std::string(63, 'x')).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu_->OpenIpcEvent(std::string(64, '\0')).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<uint16_t> x(4096, 0x3f80);
  x[4000] = 0x7fc0;
  DeviceVector<uint16_t> dx(x);
  auto after = gpu_->FindNonFiniteBf16(dx.get(), static_cast<int64_t>(x.size()), nullptr);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(*after, 4000);
}

// The rank's done events: exported interprocess, recorded after the stream's work, done once it is.
TEST_F(CudaKernelsTest, IpcEventsAreExportedAndRecordedOnTheStream) {
  std::string handle;
  absl::StatusOr<void*> event = gpu_->CreateIpcEvent(&handle);
  ASSERT_TRUE(event.ok()) << event.status();
  EXPECT_EQ(handle.size(), 64u);
  std::vector<uint16_t> x(1 << 20, 0x3f80);
  DeviceVector<uint16_t> dx(x);
  ASSERT_TRUE(gpu_->StartFindNonFiniteBf16(dx.get(), static_cast<int64_t>(x.size()), nullptr).ok());
  ASSERT_TRUE(gpu_->RecordEvent(*event, nullptr).ok());
  auto first = gpu_->FinishFindNonFiniteBf16();
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(*first, -1);
  ASSERT_TRUE(gpu_->Synchronize(nullptr).ok());
  auto done = gpu_->EventDone(*event);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_TRUE(*done);
  // A second event has a handle of its own.
  std::string other;
  absl::StatusOr<void*> second = gpu_->CreateIpcEvent(&other);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_NE(other, handle);
  gpu_->CloseIpcEvent(*second);
  gpu_->CloseIpcEvent(*event);
  std::string none;
  EXPECT_EQ(cpu_->CreateIpcEvent(&none).status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace moe::kernels
