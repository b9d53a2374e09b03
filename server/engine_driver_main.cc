// engine_driver: plays the inference engines of a local cluster. Every step it builds hidden
// rows and a top-k routing for every rank (a rank may have no tokens), calls every rank's
// ExpertLayerService at once through the client library, and checks every returned row against
// the direct semantic computation y_t = sum_j g_tj E_{e_tj}(h_t) (0x03C3) with the same
// checkpoint. Scenarios: prefill, decode, mixed (split into a prefill and a decode unit, 0x05E)
// and oversize decode, each under uniform and hot-expert routing. Ends with a summary table;
// exits non-zero on any failed step or mismatch.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

#include "kernels/api.h"
#include "kernels/numeric.h"
#include "runtime/checkpoint/checkpoint_reader.h"
#include "runtime/checkpoint/expert_checkpoint.h"
#include "runtime/checkpoint/synthetic.h"
#include "runtime/logging.h"
#include "runtime/quantile.h"
#include "runtime/status.h"
#include "server/client.h"

ABSL_FLAG(std::string, addresses, "",
          "comma-separated gRPC targets of rank 0..P-1 (unix:/path or host:port), or use --port_dir");
ABSL_FLAG(std::string, port_dir, "",
          "directory with <rank>.engine files (a rank's engine target, e.g. unix:/run/moe/0.sock) or else "
          "<rank>.port files (moe-rankd --port_file; TCP on 127.0.0.1, needs --engine_token_file)");
ABSL_FLAG(std::string, engine_token_file, "",
          "bearer token for ranks reached over TCP (moe-rankd --engine_token_file)");
ABSL_FLAG(int, world, 4, "ranks (with --port_dir)");
ABSL_FLAG(std::string, checkpoint, "", "the checkpoint the ranks serve (for the reference computation)");
ABSL_FLAG(int, rounds, 3, "rounds of the scenario list");
ABSL_FLAG(std::string, until_file, "",
          "live-traffic mode: after --rounds, keep running rounds until this file exists (an operator's rollout "
          "runs meanwhile)");
ABSL_FLAG(std::string, ready_file, "", "live-traffic mode: touched after the first round");
ABSL_FLAG(int, max_retries, 8,
          "a step every rank answered ABORTED (e.g. ranks switching generation) is retried as a new step this often, "
          "backing off 10 ms, 20 ms, ... up to 1 s");
ABSL_FLAG(bool, ring, false,
          "submit steps through a step ring on each rank (ranks on this host, reached on their Unix socket); "
          "steps larger than --prefill_tokens and malformed ones still go through gRPC");
ABSL_FLAG(bool, tolerate_faults, false,
          "fault-injection runs (ranks killed and replaced): a step answered UNAVAILABLE, ABORTED or "
          "DEADLINE_EXCEEDED by some rank counts as retryable, not failed (a wrong output still fails the run)");
ABSL_FLAG(std::string, events_file, "",
          "write one line per step: unix milliseconds and ok / retryable / failed (recovery measurements)");
ABSL_FLAG(int, k, 4, "experts per token");
ABSL_FLAG(int, prefill_tokens, 48, "tokens per rank in a prefill step");
ABSL_FLAG(int, decode_tokens, 4, "tokens per rank in a decode step (the decode bucket)");
ABSL_FLAG(int, oversize_tokens, 9, "tokens per rank in an oversize decode step");
ABSL_FLAG(std::string, fault, "",
          "bad_input: rank 1 sends a malformed step (then a good one); bad_layer: rank 1 names a layer the model "
          "does not serve (then a good step); dead_rank: expect every "
          "live rank to fail a step within the timeout (a rank was killed)");
ABSL_FLAG(int, dead_rank, -1, "dead_rank fault: the rank that was killed");
ABSL_FLAG(std::string, parity, "",
          "parity mode: a safetensors file of steps recorded from a Hugging Face transformers MoE block "
          "(bench/gpu/hf_parity.py); every layer's tokens are split across the ranks and their outputs compared");
ABSL_FLAG(double, parity_tolerance, 2e-2, "parity mode: the largest relative L2 error that passes");
ABSL_FLAG(std::string, expert_dtype, "bf16",
          "the ranks' --expert_dtype: fp8 checks outputs against the FP8 reference (the checkpoint's experts "
          "quantized in 128 x 128 blocks, rows per 128 values)");

