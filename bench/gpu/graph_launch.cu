// What a recorded step costs the host to launch: a standalone probe (nvcc only) of
// cudaGraphLaunch's host time against the graph's shape, beside the same work launched call by
// call. The lone decode step's recording (bench/RESULTS.md, twenty-eighth session) is a chain of
// kernels with programmatic (PDL) edges, a device-to-host copy and an event record on branches,
// started behind an engine's interprocess event and followed by a done event; each variant adds
// one of those. Run it plain and under bench/gpu/with_mps.sh (a co-located engine's setting).
//   nvcc -O3 -gencode arch=compute_90a,code=sm_90a -o graph_launch bench/gpu/graph_launch.cu
//   ./graph_launch            (one JSON line per variant: host µs of the launch call and of the
//                              launch through the GPU's completion, medians of 2000; then what
//                              1024 instantiated recordings of the 14-node shape hold in device
//                              and host memory: the cost of keeping many, --lone_decode_recordings)
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <vector>

#include "cuda_check.h"  // CHECK_CUDA

__global__ void Tiny(int* p) {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  if (threadIdx.x == 0) atomicAdd(p + blockIdx.x % 64, 1);
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

namespace {

using Clock = std::chrono::steady_clock;
double Us(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double, std::micro>(b - a).count(); }
// The process's resident set, in KiB (/proc/self/statm, pages of 4 KiB).
long ResidentKiB() {
  std::ifstream statm("/proc/self/statm");
  long size = 0, resident = 0;
  statm >> size >> resident;
  return resident * 4;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Shape {
  const char* name;
  int kernels;
  bool pdl, copy_branch, event_branch;
};

void Enqueue(const Shape& s, cudaStream_t st, cudaStream_t side, cudaEvent_t fork, cudaEvent_t join, int* d, int* host,
             cudaEvent_t checks, bool recording) {
  for (int i = 0; i < s.kernels; ++i) {
    if (i == 2 && (s.copy_branch || s.event_branch)) {  // after the checks' kernels, as the step
      cudaStream_t b = st;
      if (recording) {
        CHECK_CUDA(cudaEventRecord(fork, st));
        CHECK_CUDA(cudaStreamWaitEvent(side, fork, 0));
        b = side;
      }
      if (s.copy_branch) CHECK_CUDA(cudaMemcpyAsync(host, d, 64, cudaMemcpyDeviceToHost, b));
      if (s.event_branch) {
        CHECK_CUDA(recording ? cudaEventRecordWithFlags(checks, b, cudaEventRecordExternal)
                             : cudaEventRecord(checks, b));
      }
      if (recording) CHECK_CUDA(cudaEventRecord(join, b));
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(132);
    cfg.blockDim = dim3(128);
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = s.pdl && i > 0 ? 1 : 0;
    CHECK_CUDA(cudaLaunchKernelEx(&cfg, Tiny, d));
  }
  if (recording && (s.copy_branch || s.event_branch)) CHECK_CUDA(cudaStreamWaitEvent(st, join, 0));
}

}  // namespace

int main() {
  CHECK_CUDA(cudaSetDevice(0));
  cudaStream_t st, side;
  CHECK_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  CHECK_CUDA(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  cudaEvent_t fork, join, checks, ready, done;
  for (cudaEvent_t* e : {&fork, &join, &checks}) CHECK_CUDA(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  // The engine's ready event and the rank's done event are interprocess events, as in a ring.
  CHECK_CUDA(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming | cudaEventInterprocess));
  CHECK_CUDA(cudaEventCreateWithFlags(&done, cudaEventDisableTiming | cudaEventInterprocess));
  int* d = nullptr;
  int* host = nullptr;
  CHECK_CUDA(cudaMalloc(&d, 4096));
  CHECK_CUDA(cudaMallocHost(&host, 4096));
  const Shape shapes[] = {
      {"1 kernel", 1, false, false, false},
      {"12 kernels", 12, false, false, false},
      {"12 kernels, PDL", 12, true, false, false},
      {"12 kernels, PDL, copy + event on a branch", 12, true, true, true},
      {"12 kernels, PDL, copy on a branch", 12, true, true, false},
      {"12 kernels, PDL, event on a branch", 12, true, false, true},
  };
  const int reps = 2000;
  for (const Shape& s : shapes) {
    cudaGraph_t graph;
    CHECK_CUDA(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    Enqueue(s, st, side, fork, join, d, host, checks, true);
    CHECK_CUDA(cudaStreamEndCapture(st, &graph));
    cudaGraphExec_t exec;
    CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    CHECK_CUDA(cudaGraphUpload(exec, st));
    size_t nodes = 0;
    CHECK_CUDA(cudaGraphGetNodes(graph, nullptr, &nodes));
    for (int ipc = 0; ipc < 2; ++ipc) {
      std::vector<double> launch, eager, total_graph, total_eager;
      for (int r = 0; r < reps + 50; ++r) {
        for (int mode = 0; mode < 2; ++mode) {  // in turns: the recording, then call by call
          CHECK_CUDA(cudaStreamSynchronize(st));
          const auto t0 = Clock::now();
          if (ipc) {
            CHECK_CUDA(cudaEventRecord(ready, st));  // the engine's side, not timed apart
            CHECK_CUDA(cudaStreamWaitEvent(st, ready, 0));
          }
          if (mode == 0) {
            CHECK_CUDA(cudaGraphLaunch(exec, st));
          } else {
            Enqueue(s, st, side, fork, join, d, host, checks, false);
          }
          if (ipc) CHECK_CUDA(cudaEventRecord(done, st));
          const auto t1 = Clock::now();
          CHECK_CUDA(cudaStreamSynchronize(st));
          const auto t2 = Clock::now();
          if (r < 50) continue;
          (mode == 0 ? launch : eager).push_back(Us(t0, t1));
          (mode == 0 ? total_graph : total_eager).push_back(Us(t0, t2));
        }
      }
      std::printf(
          "{\"kind\": \"graph_launch\", \"shape\": \"%s\", \"nodes\": %zu, \"ipc_events\": %d, "
          "\"graph_launch_us\": %.2f, \"graph_through_gpu_us\": %.2f, \"eager_enqueue_us\": %.2f, "
          "\"eager_through_gpu_us\": %.2f}\n",
          s.name, nodes, ipc, Median(launch), Median(total_graph), Median(eager), Median(total_eager));
      std::fflush(stdout);
    }
    CHECK_CUDA(cudaGraphExecDestroy(exec));
    CHECK_CUDA(cudaGraphDestroy(graph));
  }
  // Many recordings of the step's shape kept at once, each launched once (as a kept recording is).
  {
    const Shape& s = shapes[3];
    cudaGraph_t graph;
    CHECK_CUDA(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    Enqueue(s, st, side, fork, join, d, host, checks, true);
    CHECK_CUDA(cudaStreamEndCapture(st, &graph));
    CHECK_CUDA(cudaDeviceSynchronize());
    size_t free_before = 0, total = 0, free_after = 0;
    CHECK_CUDA(cudaMemGetInfo(&free_before, &total));
    const long rss_before = ResidentKiB();
    constexpr int kKept = 1024;
    std::vector<cudaGraphExec_t> kept(kKept);
    const auto t0 = Clock::now();
    for (cudaGraphExec_t& e : kept) CHECK_CUDA(cudaGraphInstantiate(&e, graph, 0));
    const auto t1 = Clock::now();
    for (cudaGraphExec_t e : kept) CHECK_CUDA(cudaGraphLaunch(e, st));
    CHECK_CUDA(cudaStreamSynchronize(st));
    CHECK_CUDA(cudaMemGetInfo(&free_after, &total));
    const long rss_after = ResidentKiB();
    std::printf(
        "{\"kind\": \"graph_memory\", \"shape\": \"%s\", \"recordings\": %d, \"device_kib_each\": %.1f, "
        "\"host_kib_each\": %.1f, \"instantiate_us_each\": %.1f}\n",
        s.name, kKept, (static_cast<double>(free_before) - static_cast<double>(free_after)) / 1024.0 / kKept,
        static_cast<double>(rss_after - rss_before) / kKept, Us(t0, t1) / kKept);
    for (cudaGraphExec_t e : kept) CHECK_CUDA(cudaGraphExecDestroy(e));
    CHECK_CUDA(cudaGraphDestroy(graph));
  }
  return 0;
}
