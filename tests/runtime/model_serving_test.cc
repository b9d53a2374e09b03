// Every MoE layer of a model in Hugging Face layout served by two ranks (threads over the
// loopback transport): each rank loads its experts of every layer through the loader, each
// step's `layer` selects that layer's experts, and every output equals the semantic computation
// with the experts read from the same files. Layers the model keeps dense are refused; the loader
// refuses loads over its budget and weights that differ from the manifest's digests.
#include <cstdlib>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "kernels/api.h"
#include "kernels/numeric.h"
#include "runtime/checkpoint/expert_loader.h"
#include "runtime/checkpoint/hf_checkpoint.h"
#include "runtime/checkpoint/hf_writer.h"
#include "runtime/exec/layer_executor.h"
#include "runtime/placement/default_placement.h"
#include "runtime/transport/transport.h"
#include "tests/runtime/random_step.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

constexpr int kRanks = 2, kExperts = 6, kD = 48, kFf = 40, kK = 2;

struct ModelCase {
  const char* name;
  HfFamily family;
  const char* dtype;
  int64_t shard_bytes;
};

std::string WriteModel(const ModelCase& c) {
  const std::string dir = absl::StrCat(std::getenv("TEST_TMPDIR"), "/", c.name);
  HfModelSpec spec;
  spec.family = c.family;
  spec.naming = c.family == HfFamily::kMixtral ? ExpertNaming::kMixtral : ExpertNaming::kProjections;
  spec.dtype = c.dtype;
  spec.fp8_block = 16;
  spec.hidden_size = kD;
  spec.moe_intermediate_size = kFf;
  spec.num_experts = kExperts;
  spec.top_k = kK;
  spec.num_hidden_layers = 4;
  spec.first_k_dense_replace = 1;  // DeepSeek: layer 0 dense
  spec.mlp_only_layers = {0};      // Qwen: layer 0 dense (Mixtral: every layer is MoE)
  spec.max_shard_bytes = c.shard_bytes;
  spec.version = absl::StrCat(c.name, "-v1");
  EXPECT_TRUE(WriteHfModel(dir, spec, SyntheticExpertSource(kD, kFf, 9)).ok());
  return dir;
}

struct TwoRanks {
  std::unique_ptr<HfCheckpoint> ckpt;
  Topology topology = TwoNodeTopology(kRanks);
  ProcessGroup group = LocalClusterGroup(kRanks, 1);
  std::shared_ptr<const PlacementManifest> manifest;
  LoopbackFabric fabric{kRanks};
  std::unique_ptr<kernels::ExpertKernels> kernels[kRanks];
  GenerationRegistry registry[kRanks];
  std::unique_ptr<Transport> transport[kRanks];
  std::unique_ptr<LayerExecutor> exec[kRanks];
  std::vector<LoadProgress> progress[kRanks];

  explicit TwoRanks(const std::string& dir) {
    ckpt = *HfCheckpoint::Open(dir);
    manifest = *DefaultPlacement(PlacementVersion(1), kExperts, 2, topology, group, ckpt->Identity());
    EXPECT_TRUE(VerifyForPublish(*manifest, group, topology).ok());
    for (int r = 0; r < kRanks; ++r) {
      kernels[r] = kernels::CreateCpuKernels();
      EXPECT_TRUE(registry[r].Prepare(manifest).ok());
      EXPECT_TRUE(registry[r].Activate(PlacementVersion(1)).ok());
      transport[r] = fabric.Endpoint(r);
      LayerExecutorOptions o;
      o.rank = Rank(r);
      o.topology = topology;
      o.group = group;
      o.registry = &registry[r];
      o.transport = transport[r].get();
      o.kernels = kernels[r].get();
      o.timeout = absl::Seconds(5);
      exec[r] = *LayerExecutor::Create(std::move(o));
      LoadOptions lo;
      lo.threads = 3;
      lo.progress = [this, r](const LoadProgress& p) { progress[r].push_back(p); };
      auto local = LoadLocalExperts(*ckpt, *manifest, Rank(r), lo);
      EXPECT_TRUE(local.ok()) << local.status();
      EXPECT_TRUE(exec[r]->AddGeneration(PlacementVersion(1), std::make_shared<LocalExperts>(*std::move(local))).ok());
    }
  }
};

using Input = testing::RandomRankInput;

Input RandomInput(std::mt19937& rng, int64_t tokens) {
  return testing::RandomTwoRouteInput(rng, tokens, kD, kExperts, /*drop_some=*/false);
}

