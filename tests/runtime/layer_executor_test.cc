// Four ranks in one process (threads over the loopback transport) run layer steps; every
// rank's output must equal the direct semantic computation (0x03C3) with the same weights.
#include "runtime/exec/layer_executor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "kernels/numeric.h"
#include "runtime/checkpoint/synthetic.h"
#include "tests/runtime/fixtures.h"
#include "tests/runtime/random_step.h"
#include "tests/server/one_rank_fixture.h"

namespace moe {
namespace {

constexpr int kRanks = 4, kExperts = 8, kD = 32, kFf = 48, kK = 2;

struct Rank4 {
  Topology topology = fixture::FourRankTwoNode();
  ProcessGroup group = fixture::PeerOrderGroup();
  std::shared_ptr<const PlacementManifest> manifest;
  SafetensorsFile checkpoint;
  LoopbackFabric fabric{kRanks};
  std::unique_ptr<kernels::ExpertKernels> kernels[kRanks];
  GenerationRegistry registry[kRanks];
  std::unique_ptr<Transport> transport[kRanks];
  std::unique_ptr<LayerExecutor> exec[kRanks];

  // Ten slots (the last two replicas) with digests from the checkpoint.
  std::shared_ptr<const PlacementManifest> TenSlots(int64_t version, const int (&expert_of)[10],
                                                    const int (&rank_of)[10]) {
    std::vector<SlotRecord> slots;
    for (int q = 0; q < 10; ++q) {
      SlotRecord s = fixture::Slot(q, expert_of[q], q < 8 ? 0 : 1, rank_of[q], rank_of[q] / 2);
      s.parameter_digest = ParameterDigest(checkpoint.metadata.at("digest." + std::to_string(expert_of[q])));
      slots.push_back(s);
    }
    return *PlacementManifest::Create(fixture::Options(version, kExperts), slots, topology);
  }
  // A candidate placement: experts 2 and 3 replicated instead of 0 and 1, on other ranks.
  std::shared_ptr<const PlacementManifest> Candidate(int64_t version) {
    return TenSlots(version, {0, 1, 2, 3, 4, 5, 6, 7, 2, 3}, {1, 2, 3, 0, 1, 2, 3, 0, 0, 2});
  }
  // Prepares `m` beside the active generation on every rank (weights from the checkpoint, or
  // with every weight of rank `corrupt_rank` perturbed: a runner that computes something else).
  void PrepareEverywhere(const std::shared_ptr<const PlacementManifest>& m, int corrupt_rank = -1) {
    for (int r = 0; r < kRanks; ++r) {
      EXPECT_TRUE(registry[r].Prepare(m).ok());
      auto local = LoadLocalExperts(checkpoint, *m, Rank(r));
      ASSERT_TRUE(local.ok()) << local.status();
      if (r == corrupt_rank) {
        for (auto& w : local->w_down) w = kernels::FloatToBf16(kernels::Bf16ToFloat(w) * 1.5f);
      }
      EXPECT_TRUE(exec[r]->AddGeneration(m->version(), std::make_shared<LocalExperts>(*local)).ok());
    }
  }

  // `device_plan`: bit r set = rank r plans prefill steps on its kernels; `fp8_ranks`: bit r set =
  // rank r's experts are FP8. `d`, `f`: the experts' widths (FP8 needs multiples of 128).
  // `decode_rank_tokens` > 0: the decode bucket's tokens a rank (the executor's default else).
  // `swap_combine_ranks`: bit r set = rank r's combine tables are corrupted (fault injection).
  explicit Rank4(uint32_t device_plan = 0, uint32_t fp8_ranks = 0, int d = kD, int f = kFf,
                 int64_t decode_rank_tokens = 0, uint32_t swap_combine_ranks = 0)
      : checkpoint(SyntheticCheckpoint({kExperts, d, f}, 3, "checkpoint-0042")) {
    // Experts 0 and 1 replicated across nodes.
    manifest = TenSlots(17, {0, 1, 2, 3, 4, 5, 6, 7, 0, 1}, {0, 0, 1, 1, 2, 2, 3, 3, 3, 1});
    for (int r = 0; r < kRanks; ++r) {
      kernels[r] = kernels::CreateCpuKernels();
      EXPECT_TRUE(registry[r].Prepare(manifest).ok());
      EXPECT_TRUE(registry[r].Activate(PlacementVersion(17)).ok());
      transport[r] = fabric.Endpoint(group.SlotOf(Rank(r)).value());
      LayerExecutorOptions o;
      o.rank = Rank(r);
      o.topology = topology;
      o.group = group;
      o.registry = &registry[r];
      o.transport = transport[r].get();
      o.kernels = kernels[r].get();
      o.timeout = absl::Seconds(5);
      o.device_plan = (device_plan >> r & 1) != 0;
      o.expert_dtype = (fp8_ranks >> r & 1) != 0 ? ExpertDtype::kFp8 : ExpertDtype::kBf16;
      if (decode_rank_tokens > 0) o.decode_rank_tokens = decode_rank_tokens;
      o.fault_swap_combine_routes = (swap_combine_ranks >> r & 1) != 0;
      exec[r] = *LayerExecutor::Create(std::move(o));
      auto local = LoadLocalExperts(checkpoint, *manifest, Rank(r));
      EXPECT_TRUE(local.ok()) << local.status();
      EXPECT_TRUE(exec[r]->AddGeneration(PlacementVersion(17), std::make_shared<LocalExperts>(*local)).ok());
    }
  }
};

using RankInput = testing::RandomRankInput;

// One in ten first routes dropped by the router.
RankInput RandomInput(std::mt19937& rng, int64_t tokens) {
  return testing::RandomTwoRouteInput(rng, tokens, kD, kExperts, /*drop_some=*/true);
}

// Every rank executes one step on its own thread (the collectives need all of them at once).
std::vector<absl::StatusOr<LayerStepResult>> RunStep(Rank4& w, const std::vector<RankInput>& inputs, uint64_t step,
                                                     int64_t layer) {
  std::vector<absl::StatusOr<LayerStepResult>> results(kRanks, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] { results[r] = w.exec[r]->Execute(inputs[r].Step(step, layer)); });
  }
  for (auto& t : threads) t.join();
  return results;
}