namespace moe {
namespace {

struct Stats {
  int64_t steps = 0, failed = 0, mismatches = 0, routes = 0, remote = 0, inter_node = 0, dropped = 0;
  int64_t replays = 0, decode_steps = 0, retried = 0, generation_splits = 0, canary_steps = 0;
  int64_t retryable = 0;  // rank-steps answered with a retryable error (--tolerate_faults)
  std::vector<std::tuple<int64_t, uint64_t, uint64_t>> timeline;  // (generation, first step, last step)
  std::map<std::string, int64_t> fallbacks;
  std::map<std::string, std::vector<double>> latency_us;   // by phase
  std::map<std::string, std::vector<double>> executor_us;  // by phase: time inside the rank's layer executor
  std::map<std::string, std::vector<double>> server_us;    // by phase: time inside the rank's handler
  // By timeline segment, then phase: the latency before, during and after a rollout.
  std::vector<std::map<std::string, std::vector<double>>> segment_latency_us;
};

// 0x0DA's nearest rank (runtime/quantile.h), the convention of every reported quantile.
double Percentile(std::vector<double> v, double q) { return NearestRank(std::move(v), q); }

// The semantic computation from the checkpoint's own tensors, every MoE layer's experts read
// through the same CheckpointReader the ranks load from (small models: all held in memory).
class Reference {
 public:
  static absl::StatusOr<Reference> Load(const CheckpointReader& ckpt, bool fp8) {
    Reference r;
    r.fp8_ = fp8;
    const ExpertShape s = ckpt.shape();
    r.d_ = s.d;
    r.f_ = s.d_ff;
    r.layers_ = ckpt.layers();
    for (int li = 0; li < ckpt.num_layers(); ++li) {
      const int64_t layer = r.layers_.empty() ? 0 : r.layers_[li];
      r.gate_up_.emplace_back();
      r.down_.emplace_back();
      for (int e = 0; e < s.num_experts; ++e) {
        r.gate_up_.back().emplace_back(2 * static_cast<size_t>(s.d_ff) * s.d);
        r.down_.back().emplace_back(static_cast<size_t>(s.d) * s.d_ff);
        RETURN_IF_ERROR(ckpt.ReadExpert(layer, e, r.gate_up_.back().back().data(), r.down_.back().back().data()));
      }
    }
    r.kernels_ = kernels::CreateCpuKernels();
    if (fp8) RETURN_IF_ERROR(r.QuantizeExperts());
    return r;
  }
  // The layer of a step: the model's MoE layers in turn (0, 1, 2 in turn for a single-layer
  // checkpoint, whose experts serve every layer index).
  int64_t LayerFor(uint64_t step) const {
    return layers_.empty() ? static_cast<int64_t>(step % 3) : layers_[step % layers_.size()];
  }
  int num_layers() const { return static_cast<int>(gate_up_.size()); }
  int num_experts() const { return static_cast<int>(gate_up_.front().size()); }

  // y_t = sum_j g_tj E_e(h_t) in FP32, rounded to BF16 at the end.
  std::vector<float> Compute(const StepCall& c) {
    std::vector<float> y(c.tokens * d_, 0.0f);
    size_t li = 0;
    while (li < layers_.size() && layers_[li] != c.layer) ++li;
    if (li == layers_.size()) li = 0;  // a single-layer checkpoint
    std::vector<uint16_t> out(d_);
    const int64_t offsets[2] = {0, 1};
    for (int64_t t = 0; t < c.tokens; ++t) {
      for (int j = 0; j < c.k; ++j) {
        const int64_t i = t * c.k + j;
        if (!c.admitted.empty() && c.admitted[i] == 0) continue;
        const int e = c.topk_ids[i];
        if (fp8_) {
          const Fp8Expert& q = fp8_experts_[li][e];
          kernels::SwigluFp8Params p;
          p.weights = {q.gu.data(), q.gu_scales.data(), q.dn.data(), q.dn_scales.data(), 1, d_, f_};
          p.x = c.hidden.data() + t * d_;
          p.rows = 1;
          p.offsets = offsets;
          p.y = out.data();
          if (!kernels_->SwigluFp8(p, nullptr).ok()) std::abort();
        } else {
          kernels::SwigluParams p;
          p.weights = {gate_up_[li][e].data(), down_[li][e].data(), 1, d_, f_};
          p.x = c.hidden.data() + t * d_;
          p.rows = 1;
          p.host_offsets = offsets;
          p.y = out.data();
          if (!kernels_->Swiglu(p, nullptr).ok()) std::abort();
        }
        for (int col = 0; col < d_; ++col) y[t * d_ + col] += c.topk_weights[i] * kernels::Bf16ToFloat(out[col]);
      }
    }
    return y;
  }

 private:
  Reference() = default;
  int d_ = 0, f_ = 0;
  std::vector<int64_t> layers_;
  std::unique_ptr<kernels::ExpertKernels> kernels_;
  std::vector<std::vector<std::vector<uint16_t>>> gate_up_, down_;  // [layer][expert]
  // --expert_dtype fp8: each expert as the ranks hold it (LayerExecutorOptions::expert_dtype).
  struct Fp8Expert {
    std::vector<uint8_t> gu, dn;
    std::vector<float> gu_scales, dn_scales;
  };
  bool fp8_ = false;
  std::vector<std::vector<Fp8Expert>> fp8_experts_;

