// How fast can the decode experts' weights be read? A standalone probe (nvcc only) of the
// access patterns a decode-sized gate/up projection can use, reading the gate/up weights of 8 of
// 128 experts (E=128, d=2048, d_ff=768: 6.3 MB each, 50 MB in all) with L2 flushed before every
// repetition. No arithmetic beyond a checksum: the figures are the ceiling of each pattern.
//   nvcc -O3 -gencode arch=compute_90a,code=sm_90a -o read_pattern bench/gpu/read_pattern.cu
//   ./read_pattern            (one JSON line per pattern; medians of 30)
// Pattern 4 also times the gate/up reads beside a bulk copy of the down weights into shared
// memory (two streams): whether overlapping the two projections' reads could pay.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda_check.h"  // CHECK_CUDA

constexpr int kE = 128, kD = 2048, kF = 768, kHit = 8;
constexpr int kD8 = kD / 8;

__device__ __forceinline__ uint4 Load(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ unsigned Mix(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

struct Hit {
  int ids[kHit];
};

// 0: each hit expert's 2f x d block as one contiguous stream, grid-stride, U loads in flight.
template <int U>
__global__ void __launch_bounds__(256) Contiguous(const uint4* w, Hit hit, unsigned* sink) {
  const int64_t per = static_cast<int64_t>(2 * kF) * kD8;
  const int64_t total = per * kHit;
  unsigned acc = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i0 = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i0 < total; i0 += stride * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = i0 + u * stride;
      v[u] = i < total ? Load(w + static_cast<int64_t>(hit.ids[i / per]) * per + i % per) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= Mix(v[u]);
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

// 1: the decode kernel's pattern: warp units (expert, column c) = rows c and f + c; per
// iteration B vectors of each of the two rows (2 KB spans of both), every warp an equal share.
// 2: the same units, each row read whole before the next (one 4 KB span at a time).
template <int B, bool WHOLE_ROWS>
__global__ void __launch_bounds__(256) Units(const uint4* w, Hit hit, unsigned* sink) {
  const int64_t units = static_cast<int64_t>(kHit) * kF;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * 8;
  const int64_t gw = blockIdx.x * 8LL + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  unsigned acc = 0;
  for (int64_t u = units * gw / warps; u < units * (gw + 1) / warps; ++u) {
    const int e = hit.ids[u / kF], c = static_cast<int>(u % kF);
    const uint4* rows[2] = {w + (static_cast<int64_t>(e) * 2 * kF + c) * kD8,
                            w + (static_cast<int64_t>(e) * 2 * kF + kF + c) * kD8};
    if (WHOLE_ROWS) {
      for (int n = 0; n < 2; ++n) {
        for (int base = lane; base < kD8; base += 32 * B) {
          uint4 v[B];
#pragma unroll
          for (int k = 0; k < B; ++k) v[k] = Load(rows[n] + base + 32 * k);
#pragma unroll
          for (int k = 0; k < B; ++k) acc ^= Mix(v[k]);
        }
      }
    } else {
      for (int base = lane; base < kD8; base += 32 * B) {
        uint4 v[2][B];
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int k = 0; k < B; ++k) v[n][k] = Load(rows[n] + base + 32 * k);
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int k = 0; k < B; ++k) acc ^= Mix(v[n][k]);
      }
    }
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

// 3: every weight of n hit experts (gate/up and down, 3 d f values each) as contiguous streams:
// the floor of a decode step's expert work, whatever the kernels.
template <int U>
__global__ void __launch_bounds__(256)
    AllWeights(const uint4* wgu, const uint4* wd, const int* ids, int n, unsigned* sink) {
  const int64_t per_gu = static_cast<int64_t>(2 * kF) * kD8, per_d = static_cast<int64_t>(kD) * (kF / 8);
  const int64_t per = per_gu + per_d, total = per * n;
  unsigned acc = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i0 = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i0 < total; i0 += stride * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = i0 + u * stride;
      if (i < total) {
        const int64_t e = ids[i / per], j = i % per;
        v[u] = j < per_gu ? Load(wgu + e * per_gu + j) : Load(wd + e * per_d + (j - per_gu));
      } else {
        v[u] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= Mix(v[u]);
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

// 4: the down weights of the hit experts into shared memory through the bulk copy engine, one
// block a SM, each a contiguous share (at most ~191 KB at E=128: 25 MB over 132 SMs), then a
// checksum of what arrived: run alone and beside pattern 1 (the gate/up reads, two blocks a SM),
// to see whether the two streams together read faster than one after the other.
__global__ void __launch_bounds__(256, 1) DownToShared(const char* wd, Hit hit, int64_t share, unsigned* sink) {
  extern __shared__ __align__(128) char stage[];
  __shared__ __align__(8) unsigned long long bar;
  const int64_t per = static_cast<int64_t>(kD) * kF * 2;  // one expert's down bytes
  const int64_t total = per * kHit;
  const int64_t begin = blockIdx.x * share, end = begin + share < total ? begin + share : total;
  const unsigned bar_addr = static_cast<unsigned>(__cvta_generic_to_shared(&bar));
  if (threadIdx.x == 0 && begin < end) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar_addr));
    asm volatile("fence.proxy.async.shared::cta;");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar_addr),
                 "r"(static_cast<unsigned>(end - begin)));
    for (int64_t at = begin; at < end;) {
      const int64_t e = at / per, off = at % per;
      const int64_t n = (per - off) < (end - at) ? (per - off) : (end - at);
      const char* src = wd + static_cast<int64_t>(hit.ids[e]) * per + off;
      const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(stage + (at - begin)));
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                   "l"(src), "r"(static_cast<unsigned>(n)), "r"(bar_addr)
                   : "memory");
      at += n;
    }
  }
  __syncthreads();
  if (begin >= end) return;
  unsigned done = 0;
  while (!done) {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done)
                 : "r"(bar_addr)
                 : "memory");
  }
  unsigned acc = 0;
  for (int64_t i = threadIdx.x * 16; i < end - begin; i += 256 * 16)
    acc ^= Mix(*reinterpret_cast<const uint4*>(stage + i));
  if (acc == 0x12345678u) sink[0] = acc;
}