// y_t = sum_j g_tj E_{e_tj}(h_t), experts through the CPU reference kernel one row at a time.
std::vector<float> Reference(const SafetensorsFile& ckpt, const RankInput& in) {
  auto k = kernels::CreateCpuKernels();
  std::vector<float> y(in.tokens * kD, 0.0f);
  for (int64_t t = 0; t < in.tokens; ++t) {
    for (int j = 0; j < kK; ++j) {
      if (!in.admitted[t * kK + j]) continue;
      const int e = in.ids[t * kK + j];
      std::vector<uint16_t> gu, dn, out(kD);
      SyntheticExpert(e, {kExperts, kD, kFf}, 3, &gu, &dn);
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

// Every phase's time is recorded, none negative, and they add up to no more than the step.
void ExpectPhaseTimes(const StepRecord& rec) {
  double sum = 0;
  for (int i = 0; i < kNumStepPhases; ++i) {
    EXPECT_GE(rec.phase_us[i], 0) << StepPhaseName(static_cast<StepPhase>(i));
    sum += rec.phase_us[i];
  }
  EXPECT_LE(sum, rec.execute_us + 1e-3);
}

double PhaseUs(const StepRecord& rec, StepPhase phase) { return rec.phase_us[static_cast<int>(phase)]; }

// Relative L2 distance of a rank's output from the semantic computation of its input.
double ErrorAgainstReference(const SafetensorsFile& ckpt, const RankInput& in, absl::Span<const uint16_t> out) {
  return kernels::RelativeL2Bf16(out, Reference(ckpt, in));
}

TEST(LayerExecutorTest, FourRanksMatchTheSemanticComputation) {
  Rank4 w;
  std::mt19937 rng(21);
  for (uint64_t step = 1; step <= 4; ++step) {
    std::vector<RankInput> inputs;
    for (int r = 0; r < kRanks; ++r)
      inputs.push_back(RandomInput(rng, r == 2 ? 0 : 1 + rng() % 24));  // rank 2: no tokens
    const auto results = RunStep(w, inputs, step, 3);
    int64_t accepted = 0, served = 0;  // every accepted route is served by exactly one rank
    for (int r = 0; r < kRanks; ++r) {
      ASSERT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r].status();
      accepted += results[r]->record.routes_accepted;
      served += results[r]->record.routes_served;
      ASSERT_EQ(results[r]->output.size(), static_cast<size_t>(inputs[r].tokens) * kD);
      EXPECT_LT(ErrorAgainstReference(w.checkpoint, inputs[r], results[r]->output), 1e-2)
          << "rank " << r << " step " << step;
      const StepRecord& rec = results[r]->record;
      EXPECT_EQ(rec.placement_version, 17);
      EXPECT_EQ(rec.routes_attempted, inputs[r].tokens * kK);
      EXPECT_EQ(rec.routes_accepted + rec.routes_dropped, rec.routes_attempted);
      EXPECT_LE(rec.routes_inter_node, rec.routes_remote);
      EXPECT_EQ(w.registry[r].Refcount(PlacementVersion(17)), 0);  // every handle released
      // Four members: every phase ran; the collective ones waited for the peers.
      ExpectPhaseTimes(rec);
      for (StepPhase waits : {StepPhase::kAgree, StepPhase::kDispatch, StepPhase::kReturn}) {
        EXPECT_GT(PhaseUs(rec, waits), 0) << StepPhaseName(waits);
      }
    }
    EXPECT_EQ(served, accepted) << "step " << step;
    EXPECT_GT(served, 0);
  }
}

// A process group of one: decode steps take one LocalLayer call (no exchange), prefill steps the
// staged path; both must equal the semantic computation, tokenless steps and dropped routes
// included, and every handle must be released. Decode steps run the decode kernels, or the
// padded runner at the largest slot's routes (forced: the executor counts them on the host).
// A lone member sends every row to itself, so its steps run no exchange of rows and count none
// as sent; prefill steps are planned on the host or on the kernels (the parameter's second half).
class OneMemberTest : public testing::OneRankTest,
                      public ::testing::WithParamInterface<std::tuple<DecodeRunner, bool>> {
 protected:
  // The rank with placement-v2 PREPARED beside the ACTIVE v1 and its experts loaded: a
  // candidate to put on trial.
  void SetUpRankWithCandidateV2() {
    SetUpRank(kExperts, kD, kFf, 3, /*redundant=*/2);
    PrepareGeneration(2, /*redundant=*/4);
  }
};

TEST_P(OneMemberTest, ServesDecodeAndPrefillSteps) {
  const auto [runner, device_plan] = GetParam();
  count_exchanges_ = true;
  SetUpRank(kExperts, kD, kFf, 3, /*redundant=*/2, runner, device_plan);  // the weights Reference() computes with
  std::mt19937 rng(5);
  uint64_t step = 1;
  for (Phase phase : {Phase::kDecode, Phase::kPrefill}) {
    for (int64_t tokens : {1, 0, 3, 17, 1000}) {  // 1000: the metadata does not fit the agreement
      const RankInput input = RandomInput(rng, tokens);
      auto result = executor_->Execute(input.Step(step++, 0, phase));
      ASSERT_TRUE(result.ok()) << result.status();
      ASSERT_EQ(result->output.size(), static_cast<size_t>(tokens) * kD);
      if (tokens > 0) {
        EXPECT_LT(ErrorAgainstReference(ckpt_, input, result->output), 1e-2) << "T=" << tokens;
      }
      EXPECT_EQ(result->record.routes_remote, 0);
      EXPECT_EQ(result->record.routes_served, result->record.routes_accepted);
      EXPECT_EQ(result->record.device_plan, device_plan && phase == Phase::kPrefill && tokens > 0) << "T=" << tokens;
      EXPECT_TRUE(result->record.fallback_reason.empty());  // a lone member's decode: not a fallback
      EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), 0);
      ExpectPhaseTimes(result->record);
      if (phase == Phase::kDecode) {
        // One LocalLayer call does route, experts and combine: timed under experts alone.
        EXPECT_EQ(PhaseUs(result->record, StepPhase::kReturn), 0);
        EXPECT_EQ(PhaseUs(result->record, StepPhase::kCombine), 0);
        if (tokens > 0) {
          EXPECT_GT(PhaseUs(result->record, StepPhase::kExperts), 0);
        }
      }
    }
  }
  // Nothing went through the transport but the agreements: no rows, no slot metadata.
  EXPECT_EQ(counting_->exchanges(), 0);
}

// A lone member's decode steps with their routing in kernel memory are planned by the kernels
// (with the device plan on), their layer enqueued before the checks come back: the same output
// bits, counts and expert load as the same step planned on the host; bad routes and a failed input
// check refuse the step naming the value; the next step is served and every handle released.
//
// PlanBothWays: a decode step planned on the host, then the same step with its routing in kernel
// memory (the CPU kernels' memory is host memory), and how much each grew the expert load.
struct PlannedBothWays {
  absl::StatusOr<LayerStepResult> host, device;
  std::vector<int64_t> host_load, device_load;  // per expert
};
PlannedBothWays PlanBothWays(LayerExecutor& exec, const RankInput& input, uint64_t* step, int experts) {
  const auto load = [&exec, experts] {
    std::vector<int64_t> total = exec.ExpertLoad();
    total.resize(std::max<size_t>(total.size(), experts), 0);
    return total;
  };
  const auto grown = [](const std::vector<int64_t>& after, const std::vector<int64_t>& before) {
    std::vector<int64_t> d(after.size());
    for (size_t e = 0; e < after.size(); ++e) d[e] = after[e] - (e < before.size() ? before[e] : 0);
    return d;
  };
  PlannedBothWays r;
  const auto before = load();
  r.host = exec.Execute(input.Step((*step)++, 0, Phase::kDecode));
  const auto after_host = load();
  LayerStepInput in = input.Step((*step)++, 0, Phase::kDecode);
  in.routing_on_device = true;
  r.device = exec.Execute(in);
  r.host_load = grown(after_host, before);
  r.device_load = grown(load(), after_host);
  return r;
}

TEST_P(OneMemberTest, DecodeStepsWithRoutingInKernelMemoryMatchTheHostPlan) {
  const auto [runner, device_plan] = GetParam();
  SetUpRank(kExperts, kD, kFf, 3, /*redundant=*/2, runner, device_plan);
  std::mt19937 rng(17);
  uint64_t step = 1;
  for (int64_t tokens : {1, 3, 17, 40}) {
    const RankInput input = RandomInput(rng, tokens);  // some first routes dropped by the router
    PlannedBothWays both = PlanBothWays(*executor_, input, &step, kExperts);
    ASSERT_TRUE(both.host.ok()) << both.host.status();
    ASSERT_TRUE(both.device.ok()) << both.device.status();
    const auto& host = both.host;
    const auto& device = both.device;
    EXPECT_EQ(device->output, host->output) << "T=" << tokens;
    EXPECT_EQ(device->record.device_plan, device_plan) << "T=" << tokens;
    EXPECT_FALSE(host->record.device_plan);
    EXPECT_EQ(device->record.routes_accepted, host->record.routes_accepted);
    EXPECT_EQ(device->record.routes_attempted, host->record.routes_attempted);
    EXPECT_EQ(device->record.routes_served, host->record.routes_served);
    EXPECT_GT(PhaseUs(device->record, StepPhase::kExperts), 0);
    EXPECT_EQ(both.device_load, both.host_load);  // the expert load grew by the same counts
    EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), 0);
  }
  // Refusals: an expert out of range, a NaN gate (both named), and a failed input check.
  RankInput bad = RandomInput(rng, 5);
  bad.admitted.clear();
  bad.ids[7] = kExperts + 3;
  LayerStepInput in = bad.Step(step++, 0, Phase::kDecode);
  in.routing_on_device = true;
  int awaited = 0;
  in.await_input_check = [&awaited] {
    ++awaited;
    return absl::OkStatus();
  };
  auto refused = executor_->Execute(in);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()),
              ::testing::HasSubstr(absl::StrCat("topk_ids[3][1]: expert ", kExperts + 3, " outside")));
  EXPECT_EQ(awaited, 1);
  bad.ids[7] = 1;
  bad.gates[4] = std::numeric_limits<float>::quiet_NaN();
  in = bad.Step(step++, 0, Phase::kDecode);
  in.routing_on_device = true;
  refused = executor_->Execute(in);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()), ::testing::HasSubstr("topk_weights[2][0]"));
  bad.gates[4] = 0.5f;
  in = bad.Step(step++, 0, Phase::kDecode);
  in.routing_on_device = true;
  in.await_input_check = [&awaited] {
    ++awaited;
    return absl::InvalidArgumentError("hidden.data[9]: not finite");
  };
  refused = executor_->Execute(in);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()), ::testing::HasSubstr("hidden.data[9]"));
  EXPECT_EQ(awaited, 2);
  const RankInput good = RandomInput(rng, 5);  // the next step is served
  in = good.Step(step++, 0, Phase::kDecode);
  in.routing_on_device = true;
  auto served = executor_->Execute(in);
  ASSERT_TRUE(served.ok()) << served.status();
  EXPECT_LT(ErrorAgainstReference(ckpt_, good, served->output), 1e-2);
  EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), 0);
}

// A generation that names no layers (one expert set) serves a step of any layer value; those
// values cannot grow the rank's per-layer tables: every step's load is counted under layer -1
// (the record's load_layer, the metrics' layer="all"), host and device plan alike.
TEST_F(OneMemberTest, LayerValuesOfAGenerationWithoutLayersShareOneLoadEntry) {
  SetUpRank(kExperts, kD, kFf, 3, /*redundant=*/2, DecodeRunner::kKernels, /*device_plan=*/true);
  ASSERT_TRUE(v1_->layers().empty());
  std::mt19937 rng(31);
  uint64_t step = 1;
  int64_t accepted = 0;
  for (const int64_t layer : {int64_t{0}, int64_t{7}, int64_t{1} << 20, int64_t{1} << 40}) {
    for (const Phase phase : {Phase::kPrefill, Phase::kDecode}) {
      const RankInput input = RandomInput(rng, 4);
      auto r = executor_->Execute(input.Step(step++, layer, phase));
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->record.layer, layer);
      EXPECT_EQ(r->record.load_layer, -1);
      EXPECT_LT(ErrorAgainstReference(ckpt_, input, r->output), 1e-2);
      accepted += r->record.routes_accepted;
    }
  }
  const std::map<int64_t, std::vector<int64_t>> load = executor_->LayerExpertLoad();
  ASSERT_EQ(load.size(), 1u);
  EXPECT_EQ(load.begin()->first, -1);
  EXPECT_EQ(std::accumulate(load.begin()->second.begin(), load.begin()->second.end(), int64_t{0}), accepted);
  EXPECT_GT(accepted, 0);
}