  absl::Status QuantizeExperts() {
    if (d_ % 128 != 0 || f_ % 128 != 0) {
      return absl::InvalidArgumentError(absl::StrCat("--expert_dtype fp8: the checkpoint's d (", d_, ") and d_ff (", f_,
                                                     ") must be multiples of 128"));
    }
    const auto g = kernels::ScaleGranularity::kBlock128x128;
    for (size_t li = 0; li < gate_up_.size(); ++li) {
      fp8_experts_.emplace_back();
      for (size_t e = 0; e < gate_up_[li].size(); ++e) {
        Fp8Expert q;
        q.gu.resize(gate_up_[li][e].size());
        q.dn.resize(down_[li][e].size());
        q.gu_scales.resize(kernels::ScaleCount(g, 2 * f_, d_));
        q.dn_scales.resize(kernels::ScaleCount(g, d_, f_));
        RETURN_IF_ERROR(kernels_->Quantize({gate_up_[li][e].data(), 2 * f_, d_, g, q.gu.data(), q.gu_scales.data(),
                                            static_cast<int64_t>(q.gu_scales.size())},
                                           nullptr));
        RETURN_IF_ERROR(kernels_->Quantize(
            {down_[li][e].data(), d_, f_, g, q.dn.data(), q.dn_scales.data(), static_cast<int64_t>(q.dn_scales.size())},
            nullptr));
        fp8_experts_.back().push_back(std::move(q));
      }
    }
    return absl::OkStatus();
  }
};

StepCall MakeCall(std::mt19937& rng, uint64_t step, bool decode, int64_t tokens, int d, int k,
                  const Reference& reference, bool hot) {
  const int experts = reference.num_experts();
  StepCall c;
  c.step_id = step;
  c.layer = reference.LayerFor(step);
  c.decode = decode;
  c.tokens = tokens;
  c.d = d;
  c.k = k;
  std::normal_distribution<float> n(0, 1);
  for (int64_t i = 0; i < tokens * d; ++i) c.hidden.push_back(kernels::FloatToBf16(n(rng)));
  std::vector<int> perm(experts);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int e = 0; e < experts; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    if (hot && rng() % 2 == 0) std::swap(perm[0], *std::find(perm.begin(), perm.end(), 0));  // expert 0 is hot
    float sum = 0;
    for (int j = 0; j < k; ++j) {
      c.topk_ids.push_back(perm[j]);
      c.topk_weights.push_back(0.05f + std::uniform_real_distribution<float>(0, 1)(rng));
      sum += c.topk_weights.back();
      c.admitted.push_back(rng() % 20 != 0);  // the router dropped one route in twenty
    }
    for (int j = 0; j < k; ++j) c.topk_weights[c.topk_weights.size() - k + j] /= sum;
  }
  return c;
}

using Clients = std::vector<std::unique_ptr<ExpertLayerClient>>;  // by rank; nullptr: a killed rank
using Answers = std::vector<absl::StatusOr<StepAnswer>>;

// What a fault check needs: the ranks' clients, the reference, the step's shape and the calls'
// random source (one sequence across the checks' steps).
struct FaultContext {
  Clients& clients;
  Reference& reference;
  int d, k;
  std::mt19937 rng{9};

