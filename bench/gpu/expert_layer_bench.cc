// The local expert layer on one GPU: route rows (device histogram + scan + row assignment),
// scatter rows expert-major, SwiGLU experts (gate+up GEMM, activation, down GEMM), gate-weighted
// combine, for the shapes; plus the two ceilings measured in the same run: cuBLAS BF16
// 8192^3 and a device-to-device copy. Prints one JSON object per line (bench/gpu/report.py
// joins them with the PyTorch reference).
//
// Usage: expert_layer_bench [--reps N] [--layout grouped|padded|block] [--quick] [--shape S] [--tokens T]
//   [--decode-only] [--cold-l2] [--padded-decode (also the decode path's padded runner, T <= 128)]
//   [--sustain_ms MS (with the "fp8" lines, T >= 1024: the BF16 experts, then the FP8 experts from
//    quantized rows, each run back to back for MS ms: "sustained" lines with their wall-clock
//    windows, for a clock and power sampler beside the run: bench/gpu/sustained.sh)]
//   [--cell_gap_ms MS (the GPU left idle that long before each cell's main paths are timed, so
//    that every cell starts from the same state whatever ran before it; vllm_compare.py takes the
//    same flag for its side)]
//   [--routing_out DIR (writes each cell's routing to DIR/<shape>-T<t>.bin: int32 top-k ids then
//    float32 gates, T*k of each, for peers timed on the same routings: bench/gpu/vllm_compare.py)]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <cublas_v2.h>

#include "bench/gpu/cuda_check.h"
#include "bench/gpu/fill.h"
#include "bench/stats.h"
#include "kernels/api.h"
#include "kernels/numeric.h"

namespace {

using moe::bench::Median;

#define CHECK_OK(x)                                                                                      \
  do {                                                                                                   \
    absl::Status s_ = (x);                                                                               \
    if (!s_.ok()) {                                                                                      \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, std::string(s_.message()).c_str()); \
      std::exit(1);                                                                                      \
    }                                                                                                    \
  } while (0)

// An FP8 copy of a BF16 weight matrix [rows, cols] (rows and cols multiples of 128), made by the
// kernels' Quantize as moe-rankd --expert_dtype fp8 makes it: E4M3, one scale per 128 x 128 block.
struct Fp8Copy {
  uint8_t* q = nullptr;
  float* scales = nullptr;
  static Fp8Copy Of(moe::kernels::ExpertKernels* k, const uint16_t* w, int64_t rows, int cols, cudaStream_t st) {
    Fp8Copy c;
    const int64_t blocks = (rows / 128) * (cols / 128);
    CHECK_CUDA(cudaMalloc(&c.q, rows * cols));
    CHECK_CUDA(cudaMalloc(&c.scales, blocks * sizeof(float)));
    moe::kernels::QuantizeParams p;
    p.x = w;
    p.rows = rows;
    p.d = cols;
    p.granularity = moe::kernels::ScaleGranularity::kBlock128x128;
    p.q = c.q;
    p.scales = c.scales;
    p.scale_count = blocks;
    CHECK_OK(k->Quantize(p, st));
    return c;
  }
  void Free() {
    cudaFree(q);
    cudaFree(scales);
    q = nullptr;
    scales = nullptr;
  }
};

struct Shape {
  const char* name;
  int e, k, d, f;
  std::vector<int64_t> tokens;
};

// --cold-l2: every timed repetition starts from an L2 that holds nothing of the previous one
// (a decode step's weights are those of another layer the step before), scrubbed and
// synchronized outside the timed interval. Without it, repetitions run back to back on the same
// weights and may find part of them in L2.
bool g_cold_l2 = false;

// One timed repetition between two events (the stream idle before it, cold L2 if asked).
template <typename F>
double TimeOnceUs(cudaStream_t st, cudaEvent_t a, cudaEvent_t b, F&& body) {
  if (g_cold_l2) {
    CHECK_CUDA(moe::bench::ScrubL2(st));
    CHECK_CUDA(cudaStreamSynchronize(st));
  }
  CHECK_CUDA(cudaEventRecord(a, st));
  body();
  CHECK_CUDA(cudaEventRecord(b, st));
  CHECK_CUDA(cudaEventSynchronize(b));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
  return ms * 1000.0;
}

// Medians of `reps` repetitions of each body, the bodies taking turns (one repetition of each,
// then again), after three warm-up rounds: side by side under the same clocks and power state.
template <typename... F>
std::vector<double> TimeMediansUs(int reps, cudaStream_t st, F&&... bodies) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) (bodies(), ...);
  CHECK_CUDA(cudaStreamSynchronize(st));
  std::vector<std::vector<double>> us(sizeof...(bodies));
  for (int i = 0; i < reps; ++i) {
    size_t j = 0;
    ((us[j++].push_back(TimeOnceUs(st, a, b, bodies))), ...);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::vector<double> medians;
  for (auto& v : us) medians.push_back(Median(v));
  return medians;
}

template <typename F>
double TimeMedianUs(int reps, cudaStream_t st, F&& body) {
  return TimeMediansUs(reps, st, body)[0];
}

