// The kernels and transport of a one-member group, for the benches that time a rank's layer
// step in-process: the CPU kernels over the loopback transport or, with MOE_BENCH_KERNELS=cuda in
// a GPU build (the including target defines MOE_BENCH_CUDA), the CUDA kernels over a one-member
// NCCL transport (rows in device memory need a transport that moves them); and the rank's layer
// executor over them, serving a synthetic checkpoint as placement-v1.
#ifndef MOE_BENCH_ONE_MEMBER_H_
#define MOE_BENCH_ONE_MEMBER_H_

#include <stdlib.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

#include "kernels/api.h"
#include "runtime/checkpoint/synthetic.h"
#include "runtime/exec/layer_executor.h"
#include "runtime/placement/default_placement.h"
#include "runtime/status.h"
#include "runtime/transport/transport.h"
#ifdef MOE_BENCH_CUDA
#include "runtime/transport/nccl.h"
#endif

namespace moe::bench {

struct OneMemberBackend {
  bool cuda = false;  // MOE_BENCH_KERNELS=cuda
  std::unique_ptr<kernels::ExpertKernels> kernels;
  LoopbackFabric fabric{1};
  std::unique_ptr<Transport> transport;
};

// FAILED_PRECONDITION when MOE_BENCH_KERNELS=cuda names a backend this build or machine lacks.
inline absl::Status MakeOneMemberBackend(OneMemberBackend* b) {
  const char* which = std::getenv("MOE_BENCH_KERNELS");
  b->cuda = which != nullptr && std::string(which) == "cuda";
  if (!b->cuda) {
    b->kernels = kernels::CreateCpuKernels();
    b->transport = b->fabric.Endpoint(0);
    return absl::OkStatus();
  }
#ifdef MOE_BENCH_CUDA
  // The kernels' switches (kernels/api.h CudaTuning), e.g. MOE_CUDA_TUNING=blocking_sync=1.
  if (const char* spec = std::getenv("MOE_CUDA_TUNING"); spec != nullptr) {
    auto tuning = kernels::ParseCudaTuning(spec);
    if (!tuning.ok()) return tuning.status();
    kernels::SetCudaTuning(*tuning);
  }
  auto made = kernels::CreateCudaKernels();
  if (!made.ok())
    return absl::FailedPreconditionError(absl::StrCat("MOE_BENCH_KERNELS=cuda: ", made.status().message()));
  b->kernels = std::move(*made);
  char dir[] = "/tmp/moe_bench_ncclXXXXXX";
  if (mkdtemp(dir) == nullptr) return absl::FailedPreconditionError("nccl: cannot make a rendezvous directory");
  NcclOptions no;
  no.rendezvous_dir = dir;
  // MOE_BENCH_NCCL_WAIT_POLL_US: NcclOptions::wait_poll_us (sleep between polls; for measuring
  // the host's own work with MOE_CUDA_TUNING=blocking_sync=1).
  if (const char* poll = std::getenv("MOE_BENCH_NCCL_WAIT_POLL_US"); poll != nullptr) no.wait_poll_us = std::atoi(poll);
  auto nccl = CreateNcclTransport(no);
  if (!nccl.ok()) return absl::FailedPreconditionError(absl::StrCat("nccl: ", nccl.status().message()));
  b->transport = std::move(*nccl);
  return absl::OkStatus();
#else
  return absl::FailedPreconditionError("MOE_BENCH_KERNELS=cuda: this build has no CUDA backend (--config=gpu)");
#endif
}

// The one member's executor: a synthetic checkpoint of `experts` experts of d x f, placed as
// placement-v1 (no redundant slots) and active, its weights loaded. Members in destruction order:
// the executor goes before the registry it reads.
struct OneMemberRank {
  SafetensorsFile ckpt;
  GenerationRegistry registry;
  std::unique_ptr<LayerExecutor> executor;
};

inline absl::Status MakeOneMemberRank(OneMemberBackend& backend, int experts, int d, int f, DecodeRunner runner,
                                      OneMemberRank* r, bool device_plan = false,
                                      ExpertDtype dtype = ExpertDtype::kBf16) {
  r->ckpt = SyntheticCheckpoint({experts, d, f}, 1, "checkpoint-0001");
  const Topology topology = TwoNodeTopology(1);
  const ProcessGroup group = LocalClusterGroup(1, 1);
  ASSIGN_OR_RETURN(auto manifest, DefaultPlacement(PlacementVersion(1), experts, 0, topology, group, r->ckpt.metadata));
  RETURN_IF_ERROR(r->registry.Prepare(manifest));
  RETURN_IF_ERROR(r->registry.Activate(PlacementVersion(1)));
  LayerExecutorOptions eo;
  eo.rank = Rank(0);
  eo.topology = topology;
  eo.group = group;
  eo.registry = &r->registry;
  eo.transport = backend.transport.get();
  eo.kernels = backend.kernels.get();
  eo.decode_runner = runner;
  eo.device_plan = device_plan;
  eo.expert_dtype = dtype;
  ASSIGN_OR_RETURN(r->executor, LayerExecutor::Create(std::move(eo)));
  ASSIGN_OR_RETURN(LocalExperts weights, LoadLocalExperts(r->ckpt, *manifest, Rank(0)));
  return r->executor->AddGeneration(PlacementVersion(1), std::make_shared<LocalExperts>(std::move(weights)));
}

}  // namespace moe::bench

#endif  // MOE_BENCH_ONE_MEMBER_H_