  int ranks() const { return static_cast<int>(clients.size()); }
  // A prefill step of 8 tokens a rank, uniform routing.
  std::vector<StepCall> Calls(uint64_t step) {
    std::vector<StepCall> calls;
    for (int r = 0; r < ranks(); ++r) calls.push_back(MakeCall(rng, step, false, 8, d, k, reference, false));
    return calls;
  }
  // Calls every rank not skipped at once, with a 30 s deadline.
  void Run(const std::vector<StepCall>& calls, Answers* answers, const std::vector<bool>& skip) {
    answers->assign(ranks(), absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks(); ++r) {
      if (!skip[r]) threads.emplace_back([&, r] { (*answers)[r] = clients[r]->Execute(calls[r], absl::Seconds(30)); });
    }
    for (auto& t : threads) t.join();
  }
  void RunAll(const std::vector<StepCall>& calls, Answers* answers) {
    Run(calls, answers, std::vector<bool>(ranks(), false));
  }
};

// bad_input: rank 1's step is malformed; it gets INVALID_ARGUMENT naming the field, every other
// rank ABORTED, and the next step is served everywhere.
// bad_layer: the same with rank 1 naming a layer the model does not serve (a huge index): it
// gets INVALID_ARGUMENT naming the layer, every other rank ABORTED, the next step is served.
int FaultBadInput(FaultContext& f, std::vector<StepCall> calls, bool bad_layer) {
  const int p = f.ranks();
  Answers answers;
  if (bad_layer) {
    calls[1].layer = int64_t{1} << 40;
  } else {
    calls[1].hidden.pop_back();  // byte length no longer matches dtype x shape
  }
  const absl::Time start = absl::Now();
  f.RunAll(calls, &answers);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  bool ok = answers[1].status().code() == absl::StatusCode::kInvalidArgument &&
            std::string(answers[1].status().message()).find(bad_layer ? "is not a MoE layer" : "hidden.data") !=
                std::string::npos;
  std::printf("rank 1 (%s): %s\n", bad_layer ? "bad layer" : "malformed", answers[1].status().ToString().c_str());
  for (int r = 0; r < p; ++r) {
    if (r == 1) continue;
    std::printf("rank %d: %s\n", r, answers[r].status().ToString().c_str());
    ok = ok && answers[r].status().code() == absl::StatusCode::kAborted;
  }
  std::printf("step answered everywhere in %.2f s\n", seconds);
  f.RunAll(f.Calls(1001), &answers);
  for (int r = 0; r < p; ++r) ok = ok && answers[r].ok();
  std::printf("next step: %s\n", ok ? "served by every rank" : "FAILED");
  return ok ? kExitOk : kExitFailure;
}

// dead_rank: with --dead_rank killed, every live rank fails the step within the timeout.
int FaultDeadRank(FaultContext& f, const std::vector<StepCall>& calls) {
  const int p = f.ranks();
  Answers answers;
  std::vector<bool> skip(p, false);
  skip[absl::GetFlag(FLAGS_dead_rank)] = true;
  const absl::Time start = absl::Now();
  f.Run(calls, &answers, skip);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  bool ok = true;
  for (int r = 0; r < p; ++r) {
    if (skip[r]) continue;
    std::printf("rank %d: %s\n", r, answers[r].status().ToString().c_str());
    ok = ok && (answers[r].status().code() == absl::StatusCode::kDeadlineExceeded ||
                answers[r].status().code() == absl::StatusCode::kUnavailable);
  }
  std::printf("every live rank answered with an error in %.2f s\n", seconds);
  return ok ? kExitOk : kExitFailure;
}

// 0x0E "stale handle reaches new active generation -> reject handle and replan": the engine
// expects a generation the ranks do not serve; every rank refuses the step naming both, and
// the engine re-plans against the generation the error names.
int FaultStaleGeneration(FaultContext& f, const std::vector<StepCall>& calls) {
  const int p = f.ranks();
  Answers answers;
  f.RunAll(calls, &answers);  // learn the serving generation
  if (!answers[0].ok()) {
    std::printf("first step failed: %s\n", answers[0].status().ToString().c_str());
    return kExitFailure;
  }
  const int64_t serving = answers[0]->record.placement_generation();
  std::vector<StepCall> stale = f.Calls(1001);
  for (StepCall& c : stale) c.expected_generation = serving + 1;
  f.RunAll(stale, &answers);
  bool ok = true;
  for (int r = 0; r < p; ++r) {
    std::printf("rank %d (expects placement-v%lld): %s\n", r, static_cast<long long>(serving + 1),
                answers[r].status().ToString().c_str());
    ok = ok && answers[r].status().code() == absl::StatusCode::kFailedPrecondition &&
         std::string(answers[r].status().message()).find("expected_generation") != std::string::npos;
  }
  for (StepCall& c : stale) {
    c.step_id = 1002;
    c.expected_generation = serving;
  }
  f.RunAll(stale, &answers);
  for (int r = 0; r < p; ++r) {
    ok = ok && answers[r].ok() && answers[r]->record.placement_generation() == serving;
    if (answers[r].ok()) ok = ok && kernels::RelativeL2Bf16(answers[r]->output, f.reference.Compute(stale[r])) <= 1e-2;
  }
  std::printf("re-planned against placement-v%lld: %s\n", static_cast<long long>(serving),
              ok ? "served by every rank, outputs checked" : "FAILED");
  return ok ? kExitOk : kExitFailure;
}

// Fault checks on a live cluster (0x0E): each prints what it saw and returns the exit code.
int Fault(Clients& clients, Reference& reference, int d, int k) {
  FaultContext f{clients, reference, d, k};
  const std::vector<StepCall> calls = f.Calls(1000);
  const std::string fault = absl::GetFlag(FLAGS_fault);
  if (fault == "bad_input" || fault == "bad_layer") return FaultBadInput(f, calls, fault == "bad_layer");
  if (fault == "dead_rank") return FaultDeadRank(f, calls);
  if (fault == "stale_generation") return FaultStaleGeneration(f, calls);
  spdlog::error("--fault {}: unknown (bad_input, bad_layer, dead_rank, stale_generation)", fault);
  return kExitUsage;
}

std::vector<std::string> Addresses() {
  if (!absl::GetFlag(FLAGS_addresses).empty()) return absl::StrSplit(absl::GetFlag(FLAGS_addresses), ',');
  std::vector<std::string> out;
  for (int r = 0; r < absl::GetFlag(FLAGS_world); ++r) {
    std::ifstream engine(absl::StrCat(absl::GetFlag(FLAGS_port_dir), "/", r, ".engine"));
    std::string target;
    if (engine && std::getline(engine, target) && !target.empty()) {
      out.push_back(target);
      continue;
    }
    std::ifstream in(absl::StrCat(absl::GetFlag(FLAGS_port_dir), "/", r, ".port"));
    std::string port;
    std::getline(in, port);
    out.push_back(absl::StrCat("127.0.0.1:", port));
  }
  return out;
}

// One kind of step of the scenario list.
struct Unit {
  std::string scenario;
  bool decode;
  int64_t tokens;
};

std::vector<Unit> Units() {
  return {
      {"prefill", false, absl::GetFlag(FLAGS_prefill_tokens)},
      {"decode", true, absl::GetFlag(FLAGS_decode_tokens)},
      {"mixed/prefill-unit", false, absl::GetFlag(FLAGS_prefill_tokens) / 4},
      {"mixed/decode-unit", true, absl::GetFlag(FLAGS_decode_tokens) / 2},
      {"oversize-decode", true, absl::GetFlag(FLAGS_oversize_tokens)},
  };
}

// Calls every rank at once. A step every rank answered ABORTED (the group aborted before payload:
// no rank computed anything) runs again as a new step, up to --max_retries times.
Answers ExecuteWithRetries(Clients& clients, std::vector<StepCall>& calls, uint64_t step, Stats* stats) {
  const int p = static_cast<int>(clients.size());
  Answers answers(p, absl::UnknownError("not run"));
  for (int attempt = 0;; ++attempt) {
    std::vector<std::thread> threads;
    for (int r = 0; r < p; ++r) threads.emplace_back([&, r] { answers[r] = clients[r]->Execute(calls[r]); });
    for (auto& t : threads) t.join();
    const bool all_aborted = std::all_of(answers.begin(), answers.end(),
                                         [](const auto& a) { return a.status().code() == absl::StatusCode::kAborted; });
    if (!all_aborted || attempt == absl::GetFlag(FLAGS_max_retries)) break;
    ++stats->retried;
    const uint64_t retry_id = (uint64_t{1} << 40) + static_cast<uint64_t>(stats->retried);
    spdlog::info("step {} aborted on every rank ({}); retrying as step {}", step,
                 std::string(answers[0].status().message()), retry_id);
    for (StepCall& c : calls) c.step_id = retry_id;
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(1000, 10 << attempt)));
  }
  return answers;
}

