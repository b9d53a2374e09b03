// Host work of one layer step in a one-member group. On the CPU kernels with tiny experts (d 64,
// d_ff 16), so that what the executor spends outside the experts shows; with a GPU build and
// MOE_BENCH_KERNELS=cuda on the CUDA kernels over a one-member NCCL transport (d 2048, d_ff 768:
// the Qwen3-like layer). Prints, per token count, the median wall time of each phase of the step
// (runtime/exec/step.h), of the whole step, and of the step without its experts phase, in
// microseconds and per route, the CPU time per step of the step's thread and of the process, and
// the heap allocations the step's thread made during the step (this binary counts operator new;
// --trace_allocs writes each allocation of a token count's last step to stderr with its call
// stack).
// --in_place puts the rows, routing and output in kernel memory first (a co-located engine's GPU
// buffers: LayerStepInput::rows_on_device and routing_on_device). On the GPU,
// MOE_CUDA_TUNING=blocking_sync=1 makes waits for the GPU block instead of spin, so that the CPU
// times count host work only.
//
// --tokens 1,8 --decode times decode steps instead (always planned on the host). A one-member
// decode step runs the one-call local layer, whose host tables (the routes' local ids, uploaded)
// are timed in its experts phase, so "non-expert" leaves them out there.
//
//   bazel run -c opt //bench:step_host_bench [-- --reps 9 --experts 128 --k 8 --device_plan --in_place]
//   bazel run -c opt //bench:step_host_bench [-- --tokens 1,8 --decode --reps 201]
#include <time.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"

#include "bench/alloc_counter.h"
#include "bench/one_member.h"
#include "bench/stats.h"
#include "kernels/api.h"
#include "kernels/numeric.h"
#include "runtime/checkpoint/synthetic.h"
#include "runtime/exec/layer_executor.h"
#include "runtime/placement/default_placement.h"
#include "runtime/transport/transport.h"

ABSL_FLAG(int, reps, 9, "steps per token count (the median is reported)");
ABSL_FLAG(int, experts, 128, "logical experts");
ABSL_FLAG(int, k, 8, "routes per token");
ABSL_FLAG(bool, device_plan, false, "plan the steps on the kernels (LayerExecutorOptions::device_plan)");
ABSL_FLAG(std::string, expert_dtype, "bf16",
          "the experts' precision (LayerExecutorOptions::expert_dtype: bf16, fp8; fp8 on the CPU kernels: d = d_ff "
          "= 128)");
ABSL_FLAG(std::vector<std::string>, tokens, std::vector<std::string>({"256", "1024", "2048", "4096", "8192"}),
          "token counts a step");
ABSL_FLAG(bool, decode, false, "decode steps instead of prefill");
ABSL_FLAG(bool, trace_allocs, false,
          "write each heap allocation of the last step of each token count to stderr, with its call stack");
ABSL_FLAG(bool, in_place, false,
          "rows, routing and output in kernel memory (a co-located engine's GPU buffers; CUDA kernels only)");

