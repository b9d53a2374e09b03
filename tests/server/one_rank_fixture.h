// One rank with a synthetic checkpoint, placement-v1 active, a loopback transport and the CPU
// kernels: the executor the service tests put behind a real gRPC socket (and the executor
// tests run as a process group of one).
#ifndef MOE_TESTS_SERVER_ONE_RANK_FIXTURE_H_
#define MOE_TESTS_SERVER_ONE_RANK_FIXTURE_H_

#include <functional>
#include <memory>

#include "gtest/gtest.h"

#include "kernels/api.h"
#include "runtime/checkpoint/checkpoint_reader.h"
#include "runtime/checkpoint/synthetic.h"
#include "runtime/exec/layer_executor.h"
#include "runtime/placement/default_placement.h"

namespace moe::testing {

// A transport that counts the exchanges (AllToAllV) made through the one it wraps. Interrupt is
// not forwarded: for tests that do not re-form the group. `device_memory`: it says it moves
// device memory too (for kernels that only pretend to keep rows there, in host memory).
class CountingTransport final : public Transport {
 public:
  explicit CountingTransport(std::unique_ptr<Transport> inner, bool device_memory = false)
      : inner_(std::move(inner)), device_memory_(device_memory) {}
  const char* name() const override { return inner_->name(); }
  int slot() const override { return inner_->slot(); }
  int size() const override { return inner_->size(); }
  bool accepts_device_memory() const override { return device_memory_ || inner_->accepts_device_memory(); }
  absl::Status AllGather(uint64_t seq, const void* in, int64_t bytes, void* out, absl::Duration timeout) override {
    return inner_->AllGather(seq, in, bytes, out, timeout);
  }
  absl::Status StepGather(uint64_t step, const void* in, int64_t bytes, void* out, absl::Duration timeout) override {
    return inner_->StepGather(step, in, bytes, out, timeout);
  }
  void AbandonStep(uint64_t step) override { inner_->AbandonStep(step); }
  absl::Status AllToAllV(uint64_t seq, const void* send, absl::Span<const int64_t> send_bytes, void* recv,
                         absl::Span<const int64_t> recv_bytes, absl::Duration timeout) override {
    ++exchanges_;
    return inner_->AllToAllV(seq, send, send_bytes, recv, recv_bytes, timeout);
  }
  bool failed() const override { return inner_->failed(); }
  int exchanges() const { return exchanges_; }

 private:
  std::unique_ptr<Transport> inner_;
  bool device_memory_;
  int exchanges_ = 0;
};

class OneRankTest : public ::testing::Test {
 protected:
  // `redundant` extra slots replicate experts (all on this rank).
  // `runner`: the decode steps' expert runner (LayerExecutorOptions::decode_runner);
  // `device_plan`: LayerExecutorOptions::device_plan.
  void SetUpRank(int experts, int d, int d_ff, uint64_t seed, int redundant = 0,
                 DecodeRunner runner = DecodeRunner::kKernels, bool device_plan = false,
                 ExpertDtype dtype = ExpertDtype::kBf16) {
    experts_ = experts;
    ckpt_ = SyntheticCheckpoint({experts, d, d_ff}, seed, "checkpoint-0001");
    reader_ = *SingleFileReader(ckpt_);
    v1_ = *DefaultPlacement(PlacementVersion(1), experts, redundant, topology_, group_, ckpt_.metadata);
    ASSERT_TRUE(registry_.Prepare(v1_).ok());
    ASSERT_TRUE(registry_.Activate(PlacementVersion(1)).ok());
    transport_ = fabric_.Endpoint(0);
    if (count_exchanges_ || make_kernels_) {
      auto counting = std::make_unique<CountingTransport>(std::move(transport_), make_kernels_ != nullptr);
      counting_ = counting.get();
      transport_ = std::move(counting);
    }
    kernels_ = make_kernels_ ? make_kernels_() : kernels::CreateCpuKernels();
    LayerExecutorOptions eo;
    eo.rank = Rank(0);
    eo.topology = topology_;
    eo.group = group_;
    eo.registry = &registry_;
    eo.transport = transport_.get();
    eo.kernels = kernels_.get();
    eo.decode_runner = runner;
    eo.device_plan = device_plan;
    eo.lone_decode_on_kernels = lone_decode_on_kernels_;
    eo.expert_dtype = dtype;
    if (timeout_ > absl::ZeroDuration()) eo.timeout = timeout_;
    executor_ = *LayerExecutor::Create(std::move(eo));
    ASSERT_TRUE(executor_
                    ->AddGeneration(PlacementVersion(1),
                                    std::make_shared<LocalExperts>(*LoadLocalExperts(ckpt_, *v1_, Rank(0))))
                    .ok());
  }

  // After SetUpRank: another generation of the checkpoint's experts with `redundant` extra slots,
  // PREPARED in the registry and its weights added to the executor.
  void PrepareGeneration(int64_t version, int redundant) {
    auto m = *DefaultPlacement(PlacementVersion(version), experts_, redundant, topology_, group_, ckpt_.metadata);
    ASSERT_TRUE(registry_.Prepare(m).ok());
    ASSERT_TRUE(executor_
                    ->AddGeneration(PlacementVersion(version),
                                    std::make_shared<LocalExperts>(*LoadLocalExperts(ckpt_, *m, Rank(0))))
                    .ok());
  }

  bool lone_decode_on_kernels_ = true;  // set before SetUpRank: LayerExecutorOptions::lone_decode_on_kernels
  // Set before SetUpRank: the kernels (the CPU reference when empty) and the collective timeout
  // (the executor's default when zero).
  std::function<std::unique_ptr<kernels::ExpertKernels>()> make_kernels_;
  absl::Duration timeout_ = absl::ZeroDuration();
  // Set before SetUpRank: the transport is a CountingTransport (always with make_kernels_, which
  // then says it moves device memory: kernels of a test's own keep their rows in host memory).
  bool count_exchanges_ = false;
  CountingTransport* counting_ = nullptr;  // then this one (owned by transport_)
  int experts_ = 0;                        // SetUpRank's
  SafetensorsFile ckpt_;
  std::unique_ptr<CheckpointReader> reader_;  // over ckpt_
  Topology topology_ = TwoNodeTopology(1);
  ProcessGroup group_ = LocalClusterGroup(1, 1);
  std::shared_ptr<const PlacementManifest> v1_;
  GenerationRegistry registry_;
  LoopbackFabric fabric_{1};
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<kernels::ExpertKernels> kernels_;
  std::unique_ptr<LayerExecutor> executor_;
};

}  // namespace moe::testing

#endif  // MOE_TESTS_SERVER_ONE_RANK_FIXTURE_H_
