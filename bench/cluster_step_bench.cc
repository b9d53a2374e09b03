// cluster_step_bench: client-observed layer-step latency on a running cluster of moe-rankd
// processes, every rank called every step, the way an engine with one process per rank calls
// them (bench/RESULTS.md, issue 17's goals).
//
// One engine thread per rank stays alive for a whole cell and spins on a shared step counter, so
// the ranks' steps start together without a thread start per step. A cell is a phase and a
// number of tokens per rank; for each mode ("ring": a step ring per rank, the rows and routing
// written into its slot once, as an engine producing them in place would leave them; "grpc":
// ExpertLayerClient::Execute, rows in the request) it runs --warmup steps and then --steps steps
// back to back, and prints:
//   client p50/p99  submission to answer on one rank's engine thread (all ranks pooled);
//   step p50/p99    release of the step to the last rank's answer;
//   server, executor, host  the rank's own figures from StepRecord: handler, layer executor and
//                   the host-only stages (validate + acquire + plan), medians;
//   stages          StepRecord.stages medians on rank 0.
//
//   cluster_step_bench --port_dir WORK/ports --world 2 --experts 128 --d 2048 --k 8
//       --cells decode:1,decode:8,prefill:2048 --modes ring,grpc      (one command line)
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

#include "bench/stats.h"
#include "kernels/numeric.h"
#include "server/client.h"

ABSL_FLAG(std::string, port_dir, "", "directory with <rank>.engine files (deploy/cluster_lib.sh start_ranks)");
ABSL_FLAG(int, world, 2, "ranks");
ABSL_FLAG(int, experts, 128, "logical experts of the served layer (the checkpoint's)");
ABSL_FLAG(int, d, 2048, "hidden size of the served layer");
ABSL_FLAG(int, k, 8, "routes per token");
ABSL_FLAG(int64_t, layer, 0, "the MoE layer every step names");
ABSL_FLAG(std::string, cells, "decode:1,decode:8,prefill:2048", "phase:tokens-per-rank, comma-separated");
ABSL_FLAG(std::string, modes, "ring,grpc", "submission modes, in the order they run: ring, grpc");
ABSL_FLAG(int, steps, 200, "measured steps per cell and mode");
ABSL_FLAG(int, warmup, 30, "unmeasured steps before them");
ABSL_FLAG(int64_t, spin_us, 5000, "how long a ring's engine thread spins before it sleeps (StepRingOptions::spin_us)");

