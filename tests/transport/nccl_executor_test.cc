// Layer steps across the GPUs of this host the way moe-rankd runs them with its CUDA backend: one forked process
// per GPU, CUDA kernels with every row payload in device memory, the NCCL transport moving
// device buffers. Every member's output must equal the direct semantic computation (0x03C3)
// on the CPU reference, for random and hot-expert routings, prefill- and decode-sized steps,
// members with no tokens; a member with bad input aborts the step on every member, and the
// next step succeeds.
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <sys/stat.h>
#include <sys/wait.h>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

#include "kernels/api.h"
#include "kernels/numeric.h"
#include "runtime/checkpoint/synthetic.h"
#include "runtime/exec/cuda_decode_graph.h"
#include "runtime/exec/layer_executor.h"
#include "runtime/placement/default_placement.h"
#include "runtime/transport/nccl.h"
#include "tests/transport/process_harness.h"

namespace moe {
namespace {

constexpr int kExperts = 32, kD = 256, kFf = 128, kK = 8;

// Counted in a child: CUDA must not be initialized in the parent before it forks the members.
int Devices() {
  return testing::ExitCodeOfChild([] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
  });
}

struct Input {
  std::vector<uint16_t> hidden;
  std::vector<int32_t> ids;
  std::vector<float> gates;
  std::vector<uint8_t> admitted;
  int64_t tokens = 0;
};

// k distinct experts per token; `hot` sends about 70% of the routes to experts 0..3.
Input MakeInput(std::mt19937& rng, int64_t tokens, bool hot) {
  Input in;
  in.tokens = tokens;
  std::normal_distribution<float> n(0, 1);
  for (int64_t i = 0; i < tokens * kD; ++i) in.hidden.push_back(kernels::FloatToBf16(n(rng)));
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int> chosen;
    while (static_cast<int>(chosen.size()) < kK) {
      const int e = hot && rng() % 10 < 7 ? static_cast<int>(rng() % 4) : static_cast<int>(rng() % kExperts);
      if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
    }
    for (int j = 0; j < kK; ++j) {
      in.ids.push_back(chosen[j]);
      in.gates.push_back(std::uniform_real_distribution<float>(0.01f, 1.0f)(rng));
      in.admitted.push_back(rng() % 16 != 0);
    }
  }
  return in;
}

// The CPU reference's experts: BF16 weights, and their FP8 copies in 128 x 128 blocks (what an
// executor with ExpertDtype::kFp8 makes of them).
struct ReferenceExperts {
  std::vector<std::vector<uint16_t>> gu, dn;
  std::vector<std::vector<uint8_t>> qgu, qdn;
  std::vector<std::vector<float>> sgu, sdn;

  explicit ReferenceExperts(kernels::ExpertKernels& cpu)
      : gu(kExperts), dn(kExperts), qgu(kExperts), qdn(kExperts), sgu(kExperts), sdn(kExperts) {
    const auto g = kernels::ScaleGranularity::kBlock128x128;
    for (int e = 0; e < kExperts; ++e) {
      SyntheticExpert(e, {kExperts, kD, kFf}, 5, &gu[e], &dn[e]);
      qgu[e].resize(gu[e].size());
      qdn[e].resize(dn[e].size());
      sgu[e].resize(kernels::ScaleCount(g, 2 * kFf, kD));
      sdn[e].resize(kernels::ScaleCount(g, kD, kFf));
      cpu.Quantize({gu[e].data(), 2 * kFf, kD, g, qgu[e].data(), sgu[e].data(), int64_t(sgu[e].size())}, nullptr)
          .IgnoreError();
      cpu.Quantize({dn[e].data(), kD, kFf, g, qdn[e].data(), sdn[e].data(), int64_t(sdn[e].size())}, nullptr)
          .IgnoreError();
    }
  }
};

