// Dispatch + combine across the GPUs of this host with the runtime's NCCL transport and
// kernels. One process per GPU (fork); every figure is a median over repeats; JSON lines.
//
//   prefill  DeepEP's normal-kernel shape: 4096 tokens per rank, hidden 7168, top-8 of 256
//            experts (uniform), one row per route (the runtime's dispatch layout), device
//            buffers, all-to-all-v (the transport's AllToAllV). BF16 rows, and FP8 E4M3 rows
//            with per-128 FP32 scales (7168 + 224 bytes a row), whose quantize / dequantize
//            kernel time is reported beside the transfer. bench/gpu/a2a_torch.py moves the
//            same splits with all_to_all_single.
//   decode   128 tokens per rank, same hidden / top-k / experts, CUDA-graph replay of a fixed
//            bucket (every peer segment padded to the largest count, rounded up to 32 rows,
//            padding rows zero): dispatch = [quantize] + pack (gather into peer segments) +
//            grouped ncclSend/ncclRecv [+ dequantize]; combine = return send/recv + the
//            gate-weighted combine (FP32 accumulation, BF16 out). The counts agreement that
//            precedes a step on the host is not inside these figures.
//   nvlink   after the members exit, the parent copies 256 MiB GPU i -> GPU i+1 with
//            cudaMemcpyPeerAsync on every GPU at once: the per-GPU one-direction ceiling the
//            figures above are quoted against.
#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include <sys/wait.h>

#include "absl/time/clock.h"

#include "bench/stats.h"
#include "kernels/api.h"
#include "kernels/numeric.h"
#include "runtime/transport/nccl.h"

namespace {

using moe::bench::Median;

constexpr int kHidden = 7168, kTopK = 8, kExperts = 256, kPrefillTokens = 4096, kDecodeTokens = 128;
constexpr int kScalesPerRow = kHidden / 128;
constexpr int64_t kFp8RowBytes = kHidden + kScalesPerRow * 4;

#define CHECK_CUDA(x)                                                                         \
  do {                                                                                        \
    const cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      return 1;                                                                               \
    }                                                                                         \
  } while (0)
#define CHECK_OK(x)                                                                              \
  do {                                                                                           \
    const absl::Status s_ = (x);                                                                 \
    if (!s_.ok()) {                                                                              \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, std::string(s_.message()).c_str()); \
      return 1;                                                                                  \
    }                                                                                            \
  } while (0)
#define CHECK_NCCL(x)                                                                         \
  do {                                                                                        \
    const ncclResult_t r_ = (x);                                                              \
    if (r_ != ncclSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, ncclGetErrorString(r_)); \
      return 1;                                                                               \
    }                                                                                         \
  } while (0)

// Routes of every source rank under uniform top-k (the same seed everywhere): dest[src][t * k + j]
// is the peer of route (t, j).
std::vector<std::vector<int>> Routes(int p, int tokens, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<int>> dest(p);
  std::vector<int> perm(kExperts);
  for (int src = 0; src < p; ++src) {
    for (int t = 0; t < tokens; ++t) {
      for (int e = 0; e < kExperts; ++e) perm[e] = e;
      for (int j = 0; j < kTopK; ++j) {
        std::swap(perm[j], perm[j + rng() % (kExperts - j)]);
        dest[src].push_back(perm[j] / (kExperts / p));
      }
    }
  }
  return dest;
}

std::vector<int64_t> CountMatrix(const std::vector<std::vector<int>>& dest, int p) {
  std::vector<int64_t> counts(p * p, 0);
  for (int src = 0; src < p; ++src) {
    for (int d : dest[src]) ++counts[src * p + d];
  }
  return counts;
}

// Host barrier over the transport (outside any capture).
absl::Status Barrier(moe::Transport& t, uint64_t seq) {
  std::vector<int32_t> in(1, 1), out(t.size());
  return t.AllGather(seq, in.data(), 4, out.data(), absl::Seconds(60));
}