// lone_decode_on_kernels = false: a lone member's decode step with its routing in kernel memory
// copies the routing and is planned on the host.
TEST_F(OneMemberTest, DecodeStepsCanKeepTheHostPlan) {
  lone_decode_on_kernels_ = false;
  SetUpRank(kExperts, kD, kFf, 3, /*redundant=*/2, DecodeRunner::kKernels, /*device_plan=*/true);
  std::mt19937 rng(23);
  const RankInput input = RandomInput(rng, 4);
  LayerStepInput in = input.Step(1, 0, Phase::kDecode);
  in.routing_on_device = true;
  auto r = executor_->Execute(in);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->record.device_plan);
  EXPECT_LT(ErrorAgainstReference(ckpt_, input, r->output), 1e-2);
}

// A lone member's canary steps count their routes under the candidate (the promotion gate's
// r_drop denominator), decode and prefill alike.
TEST_F(OneMemberTest, CanaryStepsCountTheirRoutesUnderTheCandidate) {
  ASSERT_NO_FATAL_FAILURE(SetUpRankWithCandidateV2());
  executor_->SetTrial(2, 2, 3);  // every 3rd step a canary step, every 2nd a shadow
  std::mt19937 rng(9);
  int64_t accepted = 0;
  uint64_t step = 1;
  for (Phase phase :
       {Phase::kDecode, Phase::kPrefill, Phase::kDecode, Phase::kPrefill, Phase::kDecode, Phase::kPrefill}) {
    const RankInput input = RandomInput(rng, 5);
    const LayerStepInput in = input.Step(step++, 0, phase);
    auto result = executor_->Execute(in);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->record.canary, in.step_id % 3 == 0);
    EXPECT_EQ(result->record.placement_version, result->record.canary ? 2 : 1);
    EXPECT_GT(result->record.routes_accepted, 0);
    if (result->record.canary) accepted += result->record.routes_accepted;
  }
  const GenerationCounters c = executor_->Counters()[2];
  EXPECT_EQ(c.canary_steps, 2);
  EXPECT_EQ(c.shadow_samples, 2);  // steps 2 and 4 (step 6 is a canary step)
  EXPECT_EQ(c.routes_attempted, accepted);
}

// A step sampled for the shadow reads one private copy of its rows in both passes, and its served
// rows reach the caller's memory after the comparison: an engine that rewrites its step ring's
// slot between the two passes cannot force a mismatch (which would block the candidate's canary).
TEST_F(OneMemberTest, AShadowedStepReadsOneCopyOfItsRows) {
  ASSERT_NO_FATAL_FAILURE(SetUpRankWithCandidateV2());
  executor_->SetTrial(2, 1, 0);  // every step a shadow
  std::mt19937 rng(31);
  const RankInput input = RandomInput(rng, 5);
  std::vector<uint16_t> slot_rows = input.hidden, slot_out(input.hidden.size(), 0);
  LayerStepInput in = input.Step(2, 0, Phase::kPrefill);
  in.hidden = slot_rows.data();
  in.output = slot_out.data();
  int checks = 0;
  in.await_input_check = [&] {
    // The shadow pass's check (the second): the engine flips every row's signs under it.
    if (++checks == 2) {
      for (uint16_t& v : slot_rows) v ^= 0x8000;
    }
    return absl::OkStatus();
  };
  auto r = executor_->Execute(in);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(checks, 2);
  const GenerationCounters c = executor_->Counters()[2];
  EXPECT_EQ(c.shadow_samples, 1);
  EXPECT_EQ(c.shadow_failures, 0);
  EXPECT_EQ(c.shadow_mismatches, 0) << "the shadow read the rewritten rows";
  EXPECT_LT(ErrorAgainstReference(ckpt_, input, slot_out), 1e-2) << "the served rows, in the caller's memory";
}

// A canary step whose input this rank refuses (an expert id out of range) counts as rejected
// under the candidate, not as a failed step: a bad request must not block the promotion gate
// (FaultsOK reads failed_steps). The expert load grows only by the steps served.
TEST_F(OneMemberTest, ACanaryStepWithBadInputIsRejectedNotACandidateFailure) {
  ASSERT_NO_FATAL_FAILURE(SetUpRankWithCandidateV2());
  executor_->SetTrial(2, 0, 1);  // every step a canary step
  std::mt19937 rng(21);
  RankInput bad = RandomInput(rng, 5);
  bad.ids[2] = kExperts + 3;
  bad.admitted[2] = 1;
  for (const Phase phase : {Phase::kDecode, Phase::kPrefill}) {
    auto r = executor_->Execute(bad.Step(phase == Phase::kDecode ? 1 : 2, 0, phase));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  }
  // An input check that fails (the service's row scan) is the engine's input too.
  const RankInput good = RandomInput(rng, 5);
  LayerStepInput checked = good.Step(3, 0, Phase::kPrefill);
  checked.await_input_check = [] { return absl::InvalidArgumentError("hidden.data[1]: not finite"); };
  EXPECT_EQ(executor_->Execute(checked).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<int64_t> load = executor_->ExpertLoad();
  EXPECT_EQ(std::accumulate(load.begin(), load.end(), int64_t{0}), 0) << "refused steps counted in the load";
  auto served = executor_->Execute(good.Step(4, 0, Phase::kPrefill));
  ASSERT_TRUE(served.ok()) << served.status();
  EXPECT_TRUE(served->record.canary);
  const GenerationCounters c = executor_->Counters()[2];
  EXPECT_EQ(c.rejected_steps, 3);
  EXPECT_EQ(c.failed_steps, 0);
  EXPECT_EQ(c.canary_steps, 1);
  load = executor_->ExpertLoad();
  EXPECT_EQ(std::accumulate(load.begin(), load.end(), int64_t{0}), served->record.routes_accepted);
}

// The input check that runs beside the first phases (the service's row scan) is awaited before
// the agreement on every step, also one that failed earlier; its failure rejects the step with
// its own error, and the next step is served.
TEST_F(OneMemberTest, AnInputCheckIsAwaitedBeforeTheAgreementAndItsFailureRejectsTheStep) {
  SetUpRank(kExperts, kD, kFf, 3, /*redundant=*/2);
  std::mt19937 rng(13);
  const RankInput input = RandomInput(rng, 6);
  int awaited = 0;
  LayerStepInput in = input.Step(1, 0, Phase::kPrefill);
  in.await_input_check = [&awaited] {
    ++awaited;
    return absl::InvalidArgumentError("hidden.data[7]: not finite");
  };
  auto rejected = executor_->Execute(in);
  EXPECT_EQ(rejected.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(rejected.status().message()), ::testing::HasSubstr("hidden.data[7]"));
  EXPECT_EQ(awaited, 1);
  // A step whose layer is not served fails in acquire: the check is still awaited.
  in.step_id = 2;
  in.layer = 999;
  EXPECT_EQ(executor_->Execute(in).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(awaited, 2);
  // A passing check: the step is served.
  LayerStepInput good = input.Step(3, 0, Phase::kPrefill);
  good.await_input_check = [&awaited] {
    ++awaited;
    return absl::OkStatus();
  };
  auto served = executor_->Execute(good);
  ASSERT_TRUE(served.ok()) << served.status();
  EXPECT_EQ(awaited, 3);
  EXPECT_LT(ErrorAgainstReference(ckpt_, input, served->output), 1e-2);
  EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), 0);
}

// start_input_check: called once a pass, on the null stream where nothing is recorded (the CPU
// kernels), before its check is awaited; for decode steps planned on the kernels too. A check
// that cannot start fails the step with that status, and the next step serves.
TEST_F(OneMemberTest, AnInputCheckIsStartedOnceBeforeItIsAwaited) {
  SetUpRank(kExperts, kD, kFf, 3, /*redundant=*/2, DecodeRunner::kKernels, /*device_plan=*/true);
  std::mt19937 rng(29);
  std::vector<std::string> calls;
  const auto instrument = [&calls](LayerStepInput& in, absl::Status start) {
    in.start_input_check = [&calls, start](void* stream) {
      calls.push_back(stream == nullptr ? "start" : "start on a stream");
      return start;
    };
    in.await_input_check = [&calls] {
      calls.push_back("await");
      return absl::OkStatus();
    };
  };
  uint64_t step = 1;
  for (Phase phase : {Phase::kPrefill, Phase::kDecode}) {
    for (bool routing_on_device : {false, true}) {
      const RankInput input = RandomInput(rng, 5);
      LayerStepInput in = input.Step(step++, 0, phase);
      in.routing_on_device = routing_on_device;
      instrument(in, absl::OkStatus());
      calls.clear();
      auto r = executor_->Execute(in);
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_GE(calls.size(), 2u);
      EXPECT_EQ(calls[0], "start");
      EXPECT_EQ(std::count(calls.begin(), calls.end(), "start"), 1);
      EXPECT_EQ(std::count(calls.begin(), calls.end(), "start on a stream"), 0);
      EXPECT_EQ(r->record.device_plan, routing_on_device || phase == Phase::kPrefill);
      EXPECT_LT(ErrorAgainstReference(ckpt_, input, r->output), 1e-2);
    }
  }
  for (bool routing_on_device : {false, true}) {
    const RankInput input = RandomInput(rng, 3);
    LayerStepInput in = input.Step(step++, 0, Phase::kDecode);
    in.routing_on_device = routing_on_device;
    instrument(in, absl::ResourceExhaustedError("find_non_finite: no scratch"));
    auto refused = executor_->Execute(in);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(std::string(refused.status().message()), ::testing::HasSubstr("find_non_finite"));
    in = input.Step(step++, 0, Phase::kDecode);
    in.routing_on_device = routing_on_device;
    instrument(in, absl::OkStatus());
    auto served = executor_->Execute(in);
    ASSERT_TRUE(served.ok()) << served.status();
    EXPECT_LT(ErrorAgainstReference(ckpt_, input, served->output), 1e-2);
  }
  EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), 0);
}