// y_t = sum_j g_tj E^layer_{e_tj}(h_t) with the experts read from the files.
std::vector<float> Semantic(const HfCheckpoint& ckpt, int64_t layer, const Input& in) {
  auto k = kernels::CreateCpuKernels();
  std::vector<float> y(in.tokens * kD, 0.0f);
  std::vector<uint16_t> gu(2 * kFf * kD), dn(kD * kFf), out(kD);
  for (int64_t t = 0; t < in.tokens; ++t) {
    for (int j = 0; j < kK; ++j) {
      EXPECT_TRUE(ckpt.ReadExpert(layer, in.ids[t * kK + j], gu.data(), dn.data()).ok());
      const int64_t offsets[2] = {0, 1};
      kernels::SwigluParams p;
      p.weights = {gu.data(), dn.data(), 1, kD, kFf};
      p.x = in.hidden.data() + t * kD;
      p.rows = 1;
      p.host_offsets = offsets;
      p.y = out.data();
      EXPECT_TRUE(k->Swiglu(p, nullptr).ok());
      for (int c = 0; c < kD; ++c) y[t * kD + c] += in.gates[t * kK + j] * kernels::Bf16ToFloat(out[c]);
    }
  }
  return y;
}

std::vector<absl::StatusOr<LayerStepResult>> RunStep(TwoRanks& w, const std::vector<Input>& inputs, uint64_t step,
                                                     int64_t layer) {
  std::vector<absl::StatusOr<LayerStepResult>> results(kRanks, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] { results[r] = w.exec[r]->Execute(inputs[r].Step(step, layer)); });
  }
  for (auto& t : threads) t.join();
  return results;
}

class ModelServingTest : public ::testing::TestWithParam<ModelCase> {};

TEST_P(ModelServingTest, EveryMoeLayerMatchesItsOwnExperts) {
  TwoRanks w(WriteModel(GetParam()));
  const bool mixtral = GetParam().family == HfFamily::kMixtral;
  const std::vector<int64_t> layers = mixtral ? std::vector<int64_t>{0, 1, 2, 3} : std::vector<int64_t>{1, 2, 3};
  const int64_t dense = mixtral ? 4 : 0;  // not a MoE layer of the model
  ASSERT_EQ(w.ckpt->layers(), layers);
  EXPECT_EQ(w.manifest->layers(), layers);
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_EQ(w.progress[r].size(), layers.size());
    EXPECT_EQ(w.progress[r].back().layers_done, static_cast<int>(layers.size()));
    EXPECT_EQ(w.progress[r].back().bytes_done, w.progress[r].back().bytes_total);
    EXPECT_EQ(w.progress[r].back().bytes_total, static_cast<int64_t>(w.manifest->LocalSlots(Rank(r)).size()) *
                                                    static_cast<int64_t>(layers.size()) * w.ckpt->expert_bytes());
  }
  std::mt19937 rng(4);
  uint64_t step = 1;
  for (int64_t layer : layers) {
    const std::vector<Input> inputs = {RandomInput(rng, 9), RandomInput(rng, 5)};
    const auto results = RunStep(w, inputs, step++, layer);
    for (int r = 0; r < kRanks; ++r) {
      ASSERT_TRUE(results[r].ok()) << "rank " << r << " layer " << layer << ": " << results[r].status();
      EXPECT_LT(kernels::RelativeL2Bf16(results[r]->output, Semantic(*w.ckpt, layer, inputs[r])), 1e-2)
          << "rank " << r << " layer " << layer;
      // Another layer's experts give another answer: the step really ran this layer's.
      const int64_t other = layer == 1 ? 2 : 1;
      EXPECT_GT(kernels::RelativeL2Bf16(results[r]->output, Semantic(*w.ckpt, other, inputs[r])), 0.1);
    }
  }
  // The dense layer is the engine's: refused on every rank, naming the layer; then served again.
  const std::vector<Input> inputs = {RandomInput(rng, 3), RandomInput(rng, 3)};
  for (const auto& result : RunStep(w, inputs, step++, dense)) {
    ASSERT_FALSE(result.ok());
    EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(result.status().message(),
                HasSubstr(absl::StrCat("layer: ", dense, " is not a MoE layer of placement-v1")));
  }
  for (const auto& result : RunStep(w, inputs, step++, 3)) EXPECT_TRUE(result.ok()) << result.status();
  // Only served layers count load: a refused layer value leaves no entry behind.
  for (int r = 0; r < kRanks; ++r) {
    const auto load = w.exec[r]->LayerExpertLoad();
    EXPECT_EQ(load.count(dense), 0u);
    EXPECT_EQ(load.size(), layers.size());
  }
}

