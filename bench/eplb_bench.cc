// EPLB solve time at DeepSeek-V3 scale: 58 layers x 256 logical experts -> 288 replicas,
// 8 groups, 4 nodes, 32 GPUs (the pinned Python solver's reference shape), and the global
// policy on the same load. Loads are Zipf-like and seeded, so runs are repeatable.
#include <cmath>
#include <random>

#include "benchmark/benchmark.h"

#include "runtime/placement/eplb.h"

namespace moe {
namespace {

EplbProblem DeepSeekShape(int groups, int nodes) {
  EplbProblem p;
  p.layers = 58;
  p.experts = 256;
  p.num_replicas = 288;
  p.num_groups = groups;
  p.num_nodes = nodes;
  p.num_gpus = 32;
  std::mt19937 rng(2024);
  p.weight.resize(static_cast<size_t>(p.layers) * p.experts);
  for (int l = 0; l < p.layers; ++l) {
    std::vector<int> perm(p.experts);
    for (int e = 0; e < p.experts; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int e = 0; e < p.experts; ++e) {
      p.weight[static_cast<size_t>(l) * p.experts + perm[e]] = std::floor(100000.0 / std::pow(e + 1, 0.8)) + rng() % 97;
    }
  }
  return p;
}

void BM_EplbHierarchical(benchmark::State& state) {
  const EplbProblem p = DeepSeekShape(8, 4);
  for (auto _ : state) {
    auto s = RebalanceExperts(p);
    benchmark::DoNotOptimize(s);
  }
  state.counters["layers"] = p.layers;
}
BENCHMARK(BM_EplbHierarchical)->Unit(benchmark::kMillisecond);

void BM_EplbGlobal(benchmark::State& state) {
  const EplbProblem p = DeepSeekShape(8, 3);  // 8 % 3 != 0: global policy
  for (auto _ : state) {
    auto s = RebalanceExperts(p);
    benchmark::DoNotOptimize(s);
  }
}
BENCHMARK(BM_EplbGlobal)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace moe

BENCHMARK_MAIN();