// A loopback endpoint (not owned) whose peers can be failed, as UCX fails a peer whose
// positional call timed out (Transport::failed): every call then answers UNAVAILABLE.
class BreakableTransport final : public Transport {
 public:
  explicit BreakableTransport(Transport* inner) : inner_(inner) {}
  const char* name() const override { return "breakable"; }
  int slot() const override { return inner_->slot(); }
  int size() const override { return inner_->size(); }
  bool failed() const override { return broken; }
  absl::Status AllGather(uint64_t seq, const void* in, int64_t bytes, void* out, absl::Duration timeout) override {
    if (absl::Status s = Check(seq); !s.ok()) return s;
    return inner_->AllGather(seq, in, bytes, out, timeout);
  }
  absl::Status StepGather(uint64_t step, const void* in, int64_t bytes, void* out, absl::Duration timeout) override {
    if (absl::Status s = Check(step); !s.ok()) return s;
    return inner_->StepGather(step, in, bytes, out, timeout);
  }
  absl::Status AllToAllV(uint64_t seq, const void* send, absl::Span<const int64_t> send_bytes, void* recv,
                         absl::Span<const int64_t> recv_bytes, absl::Duration timeout) override {
    if (absl::Status s = Check(seq); !s.ok()) return s;
    return inner_->AllToAllV(seq, send, send_bytes, recv, recv_bytes, timeout);
  }
  void AbandonStep(uint64_t step) override { abandoned.push_back(step); }
  bool broken = false;
  std::vector<uint64_t> abandoned;

 private:
  absl::Status Check(uint64_t seq) const {
    if (interrupted()) return InterruptedError(seq);
    if (broken) return absl::UnavailableError("breakable: peer slot 0 failed");
    return absl::OkStatus();
  }
  Transport* inner_;
};

// Process-group epochs (spec 0x07G): an unbound executor answers UNAVAILABLE naming why; a
// bound epoch serves; a step that leaves the transport failed reports the epoch to the listener
// once (later failing steps of the same epoch do not), a new epoch reports afresh, and a step
// ended by Unbind's interruption is no fault.
TEST_F(OneMemberTest, AStepThatLeavesTheTransportFailedReportsItsEpochOnceAndTheNextEpochServes) {
  SetUpRank(kExperts, kD, kFf, 3, /*redundant=*/2);
  std::vector<std::pair<int64_t, std::string>> reports;
  executor_->SetEpochFaultListener(
      [&reports](int64_t epoch, const std::string& why) { reports.emplace_back(epoch, why); });
  std::mt19937 rng(21);
  const RankInput input = RandomInput(rng, 5);
  uint64_t step = 1;
  auto bind = [&](BreakableTransport* t, int64_t epoch) {
    executor_->Unbind(absl::StrCat("test: re-forming as epoch ", epoch));
    auto unbound = executor_->Execute(input.Step(step++, 0, Phase::kPrefill));
    EXPECT_EQ(unbound.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_THAT(std::string(unbound.status().message()), ::testing::HasSubstr(absl::StrCat("epoch ", epoch)));
    EXPECT_FALSE(executor_->Membership().has_value());
    auto group = ProcessGroup::Create(group_.id(), ProcessGroupEpoch(epoch), {Rank(0)});
    ASSERT_TRUE(group.ok()) << group.status();
    ASSERT_TRUE(executor_->Bind(t, topology_, *group, nullptr).ok());
    ASSERT_TRUE(executor_->Membership().has_value());
    EXPECT_EQ(executor_->Membership()->second.epoch().value(), epoch);
    auto served = executor_->Execute(input.Step(step++, 0, Phase::kPrefill));
    ASSERT_TRUE(served.ok()) << served.status();
    EXPECT_LT(ErrorAgainstReference(ckpt_, input, served->output), 1e-2);
  };
  BreakableTransport e7(transport_.get()), e8(transport_.get()), e9(transport_.get());
  bind(&e7, 7);
  EXPECT_TRUE(reports.empty());
  e7.broken = true;
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(executor_->Execute(input.Step(step++, 0, Phase::kPrefill)).status().code(),
              absl::StatusCode::kUnavailable);
  }
  ASSERT_EQ(reports.size(), 1u) << "one report per failed epoch";
  EXPECT_EQ(reports[0].first, 7);
  EXPECT_THAT(reports[0].second, ::testing::HasSubstr("peer slot 0 failed"));

  bind(&e8, 8);
  e8.broken = true;
  EXPECT_FALSE(executor_->Execute(input.Step(step++, 0, Phase::kDecode)).ok());
  ASSERT_EQ(reports.size(), 2u);
  EXPECT_EQ(reports[1].first, 8);

  // Unbind's interruption ends the step: the epoch is being left anyway, nothing to report.
  bind(&e9, 9);
  e9.broken = true;
  e9.Interrupt();
  EXPECT_FALSE(executor_->Execute(input.Step(step++, 0, Phase::kPrefill)).ok());
  EXPECT_EQ(reports.size(), 2u);
  EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), 0);

  // An epoch bound closed (a group's member waiting for the others) answers UNAVAILABLE naming
  // it until Open for that epoch; Open for another epoch does nothing.
  executor_->Unbind("test: re-forming as epoch 10");
  BreakableTransport e10(transport_.get());
  auto group = ProcessGroup::Create(group_.id(), ProcessGroupEpoch(10), {Rank(0)});
  ASSERT_TRUE(group.ok()) << group.status();
  ASSERT_TRUE(executor_->Bind(&e10, topology_, *group, nullptr, /*open=*/false).ok());
  EXPECT_TRUE(executor_->Membership().has_value()) << "bound, only not open";
  auto closed = executor_->Execute(input.Step(step++, 0, Phase::kPrefill));
  EXPECT_EQ(closed.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(closed.status().message()), ::testing::HasSubstr("epoch 10 is bound here, not yet on every"));
  EXPECT_EQ(e10.abandoned, std::vector<uint64_t>{step - 1}) << "the refused step is abandoned in the agreement";
  EXPECT_FALSE(executor_->Open(9));
  EXPECT_EQ(executor_->Execute(input.Step(step++, 0, Phase::kPrefill)).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(executor_->Open(10));
  auto opened = executor_->Execute(input.Step(step++, 0, Phase::kPrefill));
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_LT(ErrorAgainstReference(ckpt_, input, opened->output), 1e-2);
  EXPECT_EQ(e10.abandoned.size(), 2u) << "an open epoch abandons nothing";
  EXPECT_EQ(reports.size(), 2u) << "refusals before Open are no faults";
}

INSTANTIATE_TEST_SUITE_P(Runners, OneMemberTest,
                         ::testing::Combine(::testing::Values(DecodeRunner::kKernels, DecodeRunner::kPadded),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<DecodeRunner, bool>>& info) {
                           return std::string(std::get<0>(info.param) == DecodeRunner::kPadded ? "Padded" : "Kernels") +
                                  (std::get<1>(info.param) ? "DevicePlan" : "HostPlan");
                         });

TEST(LayerExecutorTest, BadInputOnOneRankAbortsTheStepEverywhereAndServingContinues) {
  Rank4 w;
  std::mt19937 rng(5);
  std::vector<RankInput> inputs;
  for (int r = 0; r < kRanks; ++r) inputs.push_back(RandomInput(rng, 4));
  inputs[1].ids[3] = kExperts + 5;  // expert id out of range on rank 1
  inputs[1].admitted[3] = 1;
  const absl::Time start = absl::Now();
  auto results = RunStep(w, inputs, 1, 0);
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));  // nobody waited out the 5 s timeout
  EXPECT_EQ(results[1].status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(results[1].status().message()), ::testing::HasSubstr("topk_ids[1][1]"));
  for (int r : {0, 2, 3}) EXPECT_EQ(results[r].status().code(), absl::StatusCode::kAborted) << "rank " << r;
  // The aborted step, which the engine retries, is in no rank's expert load.
  for (int r = 0; r < kRanks; ++r) {
    const std::vector<int64_t> load = w.exec[r]->ExpertLoad();
    EXPECT_EQ(std::accumulate(load.begin(), load.end(), int64_t{0}), 0) << "rank " << r;
  }
  // The next step with good input succeeds everywhere.
  inputs[1].ids[3] = 0;
  results = RunStep(w, inputs, 2, 0);
  for (int r = 0; r < kRanks; ++r) EXPECT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r].status();
}