namespace moe {
namespace {

// CPU time of the process or of the calling thread (CLOCK_*_CPUTIME_ID: the scheduler's exact
// runtime, not rusage's tick-sampled split).
double CpuSeconds(clockid_t clock = CLOCK_PROCESS_CPUTIME_ID) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int Main() {
  bench::OneMemberBackend backend;
  if (absl::Status s = bench::MakeOneMemberBackend(&backend); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  std::unique_ptr<kernels::ExpertKernels>& kernels = backend.kernels;
  const bool cuda = backend.cuda;
  auto dtype = ParseExpertDtype(absl::GetFlag(FLAGS_expert_dtype), "--expert_dtype");
  if (!dtype.ok()) {
    std::fprintf(stderr, "%s\n", dtype.status().ToString().c_str());
    return 1;
  }
  const bool fp8 = *dtype == ExpertDtype::kFp8;
  const int d = cuda  ? 2048
                : fp8 ? 128
                      : 64,
            f = cuda  ? 768
                : fp8 ? 128
                      : 16,
            experts = absl::GetFlag(FLAGS_experts), k = absl::GetFlag(FLAGS_k);
  bench::OneMemberRank rank;
  if (absl::Status s = bench::MakeOneMemberRank(backend, experts, d, f, DecodeRunner::kKernels, &rank,
                                                absl::GetFlag(FLAGS_device_plan), *dtype);
      !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  LayerExecutor* executor = rank.executor.get();
  const bool in_place = absl::GetFlag(FLAGS_in_place);
  const bool decode = absl::GetFlag(FLAGS_decode);
  std::vector<int64_t> token_counts;
  for (const std::string& t : absl::GetFlag(FLAGS_tokens)) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(t, &v) || v < 1 || v > (int64_t{1} << 20)) {
      std::fprintf(stderr, "--tokens: '%s' is not a count in [1, 2^20]\n", t.c_str());
      return 1;
    }
    token_counts.push_back(v);
  }
  std::printf("one member, %s, %s experts, E=%d k=%d d=%d d_ff=%d, %s steps, %s plan, %s, median of %d\n",
              kernels->name(), fp8 ? "FP8" : "BF16", experts, k, d, f, decode ? "decode" : "prefill",
              absl::GetFlag(FLAGS_device_plan) && !decode ? "device" : "host",
              in_place ? "rows and routing in kernel memory" : "rows and routing on the host",
              absl::GetFlag(FLAGS_reps));
  std::printf("%8s", "tokens");
  for (int p = 0; p < kNumStepPhases; ++p) std::printf(" %9s", StepPhaseName(static_cast<StepPhase>(p)));
  std::printf(" %10s %12s %13s %11s %11s %7s\n", "step_us", "non-expert", "ns/route", "thread_cpu", "process_cpu",
              "allocs");
  std::mt19937 rng(1);
  uint64_t step = 1;
  for (int64_t tokens : token_counts) {
    std::vector<uint16_t> hidden(tokens * d);
    for (auto& h : hidden) h = kernels::FloatToBf16(std::normal_distribution<float>(0, 1)(rng));
    std::vector<int32_t> ids(tokens * k);
    std::vector<float> gates(tokens * k, 1.0f / k);
    std::vector<int> perm(experts);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int e = 0; e < experts; ++e) perm[e] = e;
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int j = 0; j < k; ++j) ids[t * k + j] = perm[j];
    }
    // In kernel memory: the rows, then the routing (ids and weights adjacent, as in a step
    // ring's device slot), and the output.
    kernels::KernelBuffer k_hidden, k_routing, k_out;
    if (in_place) {
      const int64_t row_bytes = tokens * d * 2, route_bytes = tokens * k * 4;
      for (auto [b, bytes] : {std::pair{&k_hidden, row_bytes}, {&k_routing, 2 * route_bytes}, {&k_out, row_bytes}}) {
        if (absl::Status s = b->Reserve(kernels.get(), bytes); !s.ok()) {
          std::fprintf(stderr, "kernel memory: %s\n", s.ToString().c_str());
          return 1;
        }
      }
      absl::Status s = kernels->CopyToKernel(k_hidden.data(), hidden.data(), row_bytes, nullptr);
      if (s.ok()) s = kernels->CopyToKernel(k_routing.data(), ids.data(), route_bytes, nullptr);
      if (s.ok()) s = kernels->CopyToKernel(k_routing.as<char>() + route_bytes, gates.data(), route_bytes, nullptr);
      if (s.ok()) s = kernels->Synchronize(nullptr);
      if (!s.ok()) {
        std::fprintf(stderr, "kernel memory: %s\n", s.ToString().c_str());
        return 1;
      }
    }
    std::vector<std::vector<double>> phase(kNumStepPhases);
    std::vector<double> host, total, cpu, thread_cpu, allocs;
    for (int rep = 0; rep < absl::GetFlag(FLAGS_reps) + 1; ++rep) {
      LayerStepInput in;
      in.step_id = step++;
      in.phase = decode ? Phase::kDecode : Phase::kPrefill;
      in.hidden = hidden.data();
      in.tokens = tokens;
      in.d = d;
      in.topk_ids = ids.data();
      in.topk_weights = gates.data();
      in.k = k;
      if (in_place) {
        in.hidden = k_hidden.as<uint16_t>();
        in.topk_ids = k_routing.as<int32_t>();
        in.topk_weights = reinterpret_cast<const float*>(k_routing.as<int32_t>() + tokens * k);
        in.output = k_out.as<uint16_t>();
        in.rows_on_device = true;
        in.routing_on_device = true;
      }
      const double cpu0 = CpuSeconds(), thread0 = CpuSeconds(CLOCK_THREAD_CPUTIME_ID);
      const bool trace = absl::GetFlag(FLAGS_trace_allocs) && rep == absl::GetFlag(FLAGS_reps);
      if (trace) std::fprintf(stderr, "step of %lld tokens: allocations\n", static_cast<long long>(tokens));
      const int64_t allocations0 = bench::ThreadAllocations();
      bench::TraceThreadAllocations(trace);
      auto r = executor->Execute(in);
      bench::TraceThreadAllocations(false);
      const int64_t step_allocations = bench::ThreadAllocations() - allocations0;
      const double thread_us = (CpuSeconds(CLOCK_THREAD_CPUTIME_ID) - thread0) * 1e6;
      const double cpu_us = (CpuSeconds() - cpu0) * 1e6;
      if (!r.ok()) {
        std::fprintf(stderr, "step: %s\n", r.status().ToString().c_str());
        return 1;
      }
      if (r->record.device_plan != (absl::GetFlag(FLAGS_device_plan) && !decode)) {  // decode: host-planned
        std::fprintf(stderr, "step planned on the %s, asked for the other\n",
                     r->record.device_plan ? "device" : "host");
        return 1;
      }
      if (rep == 0) continue;  // warm-up
      double sum = 0;
      for (int p = 0; p < kNumStepPhases; ++p) {
        phase[p].push_back(r->record.phase_us[p]);
        if (static_cast<StepPhase>(p) != StepPhase::kExperts) sum += r->record.phase_us[p];
      }
      host.push_back(sum);
      total.push_back(r->record.execute_us);
      cpu.push_back(cpu_us);
      thread_cpu.push_back(thread_us);
      allocs.push_back(static_cast<double>(step_allocations));
      executor->RecycleOutput(std::move(r->output));  // as the engine service does
    }
    std::printf("%8lld", static_cast<long long>(tokens));
    for (int p = 0; p < kNumStepPhases; ++p) std::printf(" %9.1f", bench::Median(phase[p]));
    const double h = bench::Median(host);
    std::printf(" %10.1f %12.1f %13.1f %11.1f %11.1f %7.0f\n", bench::Median(total), h, h * 1e3 / (tokens * k),
                bench::Median(thread_cpu), bench::Median(cpu), bench::Median(allocs));
  }
  return 0;
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return moe::Main();
}