// --parity FILE: per MoE layer L the tensors hidden.L [T, d] BF16, topk_ids.L [T, k] I32,
// topk_weights.L [T, k] F32 and expected.L [T, d] F32 (a transformers MoE block's experts on that
// routing, computed by the block itself). Each layer's tokens are split across the ranks in
// order; one line per layer gives the ranks' error against `expected` and against the semantic
// computation from the checkpoint's tensors. Exit 1 when a relative L2 error is over the
// tolerance or a step fails.
int Parity(Clients& clients, Reference& reference, int d, const std::string& path) {
  auto file = ReadSafetensors(path);
  if (!file.ok()) {
    spdlog::error("--parity: {}", std::string(file.status().message()));
    return kExitUsage;
  }
  const int p = static_cast<int>(clients.size());
  const double tolerance = absl::GetFlag(FLAGS_parity_tolerance);
  bool pass = true;
  int layers_checked = 0;
  uint64_t step = 1;
  for (const auto& [name, hidden] : file->tensors) {
    if (name.rfind("hidden.", 0) != 0) continue;
    const std::string key = name.substr(7);
    int64_t layer = 0;
    const auto ids = file->tensors.find("topk_ids." + key), w = file->tensors.find("topk_weights." + key),
               want = file->tensors.find("expected." + key);
    if (!absl::SimpleAtoi(key, &layer) || ids == file->tensors.end() || w == file->tensors.end() ||
        want == file->tensors.end() || hidden.dtype != "BF16" || hidden.shape.size() != 2 || hidden.shape[1] != d ||
        ids->second.dtype != "I32" || ids->second.shape.size() != 2 || w->second.dtype != "F32" ||
        w->second.shape != ids->second.shape || want->second.dtype != "F32" || want->second.shape != hidden.shape ||
        ids->second.shape[0] != hidden.shape[0]) {
      spdlog::error("--parity: layer {}: tensors missing or of the wrong dtype / shape", key);
      return kExitUsage;
    }
    const int64_t tokens = hidden.shape[0];
    const int k = static_cast<int>(ids->second.shape[1]);
    std::vector<StepCall> calls(p);
    for (int r = 0; r < p; ++r) {
      const int64_t begin = tokens * r / p, end = tokens * (r + 1) / p;
      StepCall& c = calls[r];
      c.step_id = step;
      c.layer = layer;
      c.tokens = end - begin;
      c.d = d;
      c.k = k;
      c.hidden.resize(c.tokens * d);
      std::memcpy(c.hidden.data(), hidden.data.data() + begin * d * 2, c.hidden.size() * 2);
      c.topk_ids.resize(c.tokens * k);
      std::memcpy(c.topk_ids.data(), ids->second.data.data() + begin * k * 4, c.topk_ids.size() * 4);
      c.topk_weights.resize(c.tokens * k);
      std::memcpy(c.topk_weights.data(), w->second.data.data() + begin * k * 4, c.topk_weights.size() * 4);
    }
    Stats stats;
    const Answers answers = ExecuteWithRetries(clients, calls, step++, &stats);
    std::vector<uint16_t> got;
    std::vector<float> semantic;
    for (int r = 0; r < p; ++r) {
      if (!answers[r].ok()) {
        spdlog::error("parity layer {} rank {}: {}", layer, r, std::string(answers[r].status().message()));
        return kExitFailure;
      }
      got.insert(got.end(), answers[r]->output.begin(), answers[r]->output.end());
      const std::vector<float> ref = reference.Compute(calls[r]);
      semantic.insert(semantic.end(), ref.begin(), ref.end());
    }
    std::vector<float> expected(tokens * d);
    std::memcpy(expected.data(), want->second.data.data(), expected.size() * 4);
    double max_hf = 0, max_sem = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      max_hf = std::max<double>(max_hf, std::fabs(kernels::Bf16ToFloat(got[i]) - expected[i]));
      max_sem = std::max<double>(max_sem, std::fabs(kernels::Bf16ToFloat(got[i]) - semantic[i]));
    }
    const double rel_hf = kernels::RelativeL2Bf16(got, expected), rel_sem = kernels::RelativeL2Bf16(got, semantic);
    std::printf(
        "parity layer %lld: %lld tokens over %d ranks, k=%d: vs transformers max_abs %.3g rel_l2 %.3g; "
        "vs semantic max_abs %.3g rel_l2 %.3g\n",
        static_cast<long long>(layer), static_cast<long long>(tokens), p, k, max_hf, rel_hf, max_sem, rel_sem);
    pass = pass && rel_hf <= tolerance && rel_sem <= tolerance;
    ++layers_checked;
  }
  std::printf("parity: %d layers, %s (tolerance %.3g)\n", layers_checked, pass ? "pass" : "FAIL", tolerance);
  return pass && layers_checked > 0 ? kExitOk : kExitFailure;
}