__global__ void Flush(const uint4* p, int64_t n, unsigned* sink) {
  unsigned acc = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    acc ^= Mix(p[i]);
  if (acc == 0x12345678u) sink[0] = acc;
}

int main() {
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t wbytes = static_cast<size_t>(kE) * 2 * kF * kD * 2;
  const size_t fbytes = size_t{256} << 20;
  uint4 *w, *flush;
  unsigned* sink;
  CHECK_CUDA(cudaMalloc(&w, wbytes));
  CHECK_CUDA(cudaMalloc(&flush, fbytes));
  CHECK_CUDA(cudaMalloc(&sink, 4));
  CHECK_CUDA(cudaMemset(w, 1, wbytes));
  CHECK_CUDA(cudaMemset(flush, 2, fbytes));
  Hit hit = {{3, 17, 29, 44, 58, 77, 96, 120}};
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  auto time = [&](const char* name, int blocks_per_sm, auto launch,
                  double bytes = static_cast<double>(kHit) * 2 * kF * kD * 2) {
    std::vector<float> ms;
    for (int rep = 0; rep < 33; ++rep) {
      Flush<<<sms * 4, 256>>>(flush, static_cast<int64_t>(fbytes / 16), sink);
      CHECK_CUDA(cudaEventRecord(a));
      launch(sms * blocks_per_sm);
      CHECK_CUDA(cudaEventRecord(b));
      CHECK_CUDA(cudaEventSynchronize(b));
      float t = 0;
      CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
      if (rep >= 3) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    const double us = ms[ms.size() / 2] * 1000.0;
    std::printf("{\"pattern\": \"%s\", \"blocks_per_sm\": %d, \"us\": %.2f, \"tb_per_s\": %.3f}\n", name, blocks_per_sm,
                us, bytes / (us * 1e-6) / 1e12);
  };
  for (int bps : {2, 4, 8}) {
    time("contiguous-u4", bps, [&](int g) { Contiguous<4><<<g, 256>>>(w, hit, sink); });
    time("contiguous-u8", bps, [&](int g) { Contiguous<8><<<g, 256>>>(w, hit, sink); });
  }
  for (int bps : {2, 3, 4}) {
    time("units-2rows-b4", bps, [&](int g) { Units<4, false><<<g, 256>>>(w, hit, sink); });
    time("units-2rows-b2", bps, [&](int g) { Units<2, false><<<g, 256>>>(w, hit, sink); });
    time("units-wholerow-b8", bps, [&](int g) { Units<8, true><<<g, 256>>>(w, hit, sink); });
    time("units-wholerow-b4", bps, [&](int g) { Units<4, true><<<g, 256>>>(w, hit, sink); });
  }
  // All weights of the experts a decode step hits: 8 (one token, k = 8) and 79 (16 tokens).
  uint4* wd;
  CHECK_CUDA(cudaMalloc(&wd, static_cast<size_t>(kE) * kD * kF * 2));
  CHECK_CUDA(cudaMemset(wd, 3, static_cast<size_t>(kE) * kD * kF * 2));
  int* ids;
  CHECK_CUDA(cudaMalloc(&ids, kE * sizeof(int)));
  std::vector<int> all(kE);
  for (int e = 0; e < kE; ++e) all[e] = (e * 37) % kE;
  CHECK_CUDA(cudaMemcpy(ids, all.data(), kE * sizeof(int), cudaMemcpyHostToDevice));
  for (int n : {8, 79}) {
    const double b = static_cast<double>(n) * 3 * kF * kD * 2;
    char name[64];
    for (int bps : {4, 8}) {
      std::snprintf(name, sizeof(name), "all-weights-%d-experts-u4", n);
      time(
          name, bps, [&](int g) { AllWeights<4><<<g, 256>>>(w, wd, ids, n, sink); }, b);
      std::snprintf(name, sizeof(name), "all-weights-%d-experts-u8", n);
      time(
          name, bps, [&](int g) { AllWeights<8><<<g, 256>>>(w, wd, ids, n, sink); }, b);
    }
  }
  // Pattern 4 alone and beside pattern 1 (gate/up at two blocks a SM), on two streams.
  {
    const int64_t down_total = static_cast<int64_t>(kHit) * kD * kF * 2;
    const int64_t share = ((down_total + sms - 1) / sms + 15) / 16 * 16;
    CHECK_CUDA(
        cudaFuncSetAttribute(DownToShared, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(share)));
    const char* wd_bytes = reinterpret_cast<const char*>(wd);
    cudaStream_t s1, s2;
    cudaEvent_t fork, j1, j2;
    CHECK_CUDA(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    CHECK_CUDA(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    CHECK_CUDA(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    CHECK_CUDA(cudaEventCreateWithFlags(&j1, cudaEventDisableTiming));
    CHECK_CUDA(cudaEventCreateWithFlags(&j2, cudaEventDisableTiming));
    const double gu = static_cast<double>(kHit) * 2 * kF * kD * 2, dn = static_cast<double>(down_total);
    time(
        "down-to-shared-alone", 1, [&](int) { DownToShared<<<sms, 256, share>>>(wd_bytes, hit, share, sink); }, dn);
    time(
        "units-2rows-b4-alone", 2, [&](int g) { Units<4, false><<<g, 256>>>(w, hit, sink); }, gu);
    time(
        "units-2rows-b4-then-down-to-shared", 2,
        [&](int g) {
          Units<4, false><<<g, 256>>>(w, hit, sink);
          DownToShared<<<sms, 256, share>>>(wd_bytes, hit, share, sink);
        },
        gu + dn);
    time(
        "units-2rows-b4-beside-down-to-shared", 2,
        [&](int g) {
          CHECK_CUDA(cudaEventRecord(fork, 0));
          CHECK_CUDA(cudaStreamWaitEvent(s1, fork));
          CHECK_CUDA(cudaStreamWaitEvent(s2, fork));
          DownToShared<<<sms, 256, share, s1>>>(wd_bytes, hit, share, sink);
          Units<4, false><<<g, 256, 0, s2>>>(w, hit, sink);
          CHECK_CUDA(cudaEventRecord(j1, s1));
          CHECK_CUDA(cudaEventRecord(j2, s2));
          CHECK_CUDA(cudaStreamWaitEvent(0, j1));
          CHECK_CUDA(cudaStreamWaitEvent(0, j2));
        },
        gu + dn);
  }
  CHECK_CUDA(cudaGetLastError());
  return 0;
}