// y_t = sum_j g_tj E_{e_tj}(h_t), each route through the CPU reference kernel (SwigluFp8 on the
// FP8 copies for `fp8`, whose outputs must also stand apart from the BF16 experts').
absl::Status CheckAgainstReference(const Input& in, absl::Span<const uint16_t> got, kernels::ExpertKernels& cpu,
                                   const ReferenceExperts& w, bool fp8, const char* what) {
  kernels::RelativeL2Error error, from_bf16;
  std::vector<uint16_t> out(kD), out16(kD);
  for (int64_t t = 0; t < in.tokens; ++t) {
    std::vector<double> y(kD, 0.0), y16(kD, 0.0);
    for (int j = 0; j < kK; ++j) {
      if (!in.admitted[t * kK + j]) continue;
      const int e = in.ids[t * kK + j];
      const int64_t offsets[2] = {0, 1};
      kernels::SwigluParams p;
      p.weights = {w.gu[e].data(), w.dn[e].data(), 1, kD, kFf};
      p.x = in.hidden.data() + t * kD;
      p.rows = 1;
      p.host_offsets = offsets;
      p.y = out16.data();
      if (absl::Status s = cpu.Swiglu(p, nullptr); !s.ok()) return s;
      if (fp8) {
        kernels::SwigluFp8Params q;
        q.weights = {w.qgu[e].data(), w.sgu[e].data(), w.qdn[e].data(), w.sdn[e].data(), 1, kD, kFf};
        q.x = p.x;
        q.rows = 1;
        q.offsets = offsets;
        q.y = out.data();
        if (absl::Status s = cpu.SwigluFp8(q, nullptr); !s.ok()) return s;
      } else {
        out = out16;
      }
      for (int c = 0; c < kD; ++c) {
        y[c] += in.gates[t * kK + j] * kernels::Bf16ToFloat(out[c]);
        y16[c] += in.gates[t * kK + j] * kernels::Bf16ToFloat(out16[c]);
      }
    }
    for (int c = 0; c < kD; ++c) {
      error.Add(kernels::Bf16ToFloat(got[t * kD + c]), y[c]);
      from_bf16.Add(kernels::Bf16ToFloat(got[t * kD + c]), y16[c]);
    }
  }
  const double rel = error.Value();
  if (!(rel < 1e-2)) return absl::InternalError(absl::StrCat(what, ": relative L2 error ", rel));
  // E4M3 weights and rows put the FP8 experts' outputs some 6% from the BF16 experts' (CPU test).
  if (fp8 && in.tokens > 0 && !(from_bf16.Value() > 2e-2)) {
    return absl::InternalError(
        absl::StrCat(what, ": FP8 experts within ", from_bf16.Value(), " of the BF16 experts' outputs"));
  }
  return absl::OkStatus();
}

// An executor of `slot` on the GPU's kernels over `transport` (the options both members share).
LayerExecutorOptions GpuExecutorOptions(int slot, const Topology& topology, const ProcessGroup& group,
                                        GenerationRegistry* registry, Transport* transport,
                                        kernels::ExpertKernels* gpu) {
  LayerExecutorOptions eo;
  eo.rank = Rank(slot);
  eo.topology = topology;
  eo.group = group;
  eo.registry = registry;
  eo.transport = transport;
  eo.kernels = gpu;
  eo.timeout = absl::Seconds(20);
  return eo;
}