// Wall-clock milliseconds since the Unix epoch: the time base of the clock sampler run beside a
// bench (bench/gpu/clock_sampler.sh: sustained.sh, vllm_compare.sh).
long long UnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// --sustain_ms: `body` called back to back for `ms` milliseconds (the GPU kept busy, as a serving
// rank keeps it), each call timed between events; prints one "sustained" line with the wall-clock
// window (Unix ms, to match a clock / power sampler run beside it) and the calls' median.
template <typename F>
void Sustain(const char* what, const char* shape, int64_t t, int ms, cudaStream_t st, F&& body) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  std::vector<double> us;
  const long long start = UnixMs();
  while (UnixMs() - start < ms) us.push_back(TimeOnceUs(st, a, b, body));
  const long long end = UnixMs();
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::printf(
      "{\"kind\": \"sustained\", \"what\": \"%s\", \"shape\": \"%s\", \"T\": %lld, \"start_unix_ms\": %lld, "
      "\"end_unix_ms\": %lld, \"calls\": %zu, \"median_us\": %.1f}\n",
      what, shape, static_cast<long long>(t), start, end, us.size(), Median(us));
  std::fflush(stdout);
}

// Medians over `reps` runs of the stages one after another, each stage's time between events
// recorded on `st` before and after it (in place: each stage follows the one before, as in the
// layer), after three warm-up runs.
std::vector<double> InSituStagesUs(int reps, cudaStream_t st, const std::vector<std::function<void()>>& stages) {
  std::vector<cudaEvent_t> ev(stages.size() + 1);
  for (auto& e : ev) CHECK_CUDA(cudaEventCreate(&e));
  for (int i = 0; i < 3; ++i) {
    for (const auto& f : stages) f();
  }
  CHECK_CUDA(cudaStreamSynchronize(st));
  std::vector<std::vector<double>> us(stages.size());
  for (int i = 0; i < reps; ++i) {
    CHECK_CUDA(cudaEventRecord(ev[0], st));
    for (size_t j = 0; j < stages.size(); ++j) {
      stages[j]();
      CHECK_CUDA(cudaEventRecord(ev[j + 1], st));
    }
    CHECK_CUDA(cudaEventSynchronize(ev.back()));
    for (size_t j = 0; j < stages.size(); ++j) {
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, ev[j], ev[j + 1]));
      us[j].push_back(ms * 1000.0);
    }
  }
  for (auto& e : ev) cudaEventDestroy(e);
  std::vector<double> medians;
  for (auto& v : us) medians.push_back(Median(v));
  return medians;
}