int Prefill(moe::Transport& t, moe::kernels::ExpertKernels& k, int reps) {
  const int p = t.size(), slot = t.slot();
  const std::vector<int64_t> counts = CountMatrix(Routes(p, kPrefillTokens, 1), p);
  for (const bool fp8 : {false, true}) {
    const int64_t row = fp8 ? kFp8RowBytes : kHidden * 2;
    std::vector<int64_t> send(p), recv(p);
    int64_t send_total = 0, recv_total = 0, remote = 0, rows_in = 0;
    for (int j = 0; j < p; ++j) {
      send[j] = counts[slot * p + j] * row;
      recv[j] = counts[j * p + slot] * row;
      send_total += send[j];
      recv_total += recv[j];
      rows_in += counts[j * p + slot];
      if (j != slot) remote += send[j];
    }
    void *a, *b;
    CHECK_CUDA(cudaMalloc(&a, send_total));
    CHECK_CUDA(cudaMalloc(&b, recv_total));
    CHECK_CUDA(cudaMemset(a, 1, send_total));
    // FP8 dispatch still returns BF16 expert outputs: separate buffers for the combine.
    void *back_in = nullptr, *back_out = nullptr;
    if (fp8) {
      CHECK_CUDA(cudaMalloc(&back_in, rows_in * kHidden * 2 + 1));
      CHECK_CUDA(cudaMalloc(&back_out, send_total / row * kHidden * 2 + 1));
    }
    std::vector<double> dispatch_us, combine_us;
    for (int r = 0; r < reps + 3; ++r) {
      absl::Time s = absl::Now();
      CHECK_OK(t.AllToAllV(2 * r, a, send, b, recv, absl::Seconds(60)));
      const double d = absl::ToDoubleMicroseconds(absl::Now() - s);
      // Combine returns BF16 rows (the expert outputs) whatever the dispatch payload.
      std::vector<int64_t> back_send(p), back_recv(p);
      for (int j = 0; j < p; ++j) {
        back_send[j] = recv[j] / row * kHidden * 2;
        back_recv[j] = send[j] / row * kHidden * 2;
      }
      void* c = fp8 ? back_in : b;
      void* e = fp8 ? back_out : a;
      s = absl::Now();
      CHECK_OK(t.AllToAllV(2 * r + 1, c, back_send, e, back_recv, absl::Seconds(60)));
      const double cm = absl::ToDoubleMicroseconds(absl::Now() - s);
      if (r >= 3) {
        dispatch_us.push_back(d);
        combine_us.push_back(cm);
      }
    }
    // FP8: what the conversion costs where it happens (sender quantizes its tokens, receiver
    // dequantizes the rows it got).
    double quant_us = 0, dequant_us = 0;
    if (fp8) {
      void *x, *q, *sc, *y;
      const int64_t rows = kPrefillTokens;
      CHECK_CUDA(cudaMalloc(&x, rows * kHidden * 2));
      CHECK_CUDA(cudaMemset(x, 0x3c, rows * kHidden * 2));
      CHECK_CUDA(cudaMalloc(&q, std::max(rows, rows_in) * kHidden));
      CHECK_CUDA(cudaMalloc(&sc, std::max(rows, rows_in) * kScalesPerRow * 4));
      CHECK_CUDA(cudaMalloc(&y, rows_in * kHidden * 2 + 1));
      cudaEvent_t e0, e1, e2;
      cudaEventCreate(&e0);
      cudaEventCreate(&e1);
      cudaEventCreate(&e2);
      std::vector<double> qv, dv;
      for (int r = 0; r < reps + 3; ++r) {
        moe::kernels::QuantizeParams qp{static_cast<const uint16_t*>(x),
                                        rows,
                                        kHidden,
                                        moe::kernels::ScaleGranularity::kPerBlock128,
                                        static_cast<uint8_t*>(q),
                                        static_cast<float*>(sc),
                                        rows * kScalesPerRow};
        moe::kernels::DequantizeParams dp{static_cast<const uint8_t*>(q),
                                          static_cast<const float*>(sc),
                                          rows_in * kScalesPerRow,
                                          rows_in,
                                          kHidden,
                                          moe::kernels::ScaleGranularity::kPerBlock128,
                                          static_cast<uint16_t*>(y)};
        cudaEventRecord(e0, nullptr);
        CHECK_OK(k.Quantize(qp, nullptr));
        cudaEventRecord(e1, nullptr);
        CHECK_OK(k.Dequantize(dp, nullptr));
        cudaEventRecord(e2, nullptr);
        CHECK_CUDA(cudaEventSynchronize(e2));
        float a1 = 0, a2 = 0;
        cudaEventElapsedTime(&a1, e0, e1);
        cudaEventElapsedTime(&a2, e1, e2);
        if (r >= 3) {
          qv.push_back(a1 * 1e3);
          dv.push_back(a2 * 1e3);
        }
      }
      quant_us = Median(qv);
      dequant_us = Median(dv);
      cudaFree(x);
      cudaFree(q);
      cudaFree(sc);
      cudaFree(y);
    }
    const double dm = Median(dispatch_us), cm = Median(combine_us);
    const int64_t remote_bf16 = remote / row * kHidden * 2;
    std::printf(
        "{\"kind\": \"a2a\", \"impl\": \"moe-runtime nccl\", \"payload\": \"%s\", \"gpus\": %d, \"slot\": %d, "
        "\"dispatch_us\": %.1f, \"combine_us\": %.1f, \"remote_bytes\": %lld, \"dispatch_gbps\": %.1f, "
        "\"combine_gbps\": %.1f, \"quantize_us\": %.1f, \"dequantize_us\": %.1f}\n",
        fp8 ? "fp8" : "bf16", p, slot, dm, cm, static_cast<long long>(remote), remote / (dm * 1e3),
        remote_bf16 / (cm * 1e3), quant_us, dequant_us);
    std::fflush(stdout);
    cudaFree(a);
    cudaFree(b);
    cudaFree(back_in);
    cudaFree(back_out);
  }
  return 0;
}