int Member(int slot, int size, const std::string& dir, DecodeRunner runner, ExpertDtype dtype) {
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  auto fail = [slot](const absl::Status& s) {
    std::fprintf(stderr, "slot %d: %s\n", slot, std::string(s.message()).c_str());
    return 1;
  };
  if (cudaSetDevice(slot) != cudaSuccess) return fail(absl::UnavailableError("cudaSetDevice"));
  auto gpu = kernels::CreateCudaKernels();
  if (!gpu.ok()) return fail(gpu.status());
  auto cpu = kernels::CreateCpuKernels();
  const ReferenceExperts reference(*cpu);
  const bool fp8 = dtype == ExpertDtype::kFp8;
  NcclOptions o;
  o.slot = slot;
  o.size = size;
  o.device = slot;
  o.rendezvous_dir = dir;
  auto transport = CreateNcclTransport(o);
  if (!transport.ok()) return fail(transport.status());

  const SafetensorsFile ckpt = SyntheticCheckpoint({kExperts, kD, kFf}, 5, "checkpoint-gpu");
  const Topology topology = TwoNodeTopology(size);
  const ProcessGroup group = LocalClusterGroup(size, 1);
  auto manifest = DefaultPlacement(PlacementVersion(1), kExperts, 2, topology, group, ckpt.metadata);
  if (!manifest.ok()) return fail(manifest.status());
  GenerationRegistry registry;
  if (absl::Status s = registry.Prepare(*manifest); !s.ok()) return fail(s);
  if (absl::Status s = registry.Activate(PlacementVersion(1)); !s.ok()) return fail(s);
  LayerExecutorOptions eo = GpuExecutorOptions(slot, topology, group, &registry, transport->get(), gpu->get());
  eo.decode_rank_tokens = 8;
  eo.decode_slot_routes = 24;
  eo.decode_runner = runner;
  eo.decode_graphs = CudaDecodeGraphs(transport->get());
  eo.lone_member_graphs = true;  // one GPU: the graph is tested by a lone member
  eo.expert_dtype = dtype;
  auto exec = LayerExecutor::Create(std::move(eo));
  if (!exec.ok()) return fail(exec.status());
  auto local = LoadLocalExperts(ckpt, **manifest, Rank(slot));
  if (!local.ok()) return fail(local.status());
  if (absl::Status s = (*exec)->AddGeneration(PlacementVersion(1), std::make_shared<LocalExperts>(*std::move(local)));
      !s.ok()) {
    return fail(s);
  }

  auto run = [&](uint64_t step, Phase phase, const Input& in) {
    LayerStepInput si;
    si.step_id = step;
    si.layer = 2;
    si.phase = phase;
    si.hidden = in.hidden.data();
    si.tokens = in.tokens;
    si.d = kD;
    si.topk_ids = in.ids.data();
    si.topk_weights = in.gates.data();
    si.k = kK;
    si.admitted = in.admitted.data();
    return (*exec)->Execute(si);
  };
  uint64_t step = 0;
  // Random and hot-expert routings; decode-sized (with a member holding no tokens) and
  // prefill-sized steps. Every member derives the same sequence and runs its own input.
  for (bool hot : {false, true}) {
    for (int64_t base : {1, 16, 128, 2048}) {
      ++step;
      std::mt19937 rng(1000 * step + slot);
      const int64_t tokens = (base <= 16 && slot == size - 1 && step % 2 == 0) ? 0 : base + rng() % (base / 2 + 1);
      const Input in = MakeInput(rng, tokens, hot);
      const Phase phase = base <= 128 ? Phase::kDecode : Phase::kPrefill;
      auto r = run(step, phase, in);
      if (!r.ok())
        return fail(absl::Status(r.status().code(), absl::StrCat("step ", step, ": ", r.status().message())));
      const std::string what = absl::StrCat(hot ? "hot" : "random", " T=", tokens);
      if (absl::Status s = CheckAgainstReference(in, r->output, *cpu, reference, fp8, what.c_str()); !s.ok())
        return fail(s);
      if (r->record.routes_accepted + r->record.routes_dropped != tokens * kK)
        return fail(absl::InternalError("ledger"));
      // Steps above the bucket's 8 tokens per rank run eagerly, saying why. A member holding no
      // tokens is in an oversize step through the others; alone (one GPU) its step is empty and
      // fits the bucket.
      const bool oversize = base > 8 && (tokens > 0 || size > 1);
      if (phase == Phase::kDecode && oversize && (r->record.graph_replay || r->record.fallback_reason.empty())) {
        return fail(
            absl::InternalError(absl::StrCat(what, ": oversize decode step replayed or gave no reason (replay ",
                                             r->record.graph_replay, ", reason '", r->record.fallback_reason, "')")));
      }
    }
  }
  // Decode steps inside the bucket replay the captured graph (uniform routing stays within 24
  // routes per slot; hot routing may exceed it and fall back, saying so). Every output is
  // checked either way.
  int replays = 0, uniform_replays = 0, uniform_steps = 0;
  for (int rep = 0; rep < 3; ++rep) {
    for (bool hot : {false, true}) {
      for (int64_t tokens : {1, 3, 8}) {
        ++step;
        std::mt19937 rng(5000 * step + slot);
        const int64_t t = (slot == 0 && tokens == 3 && rep == 1) ? 0 : tokens;  // a member with no tokens
        const Input in = MakeInput(rng, t, hot);
        auto r = run(step, Phase::kDecode, in);
        if (!r.ok())
          return fail(absl::Status(r.status().code(), absl::StrCat("decode step ", step, ": ", r.status().message())));
        const std::string what =
            absl::StrCat("decode ", hot ? "hot" : "random", " T=", t, r->record.graph_replay ? " (graph)" : " (eager)");
        if (absl::Status s = CheckAgainstReference(in, r->output, *cpu, reference, fp8, what.c_str()); !s.ok())
          return fail(s);
        if (!r->record.graph_replay && r->record.fallback_reason.empty()) return fail(absl::InternalError("no reason"));
        replays += r->record.graph_replay;
        if (!hot) {
          ++uniform_steps;
          uniform_replays += r->record.graph_replay;
        }
      }
    }
  }
  std::fprintf(stderr, "slot %d: %d decode graph replays (%d of %d uniform steps)\n", slot, replays, uniform_replays,
               uniform_steps);
  if (uniform_replays != uniform_steps)
    return fail(absl::InternalError("a uniform decode step inside the bucket ran eagerly"));
  // A placement switch under live decode graphs (0x05H: the graph key follows the generation):
  // placement-v2 has no extra replicas, so other slots on every rank. Its decode steps must
  // capture and replay graphs of their own; a replay of v1's graph over v2's tables would route
  // rows to the wrong experts, which the reference check catches.
  auto v2 = DefaultPlacement(PlacementVersion(2), kExperts, 0, topology, group, ckpt.metadata);
  if (!v2.ok()) return fail(v2.status());
  auto local2 = LoadLocalExperts(ckpt, **v2, Rank(slot));
  if (!local2.ok()) return fail(local2.status());
  if (absl::Status s = registry.Prepare(*v2); !s.ok()) return fail(s);
  if (absl::Status s = (*exec)->AddGeneration(PlacementVersion(2), std::make_shared<LocalExperts>(*std::move(local2)));
      !s.ok()) {
    return fail(s);
  }
  if (absl::Status s = registry.Activate(PlacementVersion(2)); !s.ok()) return fail(s);
  for (int64_t tokens : {1, 3, 8, 8}) {
    ++step;
    std::mt19937 rng(9000 * step + slot);
    const Input in = MakeInput(rng, tokens, false);
    auto r = run(step, Phase::kDecode, in);
    if (!r.ok()) return fail(absl::Status(r.status().code(), absl::StrCat("v2 decode: ", r.status().message())));
    if (r->record.placement_version != 2 || !r->record.graph_replay) {
      return fail(
          absl::InternalError(absl::StrCat("v2 decode T=", tokens, ": placement-v", r->record.placement_version,
                                           ", replay ", r->record.graph_replay, " (", r->record.fallback_reason, ")")));
    }
    const std::string what = absl::StrCat("v2 decode T=", tokens, " (graph)");
    if (absl::Status s = CheckAgainstReference(in, r->output, *cpu, reference, fp8, what.c_str()); !s.ok())
      return fail(s);
  }
  // Bad input on the last member: everyone fails the step (ABORTED on the others), then serves.
  ++step;
  std::mt19937 rng(77 + slot);
  Input bad = MakeInput(rng, 4, false);
  if (slot == size - 1) {
    bad.ids[5] = kExperts + 3;
    bad.admitted[5] = 1;
  }
  auto r = run(step, Phase::kPrefill, bad);
  if (r.ok()) return fail(absl::InternalError("the step with a bad expert id succeeded"));
  const absl::StatusCode want = slot == size - 1 ? absl::StatusCode::kInvalidArgument : absl::StatusCode::kAborted;
  if (r.status().code() != want) return fail(r.status());
  bad.ids[5] = 0;
  auto again = run(++step, Phase::kPrefill, bad);
  if (!again.ok()) return fail(again.status());
  if (absl::Status s = CheckAgainstReference(bad, again->output, *cpu, reference, fp8, "after abort"); !s.ok())
    return fail(s);
  if (registry.Refcount(PlacementVersion(1)) != 0 || registry.Refcount(PlacementVersion(2)) != 0) {
    return fail(absl::InternalError("a handle was not released"));
  }
  return 0;
}