// `body` captured into a CUDA graph after one eager run (which sizes every scratch buffer, so
// nothing is allocated under capture).
template <typename Body>
cudaGraphExec_t CaptureGraph(cudaStream_t st, Body&& body) {
  body();
  CHECK_CUDA(cudaStreamSynchronize(st));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  body();
  CHECK_CUDA(cudaStreamEndCapture(st, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  CHECK_CUDA(cudaGraphDestroy(graph));
  return exec;
}

// The `n` BF16 values at `out` after `eager` runs, then after a replay of `exec` (out poisoned
// in between).
template <typename Body>
void EagerAndReplayOutputs(cudaStream_t st, Body&& eager, cudaGraphExec_t exec, void* out, int64_t n,
                           std::vector<uint16_t>* eager_out, std::vector<uint16_t>* replay_out) {
  eager_out->resize(n);
  replay_out->resize(n);
  eager();
  CHECK_CUDA(cudaMemcpyAsync(eager_out->data(), out, n * 2, cudaMemcpyDeviceToHost, st));
  CHECK_CUDA(cudaMemsetAsync(out, 0xff, n * 2, st));
  CHECK_CUDA(cudaGraphLaunch(exec, st));
  CHECK_CUDA(cudaMemcpyAsync(replay_out->data(), out, n * 2, cudaMemcpyDeviceToHost, st));
  CHECK_CUDA(cudaStreamSynchronize(st));
}

// cuBLAS BF16 8192^3, the dense ceiling.
class DenseGemm {
 public:
  DenseGemm(cublasHandle_t h, cudaStream_t st) : h_(h) {
    CHECK_CUDA(cudaMalloc(&a_, 2LL * kN * kN));
    CHECK_CUDA(cudaMalloc(&b_, 2LL * kN * kN));
    CHECK_CUDA(cudaMalloc(&c_, 2LL * kN * kN));
    CHECK_CUDA(moe::bench::FillRandomBf16(a_, 1LL * kN * kN, 1, 1.0f, st));
    CHECK_CUDA(moe::bench::FillRandomBf16(b_, 1LL * kN * kN, 2, 1.0f, st));
    cublasSetStream(h, st);
  }
  ~DenseGemm() {
    cudaFree(a_);
    cudaFree(b_);
    cudaFree(c_);
  }
  void Run() const {
    const float alpha = 1, beta = 0;
    cublasGemmEx(h_, CUBLAS_OP_N, CUBLAS_OP_N, kN, kN, kN, &alpha, a_, CUDA_R_16BF, kN, b_, CUDA_R_16BF, kN, &beta, c_,
                 CUDA_R_16BF, kN, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  }
  static double Tflops(double us) { return 2.0 * kN * kN * static_cast<double>(kN) / (us * 1e-6) / 1e12; }

 private:
  static constexpr int kN = 8192;
  cublasHandle_t h_;
  void *a_ = nullptr, *b_ = nullptr, *c_ = nullptr;
};

double DenseTflops(cublasHandle_t h, cudaStream_t st, int reps) {
  DenseGemm g(h, st);
  return DenseGemm::Tflops(TimeMedianUs(reps, st, [&] { g.Run(); }));
}

// Device-to-device copy rate counting bytes read plus bytes written (the way the notes quote it).
double CopyTBps(cudaStream_t st, int reps) {
  const size_t bytes = size_t{2} << 30;
  void *a, *b;
  CHECK_CUDA(cudaMalloc(&a, bytes));
  CHECK_CUDA(cudaMalloc(&b, bytes));
  CHECK_CUDA(moe::bench::FillRandomBf16(a, bytes / 2, 3, 1.0f, st));
  const double us = TimeMedianUs(reps, st, [&] { cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, st); });
  cudaFree(a);
  cudaFree(b);
  return 2.0 * bytes / (us * 1e-6) / 1e12;
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 20;
  bool quick = false, decode_only = false, padded_decode = false;
  std::string only_shape, routing_out;
  int64_t only_tokens = -1;
  int sustain_ms = 0;  // > 0: the "fp8" cells' BF16 and FP8 experts also run back to back that long each
  int cell_gap_ms = 0;
  moe::kernels::Layout layout = moe::kernels::Layout::kGrouped;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    if (!std::strcmp(argv[i], "--padded-decode")) padded_decode = true;
    if (!std::strcmp(argv[i], "--decode-only")) decode_only = true;
    if (!std::strcmp(argv[i], "--cold-l2")) g_cold_l2 = true;
    if (!std::strcmp(argv[i], "--shape") && i + 1 < argc) only_shape = argv[++i];
    if (!std::strcmp(argv[i], "--routing_out") && i + 1 < argc) routing_out = argv[++i];
    if (!std::strcmp(argv[i], "--tokens") && i + 1 < argc) only_tokens = std::atoll(argv[++i]);
    if (!std::strcmp(argv[i], "--sustain_ms") && i + 1 < argc) sustain_ms = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--cell_gap_ms") && i + 1 < argc) cell_gap_ms = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--layout") && i + 1 < argc) {
      const std::string l = argv[++i];
      layout = l == "padded" ? moe::kernels::Layout::kPaddedDense
                             : (l == "block" ? moe::kernels::Layout::kBlockSparse : moe::kernels::Layout::kGrouped);
    }
  }
  // The kernels' switches for side-by-side runs (bench/gpu/decode.sh): MOE_CUDA_TUNING="pdl=0".
  if (const char* spec = std::getenv("MOE_CUDA_TUNING"); spec != nullptr) {
    auto tuning = moe::kernels::ParseCudaTuning(spec);
    CHECK_OK(tuning.status());
    moe::kernels::SetCudaTuning(*tuning);
  }
  auto kernels_or = moe::kernels::CreateCudaKernels();
  CHECK_OK(kernels_or.status());
  auto& kernels = *kernels_or;
  cudaStream_t st;
  CHECK_CUDA(cudaStreamCreate(&st));
  cublasHandle_t h;
  cublasCreate(&h);

  const double dense = DenseTflops(h, st, reps);
  const double copy = CopyTBps(st, reps);
  std::printf(
      "{\"kind\": \"ceiling\", \"impl\": \"moe-runtime\", \"dense_bf16_tflops\": %.1f, \"copy_tbps\": %.3f, "
      "\"kernels\": \"%s\"}\n",
      dense, copy, kernels->name());

  std::vector<Shape> shapes = {
      {"E128-k8-d2048-f768", 128, 8, 2048, 768, {1, 16, 64, 128, 1024, 8192}},
      {"E32-k8-d7168-f2048", 32, 8, 7168, 2048, {16, 128, 1024, 4096}},
      {"E8-k2-d4096-f14336", 8, 2, 4096, 14336, {1, 128, 8192}},
      {"E16-k4-d256-f512", 16, 4, 256, 512, {48}},  // the local cluster's experts (deploy/local_cluster.sh)
  };
  if (quick) shapes = {{"E128-k8-d2048-f768", 128, 8, 2048, 768, {1, 1024}}};

  std::mt19937 rng(7);
  for (Shape& s : shapes) {
    if (!only_shape.empty() && only_shape != s.name) continue;
    // --tokens T outside the shape's list: that T alone.
    if (only_tokens > 0 && std::find(s.tokens.begin(), s.tokens.end(), only_tokens) == s.tokens.end()) {
      s.tokens = {only_tokens};
    }
    const int64_t wgu_n = static_cast<int64_t>(s.e) * 2 * s.f * s.d, wd_n = static_cast<int64_t>(s.e) * s.d * s.f;
    void *wgu, *wd;
    CHECK_CUDA(cudaMalloc(&wgu, wgu_n * 2));
    CHECK_CUDA(cudaMalloc(&wd, wd_n * 2));
    CHECK_CUDA(moe::bench::FillRandomBf16(wgu, wgu_n, 11, 1.0f / std::sqrt(static_cast<float>(s.d)), st));
    CHECK_CUDA(moe::bench::FillRandomBf16(wd, wd_n, 12, 1.0f / std::sqrt(static_cast<float>(s.f)), st));
    // FP8 copies of the weights for the FP8 cells (the FP8 layer at every T, the FP8 experts
    // against BF16 at T >= 1024).
    Fp8Copy fp8_gu, fp8_d;
    const bool fp8_cells = !decode_only && s.d % 128 == 0 && s.f % 128 == 0;
    if (fp8_cells) {
      fp8_gu =
          Fp8Copy::Of(kernels.get(), static_cast<const uint16_t*>(wgu), static_cast<int64_t>(s.e) * 2 * s.f, s.d, st);
      fp8_d = Fp8Copy::Of(kernels.get(), static_cast<const uint16_t*>(wd), static_cast<int64_t>(s.e) * s.d, s.f, st);
    }
    for (int64_t t : s.tokens) {
      if (only_tokens > 0 && t != only_tokens) continue;
      // The cell's wall-clock window ("window" line below): a sampler's SM clock over it says
      // at what clock this cell's figures were taken.
      long long window_start = UnixMs();
      const int64_t routes = t * s.k;
      // Uniform top-k without replacement; gates normalized per token.
      std::vector<int32_t> topk(routes);
      std::vector<float> gates(routes);
      std::vector<int> perm(s.e);
      std::iota(perm.begin(), perm.end(), 0);
      for (int64_t i = 0; i < t; ++i) {
        for (int j = 0; j < s.k; ++j) std::swap(perm[j], perm[j + rng() % (s.e - j)]);
        float sum = 0;
        for (int j = 0; j < s.k; ++j) {
          topk[i * s.k + j] = perm[j];
          gates[i * s.k + j] = 0.1f + static_cast<float>(rng() % 1000) / 1000.0f;
          sum += gates[i * s.k + j];
        }
        for (int j = 0; j < s.k; ++j) gates[i * s.k + j] /= sum;
      }
      if (!routing_out.empty()) {
        const std::string path = routing_out + "/" + s.name + "-T" + std::to_string(t) + ".bin";
        std::FILE* f = std::fopen(path.c_str(), "wb");
        if (f == nullptr || std::fwrite(topk.data(), sizeof(int32_t), topk.size(), f) != topk.size() ||
            std::fwrite(gates.data(), sizeof(float), gates.size(), f) != gates.size() || std::fclose(f) != 0) {
          std::fprintf(stderr, "--routing_out: cannot write %s\n", path.c_str());
          return 1;
        }
      }
      std::vector<bool> hit(s.e, false);
      for (int32_t id : topk) hit[id] = true;
      const int experts_hit = static_cast<int>(std::count(hit.begin(), hit.end(), true));

      void *hidden, *packed, *expert_out, *out;
      int32_t *d_topk, *row_of_route, *token_of_row;
      float* d_gates;
      int64_t *counts, *offsets;
      CHECK_CUDA(cudaMalloc(&hidden, t * s.d * 2));
      CHECK_CUDA(cudaMalloc(&packed, routes * s.d * 2));
      CHECK_CUDA(cudaMalloc(&expert_out, routes * s.d * 2));
      CHECK_CUDA(cudaMalloc(&out, t * s.d * 2));
      CHECK_CUDA(cudaMalloc(&d_topk, routes * 4));
      CHECK_CUDA(cudaMalloc(&row_of_route, routes * 4));
      CHECK_CUDA(cudaMalloc(&token_of_row, routes * 4));
      CHECK_CUDA(cudaMalloc(&d_gates, routes * 4));
      CHECK_CUDA(cudaMalloc(&counts, s.e * 8));
      CHECK_CUDA(cudaMalloc(&offsets, (s.e + 1) * 8));
      CHECK_CUDA(moe::bench::FillRandomBf16(hidden, t * s.d, 13 + t, 1.0f, st));
      CHECK_CUDA(cudaMemcpy(d_topk, topk.data(), routes * 4, cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMemcpy(d_gates, gates.data(), routes * 4, cudaMemcpyHostToDevice));
      std::vector<int64_t> host_offsets(s.e + 1);

      // The stages, shared by the two paths and the breakdowns.
      int64_t max_seg = 1;
      auto route = [&] {
        CHECK_OK(kernels->RouteRows({d_topk, t, s.k, s.e, counts, offsets, row_of_route, token_of_row}, st));
      };
      // The rows into expert order: each token's row scattered to its k routes' rows (read once;
      // a gather through token_of_row would read it k times).
      const moe::kernels::ScatterParams gather{s.d, static_cast<const uint16_t*>(hidden), t,     row_of_route,
                                               s.k, static_cast<uint16_t*>(packed),       routes};
      moe::kernels::SwigluParams prefill;  // host offsets: the GEMM shapes
      prefill.weights = {static_cast<const uint16_t*>(wgu), static_cast<const uint16_t*>(wd), s.e, s.d, s.f};
      prefill.x = static_cast<const uint16_t*>(packed);
      prefill.rows = routes;
      prefill.host_offsets = host_offsets.data();
      prefill.y = static_cast<uint16_t*>(expert_out);
      moe::kernels::SwigluParams decode = prefill;  // device offsets, gather fused into the loads
      decode.host_offsets = nullptr;
      decode.device_offsets = offsets;
      decode.max_segment_rows = t;  // a token's k routes go to distinct experts
      decode.x = static_cast<const uint16_t*>(hidden);
      decode.x_row_index = token_of_row;
      decode.x_rows = t;
      const moe::kernels::CombineParams combine{static_cast<const uint16_t*>(expert_out),
                                                routes,
                                                s.d,
                                                row_of_route,
                                                d_gates,
                                                t,
                                                s.k,
                                                nullptr,
                                                static_cast<uint16_t*>(out)};
      auto layer = [&] {
        route();
        // Prefill path: the GEMM shapes come back to the host once per step.
        CHECK_CUDA(cudaMemcpyAsync(host_offsets.data(), offsets, (s.e + 1) * 8, cudaMemcpyDeviceToHost, st));
        CHECK_CUDA(cudaStreamSynchronize(st));
        CHECK_OK(kernels->Scatter(gather, st));
        prefill.layout = {layout, max_seg, 8, 128};
        CHECK_OK(kernels->Swiglu(prefill, st));
        CHECK_OK(kernels->Combine(combine, st));
      };
      // Decode path: no host round trip; offsets stay on the device. One LocalLayer call (route,
      // experts with the gather fused into their loads, combine): at one token, eager, the fused
      // kernels; captured, the stages (MOE_CUDA_FUSED_LAYER=0: stages always, side by side).
      moe::kernels::LocalLayerParams local;
      local.weights = prefill.weights;
      local.x = static_cast<const uint16_t*>(hidden);
      local.topk = d_topk;
      local.gate = d_gates;
      local.num_tokens = t;
      local.k = s.k;
      local.out_bf16 = static_cast<uint16_t*>(out);
      auto decode_layer = [&] { CHECK_OK(kernels->LocalLayer(local, st)); };
      // Stage-alone medians (same inputs); `experts` is the given Swiglu variant.
      auto breakdown = [&](const char* path, const moe::kernels::SwigluParams& experts, double floor_us) {
        const double route_us = TimeMedianUs(reps, st, route);
        const double gather_us = TimeMedianUs(reps, st, [&] { CHECK_OK(kernels->Scatter(gather, st)); });
        const double experts_us = TimeMedianUs(reps, st, [&] { CHECK_OK(kernels->Swiglu(experts, st)); });
        const double combine_us = TimeMedianUs(reps, st, [&] { CHECK_OK(kernels->Combine(combine, st)); });
        // Host time to enqueue each stage (the API call, its checks and launches), the stream
        // idle before each call: what an eager step spends on the CPU per stage.
        std::vector<double> host[3];
        for (int i = 0; i < reps; ++i) {
          CHECK_CUDA(cudaStreamSynchronize(st));
          const auto t0 = std::chrono::steady_clock::now();
          route();
          const auto t1 = std::chrono::steady_clock::now();
          CHECK_OK(kernels->Swiglu(experts, st));
          const auto t2 = std::chrono::steady_clock::now();
          CHECK_OK(kernels->Combine(combine, st));
          const auto t3 = std::chrono::steady_clock::now();
          host[0].push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
          host[1].push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
          host[2].push_back(std::chrono::duration<double, std::micro>(t3 - t2).count());
        }
        // The same for the decode path's one LocalLayer call.
        std::vector<double> host_layer;
        for (int i = 0; i < reps; ++i) {
          CHECK_CUDA(cudaStreamSynchronize(st));
          const auto t0 = std::chrono::steady_clock::now();
          decode_layer();
          host_layer.push_back(
              std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
        }
        CHECK_CUDA(cudaStreamSynchronize(st));
        std::printf(
            "{\"kind\": \"breakdown\", \"path\": \"%s\", \"shape\": \"%s\", \"T\": %lld, \"route_rows_us\": %.1f, "
            "\"gather_us\": %.1f, \"experts_us\": %.1f, \"combine_us\": %.1f, \"gemm_floor_us\": %.1f, "
            "\"host_route_us\": %.1f, \"host_experts_us\": %.1f, \"host_combine_us\": %.1f, "
            "\"host_local_layer_us\": %.1f}\n",
            path, s.name, static_cast<long long>(t), route_us, gather_us, experts_us, combine_us, floor_us,
            Median(host[0]), Median(host[1]), Median(host[2]), Median(host_layer));
      };
      // Capacity for the padded layout: the largest segment of this routing.
      if (!decode_only) layer();
      CHECK_CUDA(cudaStreamSynchronize(st));
      for (int e = 0; e < s.e; ++e) max_seg = std::max(max_seg, host_offsets[e + 1] - host_offsets[e]);
      const double flops = 6.0 * routes * s.d * static_cast<double>(s.f);
      const double weight_bytes = static_cast<double>(experts_hit) * 3.0 * s.d * s.f * 2.0;
      const double act_bytes = (t * s.d * 2.0) * 2 + routes * s.d * 2.0 * 2;  // hidden in, out; packed, expert out
      const double weight_read_us = weight_bytes / (copy * 1e12) * 1e6;
      // GEMM-bound cells (T >= 4096) also run side by side with the dense GEMM, repetitions taking
      // turns (interleaved_us, dense_interleaved_tflops): the dense rate under the same clocks
      // and power state as the cell, which a long sweep moves away from the first ceiling's.
      auto report = [&](const char* path, double us, double interleaved_us = 0, double dense_here = 0) {
        const double here =
            interleaved_us > 0 && dense_here > 0 ? flops / (interleaved_us * 1e-6) / 1e12 / dense_here : 0;
        std::printf(
            "{\"kind\": \"cell\", \"impl\": \"moe-runtime\", \"path\": \"%s\", \"layout\": \"%s\", \"shape\": \"%s\", "
            "\"T\": %lld, \"us\": %.1f, \"tflops\": %.2f, \"bytes_per_s_tb\": %.3f, \"experts_hit\": %d, "
            "\"weight_read_us\": %.1f, \"dense_fraction\": %.3f, \"interleaved_us\": %.1f, "
            "\"dense_interleaved_tflops\": %.1f, \"dense_interleaved_fraction\": %.3f, \"cold_l2\": %d}\n",
            path, moe::kernels::LayoutName(layout), s.name, static_cast<long long>(t), us, flops / (us * 1e-6) / 1e12,
            (weight_bytes + act_bytes) / (us * 1e-6) / 1e12, experts_hit, weight_read_us,
            flops / (us * 1e-6) / 1e12 / dense, interleaved_us, dense_here, here, g_cold_l2 ? 1 : 0);
      };
      // The paths' cells take turns (one repetition of each, then again): each path's median under
      // the same clocks and power state. Timed one after another, a later cell ran hotter (after
      // the dense GEMM's interleave below, for one) and read up to 5% slower.
      const bool decode_cells = t <= 128 || kernels->DecodeGemmBeatsPadded(s.e, s.d, s.f, routes);
      cudaGraphExec_t decode_exec = nullptr;
      if (decode_cells) {
        // The decode path has no host round trip, so the whole step captures into one CUDA
        // graph (stable buffers: the same device pointers every replay).
        decode_exec = CaptureGraph(st, decode_layer);
        // Replay must reproduce the eager output bit for bit.
        std::vector<uint16_t> eager_out, graph_out;
        EagerAndReplayOutputs(st, decode_layer, decode_exec, out, t * s.d, &eager_out, &graph_out);
        if (eager_out != graph_out) {
          std::fprintf(stderr, "graph replay differs from eager at %s T=%lld\n", s.name, static_cast<long long>(t));
          return 1;
        }
      }
      auto replay = [&] { CHECK_CUDA(cudaGraphLaunch(decode_exec, st)); };
      if (cell_gap_ms > 0) {  // idle before the cell's main paths (--cell_gap_ms)
        CHECK_CUDA(cudaStreamSynchronize(st));
        std::this_thread::sleep_for(std::chrono::milliseconds(cell_gap_ms));
        window_start = UnixMs();  // the cell's clock window without the idle gap
      }
      std::vector<double> cells;  // prefill (unless --decode-only), then decode and decode-graph (where they run)
      if (!decode_only && decode_cells) {
        cells = TimeMediansUs(reps, st, layer, decode_layer, replay);
      } else if (!decode_only) {
        cells = TimeMediansUs(reps, st, layer);
      } else if (decode_cells) {
        cells = TimeMediansUs(reps, st, decode_layer, replay);
      }
      if (!decode_only) {
        if (t >= 4096) {
          // GEMM-bound cells: the dense rate under the cell's own clocks (after the cells above).
          DenseGemm gemm(h, st);
          const std::vector<double> side = TimeMediansUs(reps, st, layer, [&] { gemm.Run(); });
          report("prefill", cells[0], side[0], DenseGemm::Tflops(side[1]));
        } else {
          report("prefill", cells[0]);
        }
      }
      // The device-offset path past decode sizes too, where it runs the Hopper grouped kernels
      // (no host round trip, so it captures into a graph at any T).
      if (decode_cells) {
        const size_t at = decode_only ? 0 : 1;
        report("decode", cells[at]);
        report("decode-graph", cells[at + 1]);
        cudaGraphExecDestroy(decode_exec);
      }
      if (t <= 128 && padded_decode) {
        // The decode path's padded runner: route, experts at a fixed capacity per expert (this
        // routing's largest segment, aligned to 16: the best case of a bucket's capacity) by
        // strided-batched GEMMs, combine. Graph-capturable like the decode kernels.
        std::vector<int64_t> seg(s.e, 0);
        for (int32_t id : topk) ++seg[id];
        moe::kernels::SwigluParams padded = decode;
        padded.layout = {moe::kernels::Layout::kPaddedDense, *std::max_element(seg.begin(), seg.end()), 16, 128};
        auto padded_layer = [&] {
          route();
          CHECK_OK(kernels->Swiglu(padded, st));
          CHECK_OK(kernels->Combine(combine, st));
        };
        report("decode-padded", TimeMedianUs(reps, st, padded_layer));
        cudaGraphExec_t exec = CaptureGraph(st, padded_layer);
        report("decode-padded-graph", TimeMedianUs(reps, st, [&] { CHECK_CUDA(cudaGraphLaunch(exec, st)); }));
        // Against the decode kernels' output (LocalLayer, eager): the same rows within rounding.
        std::vector<uint16_t> kernels_out, padded_out;
        EagerAndReplayOutputs(st, decode_layer, exec, out, t * s.d, &kernels_out, &padded_out);
        const double rel = moe::kernels::RelativeL2Bf16(padded_out, kernels_out);
        if (!(rel <= 1e-2)) {
          std::fprintf(stderr, "padded runner differs from the decode kernels at %s T=%lld (rel %.3g)\n", s.name,
                       static_cast<long long>(t), rel);
          return 1;
        }
        // Does replaying a graph of cuBLAS GEMMs slow the eager (prefill) path's steps run
        // between replays? The prefill layer timed taking turns with each runner's graph.
        if (!decode_only) {
          cudaGraphExec_t kernels_exec = CaptureGraph(st, decode_layer);
          const std::vector<double> with_padded =
              TimeMediansUs(reps, st, layer, [&] { CHECK_CUDA(cudaGraphLaunch(exec, st)); });
          const std::vector<double> with_kernels =
              TimeMediansUs(reps, st, layer, [&] { CHECK_CUDA(cudaGraphLaunch(kernels_exec, st)); });
          report("prefill-between-padded-replays", with_padded[0]);
          report("prefill-between-kernels-replays", with_kernels[0]);
          cudaGraphExecDestroy(kernels_exec);
        }
        cudaGraphExecDestroy(exec);
      }
      if (fp8_cells) {
        // The layer with FP8 experts as a lone moe-rankd --expert_dtype fp8 runs it (LayerExecutor's
        // PackFp8Rows, then the experts): route, the T tokens quantized once (E4M3 per 128 values)
        // into packed rows in expert order (PackFp8Rows: bytes, scales, padding), the FP8 experts
        // on device offsets, combine. No host round
        // trip, so eager ("fp8") and as a replayed graph ("fp8-graph"), taking turns.
        const int64_t row_bytes = moe::kernels::Fp8PackedRowBytes(s.d);
        uint8_t* rows8 = nullptr;
        CHECK_CUDA(cudaMalloc(&rows8, routes * row_bytes));
        moe::kernels::PackFp8Params pack;
        pack.x = static_cast<const uint16_t*>(hidden);
        pack.tokens = t;
        pack.d = s.d;
        pack.dest = row_of_route;
        pack.k = s.k;
        pack.out = rows8;
        pack.out_rows = routes;
        moe::kernels::SwigluFp8Params experts8;
        experts8.weights = {fp8_gu.q, fp8_gu.scales, fp8_d.q, fp8_d.scales, s.e, s.d, s.f};
        experts8.rows = routes;
        experts8.offsets = offsets;
        experts8.y = static_cast<uint16_t*>(expert_out);
        experts8.xq = rows8;
        experts8.x_scales = reinterpret_cast<const float*>(rows8 + s.d);
        experts8.xq_ld = row_bytes;
        experts8.x_scales_ld = row_bytes / 4;
        auto fp8_layer = [&] {
          route();
          CHECK_OK(kernels->PackFp8Rows(pack, st));
          CHECK_OK(kernels->SwigluFp8(experts8, st));
          CHECK_OK(kernels->Combine(combine, st));
        };
        cudaGraphExec_t fp8_exec = CaptureGraph(st, fp8_layer);
        std::vector<uint16_t> eager8, replay8, bf16_out(t * s.d);
        layer();  // the BF16 layer's output, for a sanity bound on the FP8 one
        CHECK_CUDA(cudaMemcpyAsync(bf16_out.data(), out, t * s.d * 2, cudaMemcpyDeviceToHost, st));
        EagerAndReplayOutputs(st, fp8_layer, fp8_exec, out, t * s.d, &eager8, &replay8);
        const double rel8 = moe::kernels::RelativeL2Bf16(eager8, bf16_out);
        // E4M3 weights and activations put a layer 6-7% (relative L2) from its BF16 output
        // (bench/RESULTS.md); far more is a broken layer, not quantization.
        if (eager8 != replay8 || !(rel8 <= 0.1)) {
          std::fprintf(stderr, "FP8 layer at %s T=%lld: replay %s eager, %.3g from the BF16 layer\n", s.name,
                       static_cast<long long>(t), eager8 == replay8 ? "equals" : "differs from", rel8);
          return 1;
        }
        const std::vector<double> fp8_us =
            TimeMediansUs(reps, st, fp8_layer, [&] { CHECK_CUDA(cudaGraphLaunch(fp8_exec, st)); });
        report("fp8", fp8_us[0]);
        report("fp8-graph", fp8_us[1]);
        std::printf("{\"kind\": \"fp8_layer\", \"shape\": \"%s\", \"T\": %lld, \"rel_l2_vs_bf16\": %.4f}\n", s.name,
                    static_cast<long long>(t), rel8);
        cudaGraphExecDestroy(fp8_exec);
        CHECK_CUDA(cudaFree(rows8));
      }
      if (t >= 4096 && !decode_only) breakdown("prefill", prefill, flops / (dense * 1e12) * 1e6);
      if (t >= 4096 && !decode_only && kernels->DecodeGemmBeatsPadded(s.e, s.d, s.f, routes)) {
        // Where a layer's time goes in place (events between its stages, one call after another),
        // for the prefill path and for the stages LocalLayer runs on the decode path (experts on
        // device offsets): stage-alone medians cannot show a difference that depends on what ran
        // before. "offsets" is the prefill path's host round trip.
        moe::kernels::SwigluParams scattered = decode;  // the decode path's experts, rows scattered first
        scattered.x = static_cast<const uint16_t*>(packed);
        scattered.x_row_index = nullptr;
        scattered.x_rows = 0;
        auto offsets_back = [&] {
          CHECK_CUDA(cudaMemcpyAsync(host_offsets.data(), offsets, (s.e + 1) * 8, cudaMemcpyDeviceToHost, st));
          CHECK_CUDA(cudaStreamSynchronize(st));
        };
        auto scatter = [&] { CHECK_OK(kernels->Scatter(gather, st)); };
        auto combine_rows = [&] { CHECK_OK(kernels->Combine(combine, st)); };
        const std::vector<std::function<void()>> prefill_stages = {
            route, offsets_back, scatter, [&] { CHECK_OK(kernels->Swiglu(prefill, st)); }, combine_rows};
        const std::vector<std::function<void()>> decode_stages = {
            route, scatter, [&] { CHECK_OK(kernels->Swiglu(scattered, st)); }, combine_rows};
        const std::vector<double> p_us = InSituStagesUs(reps, st, prefill_stages);
        const std::vector<double> d_us = InSituStagesUs(reps, st, decode_stages);
        // The two layers and LocalLayer's stages as separate calls, taking turns (the same clocks
        // and power state for all three; the cells above are timed one after another).
        const std::vector<double> turns = TimeMediansUs(reps, st, layer, decode_layer, [&] {
          for (const auto& f : decode_stages) f();
        });
        std::printf(
            "{\"kind\": \"in_situ\", \"shape\": \"%s\", \"T\": %lld, \"prefill\": {\"route_rows_us\": %.1f, "
            "\"offsets_us\": %.1f, \"scatter_us\": %.1f, \"experts_us\": %.1f, \"combine_us\": %.1f}, "
            "\"decode_stages\": {\"route_rows_us\": %.1f, \"scatter_us\": %.1f, \"experts_us\": %.1f, "
            "\"combine_us\": %.1f}, \"in_turns\": {\"prefill_layer_us\": %.1f, \"local_layer_us\": %.1f, "
            "\"decode_stages_us\": %.1f}}\n",
            s.name, static_cast<long long>(t), p_us[0], p_us[1], p_us[2], p_us[3], p_us[4], d_us[0], d_us[1], d_us[2],
            d_us[3], turns[0], turns[1], turns[2]);
      }
      if (fp8_cells && t >= 1024) {
        // The experts alone, BF16 (the prefill path's Swiglu, host offsets, what gemm=auto picks)
        // against FP8 (device offsets; its quantization of the rows and of the activation included).
        moe::kernels::SwigluFp8Params q;
        q.weights = {fp8_gu.q, fp8_gu.scales, fp8_d.q, fp8_d.scales, s.e, s.d, s.f};
        q.x = static_cast<const uint16_t*>(packed);
        q.rows = routes;
        q.offsets = offsets;
        q.y = static_cast<uint16_t*>(expert_out);
        const absl::Status fp8_ok = kernels->SwigluFp8(q, st);
        if (fp8_ok.ok()) {
          // The same rows quantized before the call (an FP8 dispatch's payload: Quantize per 128
          // values, once a token on the sender), and that per-token quantization of the step's
          // T hidden rows, timed on its own.
          uint8_t *xq = nullptr, *hq = nullptr;
          float *xs = nullptr, *hs = nullptr;
          CHECK_CUDA(cudaMalloc(&xq, routes * s.d));
          CHECK_CUDA(cudaMalloc(&xs, routes * (s.d / 128) * sizeof(float)));
          CHECK_CUDA(cudaMalloc(&hq, t * s.d));
          CHECK_CUDA(cudaMalloc(&hs, t * (s.d / 128) * sizeof(float)));
          const moe::kernels::ScaleGranularity g128 = moe::kernels::ScaleGranularity::kPerBlock128;
          CHECK_OK(kernels->Quantize(
              {static_cast<const uint16_t*>(packed), routes, s.d, g128, xq, xs, routes * (s.d / 128)}, st));
          moe::kernels::SwigluFp8Params pre = q;
          pre.x = nullptr;
          pre.xq = xq;
          pre.x_scales = xs;
          const moe::kernels::QuantizeParams tokens{
              static_cast<const uint16_t*>(hidden), t, s.d, g128, hq, hs, t * (s.d / 128)};
          const std::vector<double> side = TimeMediansUs(
              reps, st, [&] { CHECK_OK(kernels->Swiglu(prefill, st)); }, [&] { CHECK_OK(kernels->SwigluFp8(q, st)); },
              [&] { CHECK_OK(kernels->SwigluFp8(pre, st)); }, [&] { CHECK_OK(kernels->Quantize(tokens, st)); });
          std::printf(
              "{\"kind\": \"fp8\", \"shape\": \"%s\", \"T\": %lld, \"bf16_experts_us\": %.1f, \"fp8_experts_us\": "
              "%.1f, \"fp8_speedup\": %.2f, \"fp8_tflops\": %.1f, \"fp8_rows_us\": %.1f, \"fp8_rows_speedup\": %.2f, "
              "\"token_quantize_us\": %.1f}\n",
              s.name, static_cast<long long>(t), side[0], side[1], side[0] / side[1], flops / (side[1] * 1e-6) / 1e12,
              side[2], side[0] / side[2], side[3]);
          if (sustain_ms > 0) {
            Sustain("bf16_experts", s.name, t, sustain_ms, st, [&] { CHECK_OK(kernels->Swiglu(prefill, st)); });
            Sustain("fp8_experts_from_rows", s.name, t, sustain_ms, st, [&] { CHECK_OK(kernels->SwigluFp8(pre, st)); });
          }
          for (void* ptr :
               {static_cast<void*>(xq), static_cast<void*>(xs), static_cast<void*>(hq), static_cast<void*>(hs)}) {
            CHECK_CUDA(cudaFree(ptr));
          }
        }
      }
      if (t <= 16) {
        decode_layer();
        breakdown("decode", decode, flops / (dense * 1e12) * 1e6);
      }
      std::printf(
          "{\"kind\": \"window\", \"impl\": \"moe-runtime\", \"shape\": \"%s\", \"T\": %lld, "
          "\"start_unix_ms\": %lld, \"end_unix_ms\": %lld}\n",
          s.name, static_cast<long long>(t), window_start, UnixMs());
      std::fflush(stdout);
      cudaFree(hidden);
      cudaFree(packed);
      cudaFree(expert_out);
      cudaFree(out);
      cudaFree(d_topk);
      cudaFree(row_of_route);
      cudaFree(token_of_row);
      cudaFree(d_gates);
      cudaFree(counts);
      cudaFree(offsets);
    }
    fp8_gu.Free();
    fp8_d.Free();
    cudaFree(wgu);
    cudaFree(wd);
  }
  return 0;
}