namespace moe {
namespace {

using bench::Median;
using bench::Quantile;

struct Cell {
  bool decode = false;
  int64_t tokens = 0;
};

// One rank's step: random rows, k distinct uniformly drawn experts per token, normalized gates.
StepCall MakeCall(std::mt19937& rng, const Cell& cell, int experts, int d, int k, int64_t layer) {
  StepCall c;
  c.layer = layer;
  c.decode = cell.decode;
  c.tokens = cell.tokens;
  c.d = d;
  c.k = k;
  c.hidden.resize(cell.tokens * d);
  std::normal_distribution<float> n(0, 1);
  for (uint16_t& v : c.hidden) v = kernels::FloatToBf16(n(rng));
  std::vector<int> perm(experts);
  for (int64_t t = 0; t < cell.tokens; ++t) {
    for (int e = 0; e < experts; ++e) perm[e] = e;
    float sum = 0;
    for (int j = 0; j < k; ++j) {  // a partial Fisher-Yates shuffle: k distinct experts
      std::swap(perm[j], perm[j + rng() % (experts - j)]);
      c.topk_ids.push_back(perm[j]);
      c.topk_weights.push_back(0.05f + std::uniform_real_distribution<float>(0, 1)(rng));
      sum += c.topk_weights.back();
    }
    for (int j = 0; j < k; ++j) c.topk_weights[c.topk_weights.size() - k + j] /= sum;
  }
  return c;
}

struct Sample {
  double client_us = 0, server_us = 0, executor_us = 0, host_us = 0;
  double stages[9] = {};
  absl::Time end;
};

// Runs warmup + steps steps of one cell in one mode; returns false (after printing why) when a
// step fails.
bool RunCell(const std::vector<std::unique_ptr<ExpertLayerClient>>& clients, const Cell& cell, bool ring,
             uint64_t* step_id) {
  const int p = static_cast<int>(clients.size());
  const int d = absl::GetFlag(FLAGS_d), k = absl::GetFlag(FLAGS_k);
  const int warmup = absl::GetFlag(FLAGS_warmup), steps = absl::GetFlag(FLAGS_steps);
  std::mt19937 rng(static_cast<uint32_t>(17 + cell.tokens));
  std::vector<StepCall> calls;
  for (int r = 0; r < p; ++r) {
    calls.push_back(MakeCall(rng, cell, absl::GetFlag(FLAGS_experts), d, k, absl::GetFlag(FLAGS_layer)));
  }
  std::vector<std::unique_ptr<StepRing>> rings(p);
  if (ring) {
    for (int r = 0; r < p; ++r) {
      StepRingOptions o;
      o.slots = 1;
      o.max_tokens = std::max<int64_t>(1, cell.tokens);
      o.d = d;
      o.k = k;
      o.spin_us = absl::GetFlag(FLAGS_spin_us);
      auto opened = clients[r]->OpenRing(o);
      if (!opened.ok()) {
        std::fprintf(stderr, "rank %d: OpenRing: %s\n", r, opened.status().ToString().c_str());
        return false;
      }
      rings[r] = std::move(*opened);
      auto slot = rings[r]->NextSlot();
      if (!slot.ok()) return false;
      std::memcpy(slot->hidden, calls[r].hidden.data(), calls[r].hidden.size() * 2);
      std::copy(calls[r].topk_ids.begin(), calls[r].topk_ids.end(), slot->topk_ids);
      std::copy(calls[r].topk_weights.begin(), calls[r].topk_weights.end(), slot->topk_weights);
    }
  }
  const int total = warmup + steps;
  std::vector<std::vector<Sample>> samples(p, std::vector<Sample>(total));
  std::atomic<int> released{-1};
  std::atomic<int> answered{0};
  std::atomic<bool> failed{false};
  const uint64_t first_id = *step_id;
  std::vector<std::thread> threads;
  for (int r = 0; r < p; ++r) {
    threads.emplace_back([&, r] {
      for (int i = 0; i < total; ++i) {
        while (released.load(std::memory_order_acquire) < i) {
        }
        Sample& s = samples[r][i];
        const absl::Time start = absl::Now();
        absl::StatusOr<v1::StepRecord> record;
        if (ring) {
          StepRing::StepMeta meta;
          meta.step_id = first_id + i;
          meta.layer = calls[r].layer;
          meta.decode = cell.decode;
          meta.tokens = cell.tokens;
          meta.k = k;
          absl::Status st = rings[r]->Submit(meta);
          record = st.ok() ? rings[r]->Wait() : st;
        } else {
          StepCall c = calls[r];
          c.step_id = first_id + i;
          auto answer = clients[r]->Execute(c);
          if (answer.ok()) {
            record = answer->record;
          } else {
            record = answer.status();
          }
        }
        s.end = absl::Now();
        s.client_us = absl::ToDoubleMicroseconds(s.end - start);
        if (!record.ok()) {
          std::fprintf(stderr, "rank %d step %llu: %s\n", r, static_cast<unsigned long long>(first_id + i),
                       record.status().ToString().c_str());
          failed.store(true);
        } else {
          s.server_us = record->server_latency_us();
          s.executor_us = record->compute_latency_us();
          const v1::StepStages& st = record->stages();
          const double us[9] = {st.validate_us(), st.acquire_us(), st.plan_us(),    st.agree_us(),  st.dispatch_us(),
                                st.experts_us(),  st.return_us(),  st.combine_us(), st.release_us()};
          std::copy(us, us + 9, s.stages);
          s.host_us = us[0] + us[1] + us[2];
        }
        answered.fetch_add(1, std::memory_order_acq_rel);
      }
    });
  }
  std::vector<double> step_us, client_us, server_us, executor_us, host_us;
  std::vector<std::vector<double>> stages(9);
  for (int i = 0; i < total && !failed.load(); ++i) {
    const absl::Time start = absl::Now();
    released.store(i, std::memory_order_release);
    while (answered.load(std::memory_order_acquire) < (i + 1) * p) {
    }
    if (i < warmup) continue;
    absl::Time last = start;
    for (int r = 0; r < p; ++r) {
      const Sample& s = samples[r][i];
      last = std::max(last, s.end);
      client_us.push_back(s.client_us);
      server_us.push_back(s.server_us);
      executor_us.push_back(s.executor_us);
      host_us.push_back(s.host_us);
    }
    for (int j = 0; j < 9; ++j) stages[j].push_back(samples[0][i].stages[j]);
    step_us.push_back(absl::ToDoubleMicroseconds(last - start));
  }
  if (failed.load()) released.store(total, std::memory_order_release);  // let the threads run out
  for (auto& t : threads) t.join();
  *step_id += total;
  if (failed.load()) return false;
  for (auto& r : rings) {
    if (r) r->Close().IgnoreError();
  }
  std::printf("%-8s %6lld %-5s %10.1f %10.1f %10.1f %10.1f %10.1f %10.1f %10.1f\n", cell.decode ? "decode" : "prefill",
              static_cast<long long>(cell.tokens), ring ? "ring" : "grpc", Median(client_us), Quantile(client_us, 0.99),
              Median(step_us), Quantile(step_us, 0.99), Median(server_us), Median(executor_us), Median(host_us));
  static const char* kNames[9] = {"validate", "acquire", "plan",    "agree",  "dispatch",
                                  "experts",  "return",  "combine", "release"};
  std::printf("  rank 0 stages:");
  for (int j = 0; j < 9; ++j) std::printf(" %s %.1f", kNames[j], Median(stages[j]));
  std::printf("\n");
  return true;
}

int Main() {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  const int p = absl::GetFlag(FLAGS_world);
  std::vector<Cell> cells;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_cells), ',')) {
    std::vector<std::string> kv = absl::StrSplit(part, ':');
    Cell c;
    if (kv.size() != 2 || (kv[0] != "decode" && kv[0] != "prefill") || !absl::SimpleAtoi(kv[1], &c.tokens) ||
        c.tokens < 0) {
      std::fprintf(stderr, "--cells: '%s' is not phase:tokens\n", std::string(part).c_str());
      return 2;
    }
    c.decode = kv[0] == "decode";
    cells.push_back(c);
  }
  std::vector<std::string> modes = absl::StrSplit(absl::GetFlag(FLAGS_modes), ',');
  for (const std::string& m : modes) {
    if (m != "ring" && m != "grpc") {
      std::fprintf(stderr, "--modes: '%s' is neither ring nor grpc\n", m.c_str());
      return 2;
    }
  }
  std::vector<std::unique_ptr<ExpertLayerClient>> clients;
  for (int r = 0; r < p; ++r) {
    std::ifstream in(absl::StrCat(absl::GetFlag(FLAGS_port_dir), "/", r, ".engine"));
    std::string target;
    if (!std::getline(in, target) || target.empty()) {
      std::fprintf(stderr, "--port_dir: no %d.engine\n", r);
      return 2;
    }
    auto c = ExpertLayerClient::Connect(target, absl::Seconds(30));
    if (!c.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", r, c.status().ToString().c_str());
      return 1;
    }
    clients.push_back(std::move(*c));
  }
  std::printf("%d ranks, E%d k%d d%d, %d steps after %d warm-up, ring spin %lld us; microseconds\n", p,
              absl::GetFlag(FLAGS_experts), absl::GetFlag(FLAGS_k), absl::GetFlag(FLAGS_d), absl::GetFlag(FLAGS_steps),
              absl::GetFlag(FLAGS_warmup), static_cast<long long>(absl::GetFlag(FLAGS_spin_us)));
  std::printf("%-8s %6s %-5s %10s %10s %10s %10s %10s %10s %10s\n", "phase", "T/rank", "mode", "client50", "client99",
              "step50", "step99", "server50", "executor50", "host50");
  // Step ids unique to this run: the ranks keep no memory of them across steps, but a log reader does.
  uint64_t step_id = static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()));
  for (const Cell& cell : cells) {
    for (const std::string& m : modes) {
      if (!RunCell(clients, cell, m == "ring", &step_id)) return 1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return moe::Main();
}