// A lone member's decode steps with rows and routing in device memory, planned on the kernels
// (device_plan, lone_decode_on_kernels): with lone_decode_graphs a key's first step runs eagerly,
// its second is recorded as a CUDA graph and later ones launch it. Every output equals, bit for
// bit, the same step on an executor that enqueues each call (no recordings), and the CPU
// reference; a refused step through a recording names the same route; memory the kernels free
// makes the recordings stale and they are made again. With FP8 experts the layer runs in its
// stages (RouteRows on the local slots, PackFp8Rows, SwigluFp8, Combine) inside the recording.
int LoneRecordedMember(const std::string& dir, ExpertDtype dtype) {
  const bool fp8 = dtype == ExpertDtype::kFp8;
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  auto fail = [](const absl::Status& s) {
    std::fprintf(stderr, "lone recorded: %s\n", std::string(s.message()).c_str());
    return 1;
  };
  if (cudaSetDevice(0) != cudaSuccess) return fail(absl::UnavailableError("cudaSetDevice"));
  auto gpu = kernels::CreateCudaKernels();
  if (!gpu.ok()) return fail(gpu.status());
  auto cpu = kernels::CreateCpuKernels();
  const ReferenceExperts reference(*cpu);
  const SafetensorsFile ckpt = SyntheticCheckpoint({kExperts, kD, kFf}, 5, "checkpoint-gpu");
  const Topology topology = TwoNodeTopology(1);
  const ProcessGroup group = LocalClusterGroup(1, 1);
  auto manifest = DefaultPlacement(PlacementVersion(1), kExperts, 2, topology, group, ckpt.metadata);
  if (!manifest.ok()) return fail(manifest.status());
  GenerationRegistry registry;
  if (absl::Status s = registry.Prepare(*manifest); !s.ok()) return fail(s);
  if (absl::Status s = registry.Activate(PlacementVersion(1)); !s.ok()) return fail(s);
  // Two executors on the same kernels, each over a one-member NCCL group of its own.
  std::vector<std::unique_ptr<Transport>> transports;
  std::vector<std::unique_ptr<LayerExecutor>> execs;
  for (bool recorded : {true, false}) {
    NcclOptions o;
    o.rendezvous_dir = absl::StrCat(dir, recorded ? "/recorded" : "/eager");
    if (mkdir(o.rendezvous_dir.c_str(), 0700) != 0) return fail(absl::InternalError("mkdir"));
    auto transport = CreateNcclTransport(o);
    if (!transport.ok()) return fail(transport.status());
    LayerExecutorOptions eo = GpuExecutorOptions(0, topology, group, &registry, transport->get(), gpu->get());
    eo.device_plan = true;
    eo.lone_decode_graphs = recorded;
    eo.expert_dtype = dtype;
    auto exec = LayerExecutor::Create(std::move(eo));
    if (!exec.ok()) return fail(exec.status());
    auto local = LoadLocalExperts(ckpt, **manifest, Rank(0));
    if (!local.ok()) return fail(local.status());
    if (absl::Status s = (*exec)->AddGeneration(PlacementVersion(1), std::make_shared<LocalExperts>(*std::move(local)));
        !s.ok()) {
      return fail(s);
    }
    transports.push_back(*std::move(transport));
    execs.push_back(*std::move(exec));
  }
  LayerExecutor& recorded = *execs[0];
  LayerExecutor& eager = *execs[1];
  // The engine's buffers: fixed addresses, so each token count keeps its key.
  constexpr int64_t kMaxTokens = 8;
  void *hidden = nullptr, *ids = nullptr, *gates = nullptr, *out_recorded = nullptr, *out_eager = nullptr;
  for (auto [ptr, bytes] : {std::pair{&hidden, kMaxTokens * kD * 2}, std::pair{&ids, kMaxTokens * kK * 4},
                            std::pair{&gates, kMaxTokens * kK * 4}, std::pair{&out_recorded, kMaxTokens * kD * 2},
                            std::pair{&out_eager, kMaxTokens * kD * 2}}) {
    if (cudaMalloc(ptr, static_cast<size_t>(bytes)) != cudaSuccess) return fail(absl::InternalError("cudaMalloc"));
  }
  std::string unused;
  auto done = recorded.CreateDoneEvent(&unused);
  if (!done.ok()) return fail(done.status());
  uint64_t step = 0;
  // Runs `in` on both executors; the outputs must be equal and match the reference.
  const void* const hidden_rows = hidden;
  auto run_both = [&](const Input& in, const char* what) -> absl::StatusOr<std::vector<uint16_t>> {
    if (cudaMemcpy(hidden, in.hidden.data(), in.hidden.size() * 2, cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(ids, in.ids.data(), in.ids.size() * 4, cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(gates, in.gates.data(), in.gates.size() * 4, cudaMemcpyHostToDevice) != cudaSuccess) {
      return absl::InternalError("cudaMemcpy");
    }
    std::vector<uint16_t> got[2];
    for (int e = 0; e < 2; ++e) {
      LayerStepInput si;
      si.step_id = ++step;
      si.layer = 2;
      si.phase = Phase::kDecode;
      si.hidden = static_cast<const uint16_t*>(hidden);
      si.tokens = in.tokens;
      si.d = kD;
      si.topk_ids = static_cast<const int32_t*>(ids);
      si.topk_weights = static_cast<const float*>(gates);
      si.k = kK;
      si.admitted = in.admitted.data();
      si.rows_on_device = true;
      si.routing_on_device = true;
      si.output = static_cast<uint16_t*>(e == 0 ? out_recorded : out_eager);
      si.done_event = e == 0 ? *done : nullptr;
      // The rows' NaN/Inf scan as moe-rankd runs it: started by the executor (in the recording
      // on the recorded executor), its answer awaited.
      LayerExecutor& ex = e == 0 ? recorded : eager;
      const int64_t n = in.tokens * kD;
      si.start_input_check = [&ex, n, hidden_rows](void* stream) {
        return ex.StartDeviceRowCheck(static_cast<const uint16_t*>(hidden_rows), n, stream);
      };
      si.await_input_check = [&ex]() -> absl::Status {
        absl::StatusOr<int64_t> first = ex.FinishDeviceRowCheck();
        if (!first.ok()) return first.status();
        if (*first >= 0) return absl::InvalidArgumentError(absl::StrCat("hidden.data[", *first, "]: not finite"));
        return absl::OkStatus();
      };
      auto r = ex.Execute(si);
      if (!r.ok()) return r.status();
      if (!r->record.device_plan) return absl::InternalError(absl::StrCat(what, ": not planned on the kernels"));
      if (e == 0 && cudaEventSynchronize(static_cast<cudaEvent_t>(*done)) != cudaSuccess) {
        return absl::InternalError("done event");
      }
      got[e].resize(in.tokens * kD);
      if (cudaMemcpy(got[e].data(), si.output, got[e].size() * 2, cudaMemcpyDeviceToHost) != cudaSuccess) {
        return absl::InternalError("cudaMemcpy out");
      }
    }
    if (got[0] != got[1]) return absl::InternalError(absl::StrCat(what, ": recorded and eager outputs differ"));
    if (absl::Status s = CheckAgainstReference(in, got[0], *cpu, reference, fp8, what); !s.ok()) return s;
    return got[0];
  };
  // The largest step first: the executors' buffers and the kernels' scratch reach their size
  // (a buffer that grows frees the old one, which makes recordings stale and moves keys).
  {
    std::mt19937 rng(8999);
    if (auto r = run_both(MakeInput(rng, kMaxTokens, true), "warm-up"); !r.ok()) return fail(r.status());
  }
  for (int rep = 0; rep < 4; ++rep) {
    for (int64_t tokens : {1, 3, 8}) {
      std::mt19937 rng(9000 + 10 * rep + tokens);
      const Input in = MakeInput(rng, tokens, rep % 2 == 1);
      const std::string what = absl::StrCat("rep ", rep, " T=", tokens);
      if (auto r = run_both(in, what.c_str()); !r.ok()) return fail(r.status());
    }
  }
  RecordedWork::Stats st = recorded.LoneDecodeRecordings();
  std::fprintf(stderr, "lone recorded: %lld launches, %lld recorded, %lld eager, %lld failed (%s)\n",
               static_cast<long long>(st.launches), static_cast<long long>(st.recorded),
               static_cast<long long>(st.eager), static_cast<long long>(st.failed), st.last_failure.c_str());
  // Each token count: one eager step, then its recording and launches (T = 8 was seen first).
  if (st.recorded != 3 || st.launches != 10 || st.eager != 3 || st.failed != 0 || st.stale != 0) {
    return fail(absl::InternalError("each token count: one eager step, then a recording and its launches expected"));
  }
  if (eager.LoneDecodeRecordings().launches != 0) return fail(absl::InternalError("the eager executor launched"));
  // A refused route through a recording: the same error as eager, and the next step serves.
  {
    std::mt19937 rng(31);
    Input bad = MakeInput(rng, 3, false);
    bad.ids[13] = kExperts + 2;
    bad.admitted[13] = 1;
    auto r = run_both(bad, "bad id");
    if (r.ok() || r.status().code() != absl::StatusCode::kInvalidArgument ||
        r.status().message().find("topk_ids[1][5]: expert") == std::string::npos) {
      return fail(absl::InternalError(absl::StrCat("bad id through a recording: ", r.status().ToString())));
    }
    if (recorded.LoneDecodeRecordings().launches != 11) return fail(absl::InternalError("not refused by a launch"));
    Input good = MakeInput(rng, 3, false);
    if (auto ok = run_both(good, "after the refusal"); !ok.ok()) return fail(ok.status());
    // A NaN in the rows: refused by the scan inside the recording.
    Input nan_rows = MakeInput(rng, 3, false);
    nan_rows.hidden[kD + 17] = 0x7fc0;
    auto n = run_both(nan_rows, "NaN row");
    if (n.ok() || n.status().code() != absl::StatusCode::kInvalidArgument ||
        n.status().message().find(absl::StrCat("hidden.data[", kD + 17, "]: not finite")) == std::string::npos) {
      return fail(absl::InternalError(absl::StrCat("NaN row through a recording: ", n.status().ToString())));
    }
    if (recorded.LoneDecodeRecordings().launches != 13) return fail(absl::InternalError("NaN: not a launch"));
    if (auto ok = run_both(MakeInput(rng, 3, false), "after the NaN"); !ok.ok()) return fail(ok.status());
  }
  // Memory the kernels free: the recordings are stale; the step runs eagerly, the next records.
  {
    auto p = (*gpu)->Allocate(4096);
    if (!p.ok()) return fail(p.status());
    (*gpu)->Free(*p);
    std::mt19937 rng(41);
    for (int i = 0; i < 2; ++i) {
      if (auto r = run_both(MakeInput(rng, 8, false), "after a free"); !r.ok()) return fail(r.status());
    }
    st = recorded.LoneDecodeRecordings();
    if (st.stale != 1 || st.recorded != 4) {
      return fail(absl::InternalError(absl::StrCat("after a free: ", st.stale, " stale, ", st.recorded, " recorded")));
    }
  }
  recorded.CloseReadyEvent(*done);
  for (void* p : {hidden, ids, gates, out_recorded, out_eager}) cudaFree(p);
  if (registry.Refcount(PlacementVersion(1)) != 0) return fail(absl::InternalError("a handle was not released"));
  return 0;
}

class NcclExecutorLoneTest : public ::testing::TestWithParam<ExpertDtype> {};

TEST_P(NcclExecutorLoneTest, LoneDecodeStepsAreRecordedOnceAndEqualTheEagerSteps) {
  ASSERT_GE(Devices(), 1) << "no GPU";
  const ExpertDtype dtype = GetParam();
  const auto codes = testing::ForkMembers(
      1, "nccl-lone", [dtype](int, const std::string& dir) { return LoneRecordedMember(dir, dtype); });
  EXPECT_EQ(codes[0], 0);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, NcclExecutorLoneTest, ::testing::Values(ExpertDtype::kBf16, ExpertDtype::kFp8),
                         [](const ::testing::TestParamInfo<ExpertDtype>& info) {
                           return std::string(info.param == ExpertDtype::kFp8 ? "Fp8" : "Bf16");
                         });

// Every step through both runners of the decode bucket's graph: the decode kernels over compact
// segments, and GEMMs over slots padded to the bucket's 24 routes; and with FP8 experts (whose
// graph gathers the rows and runs SwigluFp8 over the compact segments).
class NcclExecutorTest : public ::testing::TestWithParam<std::tuple<DecodeRunner, ExpertDtype>> {};

TEST_P(NcclExecutorTest, DeviceResidentStepsMatchTheSemanticComputation) {
  const int n = Devices();
  ASSERT_GE(n, 1) << "no GPU";
  const auto [runner, dtype] = GetParam();
  const auto codes =
      testing::ForkMembers(n, "nccl-exec", [n, runner = runner, dtype = dtype](int slot, const std::string& dir) {
        return Member(slot, n, dir, runner, dtype);
      });
  for (int i = 0; i < n; ++i) EXPECT_EQ(codes[i], 0) << "slot " << i;
}

INSTANTIATE_TEST_SUITE_P(Runners, NcclExecutorTest,
                         ::testing::Values(std::make_tuple(DecodeRunner::kKernels, ExpertDtype::kBf16),
                                           std::make_tuple(DecodeRunner::kPadded, ExpertDtype::kBf16),
                                           std::make_tuple(DecodeRunner::kKernels, ExpertDtype::kFp8)),
                         [](const ::testing::TestParamInfo<std::tuple<DecodeRunner, ExpertDtype>>& info) {
                           if (std::get<1>(info.param) == ExpertDtype::kFp8) return std::string("Fp8");
                           return std::string(std::get<0>(info.param) == DecodeRunner::kPadded ? "Padded" : "Kernels");
                         });

}  // namespace
}  // namespace moe
