// Route planning cost per route on one core.
//
// BM_RankStep: what one rank does per layer step before any payload moves: replica selection
// for its T x k routes (locality-first or hash) and the source plan (peer-slot splits, offsets,
// stable send order) over a 64-rank group with 288 physical slots (256 experts + 32 replicas).
// BM_Destination: the receive-side repack for the rows one rank receives.
// BM_Cluster: the whole-group oracle plan (every rank's source and destination side).
// Plan objects are reused across iterations, as the daemon reuses them across steps.
#include <optional>
#include <random>

#include "benchmark/benchmark.h"

#include "runtime/placement/replica_selector.h"
#include "runtime/plan/route_plan.h"

namespace moe {
namespace {

constexpr int kRanks = 64;
constexpr int kExperts = 256;
constexpr int kSlots = 288;
constexpr int kTopK = 8;

struct World {
  Topology topology = Topology::SingleNode(1);
  std::shared_ptr<const PlacementManifest> manifest;
  std::optional<PlanLayout> layout;
  World() {
    std::vector<RankInfo> ranks;
    for (int r = 0; r < kRanks; ++r) ranks.push_back(RankInfo{Rank(r), TopologyDomainId(r / 8), r % 8, "", r % 8 == 0});
    std::vector<std::string> nodes;
    for (int n = 0; n < kRanks / 8; ++n) nodes.push_back("node-" + std::to_string(n));
    topology = *Topology::Create(ranks, nodes);
    std::vector<SlotRecord> slots;
    for (int q = 0; q < kSlots; ++q) {
      SlotRecord s;
      s.slot = PhysicalSlotId(q);
      s.expert = LogicalExpertId(q < kExperts ? q : (q - kExperts) * 7 % kExperts);
      s.replica = ReplicaId(q < kExperts ? 0 : 1);
      s.rank = Rank(q * kRanks / kSlots);
      s.domain = topology.NodeOf(s.rank);
      s.checkpoint = CheckpointVersion("ckpt");
      slots.push_back(s);
    }
    ManifestOptions o;
    o.version = PlacementVersion(1);
    o.process_group = ProcessGroupId("ep");
    o.epoch = ProcessGroupEpoch(1);
    o.checkpoint = CheckpointVersion("ckpt");
    o.num_experts = kExperts;
    manifest = *PlacementManifest::Create(o, slots, topology);
    std::vector<Rank> peers;
    for (int r = 0; r < kRanks; ++r) peers.push_back(Rank((r * 13) % kRanks));  // non-trivial peer order
    layout = *PlanLayout::Create(manifest, *ProcessGroup::Create(ProcessGroupId("ep"), ProcessGroupEpoch(1), peers));
  }
};

const World& GetWorld() {
  static const World* w = new World();
  return *w;
}

SemanticHandoff Routes(int tokens, int sources, uint32_t seed) {
  std::mt19937 rng(seed);
  SemanticHandoff h;
  h.num_experts = kExperts;
  h.top_k = kTopK;
  h.num_partitions = kRanks;
  h.Reserve(static_cast<size_t>(tokens) * kTopK * sources);
  for (int s = 0; s < sources; ++s) {
    for (int t = 0; t < tokens; ++t) {
      const int base = static_cast<int>(rng() % kExperts);
      for (int j = 0; j < kTopK; ++j) {
        h.Add(Rank(s), t, j, LogicalExpertId((base + j * 31) % kExperts), 0.125f);
      }
    }
  }
  return h;
}

void BM_RankStep(benchmark::State& state) {
  const World& w = GetWorld();
  const int tokens = static_cast<int>(state.range(0));
  const auto policy = static_cast<SelectorPolicy>(state.range(1));
  SemanticHandoff h = Routes(tokens, 1, 1);
  auto selector = ReplicaSelector::Create(policy);
  std::vector<PhysicalSlotId> slots(h.size());
  SourcePlan plan;
  for (auto _ : state) {
    if (!selector->Select(h, *w.manifest, w.layout->group(), w.topology, {}, absl::MakeSpan(slots)).ok())
      state.SkipWithError("select");
    if (!PlanSource(*w.layout, slots, &plan).ok()) state.SkipWithError("plan");
    benchmark::DoNotOptimize(plan.send_order.data());
  }
  state.SetItemsProcessed(state.iterations() * h.size());
  state.counters["ns_per_route"] =
      benchmark::Counter(static_cast<double>(h.size()) * state.iterations(),
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert, benchmark::Counter::kIs1000);
  state.SetLabel(SelectorPolicyName(policy));
}
BENCHMARK(BM_RankStep)
    ->ArgsProduct({{1024, 2048, 4096, 8192, 16384, 32768, 65536}, {0}})
    ->Args({8192, 3})
    ->Unit(benchmark::kMicrosecond);

void BM_SourcePlanOnly(benchmark::State& state) {
  const World& w = GetWorld();
  SemanticHandoff h = Routes(static_cast<int>(state.range(0)), 1, 2);
  std::vector<PhysicalSlotId> slots(h.size());
  (void)ReplicaSelector::Create(SelectorPolicy::kHash)
      ->Select(h, *w.manifest, w.layout->group(), w.topology, {}, absl::MakeSpan(slots));
  SourcePlan plan;
  for (auto _ : state) {
    if (!PlanSource(*w.layout, slots, &plan).ok()) state.SkipWithError("plan");
    benchmark::DoNotOptimize(plan.send_order.data());
  }
  state.counters["ns_per_route"] =
      benchmark::Counter(static_cast<double>(h.size()) * state.iterations(),
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_SourcePlanOnly)->Arg(8192)->Unit(benchmark::kMicrosecond);

void BM_Cluster(benchmark::State& state) {
  const World& w = GetWorld();
  // T tokens spread over all 64 ranks.
  const int per_rank = static_cast<int>(state.range(0)) / kRanks;
  FrozenHandoff frozen = *Freeze(Routes(per_rank, kRanks, 3));
  std::vector<PhysicalSlotId> slots(frozen.routes.size());
  (void)ReplicaSelector::Create(SelectorPolicy::kHash)
      ->Select(frozen.routes, *w.manifest, w.layout->group(), w.topology, {}, absl::MakeSpan(slots));
  for (auto _ : state) {
    auto plan = PlanCluster(frozen, slots, *w.layout, w.topology);
    if (!plan.ok()) state.SkipWithError("plan");
    benchmark::DoNotOptimize(plan);
  }
  state.counters["ns_per_route"] =
      benchmark::Counter(static_cast<double>(frozen.routes.size()) * state.iterations(),
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_Cluster)->Arg(8192)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace moe

BENCHMARK_MAIN();