// 0x0E "inverse permutation is corrupt -> reject output before publish": rank 1's combine tables
// trade two routes of different tokens. Its step answers DATA_LOSS naming the route and combines
// nothing into its caller's output; its peers, whose exchanges it completed, serve theirs
// correctly; nothing stays held.
TEST(LayerExecutorTest, ACorruptInversePermutationIsRejectedBeforePublish) {
  Rank4 w(0, 0, kD, kFf, 0, /*swap_combine_ranks=*/0b0010);
  std::mt19937 rng(21);
  std::vector<RankInput> inputs;
  for (int r = 0; r < kRanks; ++r) inputs.push_back(RandomInput(rng, 6));
  for (uint64_t step : {1, 2}) {
    // Rank 1 writes into its caller's memory: nothing may be combined into it.
    std::vector<uint16_t> caller_out(6 * kD, 0x7FC0);
    std::vector<absl::StatusOr<LayerStepResult>> results(kRanks, absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r) {
      threads.emplace_back([&, r] {
        LayerStepInput in = inputs[r].Step(step, 0);
        if (r == 1) in.output = caller_out.data();
        results[r] = w.exec[r]->Execute(in);
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_TRUE(std::all_of(caller_out.begin(), caller_out.end(), [](uint16_t v) { return v == 0x7FC0; }));
    EXPECT_EQ(results[1].status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(std::string(results[1].status().message()), ::testing::HasSubstr("inverse permutation: route "));
    EXPECT_THAT(std::string(results[1].status().message()), ::testing::HasSubstr("output is not published"));
    for (int r : {0, 2, 3}) {
      ASSERT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r].status();
      EXPECT_LT(ErrorAgainstReference(w.checkpoint, inputs[r], results[r]->output), 1e-2) << "rank " << r;
    }
    for (int r = 0; r < kRanks; ++r) EXPECT_EQ(w.registry[r].Refcount(PlacementVersion(17)), 0) << "rank " << r;
  }
}

// 0x05F through the executor: the fixture's oversize decode step, tokens [5, 4, 2, 0] a rank
// against a bucket of 4, k = 2. Every rank runs it eagerly and says why with the one agreed reason,
// rank_token_capacity_exceeded (rank 0's 5 > 4), accepts all 22 routes (no clipping) and returns
// the reference; a step inside the bucket is refused only for want of captured graphs (no GPU).
TEST(LayerExecutorTest, AnOversizeDecodeStepFallsBackWholeOnEveryRank) {
  Rank4 w(0, 0, kD, kFf, /*decode_rank_tokens=*/4);
  std::mt19937 rng(13);
  const int64_t tokens[kRanks] = {5, 4, 2, 0};
  std::vector<RankInput> inputs;
  for (int r = 0; r < kRanks; ++r) {
    inputs.push_back(testing::RandomTwoRouteInput(rng, tokens[r], kD, kExperts, /*drop_some=*/false));
    inputs.back().admitted.assign(tokens[r] * 2, 1);  // every route admitted (the reference reads the table)
  }
  std::vector<absl::StatusOr<LayerStepResult>> results(kRanks, absl::UnknownError("not run"));
  const auto run = [&](uint64_t step) {
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r) {
      threads.emplace_back([&, r] { results[r] = w.exec[r]->Execute(inputs[r].Step(step, 0, Phase::kDecode)); });
    }
    for (auto& t : threads) t.join();
  };
  run(1);
  int64_t accepted = 0;
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r].status();
    EXPECT_FALSE(results[r]->record.graph_replay) << "rank " << r;
    EXPECT_EQ(results[r]->record.fallback_reason, "rank_token_capacity_exceeded") << "rank " << r;
    EXPECT_EQ(results[r]->record.routes_dropped, 0) << "rank " << r;
    accepted += results[r]->record.routes_accepted;
    if (tokens[r] > 0) {
      EXPECT_LT(ErrorAgainstReference(w.checkpoint, inputs[r], results[r]->output), 1e-2) << "rank " << r;
    }
  }
  EXPECT_EQ(accepted, 22);
  inputs[0] = testing::RandomTwoRouteInput(rng, 3, kD, kExperts, /*drop_some=*/false);  // [3, 4, 2, 0]: fits
  inputs[0].admitted.assign(6, 1);
  run(2);
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r].status();
    EXPECT_EQ(results[r]->record.fallback_reason, "stable_buffer_unavailable") << "rank " << r;
  }
}

// Weights for another slot count than the generation puts on a rank (rank 2 holds placement-v17's
// two slots' weights under placement-v18, which puts three there) fail that rank's step before
// the agreement: its peers abort at once instead of waiting out the timeout in an exchange it
// would not finish.
TEST(LayerExecutorTest, WeightsForAnotherSlotCountFailTheStepBeforeTheAgreement) {
  Rank4 w;
  const std::shared_ptr<const PlacementManifest> v18 = w.Candidate(18);
  ASSERT_EQ(v18->LocalSlots(Rank(2)).size(), 3u);
  ASSERT_EQ(w.manifest->LocalSlots(Rank(2)).size(), 2u);
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(w.registry[r].Prepare(v18).ok());
    auto local = LoadLocalExperts(w.checkpoint, r == 2 ? *w.manifest : *v18, Rank(r));
    ASSERT_TRUE(local.ok()) << local.status();
    ASSERT_TRUE(w.exec[r]->AddGeneration(PlacementVersion(18), std::make_shared<LocalExperts>(*local)).ok());
    ASSERT_TRUE(w.registry[r].Activate(PlacementVersion(18)).ok());
  }
  std::mt19937 rng(8);
  std::vector<RankInput> inputs;
  for (int r = 0; r < kRanks; ++r) inputs.push_back(RandomInput(rng, 4));
  const absl::Time start = absl::Now();
  const auto results = RunStep(w, inputs, 1, 0);
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));  // nobody waited out the 5 s timeout
  EXPECT_EQ(results[2].status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(results[2].status().message()),
              ::testing::HasSubstr("rank 2 holds weights for a different number of local slots than placement-v18 "
                                   "puts here (3)"));
  for (int r : {0, 1, 3}) EXPECT_EQ(results[r].status().code(), absl::StatusCode::kAborted) << "rank " << r;
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(w.registry[r].Refcount(PlacementVersion(18)), 0) << "rank " << r;
}

// The device plan (the kernels key, check and rank the routes; here the CPU reference) gives
// the host plan's outputs bit for bit and the same records, with some members planning on the
// kernels and others on the host in the same steps. Ranks 2 and 3 (node 1) choose expert 1's
// copy between two slots on node 0 by load, so they keep the host plan whatever the setting;
// decode steps keep it too.
TEST(LayerExecutorTest, DevicePlanGivesTheHostPlansOutputsAndRecords) {
  for (uint32_t mask : {0b1111u, 0b0001u}) {
    Rank4 host(0), mixed(mask);
    std::mt19937 rng(33);
    for (uint64_t step = 1; step <= 5; ++step) {
      std::vector<RankInput> inputs;
      for (int r = 0; r < kRanks; ++r) inputs.push_back(RandomInput(rng, r == 0 && step == 2 ? 0 : 1 + rng() % 40));
      const Phase phase = step == 4 ? Phase::kDecode : Phase::kPrefill;
      std::vector<absl::StatusOr<LayerStepResult>> a(kRanks, absl::UnknownError("")), b = a;
      std::vector<std::thread> threads;
      for (int r = 0; r < kRanks; ++r) {
        threads.emplace_back([&, r] { a[r] = host.exec[r]->Execute(inputs[r].Step(step, 3, phase)); });
        threads.emplace_back([&, r] { b[r] = mixed.exec[r]->Execute(inputs[r].Step(step, 3, phase)); });
      }
      for (auto& t : threads) t.join();
      for (int r = 0; r < kRanks; ++r) {
        ASSERT_TRUE(a[r].ok()) << a[r].status();
        ASSERT_TRUE(b[r].ok()) << b[r].status();
        EXPECT_EQ(a[r]->output, b[r]->output) << "mask " << mask << " step " << step << " rank " << r;
        const StepRecord &x = a[r]->record, &y = b[r]->record;
        EXPECT_FALSE(x.device_plan);
        const bool expect_device = (mask >> r & 1) != 0 && r < 2 && phase == Phase::kPrefill && inputs[r].tokens > 0;
        EXPECT_EQ(y.device_plan, expect_device) << "mask " << mask << " step " << step << " rank " << r;
        EXPECT_EQ(x.routes_attempted, y.routes_attempted);
        EXPECT_EQ(x.routes_accepted, y.routes_accepted);
        EXPECT_EQ(x.routes_remote, y.routes_remote);
        EXPECT_EQ(x.routes_inter_node, y.routes_inter_node);
        EXPECT_EQ(x.routes_served, y.routes_served);
        EXPECT_EQ(x.bytes_sent, y.bytes_sent);
        EXPECT_LT(ErrorAgainstReference(host.checkpoint, inputs[r], b[r]->output), 1e-2);
        EXPECT_EQ(mixed.registry[r].Refcount(PlacementVersion(17)), 0);
      }
    }
    // The load signal counts the same routes per expert.
    for (int r = 0; r < kRanks; ++r) EXPECT_EQ(host.exec[r]->ExpertLoad(), mixed.exec[r]->ExpertLoad()) << r;
  }
}