// Follows the serving generation through the steps: the timeline, its segments, canary steps
// and steps the ranks answered under different generations.
void RecordGeneration(const Answers& answers, uint64_t step, Stats* stats) {
  if (answers[0].ok() && answers[0]->record.canary()) {
    ++stats->canary_steps;  // served by the candidate on trial: not a change of the serving generation
    return;
  }
  if (!answers[0].ok()) return;
  const int64_t gen = answers[0]->record.placement_generation();
  for (size_t r = 1; r < answers.size(); ++r) {
    if (answers[r].ok() && answers[r]->record.placement_generation() != gen) ++stats->generation_splits;
  }
  if (stats->timeline.empty() || std::get<0>(stats->timeline.back()) != gen) {
    stats->timeline.emplace_back(gen, step, step);
    stats->segment_latency_us.emplace_back();
  } else {
    std::get<2>(stats->timeline.back()) = step;
  }
}

// Checks every rank's answer against the semantic computation and counts its record.
void CheckAnswers(const Answers& answers, const std::vector<StepCall>& calls, const Unit& u, uint64_t step,
                  Reference& reference, Stats* stats) {
  const std::string phase = u.decode ? "decode" : "prefill";
  const bool tolerate = absl::GetFlag(FLAGS_tolerate_faults);
  for (size_t r = 0; r < answers.size(); ++r) {
    ++stats->steps;
    if (!answers[r].ok()) {
      const absl::StatusCode code = answers[r].status().code();
      if (tolerate && (code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kAborted ||
                       code == absl::StatusCode::kDeadlineExceeded)) {
        ++stats->retryable;
        continue;
      }
      ++stats->failed;
      spdlog::error("step {} rank {}: {}", step, r, std::string(answers[r].status().message()));
      continue;
    }
    const std::vector<float> ref = reference.Compute(calls[r]);
    const double rel = kernels::RelativeL2Bf16(answers[r]->output, ref);
    if (!ref.empty() && rel > 1e-2) {
      ++stats->mismatches;
      spdlog::error("step {} rank {}: output differs from the semantic computation (rel {:.3g})", step, r, rel);
    }
    const v1::StepRecord& rec = answers[r]->record;
    stats->routes += rec.routes_accepted();
    stats->remote += rec.routes_remote();
    stats->inter_node += rec.routes_inter_node();
    stats->dropped += rec.routes_dropped();
    if (u.decode) {
      ++stats->decode_steps;
      if (rec.path() == v1::PATH_GRAPH_REPLAY) {
        ++stats->replays;
      } else if (!rec.fallback_reason().empty()) {  // (a lone rank's local-layer decode is no fallback)
        ++stats->fallbacks[rec.fallback_reason()];
      }
    }
    stats->latency_us[phase].push_back(answers[r]->client_latency_us);
    stats->executor_us[phase].push_back(rec.compute_latency_us());
    stats->server_us[phase].push_back(rec.server_latency_us());
    if (!stats->segment_latency_us.empty()) {
      stats->segment_latency_us.back()[phase].push_back(answers[r]->client_latency_us);
    }
  }
}

// One line per step for recovery measurements (--events_file): unix ms, the step's outcome and,
// unless ok, the first rank's error.
struct Outcomes {
  int64_t bad = 0, retryable = 0;
  explicit Outcomes(const Stats& s) : bad(s.failed + s.mismatches), retryable(s.retryable) {}
};
void RecordEvent(const Outcomes& before, const Outcomes& after, const Answers& answers) {
  static std::ofstream* events = [] {
    const std::string path = absl::GetFlag(FLAGS_events_file);
    return path.empty() ? nullptr : new std::ofstream(path, std::ios::app);
  }();
  if (events == nullptr) return;
  const char* outcome = after.bad > before.bad ? "failed" : after.retryable > before.retryable ? "retryable" : "ok";
  *events << absl::ToUnixMillis(absl::Now()) << " " << outcome;
  if (outcome[0] != 'o') {
    for (size_t r = 0; r < answers.size(); ++r) {
      if (answers[r].ok()) continue;
      std::string why = answers[r].status().ToString().substr(0, 200);
      std::replace(why.begin(), why.end(), '\n', ' ');
      *events << " rank " << r << ": " << why;
      break;
    }
  }
  *events << "\n";
  events->flush();
}

