// Stand-ins for libmoe_cuda.so in cuda_backend_test: a plugin built from other sources, which
// CudaBackend::Load must refuse before it calls anything else of it. FAKE_ABI_DELTA shifts the
// interface version it reports; FAKE_NO_ABI leaves the version entry point out (a plugin from
// before it existed). None of them has the other entry points.
#include "server/cuda_backend.h"

#ifndef FAKE_NO_ABI
extern "C" int moe_cuda_abi(int* tuning_bytes, int* nccl_options_bytes) {
  *tuning_bytes = static_cast<int>(sizeof(moe::kernels::CudaTuning));
  *nccl_options_bytes = static_cast<int>(sizeof(moe::NcclBackendOptions));
  return moe::kCudaPluginAbi + FAKE_ABI_DELTA;
}
#endif