// FP8 experts (LayerExecutorOptions::expert_dtype): each rank's weights are quantized in
// 128 x 128 blocks when the generation is added, and every step's output equals, bit for bit,
// the semantic computation with the FP8 reference kernel (SwigluFp8 a route at a time on the
// block-quantized weights, the CPU Combine) on every rank: prefill planned on the host and on
// the kernels, and decode. The outputs are near the BF16 experts' and not equal to them.
constexpr int kD8 = 256, kFf8 = 128;

std::vector<uint16_t> Fp8Reference(const RankInput& in) {
  auto k = kernels::CreateCpuKernels();
  std::vector<uint16_t> rows(in.tokens * kK * kD8, 0);
  std::vector<int32_t> row_of_route(in.tokens * kK, -1);
  for (int64_t t = 0; t < in.tokens; ++t) {
    for (int j = 0; j < kK; ++j) {
      if (!in.admitted[t * kK + j]) continue;
      std::vector<uint16_t> gu, dn;
      SyntheticExpert(in.ids[t * kK + j], {kExperts, kD8, kFf8}, 3, &gu, &dn);
      std::vector<uint8_t> qgu(gu.size()), qdn(dn.size());
      std::vector<float> sgu(2 * kFf8 / 128 * kD8 / 128), sdn(kD8 / 128 * kFf8 / 128);
      const auto g = kernels::ScaleGranularity::kBlock128x128;
      EXPECT_TRUE(
          k->Quantize({gu.data(), 2 * kFf8, kD8, g, qgu.data(), sgu.data(), int64_t(sgu.size())}, nullptr).ok());
      EXPECT_TRUE(k->Quantize({dn.data(), kD8, kFf8, g, qdn.data(), sdn.data(), int64_t(sdn.size())}, nullptr).ok());
      const int64_t offsets[2] = {0, 1};
      kernels::SwigluFp8Params p;
      p.weights = {qgu.data(), sgu.data(), qdn.data(), sdn.data(), 1, kD8, kFf8};
      p.x = in.hidden.data() + t * kD8;
      p.rows = 1;
      p.offsets = offsets;
      p.y = rows.data() + (t * kK + j) * kD8;
      EXPECT_TRUE(k->SwigluFp8(p, nullptr).ok());
      row_of_route[t * kK + j] = static_cast<int32_t>(t * kK + j);
    }
  }
  std::vector<uint16_t> out(in.tokens * kD8);
  if (in.tokens == 0) return out;
  kernels::CombineParams c{rows.data(), in.tokens * kK, kD8,       row_of_route.data(), in.gates.data(), in.tokens,
                           kK,          nullptr,        out.data()};
  EXPECT_TRUE(k->Combine(c, nullptr).ok());
  return out;
}

template <typename Rows>
std::vector<uint16_t> Plain(const Rows& rows) {
  return std::vector<uint16_t>(rows.begin(), rows.end());
}

TEST(LayerExecutorTest, Fp8ExpertsEqualTheFp8ReferenceOnEveryRank) {
  Rank4 fp8(0b0011, 0b1111, kD8, kFf8), bf16(0, 0, kD8, kFf8);
  std::mt19937 rng(8);
  bool any_differs = false, fewer_bytes = false;
  for (uint64_t step = 1; step <= 4; ++step) {
    std::vector<RankInput> inputs;
    for (int r = 0; r < kRanks; ++r) {
      inputs.push_back(testing::RandomTwoRouteInput(rng, r == 3 && step == 2 ? 0 : 1 + rng() % 20, kD8, kExperts,
                                                    /*drop_some=*/true));
    }
    const Phase phase = step == 3 ? Phase::kDecode : Phase::kPrefill;
    std::vector<absl::StatusOr<LayerStepResult>> a(kRanks, absl::UnknownError("")), b = a;
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r) {
      threads.emplace_back([&, r] { a[r] = fp8.exec[r]->Execute(inputs[r].Step(step, 3, phase)); });
      threads.emplace_back([&, r] { b[r] = bf16.exec[r]->Execute(inputs[r].Step(step, 3, phase)); });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < kRanks; ++r) {
      ASSERT_TRUE(a[r].ok()) << "rank " << r << ": " << a[r].status();
      ASSERT_TRUE(b[r].ok()) << "rank " << r << ": " << b[r].status();
      EXPECT_EQ(Plain(a[r]->output), Fp8Reference(inputs[r])) << "step " << step << " rank " << r;
      EXPECT_EQ(a[r]->record.device_plan, r < 2 && phase == Phase::kPrefill && inputs[r].tokens > 0);
      if (inputs[r].tokens == 0) continue;
      std::vector<float> want(b[r]->output.size());
      for (size_t i = 0; i < want.size(); ++i) want[i] = kernels::Bf16ToFloat(b[r]->output[i]);
      const double err = kernels::RelativeL2Bf16(a[r]->output, want);
      EXPECT_LT(err, 0.1) << "step " << step << " rank " << r;  // E4M3 weights and rows
      any_differs |= a[r]->output != b[r]->output;
      // The dispatch moves packed FP8 rows (d + 4 d / 128 bytes, padded to 16: 272) instead of
      // BF16 rows (512) to the peers; the return stays BF16.
      const StepRecord &x = a[r]->record, &y = b[r]->record;
      EXPECT_EQ(x.routes_remote, y.routes_remote);
      EXPECT_EQ(x.bytes_sent, y.bytes_sent - x.routes_remote * (2 * kD8 - kernels::Fp8PackedRowBytes(kD8)))
          << "step " << step << " rank " << r;
      fewer_bytes |= x.bytes_sent < y.bytes_sent;
      EXPECT_EQ(fp8.registry[r].Refcount(PlacementVersion(17)), 0);
    }
  }
  EXPECT_TRUE(any_differs);  // the FP8 path ran, not the BF16 one
  EXPECT_TRUE(fewer_bytes);
}

// A lone member's FP8 decode steps take the staged path (LocalLayer is BF16) and equal the FP8
// reference too.
class Fp8OneMemberTest : public testing::OneRankTest {};

TEST_F(Fp8OneMemberTest, DecodeAndPrefillEqualTheFp8Reference) {
  SetUpRank(kExperts, kD8, kFf8, 3, 0, DecodeRunner::kKernels, /*device_plan=*/true, ExpertDtype::kFp8);
  std::mt19937 rng(12);
  uint64_t step = 1;
  for (Phase phase : {Phase::kDecode, Phase::kPrefill}) {
    for (int64_t tokens : {1, 0, 9}) {
      const RankInput input = testing::RandomTwoRouteInput(rng, tokens, kD8, kExperts, /*drop_some=*/true);
      auto result = executor_->Execute(input.Step(step++, 0, phase));
      ASSERT_TRUE(result.ok()) << result.status();
      EXPECT_EQ(Plain(result->output), Fp8Reference(input)) << "T=" << tokens;
    }
  }
}

// A lone member's FP8 decode steps with their routing in kernel memory are planned by the kernels
// too (SealRoutes, then RouteRows, PackFp8Rows, SwigluFp8 and Combine on the local slots): the
// host plan's output bits and expert load, and the FP8 reference; a bad route refuses the step
// naming it, and the next one is served.
TEST_F(Fp8OneMemberTest, DecodeStepsWithRoutingInKernelMemoryMatchTheHostPlan) {
  SetUpRank(kExperts, kD8, kFf8, 3, 0, DecodeRunner::kKernels, /*device_plan=*/true, ExpertDtype::kFp8);
  std::mt19937 rng(31);
  uint64_t step = 1;
  for (int64_t tokens : {1, 3, 9}) {
    const RankInput input = testing::RandomTwoRouteInput(rng, tokens, kD8, kExperts, /*drop_some=*/true);
    PlannedBothWays both = PlanBothWays(*executor_, input, &step, kExperts);
    ASSERT_TRUE(both.host.ok()) << both.host.status();
    ASSERT_TRUE(both.device.ok()) << both.device.status();
    EXPECT_TRUE(both.device->record.device_plan) << "T=" << tokens;
    EXPECT_FALSE(both.host->record.device_plan);
    EXPECT_EQ(both.device->output, both.host->output) << "T=" << tokens;
    EXPECT_EQ(Plain(both.device->output), Fp8Reference(input)) << "T=" << tokens;
    EXPECT_EQ(both.device->record.routes_served, both.host->record.routes_served);
    EXPECT_EQ(both.device_load, both.host_load);
    EXPECT_GT(std::accumulate(both.host_load.begin(), both.host_load.end(), int64_t{0}), 0);
  }
  RankInput bad = testing::RandomTwoRouteInput(rng, 4, kD8, kExperts, /*drop_some=*/true);
  bad.ids[5] = kExperts;  // token 2's second route, always admitted
  LayerStepInput in = bad.Step(step++, 0, Phase::kDecode);
  in.routing_on_device = true;
  auto refused = executor_->Execute(in);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()), ::testing::HasSubstr("topk_ids[2][1]"));
  const RankInput good = testing::RandomTwoRouteInput(rng, 2, kD8, kExperts, /*drop_some=*/true);
  in = good.Step(step++, 0, Phase::kDecode);
  in.routing_on_device = true;
  auto served = executor_->Execute(in);
  ASSERT_TRUE(served.ok()) << served.status();
  EXPECT_EQ(Plain(served->output), Fp8Reference(good));
  EXPECT_EQ(registry_.Refcount(PlacementVersion(1)), 0);
}