void PrintProgress(int round, int rounds, uint64_t step, const Unit& u, bool hot, const Stats& stats) {
  std::printf("%s", isatty(1) ? "\r" : "");
  std::printf("round %d/%s  step %llu  %-20s %-7s routing   failed %lld  mismatches %lld", round + 1,
              round < rounds ? std::to_string(rounds).c_str() : "live", static_cast<unsigned long long>(step),
              u.scenario.c_str(), hot ? "hot" : "uniform", static_cast<long long>(stats.failed),
              static_cast<long long>(stats.mismatches));
  if (!isatty(1)) std::printf("\n");
  std::fflush(stdout);
}

// The scenario list under uniform and hot-expert routing, --rounds times and then, in live-traffic
// mode, until --until_file exists.
Stats RunRounds(Clients& clients, Reference& reference, int d, int k) {
  const int p = static_cast<int>(clients.size());
  const std::vector<Unit> units = Units();
  Stats stats;
  std::mt19937 rng(42);
  uint64_t step = 1;
  const int rounds = absl::GetFlag(FLAGS_rounds);
  const std::string until = absl::GetFlag(FLAGS_until_file);
  auto more = [&](int round) {
    if (round < rounds) return true;
    return !until.empty() && !std::ifstream(until).good();
  };
  for (int round = 0; more(round); ++round) {
    if (round == 1 && !absl::GetFlag(FLAGS_ready_file).empty()) std::ofstream(absl::GetFlag(FLAGS_ready_file)) << "1";
    for (bool hot : {false, true}) {
      for (const Unit& u : units) {
        std::vector<StepCall> calls;
        for (int r = 0; r < p; ++r) {
          // The last rank sits out every third step with zero tokens (it still takes part). A lone
          // rank sits out every seventh: every third would make each of a rollout's canary steps
          // (live_rollout.sh: --canary_every 3) an empty one, and a candidate without a route
          // fails the gate's r_drop clause (its denominator must be positive).
          const uint64_t sit_out = p > 1 ? 3 : 7;
          const int64_t tokens = (r == p - 1 && step % sit_out == 0) ? 0 : u.tokens;
          calls.push_back(MakeCall(rng, step, u.decode, tokens, d, k, reference, hot));
        }
        const Answers answers = ExecuteWithRetries(clients, calls, step, &stats);
        RecordGeneration(answers, step, &stats);
        const Outcomes before(stats);
        CheckAnswers(answers, calls, u, step, reference, &stats);
        RecordEvent(before, Outcomes(stats), answers);
        PrintProgress(round, rounds, step, u, hot, stats);
        ++step;
      }
    }
  }
  return stats;
}

// The samples of `phase` (none if it has none).
const std::vector<double>& Samples(const std::map<std::string, std::vector<double>>& by_phase,
                                   const std::string& phase) {
  static const std::vector<double>* const kNone = new std::vector<double>();
  auto it = by_phase.find(phase);
  return it == by_phase.end() ? *kNone : it->second;
}

// The latency of each segment of the generation timeline (when a rollout made more than one).
void PrintTimelineSegments(const Stats& stats) {
  for (size_t i = 0; i < stats.timeline.size() && stats.timeline.size() > 1; ++i) {
    std::printf("    placement-v%lld (steps %llu-%llu):", static_cast<long long>(std::get<0>(stats.timeline[i])),
                static_cast<unsigned long long>(std::get<1>(stats.timeline[i])),
                static_cast<unsigned long long>(std::get<2>(stats.timeline[i])));
    for (const auto& [phase, v] : stats.segment_latency_us[i]) {
      std::printf("  %s p50 %.0f us p99 %.0f us (%zu)", phase.c_str(), Percentile(v, 0.5), Percentile(v, 0.99),
                  v.size());
    }
    std::printf("\n");
  }
}