int Decode(moe::Transport& t, moe::kernels::ExpertKernels& k, int reps) {
  const int p = t.size(), me = t.slot();
  const moe::NcclHandles h = moe::NativeNcclHandles(t);
  auto comm = static_cast<ncclComm_t>(h.comm);
  auto st = static_cast<cudaStream_t>(h.stream);
  const auto dest = Routes(p, kDecodeTokens, 2);
  const std::vector<int64_t> counts = CountMatrix(dest, p);
  const int64_t cap = (*std::max_element(counts.begin(), counts.end()) + 31) / 32 * 32;
  const int64_t slots = p * cap;
  // Plan (host, once per bucket): send position of every route, padding index -1.
  std::vector<int32_t> index(slots, -1), row_of_route(kDecodeTokens * kTopK);
  std::vector<int64_t> fill(p, 0);
  std::vector<float> gates(kDecodeTokens * kTopK);
  std::mt19937 rng(7 + me);
  for (int r = 0; r < kDecodeTokens * kTopK; ++r) {
    const int j = dest[me][r];
    const int64_t pos = j * cap + fill[j]++;
    index[pos] = r / kTopK;
    row_of_route[r] = static_cast<int32_t>(pos);
    gates[r] = std::uniform_real_distribution<float>(0, 0.25f)(rng);
  }
  std::vector<uint16_t> hidden_h(kDecodeTokens * kHidden);
  for (auto& v : hidden_h) v = moe::kernels::FloatToBf16(std::normal_distribution<float>(0, 1)(rng));
  uint16_t *hidden, *send, *recv, *back, *out;
  uint8_t *q, *send_q, *recv_q;
  float *sc, *send_sc, *recv_sc, *gate_d;
  int32_t *index_d, *rows_d;
  CHECK_CUDA(cudaSetDevice(me));
  CHECK_CUDA(cudaMalloc(&hidden, kDecodeTokens * kHidden * 2));
  CHECK_CUDA(cudaMalloc(&send, slots * kHidden * 2));
  CHECK_CUDA(cudaMalloc(&recv, slots * kHidden * 2));
  CHECK_CUDA(cudaMalloc(&back, slots * kHidden * 2));
  CHECK_CUDA(cudaMalloc(&out, kDecodeTokens * kHidden * 2));
  CHECK_CUDA(cudaMalloc(&q, kDecodeTokens * kHidden));
  CHECK_CUDA(cudaMalloc(&send_q, slots * kHidden));
  CHECK_CUDA(cudaMalloc(&recv_q, slots * kHidden));
  CHECK_CUDA(cudaMalloc(&sc, kDecodeTokens * kScalesPerRow * 4));
  CHECK_CUDA(cudaMalloc(&send_sc, slots * kScalesPerRow * 4));
  CHECK_CUDA(cudaMalloc(&recv_sc, slots * kScalesPerRow * 4));
  CHECK_CUDA(cudaMalloc(&gate_d, gates.size() * 4));
  CHECK_CUDA(cudaMalloc(&index_d, slots * 4));
  CHECK_CUDA(cudaMalloc(&rows_d, row_of_route.size() * 4));
  CHECK_CUDA(cudaMemcpy(hidden, hidden_h.data(), hidden_h.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(gate_d, gates.data(), gates.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(index_d, index.data(), index.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(rows_d, row_of_route.data(), row_of_route.size() * 4, cudaMemcpyHostToDevice));

  using moe::kernels::ScaleGranularity;
  auto exchange = [&](const void* s, void* r, int64_t bytes_per_peer) -> int {
    CHECK_NCCL(ncclGroupStart());
    for (int j = 0; j < p; ++j) {
      CHECK_NCCL(ncclSend(static_cast<const char*>(s) + j * bytes_per_peer, bytes_per_peer, ncclUint8, j, comm, st));
      CHECK_NCCL(ncclRecv(static_cast<char*>(r) + j * bytes_per_peer, bytes_per_peer, ncclUint8, j, comm, st));
    }
    CHECK_NCCL(ncclGroupEnd());
    return 0;
  };
  auto capture = [&](cudaGraphExec_t* exec, auto&& body) -> int {
    cudaGraph_t g;
    CHECK_CUDA(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    const int rc = body();
    CHECK_CUDA(cudaStreamEndCapture(st, &g));
    if (rc != 0) return rc;
    CHECK_CUDA(cudaGraphInstantiate(exec, g, 0));
    return 0;
  };
  cudaGraphExec_t dispatch_bf16, dispatch_fp8, combine;
  if (capture(&dispatch_bf16, [&]() -> int {
        moe::kernels::GatherParams g;
        g.d = kHidden;
        g.in = hidden;
        g.in_rows = kDecodeTokens;
        g.index = index_d;
        g.n = slots;
        g.out = send;
        CHECK_OK(k.Gather(g, st));
        return exchange(send, recv, cap * kHidden * 2);
      }) != 0) {
    return 1;
  }
  if (capture(&dispatch_fp8, [&]() -> int {
        CHECK_OK(k.Quantize(
            {hidden, kDecodeTokens, kHidden, ScaleGranularity::kPerBlock128, q, sc, kDecodeTokens * kScalesPerRow},
            st));
        moe::kernels::GatherParams g;
        g.dtype = moe::kernels::DType::kFP8E4M3;
        g.d = kHidden;
        g.in = q;
        g.in_rows = kDecodeTokens;
        g.index = index_d;
        g.n = slots;
        g.out = send_q;
        g.scales = ScaleGranularity::kPerBlock128;
        g.in_scales = sc;
        g.in_scale_count = kDecodeTokens * kScalesPerRow;
        g.out_scales = send_sc;
        CHECK_OK(k.Gather(g, st));
        if (exchange(send_q, recv_q, cap * kHidden) != 0) return 1;
        if (exchange(send_sc, recv_sc, cap * kScalesPerRow * 4) != 0) return 1;
        CHECK_OK(k.Dequantize(
            {recv_q, recv_sc, slots * kScalesPerRow, slots, kHidden, ScaleGranularity::kPerBlock128, recv}, st));
        return 0;
      }) != 0) {
    return 1;
  }
  if (capture(&combine, [&]() -> int {
        if (exchange(recv, back, cap * kHidden * 2) != 0) return 1;
        moe::kernels::CombineParams c{back, slots, kHidden, rows_d, gate_d, kDecodeTokens, kTopK, nullptr, out};
        CHECK_OK(k.Combine(c, st));
        return 0;
      }) != 0) {
    return 1;
  }
  cudaEvent_t e0, e1, e2;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventCreate(&e2);
  for (const bool fp8 : {false, true}) {
    std::vector<double> dv, cv;
    for (int r = 0; r < reps + 5; ++r) {
      CHECK_OK(Barrier(t, 1000 + r + (fp8 ? 500 : 0)));
      CHECK_CUDA(cudaEventRecord(e0, st));
      CHECK_CUDA(cudaGraphLaunch(fp8 ? dispatch_fp8 : dispatch_bf16, st));
      CHECK_CUDA(cudaEventRecord(e1, st));
      CHECK_CUDA(cudaGraphLaunch(combine, st));
      CHECK_CUDA(cudaEventRecord(e2, st));
      CHECK_CUDA(cudaEventSynchronize(e2));
      float a = 0, b = 0;
      cudaEventElapsedTime(&a, e0, e1);
      cudaEventElapsedTime(&b, e1, e2);
      if (r >= 5) {
        dv.push_back(a * 1e3);
        cv.push_back(b * 1e3);
      }
    }
    // Check one replay: the combined rows equal sum_j g_tj h_t (the rows went out and back
    // unchanged, through FP8 when fp8): relative L2 error against the host computation.
    std::vector<uint16_t> got(kDecodeTokens * kHidden);
    CHECK_CUDA(cudaMemcpy(got.data(), out, got.size() * 2, cudaMemcpyDeviceToHost));
    moe::kernels::RelativeL2Error error;
    for (int tk = 0; tk < kDecodeTokens; ++tk) {
      double g = 0;
      for (int j = 0; j < kTopK; ++j) g += gates[tk * kTopK + j];
      for (int c = 0; c < kHidden; ++c) {
        error.Add(moe::kernels::Bf16ToFloat(got[tk * kHidden + c]),
                  g * moe::kernels::Bf16ToFloat(hidden_h[tk * kHidden + c]));
      }
    }
    const double rel = error.Value();
    int64_t remote_rows = 0;
    for (int j = 0; j < p; ++j) {
      if (j != me) remote_rows += counts[me * p + j];
    }
    std::printf(
        "{\"kind\": \"decode\", \"impl\": \"moe-runtime nccl graph\", \"payload\": \"%s\", \"gpus\": %d, "
        "\"slot\": %d, \"tokens\": %d, \"bucket_rows_per_peer\": %lld, \"dispatch_us\": %.1f, "
        "\"combine_us\": %.1f, \"dispatch_p99_us\": %.1f, \"combine_p99_us\": %.1f, \"samples\": %zu, "
        "\"remote_routes\": %lld, \"rel_error\": %.2e}\n",
        fp8 ? "fp8" : "bf16", p, me, kDecodeTokens, static_cast<long long>(cap), Median(dv), Median(cv),
        moe::bench::Quantile(dv, 0.99), moe::bench::Quantile(cv, 0.99), dv.size(), static_cast<long long>(remote_rows),
        rel);
    std::fflush(stdout);
    if (!(rel < (fp8 ? 0.08 : 0.01))) {
      std::fprintf(stderr, "decode %s: combined rows wrong\n", fp8 ? "fp8" : "bf16");
      return 1;
    }
  }
  return 0;
}

int Member(int slot, int p, const std::string& dir, int reps) {
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  moe::NcclOptions o;
  o.slot = slot;
  o.size = p;
  o.device = slot;
  o.rendezvous_dir = dir;
  auto t = moe::CreateNcclTransport(o);
  if (!t.ok()) {
    std::fprintf(stderr, "%s\n", std::string(t.status().message()).c_str());
    return 2;
  }
  auto k = moe::kernels::CreateCudaKernels();
  if (!k.ok()) {
    std::fprintf(stderr, "%s\n", std::string(k.status().message()).c_str());
    return 2;
  }
  int rc = Prefill(**t, **k, reps);
  if (rc == 0) rc = Decode(**t, **k, reps * 5);
  // The process exits now: leave the communicator to the OS (its teardown after graphs that
  // captured NCCL calls can wait on peers that have already gone).
  (void)t->release();
  return rc;
}

// One-direction copy bandwidth GPU i -> GPU (i + 1) % p, all GPUs at once.
int NvlinkCeiling(int p) {
  if (p < 2) return 0;
  const size_t bytes = size_t{256} << 20;
  std::vector<void*> buf(p);
  std::vector<cudaStream_t> streams(p);
  std::vector<cudaEvent_t> start(p), stop(p);
  for (int i = 0; i < p; ++i) {
    CHECK_CUDA(cudaSetDevice(i));
    CHECK_CUDA(cudaMalloc(&buf[i], 2 * bytes));
    CHECK_CUDA(cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking));
    cudaEventCreate(&start[i]);
    cudaEventCreate(&stop[i]);
    const int peer = (i + 1) % p;
    if (cudaDeviceEnablePeerAccess(peer, 0) != cudaSuccess) cudaGetLastError();
  }
  std::vector<double> gbps;
  for (int r = 0; r < 8; ++r) {
    for (int i = 0; i < p; ++i) {
      CHECK_CUDA(cudaSetDevice(i));
      CHECK_CUDA(cudaEventRecord(start[i], streams[i]));
      const int peer = (i + 1) % p;
      CHECK_CUDA(cudaMemcpyPeerAsync(static_cast<char*>(buf[peer]) + bytes, peer, buf[i], i, bytes, streams[i]));
      CHECK_CUDA(cudaEventRecord(stop[i], streams[i]));
    }
    for (int i = 0; i < p; ++i) {
      CHECK_CUDA(cudaSetDevice(i));
      CHECK_CUDA(cudaEventSynchronize(stop[i]));
      float ms = 0;
      cudaEventElapsedTime(&ms, start[i], stop[i]);
      if (r >= 2) gbps.push_back(bytes / (ms * 1e6));
    }
  }
  std::printf("{\"kind\": \"nvlink\", \"gpus\": %d, \"copy_bytes\": %zu, \"one_direction_gbps\": %.1f}\n", p, bytes,
              Median(gbps));
  int version = 0;
  ncclGetVersion(&version);
  std::printf("{\"kind\": \"nccl\", \"version\": %d}\n", version);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Count the GPUs in a child: CUDA must not be initialized here before the members fork.
  int p = 0;
  if (const pid_t pid = fork(); pid == 0) {
    int n = 0;
    _exit(cudaGetDeviceCount(&n) == cudaSuccess ? n : 0);
  } else {
    int status = 0;
    waitpid(pid, &status, 0);
    p = WIFEXITED(status) ? WEXITSTATUS(status) : 0;
  }
  const int reps = argc > 1 ? std::atoi(argv[1]) : 10;
  char tmpl[] = "/tmp/a2a-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  std::vector<pid_t> pids;
  for (int i = 0; i < p; ++i) {
    const pid_t pid = fork();
    if (pid == 0) _exit(Member(i, p, dir, reps));
    pids.push_back(pid);
  }
  int bad = 0;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    bad += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  return bad + NvlinkCeiling(p);
}
