// The kernels and transport of a one-member group, for the benches that time a rank's layer
// step in-process: the CPU kernels over the loopback transport or, with MOE_BENCH_KERNELS=cuda in
// a GPU build (the including target defines MOE_BENCH_CUDA), the CUDA kernels over a one-member
// NCCL transport (rows in device memory need a transport that moves them).
#ifndef MOE_BENCH_ONE_MEMBER_H_
#define MOE_BENCH_ONE_MEMBER_H_

#include <stdlib.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

#include "kernels/api.h"
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
  auto made = kernels::CreateCudaKernels();
  if (!made.ok())
    return absl::FailedPreconditionError(absl::StrCat("MOE_BENCH_KERNELS=cuda: ", made.status().message()));
  b->kernels = std::move(*made);
  char dir[] = "/tmp/moe_bench_ncclXXXXXX";
  if (mkdtemp(dir) == nullptr) return absl::FailedPreconditionError("nccl: cannot make a rendezvous directory");
  NcclOptions no;
  no.rendezvous_dir = dir;
  auto nccl = CreateNcclTransport(no);
  if (!nccl.ok()) return absl::FailedPreconditionError(absl::StrCat("nccl: ", nccl.status().message()));
  b->transport = std::move(*nccl);
  return absl::OkStatus();
#else
  return absl::FailedPreconditionError("MOE_BENCH_KERNELS=cuda: this build has no CUDA backend (--config=gpu)");
#endif
}

}  // namespace moe::bench

#endif  // MOE_BENCH_ONE_MEMBER_H_