void PrintSummary(const Stats& stats, int p, int k, int d, int f, int experts, int layers) {
  std::printf("\n\n== local cluster summary (%d ranks, k=%d, d=%d, d_ff=%d, %d experts x %d MoE layers)\n", p, k, d, f,
              experts, layers);
  std::printf("  rank-steps          %lld (failed %lld, retryable %lld)\n", static_cast<long long>(stats.steps),
              static_cast<long long>(stats.failed), static_cast<long long>(stats.retryable));
  std::printf("  routes accepted     %lld (router-dropped %lld)\n", static_cast<long long>(stats.routes),
              static_cast<long long>(stats.dropped));
  std::printf("  remote fraction     %.3f\n", stats.routes ? static_cast<double>(stats.remote) / stats.routes : 0.0);
  std::printf("  inter-node fraction %.3f\n",
              stats.routes ? static_cast<double>(stats.inter_node) / stats.routes : 0.0);
  std::printf("  graph replay ratio  %.3f (%lld of %lld decode rank-steps)\n",
              stats.decode_steps ? static_cast<double>(stats.replays) / stats.decode_steps : 0.0,
              static_cast<long long>(stats.replays), static_cast<long long>(stats.decode_steps));
  for (const auto& [reason, n] : stats.fallbacks)
    std::printf("  fallback %-26s %lld\n", reason.c_str(), static_cast<long long>(n));
  for (const auto& [phase, v] : stats.latency_us) {
    std::printf(
        "  %-8s latency     p50 %.0f us  p99 %.0f us  (%zu rank-steps; inside the rank's handler p50 %.0f us, "
        "its executor p50 %.0f us)\n",
        phase.c_str(), Percentile(v, 0.5), Percentile(v, 0.99), v.size(),
        Percentile(Samples(stats.server_us, phase), 0.5), Percentile(Samples(stats.executor_us, phase), 0.5));
  }
  std::printf("  mismatches          %lld\n", static_cast<long long>(stats.mismatches));
  std::printf("  steps retried       %lld (aborted on every rank before payload, e.g. during a generation switch)\n",
              static_cast<long long>(stats.retried));
  if (stats.canary_steps > 0) {
    std::printf("  canary steps        %lld (served by a candidate generation on trial)\n",
                static_cast<long long>(stats.canary_steps));
  }
  std::printf("  generation timeline");
  for (const auto& [gen, first, last] : stats.timeline) {
    std::printf("  placement-v%lld: steps %llu-%llu", static_cast<long long>(gen),
                static_cast<unsigned long long>(first), static_cast<unsigned long long>(last));
  }
  std::printf("\n");
  PrintTimelineSegments(stats);
  if (stats.generation_splits > 0) {
    std::printf("  GENERATION SPLITS   %lld (ranks answered one step under different generations)\n",
                static_cast<long long>(stats.generation_splits));
  }
}

// A client for every rank but a killed one (--dead_rank: nullptr).
absl::StatusOr<Clients> ConnectClients(const std::vector<std::string>& addresses, const std::string& token) {
  Clients clients;
  for (int r = 0; r < static_cast<int>(addresses.size()); ++r) {
    if (r == absl::GetFlag(FLAGS_dead_rank)) {  // a killed rank is not called
      clients.push_back(nullptr);
      continue;
    }
    ASSIGN_OR_RETURN(std::unique_ptr<ExpertLayerClient> c,
                     ExpertLayerClient::Connect(addresses[r], absl::Seconds(30), token));
    clients.push_back(std::move(c));
  }
  return clients;
}

int Main() {
  std::unique_ptr<SafetensorsFile> file;
  auto ckpt = OpenCheckpoint(absl::GetFlag(FLAGS_checkpoint), &file);
  const std::string dtype = absl::GetFlag(FLAGS_expert_dtype);
  if (dtype != "bf16" && dtype != "fp8") {
    spdlog::error("--expert_dtype={}: expected bf16 or fp8", dtype);
    return kExitUsage;
  }
  absl::StatusOr<Reference> loaded =
      ckpt.ok() ? Reference::Load(**ckpt, dtype == "fp8") : absl::StatusOr<Reference>(ckpt.status());
  if (!loaded.ok()) {
    spdlog::error("--checkpoint: {}", std::string(loaded.status().message()));
    return kExitUsage;
  }
  Reference& reference = *loaded;
  const int d = (*ckpt)->shape().d, f = (*ckpt)->shape().d_ff;
  const std::vector<std::string> addresses = Addresses();
  std::string token;
  if (!absl::GetFlag(FLAGS_engine_token_file).empty()) {
    std::ifstream in(absl::GetFlag(FLAGS_engine_token_file));
    std::getline(in, token);
  }
  auto clients = ConnectClients(addresses, token);
  if (!clients.ok()) {
    spdlog::error("{}", std::string(clients.status().message()));
    return kExitFailure;
  }
  const int k = absl::GetFlag(FLAGS_k);
  if (absl::GetFlag(FLAGS_ring)) {
    StepRingOptions ro;
    ro.max_tokens = std::max(absl::GetFlag(FLAGS_prefill_tokens), absl::GetFlag(FLAGS_oversize_tokens));
    ro.d = d;
    ro.k = k;
    int rings = 0;
    for (auto& c : *clients) {
      if (c == nullptr) continue;
      if (absl::Status s = c->UseRing(ro); !s.ok()) {
        spdlog::error("--ring: {}", s.ToString());
        return kExitFailure;
      }
      ++rings;
    }
    std::printf("submission: step rings on %d ranks (slots of %d tokens)\n", rings, static_cast<int>(ro.max_tokens));
  }
  if (!absl::GetFlag(FLAGS_fault).empty()) return Fault(*clients, reference, d, k);
  if (!absl::GetFlag(FLAGS_parity).empty()) return Parity(*clients, reference, d, absl::GetFlag(FLAGS_parity));
  const Stats stats = RunRounds(*clients, reference, d, k);
  PrintSummary(stats, static_cast<int>(clients->size()), k, d, f, reference.num_experts(), reference.num_layers());
  return stats.failed == 0 && stats.mismatches == 0 && stats.generation_splits == 0 ? kExitOk : kExitFailure;
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  moe::InitLogging("engine_driver", "info");
  return moe::Main();
}