// A group whose members run the experts in different precisions aborts every step on every
// member before payload moves, naming expert_dtype (a token's routes would otherwise get BF16 or
// FP8 experts depending on where they land).
// A decode step's graph is shaped by its k (routes a token), which each engine sends: members
// whose k differ (an idle rank's [0, 1] routing beside [T, 2]) disagree in the graph-key word, so
// every member serves the step eagerly (graph_key_mismatch) and the outputs are right, instead of
// each capturing graphs of other collective sizes.
TEST(LayerExecutorTest, MembersWhoseDecodeStepsDifferInKServeThemEagerly) {
  Rank4 w;
  std::mt19937 rng(21);
  std::vector<RankInput> inputs;
  for (int r = 0; r < kRanks; ++r) inputs.push_back(RandomInput(rng, r == 3 ? 0 : 1));
  std::vector<absl::StatusOr<LayerStepResult>> results(kRanks, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      LayerStepInput in = inputs[r].Step(1, 0, Phase::kDecode);
      if (r == 3) in.k = 1;  // no tokens, routing of another width
      results[r] = w.exec[r]->Execute(in);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r].status();
    EXPECT_FALSE(results[r]->record.graph_replay) << "rank " << r;
    EXPECT_EQ(results[r]->record.fallback_reason, "graph_key_mismatch") << "rank " << r;
    if (r < 3) {
      EXPECT_LE(ErrorAgainstReference(w.checkpoint, inputs[r], results[r]->output), 1e-2) << "rank " << r;
    }
  }
}

TEST(LayerExecutorTest, MembersWithDifferentExpertDtypesAbortTheStep) {
  Rank4 w(0, 0b0100, kD8, kFf8);
  std::mt19937 rng(3);
  std::vector<RankInput> inputs;
  for (int r = 0; r < kRanks; ++r) {
    inputs.push_back(testing::RandomTwoRouteInput(rng, 5, kD8, kExperts, /*drop_some=*/false));
  }
  const auto results = RunStep(w, inputs, 1, 0);
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(results[r].status().code(), absl::StatusCode::kAborted) << "rank " << r;
    const std::string why(results[r].status().message());
    EXPECT_THAT(why, ::testing::HasSubstr("has expert_dtype")) << "rank " << r;
    EXPECT_THAT(why, ::testing::HasSubstr("fp8")) << "rank " << r;
    EXPECT_THAT(why, ::testing::HasSubstr("bf16")) << "rank " << r;
    EXPECT_EQ(w.registry[r].Refcount(PlacementVersion(17)), 0);
  }
}

// FP8 experts need widths in whole 128 x 128 blocks: refused when the generation is added,
// naming the setting, and nothing is served from it.
TEST(LayerExecutorTest, Fp8ExpertsRefuseWidthsOutsideTheBlocks) {
  Rank4 w(0, 0, kD, kFf);  // d = 32, d_ff = 48
  LayerExecutorOptions o;
  o.rank = Rank(0);
  o.registry = &w.registry[0];
  o.kernels = w.kernels[0].get();
  o.expert_dtype = ExpertDtype::kFp8;
  auto exec = LayerExecutor::Create(std::move(o));
  ASSERT_TRUE(exec.ok());
  auto local = LoadLocalExperts(w.checkpoint, *w.manifest, Rank(0));
  ASSERT_TRUE(local.ok());
  const absl::Status s = (*exec)->AddGeneration(PlacementVersion(17), std::make_shared<LocalExperts>(*local));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("expert_dtype fp8"));
  EXPECT_EQ((*exec)->HostWeights(PlacementVersion(17)), nullptr);
  EXPECT_EQ(ParseExpertDtype("fp16", "--expert_dtype").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*ParseExpertDtype("fp8", "--expert_dtype"), ExpertDtype::kFp8);
}

// The recordings' capacity is bounded: 0 and more than 65536 are refused naming the option.
TEST(LayerExecutorTest, LoneDecodeRecordingsOutsideTheirRangeAreRefused) {
  Rank4 w(0, 0, kD, kFf);
  for (int bad : {0, -3, 65537}) {
    LayerExecutorOptions o;
    o.registry = &w.registry[0];
    o.kernels = w.kernels[0].get();
    o.lone_decode_recordings = bad;
    auto exec = LayerExecutor::Create(std::move(o));
    EXPECT_EQ(exec.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(exec.status().message()), ::testing::HasSubstr("lone_decode_recordings")) << bad;
  }
  for (int good : {1, 65536}) {
    LayerExecutorOptions o;
    o.registry = &w.registry[0];
    o.kernels = w.kernels[0].get();
    o.lone_decode_recordings = good;
    EXPECT_TRUE(LayerExecutor::Create(std::move(o)).ok()) << good;
  }
}

