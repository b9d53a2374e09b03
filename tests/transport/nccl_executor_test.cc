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
#include <vector>

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

// y_t = sum_j g_tj E_{e_tj}(h_t), each route through the CPU reference kernel.
absl::Status CheckAgainstReference(const Input& in, absl::Span<const uint16_t> got, kernels::ExpertKernels& cpu,
                                   const char* what) {
  std::vector<std::vector<uint16_t>> gu(kExperts), dn(kExperts);
  for (int e = 0; e < kExperts; ++e) SyntheticExpert(e, {kExperts, kD, kFf}, 5, &gu[e], &dn[e]);
  kernels::RelativeL2Error error;
  std::vector<uint16_t> out(kD);
  for (int64_t t = 0; t < in.tokens; ++t) {
    std::vector<double> y(kD, 0.0);
    for (int j = 0; j < kK; ++j) {
      if (!in.admitted[t * kK + j]) continue;
      const int e = in.ids[t * kK + j];
      const int64_t offsets[2] = {0, 1};
      kernels::SwigluParams p;
      p.weights = {gu[e].data(), dn[e].data(), 1, kD, kFf};
      p.x = in.hidden.data() + t * kD;
      p.rows = 1;
      p.host_offsets = offsets;
      p.y = out.data();
      if (absl::Status s = cpu.Swiglu(p, nullptr); !s.ok()) return s;
      for (int c = 0; c < kD; ++c) y[c] += in.gates[t * kK + j] * kernels::Bf16ToFloat(out[c]);
    }
    for (int c = 0; c < kD; ++c) error.Add(kernels::Bf16ToFloat(got[t * kD + c]), y[c]);
  }
  const double rel = error.Value();
  if (!(rel < 1e-2)) return absl::InternalError(absl::StrCat(what, ": relative L2 error ", rel));
  return absl::OkStatus();
}

int Member(int slot, int size, const std::string& dir, DecodeRunner runner) {
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  auto fail = [slot](const absl::Status& s) {
    std::fprintf(stderr, "slot %d: %s\n", slot, std::string(s.message()).c_str());
    return 1;
  };
  if (cudaSetDevice(slot) != cudaSuccess) return fail(absl::UnavailableError("cudaSetDevice"));
  auto gpu = kernels::CreateCudaKernels();
  if (!gpu.ok()) return fail(gpu.status());
  auto cpu = kernels::CreateCpuKernels();
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
  LayerExecutorOptions eo;
  eo.rank = Rank(slot);
  eo.topology = topology;
  eo.group = group;
  eo.registry = &registry;
  eo.transport = transport->get();
  eo.kernels = gpu->get();
  eo.timeout = absl::Seconds(20);
  eo.decode_rank_tokens = 8;
  eo.decode_slot_routes = 24;
  eo.decode_runner = runner;
  eo.decode_graphs = CudaDecodeGraphs(transport->get());
  eo.lone_member_graphs = true;  // one GPU: the graph is tested by a lone member
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
      if (absl::Status s = CheckAgainstReference(in, r->output, *cpu, what.c_str()); !s.ok()) return fail(s);
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
        if (absl::Status s = CheckAgainstReference(in, r->output, *cpu, what.c_str()); !s.ok()) return fail(s);
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
  if (absl::Status s = CheckAgainstReference(bad, again->output, *cpu, "after abort"); !s.ok()) return fail(s);
  if (registry.Refcount(PlacementVersion(1)) != 0) return fail(absl::InternalError("a handle was not released"));
  return 0;
}

// Every step through both runners of the decode bucket's graph: the decode kernels over compact
// segments, and GEMMs over slots padded to the bucket's 24 routes.
class NcclExecutorTest : public ::testing::TestWithParam<DecodeRunner> {};

TEST_P(NcclExecutorTest, DeviceResidentStepsMatchTheSemanticComputation) {
  const int n = Devices();
  ASSERT_GE(n, 1) << "no GPU";
  const DecodeRunner runner = GetParam();
  const auto codes = testing::ForkMembers(
      n, "nccl-exec", [n, runner](int slot, const std::string& dir) { return Member(slot, n, dir, runner); });
  for (int i = 0; i < n; ++i) EXPECT_EQ(codes[i], 0) << "slot " << i;
}

INSTANTIATE_TEST_SUITE_P(Runners, NcclExecutorTest, ::testing::Values(DecodeRunner::kKernels, DecodeRunner::kPadded),
                         [](const ::testing::TestParamInfo<DecodeRunner>& info) {
                           return std::string(info.param == DecodeRunner::kPadded ? "Padded" : "Kernels");
                         });

}  // namespace
}  // namespace moe