INSTANTIATE_TEST_SUITE_P(Families, ModelServingTest,
                         ::testing::Values(ModelCase{"qwen3_moe_sharded", HfFamily::kQwen3Moe, "BF16", 40000},
                                           ModelCase{"deepseek_v3_fp8", HfFamily::kDeepseekV3, "F8_E4M3", 0},
                                           ModelCase{"mixtral_f32", HfFamily::kMixtral, "F32", 0}),
                         [](const ::testing::TestParamInfo<ModelCase>& info) { return info.param.name; });

TEST(ExpertLoaderTest, RefusesOverBudgetWrongDigestsAndOtherLayers) {
  const std::string dir = WriteModel({"loader", HfFamily::kQwen2Moe, "BF16", 0});
  auto ckpt = *HfCheckpoint::Open(dir);
  const Topology topology = TwoNodeTopology(kRanks);
  const ProcessGroup group = LocalClusterGroup(kRanks, 1);
  const CheckpointIdentity id = ckpt->Identity();
  auto m = *DefaultPlacement(PlacementVersion(1), kExperts, 0, topology, group, id);
  // Over budget: refused before anything is read, naming both numbers.
  const int64_t need = *LocalExpertBytes(*ckpt, *m, Rank(0));
  EXPECT_EQ(need, 3 * 3 * ckpt->expert_bytes());  // 3 slots x 3 MoE layers (layer 0 dense)
  LoadOptions tight;
  tight.max_bytes = need - 1;
  auto over = LoadLocalExperts(*ckpt, *m, Rank(0), tight);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.status().message(), HasSubstr(absl::StrCat(need, " bytes")));
  EXPECT_THAT(over.status().message(), HasSubstr(absl::StrCat(need - 1, " bytes available")));
  // One layer's recorded digest of expert 2 differs from the weights: the load names slot and layer.
  CheckpointIdentity tampered = id;
  tampered.digests[2][1] = std::string(64, 'a');
  auto bad = *DefaultPlacement(PlacementVersion(2), kExperts, 0, topology, group, tampered);
  auto refused = LoadLocalExperts(*ckpt, *bad, Rank(0));  // expert 2 is on rank 0 (e % 2)
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("(expert 2) layer 2"));
  // A placement over other layers than the checkpoint's.
  CheckpointIdentity fewer = id;
  fewer.layers = {1, 2};
  for (auto& e : fewer.digests) e.resize(2);
  auto other = *DefaultPlacement(PlacementVersion(3), kExperts, 0, topology, group, fewer);
  EXPECT_EQ(LoadLocalExperts(*ckpt, *other, Rank(0)).status().code(), absl::StatusCode::kFailedPrecondition);
  // Without recorded digests a load still computes and the placement carries none.
  CheckpointIdentity unknown = id;
  for (auto& e : unknown.digests) e.assign(e.size(), "");
  auto blank = *DefaultPlacement(PlacementVersion(4), kExperts, 0, topology, group, unknown);
  EXPECT_TRUE(blank->slot(PhysicalSlotId(0)).parameter_digest.empty());
  EXPECT_TRUE(LoadLocalExperts(*ckpt, *blank, Rank(0)).ok());
  // ... but such a placement cannot be prepared later (RequireSlotDigests, before a rank
  // materializes a generation it was sent): nothing would verify its copies. A shared table's
  // combined digest alone verifies every layer's copy together.
  const int layers = ckpt->num_layers();
  EXPECT_TRUE(RequireSlotDigests(*m, PhysicalSlotId(0), layers).ok());
  const absl::Status none = RequireSlotDigests(*blank, PhysicalSlotId(0), layers);
  EXPECT_EQ(none.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(none.message(), HasSubstr("slot q0 (expert 0) layer 1 has no parameter digest"));
  std::vector<SlotRecord> combined_only = m->slots();
  for (SlotRecord& slot : combined_only) slot.layer_digests.clear();
  ManifestOptions mo;
  mo.version = PlacementVersion(5);
  mo.process_group = m->process_group();
  mo.epoch = m->epoch();
  mo.checkpoint = m->checkpoint();
  mo.num_experts = m->num_experts();
  mo.layers = m->layers();
  auto combined = PlacementManifest::Create(mo, combined_only, topology);
  ASSERT_TRUE(combined.ok()) << combined.status();
  EXPECT_TRUE(RequireSlotDigests(**combined, PhysicalSlotId(0), layers).ok());
}

}  // namespace
}  // namespace moe