// Bad routes found by the kernels are refused as the host plan refuses them (same code and
// message), every peer aborts at once, and the next step serves.
TEST(LayerExecutorTest, DevicePlanRefusesBadRoutesAsTheHostPlanDoes) {
  for (const auto& [what, id, gate] : {std::tuple<const char*, int, float>{"id", kExperts + 5, 0.5f},
                                       {"negative id", -1, 0.5f},
                                       {"NaN gate", 0, std::nanf("")},
                                       {"negative gate", 0, -0.25f}}) {
    Rank4 host(0), device(0b1111);
    std::mt19937 rng(5);
    std::vector<RankInput> inputs;
    for (int r = 0; r < kRanks; ++r) inputs.push_back(RandomInput(rng, 6));
    inputs[1].ids[7] = id;
    inputs[1].gates[7] = gate;
    inputs[1].admitted[7] = 1;
    inputs[1].ids[9] = kExperts + 7;  // a later bad route: the first one is named
    inputs[1].admitted[9] = 1;
    inputs[1].admitted[4] = 0;  // an unadmitted route is not checked
    inputs[1].ids[4] = -100;
    const auto a = RunStep(host, inputs, 1, 0);
    const absl::Time start = absl::Now();
    const auto b = RunStep(device, inputs, 1, 0);
    EXPECT_LT(absl::Now() - start, absl::Seconds(2)) << what;
    EXPECT_EQ(b[1].status().code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_EQ(b[1].status().message(), a[1].status().message()) << what;
    EXPECT_THAT(std::string(b[1].status().message()), ::testing::HasSubstr("[3][1]")) << what;
    for (int r : {0, 2, 3}) EXPECT_EQ(b[r].status().code(), absl::StatusCode::kAborted) << what << " rank " << r;
    inputs[1].ids[7] = 0;
    inputs[1].gates[7] = 0.5f;
    inputs[1].ids[9] = 1;
    const auto c = RunStep(device, inputs, 2, 0);
    for (int r = 0; r < kRanks; ++r) {
      ASSERT_TRUE(c[r].ok()) << what << " rank " << r << ": " << c[r].status();
      EXPECT_EQ(c[r]->record.device_plan, r < 2) << what << " rank " << r;  // 2 and 3: load-dependent choice
    }
  }
}

// Routing in kernel memory (LayerStepInput::routing_on_device; host memory for the CPU
// reference): device-planned steps read it in place, host-planned ones (decode, load-dependent
// choices) copy it first, with the tables adjacent as in a step ring's device slot or apart.
// Outputs, records and the load signal are those of the same steps with host routing; a bad
// route is named alike.
TEST(LayerExecutorTest, RoutingInKernelMemoryGivesTheSameSteps) {
  Rank4 host(0), mixed(0b0011);
  std::mt19937 rng(41);
  for (uint64_t step = 1; step <= 6; ++step) {
    std::vector<RankInput> inputs;
    for (int r = 0; r < kRanks; ++r) inputs.push_back(RandomInput(rng, 1 + rng() % 30));
    const Phase phase = step % 3 == 0 ? Phase::kDecode : Phase::kPrefill;
    // Steps 1, 3, 5: ids then weights in one block, 16 bytes apart; else two blocks.
    std::vector<std::vector<int32_t>> blocks(kRanks);
    std::vector<std::vector<float>> weights(kRanks);
    std::vector<LayerStepInput> device_in(kRanks);
    for (int r = 0; r < kRanks; ++r) {
      LayerStepInput& in = device_in[r];
      in = inputs[r].Step(step, 3, phase);
      const size_t n = inputs[r].ids.size();
      if (step % 2 == 1) {
        blocks[r].assign(2 * n + 4, -7);
        std::memcpy(blocks[r].data(), inputs[r].ids.data(), n * 4);
        std::memcpy(blocks[r].data() + n + 4, inputs[r].gates.data(), n * 4);
        in.topk_ids = blocks[r].data();
        in.topk_weights = reinterpret_cast<const float*>(blocks[r].data() + n + 4);
      } else {
        blocks[r] = inputs[r].ids;
        weights[r] = inputs[r].gates;
        in.topk_ids = blocks[r].data();
        in.topk_weights = weights[r].data();
      }
      in.routing_on_device = true;
    }
    std::vector<absl::StatusOr<LayerStepResult>> a(kRanks, absl::UnknownError("")), b = a;
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r) {
      threads.emplace_back([&, r] { a[r] = host.exec[r]->Execute(inputs[r].Step(step, 3, phase)); });
      threads.emplace_back([&, r] { b[r] = mixed.exec[r]->Execute(device_in[r]); });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < kRanks; ++r) {
      ASSERT_TRUE(a[r].ok()) << a[r].status();
      ASSERT_TRUE(b[r].ok()) << "step " << step << " rank " << r << ": " << b[r].status();
      EXPECT_EQ(a[r]->output, b[r]->output) << "step " << step << " rank " << r;
      EXPECT_EQ(b[r]->record.device_plan, r < 2 && phase == Phase::kPrefill) << "step " << step << " rank " << r;
      EXPECT_EQ(a[r]->record.routes_accepted, b[r]->record.routes_accepted);
      EXPECT_EQ(a[r]->record.bytes_sent, b[r]->record.bytes_sent);
    }
  }
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(host.exec[r]->ExpertLoad(), mixed.exec[r]->ExpertLoad()) << r;
  // A bad route on a device-planned rank (0) and on a host-planned one (2), read back alike.
  for (int bad : {0, 2}) {
    std::vector<RankInput> inputs;
    for (int r = 0; r < kRanks; ++r) inputs.push_back(RandomInput(rng, 6));
    inputs[bad].ids[5] = kExperts + 3;
    inputs[bad].admitted.assign(12, 1);
    const auto a = RunStep(host, inputs, 20 + bad, 3);
    std::vector<absl::StatusOr<LayerStepResult>> b(kRanks, absl::UnknownError(""));
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r) {
      threads.emplace_back([&, r] {
        LayerStepInput in = inputs[r].Step(20 + bad, 3);
        in.routing_on_device = true;
        b[r] = mixed.exec[r]->Execute(in);
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(b[bad].status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(b[bad].status().message(), a[bad].status().message()) << bad;
    EXPECT_THAT(std::string(b[bad].status().message()), ::testing::HasSubstr("topk_ids[2][1]")) << bad;
  }
}

TEST(CheckpointTest, SafetensorsRoundTripAndDigestCheck) {
  const SafetensorsFile f = SyntheticCheckpoint({3, 16, 8}, 9, "checkpoint-0001");
  const std::string path = std::string(std::getenv("TEST_TMPDIR")) + "/synthetic.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, f).ok());
  auto back = ReadSafetensors(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->metadata, f.metadata);
  ASSERT_EQ(back->tensors.size(), 6u);
  EXPECT_EQ(back->tensors.at("experts.2.w_down").shape, (std::vector<int64_t>{16, 8}));
  EXPECT_EQ(back->tensors.at("experts.2.w_down").data, f.tensors.at("experts.2.w_down").data);
  // A manifest slot whose digest disagrees with the checkpoint is refused.
  Topology t = Topology::SingleNode(1);
  SlotRecord s = fixture::Slot(0, 2, 0, 0, 0);
  s.parameter_digest = ParameterDigest(f.metadata.at("digest.1"));
  ManifestOptions o = fixture::Options(1, 3);
  auto m = *PlacementManifest::Create(o, {s}, t);
  auto local = LoadLocalExperts(*back, *m, Rank(0));
  EXPECT_EQ(local.status().code(), absl::StatusCode::kFailedPrecondition);
  // A truncated file is detected.
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  std::ofstream(path, std::ios::binary) << bytes.substr(0, bytes.size() - 10);
  EXPECT_EQ(ReadSafetensors(path).status().code(), absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace moe

namespace moe {
namespace {

// Shadow: sampled steps also run on the PREPARED candidate and are compared (runner parity);
// canary: sampled steps are served by the candidate. Counters per generation on every rank.
TEST(LayerExecutorTrialTest, ShadowComparesAndCanaryServesTheCandidate) {
  Rank4 w;
  w.PrepareEverywhere(w.Candidate(18));
  for (int r = 0; r < kRanks; ++r) w.exec[r]->SetTrial(18, 2, 0);
  std::mt19937 rng(8);
  auto check_outputs = [&](const std::vector<RankInput>& inputs, const auto& results, uint64_t step) {
    for (int r = 0; r < kRanks; ++r) {
      ASSERT_TRUE(results[r].ok()) << "rank " << r << " step " << step << ": " << results[r].status();
      EXPECT_LT(ErrorAgainstReference(w.checkpoint, inputs[r], results[r]->output), 1e-2)
          << "rank " << r << " step " << step;
    }
  };
  for (uint64_t step = 1; step <= 6; ++step) {
    std::vector<RankInput> inputs;
    for (int r = 0; r < kRanks; ++r) inputs.push_back(RandomInput(rng, 1 + rng() % 12));
    const auto results = RunStep(w, inputs, step, 1);
    check_outputs(inputs, results, step);
    for (int r = 0; r < kRanks; ++r) EXPECT_EQ(results[r]->record.placement_version, 17);  // shadow never answers
  }
  for (int r = 0; r < kRanks; ++r) {
    const auto c = w.exec[r]->Counters();
    EXPECT_EQ(c.at(17).steps, 6) << "rank " << r;
    EXPECT_EQ(c.at(18).shadow_samples, 3) << "rank " << r;  // steps 2, 4, 6
    EXPECT_EQ(c.at(18).shadow_mismatches, 0) << "rank " << r;
    EXPECT_EQ(c.at(18).shadow_failures, 0) << "rank " << r;
    EXPECT_EQ(w.registry[r].Refcount(PlacementVersion(18)), 0);
  }

  // Canary every third step: steps 9 and 12 are answered by placement-v18.
  for (int r = 0; r < kRanks; ++r) w.exec[r]->SetTrial(18, 0, 3);
  for (uint64_t step = 7; step <= 12; ++step) {
    std::vector<RankInput> inputs;
    for (int r = 0; r < kRanks; ++r) inputs.push_back(RandomInput(rng, 1 + rng() % 12));
    const auto results = RunStep(w, inputs, step, 1);
    check_outputs(inputs, results, step);
    for (int r = 0; r < kRanks; ++r) {
      EXPECT_EQ(results[r]->record.placement_version, step % 3 == 0 ? 18 : 17) << "step " << step;
      EXPECT_EQ(results[r]->record.canary, step % 3 == 0);
    }
  }
  for (int r = 0; r < kRanks; ++r) {
    const auto c = w.exec[r]->Counters();
    EXPECT_EQ(c.at(18).canary_steps, 2);
    EXPECT_EQ(c.at(18).steps, 2);
    EXPECT_EQ(c.at(17).steps, 10);
  }

  // One rank without the shadow setting: no shadow pass is agreed, every step still served.
  for (int r = 0; r < kRanks; ++r) w.exec[r]->SetTrial(r == 3 ? -1 : 18, 1, 0);
  std::vector<RankInput> inputs;
  for (int r = 0; r < kRanks; ++r) inputs.push_back(RandomInput(rng, 4));
  const auto results = RunStep(w, inputs, 14, 1);
  check_outputs(inputs, results, 14);
  EXPECT_EQ(w.exec[0]->Counters().at(18).shadow_samples, 3);
}

// A canary step while the controller is still telling the ranks (rank 3 has no canary setting
// yet): the ranks propose different generations and abort before payload, which is the rollout's
// switch, not a fault of the candidate: counted as aborted, never as a failed step (FaultsOK).
TEST(LayerExecutorTrialTest, ACanaryStepAbortedDuringTheSwitchIsNoCandidateFailure) {
  Rank4 w;
  w.PrepareEverywhere(w.Candidate(18));
  for (int r = 0; r < kRanks; ++r) w.exec[r]->SetTrial(r == 3 ? -1 : 18, 0, 3);
  std::mt19937 rng(11);
  std::vector<RankInput> inputs;
  for (int r = 0; r < kRanks; ++r) inputs.push_back(RandomInput(rng, 3));
  const auto results = RunStep(w, inputs, 9, 1);
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_FALSE(results[r].ok()) << "rank " << r;
    EXPECT_EQ(results[r].status().code(), absl::StatusCode::kAborted) << results[r].status();
    const auto c = w.exec[r]->Counters();
    const int64_t v = r == 3 ? 17 : 18;
    EXPECT_EQ(c.at(v).aborted_steps, 1) << "rank " << r;
    EXPECT_EQ(c.at(v).failed_steps, 0) << "rank " << r;
  }
}

TEST(LayerExecutorTrialTest, ShadowCatchesACandidateThatComputesSomethingElse) {
  Rank4 w;
  w.PrepareEverywhere(w.Candidate(19), /*corrupt_rank=*/1);
  for (int r = 0; r < kRanks; ++r) w.exec[r]->SetTrial(19, 1, 0);
  std::mt19937 rng(9);
  for (uint64_t step = 1; step <= 3; ++step) {
    std::vector<RankInput> inputs;
    for (int r = 0; r < kRanks; ++r) inputs.push_back(RandomInput(rng, 8));
    const auto results = RunStep(w, inputs, step, 1);
    for (int r = 0; r < kRanks; ++r) ASSERT_TRUE(results[r].ok()) << results[r].status();
  }
  int64_t mismatches = 0;
  for (int r = 0; r < kRanks; ++r) {
    const auto c = w.exec[r]->Counters();
    EXPECT_EQ(c.at(19).shadow_samples, 3);
    mismatches += c.at(19).shadow_mismatches;
  }
  // Every rank whose tokens reached one of rank 1's candidate slots sees its rows differ.
  EXPECT_GT(mismatches, 0);
}

}  // namespace
}  // namespace moe