namespace moe {
namespace {

// A per-layer generation (EPLB's phy2log per layer): every layer places the experts its own
// way on the same slots; each step runs on its layer's table and still equals the semantic
// computation; the loader checks each layer's copy against that layer's table.
TEST(PerLayerPlacementTest, EachLayerServesFromItsOwnSlotTable) {
  TwoRanks w(WriteModel({"per_layer", HfFamily::kQwen3Moe, "BF16", 0}));
  const CheckpointIdentity id = w.ckpt->Identity();
  ASSERT_EQ(id.layers, (std::vector<int64_t>{1, 2, 3}));
  // Eight slots, four a rank; each layer rotates the experts and replicates another one.
  std::vector<std::vector<std::pair<int, int>>> assignment;
  for (int i = 0; i < 3; ++i) {
    std::vector<std::pair<int, int>> slots;
    for (int q = 0; q < 8; ++q) slots.emplace_back(q < kExperts ? (q + 2 * i) % kExperts : i + q - kExperts, q / 4);
    assignment.push_back(slots);
  }
  auto v2 = LayeredPlacementFromAssignment(PlacementVersion(2), kExperts, assignment, w.topology, w.group, id);
  ASSERT_TRUE(v2.ok()) << v2.status();
  ASSERT_TRUE((*v2)->per_layer());
  EXPECT_TRUE(VerifyForPublish(**v2, w.group, w.topology).ok());
  EXPECT_EQ((*v2)->ForLayer(2)->slot(PhysicalSlotId(0)).expert.value(), 2);
  EXPECT_EQ((*v2)->ForLayer(3)->slot(PhysicalSlotId(0)).expert.value(), 4);
  // Each layer's slot carries that layer's digest of its expert.
  EXPECT_EQ((*v2)->ForLayer(3)->slot(PhysicalSlotId(0)).parameter_digest.value(), w.ckpt->RecordedDigest(3, 4));
  for (int r = 0; r < kRanks; ++r) {
    auto local = LoadLocalExperts(*w.ckpt, **v2, Rank(r));
    ASSERT_TRUE(local.ok()) << local.status();
    ASSERT_TRUE(w.registry[r].Prepare(*v2).ok());
    ASSERT_TRUE(w.exec[r]->AddGeneration(PlacementVersion(2), std::make_shared<LocalExperts>(*std::move(local))).ok());
    ASSERT_TRUE(w.registry[r].Activate(PlacementVersion(2)).ok());
  }
  std::mt19937 rng(8);
  uint64_t step = 100;
  for (int64_t layer : id.layers) {
    const std::vector<Input> inputs = {RandomInput(rng, 11), RandomInput(rng, 7)};
    const auto results = RunStep(w, inputs, step++, layer);
    for (int r = 0; r < kRanks; ++r) {
      ASSERT_TRUE(results[r].ok()) << results[r].status();
      EXPECT_EQ(results[r]->record.placement_version, 2);
      EXPECT_EQ(results[r]->record.layer, layer);
      EXPECT_LT(kernels::RelativeL2Bf16(results[r]->output, Semantic(*w.ckpt, layer, inputs[r])), 1e-2)
          << "rank " << r << " layer " << layer;
    }
  }
  EXPECT_EQ(w.exec[0]->LayerExpertLoad().size(), 3u);  // load counted per layer
  // A table that puts a slot on another rank in one layer is refused, naming the layer.
  assignment[1][0].second = 1;
  auto bad = LayeredPlacementFromAssignment(PlacementVersion(3), kExperts, assignment, w.topology, w.group, id);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("layer_slots[2]"));
  // A layer's digest that differs from its weights fails that layer's load, naming it.
  CheckpointIdentity tampered = id;
  tampered.digests[(0 + 2 * 2) % kExperts][2] = std::string(64, 'b');  // expert 4 in layer 3
  assignment[1][0].second = 0;
  auto wrong =
      *LayeredPlacementFromAssignment(PlacementVersion(4), kExperts, assignment, w.topology, w.group, tampered);
  auto refused = LoadLocalExperts(*w.ckpt, *wrong, Rank(0));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("layer 3"));
}

}  // namespace
}  // namespace moe
