// libmoe_cuda.so: the CUDA kernels and the NCCL transport behind server/cuda_backend.h's entry
// points.
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"

#include "runtime/exec/cuda_decode_graph.h"
#include "runtime/transport/nccl.h"
#include "server/cuda_backend.h"

extern "C" {

int moe_cuda_abi(int* tuning_bytes, int* nccl_options_bytes) {
  *tuning_bytes = static_cast<int>(sizeof(moe::kernels::CudaTuning));
  *nccl_options_bytes = static_cast<int>(sizeof(moe::NcclBackendOptions));
  return moe::kCudaPluginAbi;
}

void moe_cuda_set_tuning(const moe::kernels::CudaTuning* tuning) { moe::kernels::SetCudaTuning(*tuning); }

moe::kernels::ExpertKernels* moe_cuda_create_kernels(int device, std::string* error) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    *error = "no CUDA device";
    return nullptr;
  }
  if (device < 0 || device >= count) {
    *error = absl::StrCat("device ", device, " does not exist (", count, " visible)");
    return nullptr;
  }
  if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
    *error = absl::StrCat("cudaSetDevice(", device, "): ", cudaGetErrorString(e));
    return nullptr;
  }
  auto k = moe::kernels::CreateCudaKernels();
  if (!k.ok()) {
    *error = std::string(k.status().message());
    return nullptr;
  }
  return k->release();
}

moe::Transport* moe_cuda_create_nccl(const moe::NcclBackendOptions* options, std::string* error) {
  moe::NcclOptions o;
  o.slot = options->slot;
  o.size = options->size;
  o.device = options->device;
  o.unique_id = options->unique_id;
  o.rendezvous_dir = options->rendezvous_dir;
  o.connect_timeout = absl::Milliseconds(options->connect_timeout_ms);
  o.host_agreement = options->host_agreement;
  o.wait_poll_us = options->wait_poll_us;
  auto t = moe::CreateNcclTransport(o);
  if (!t.ok()) {
    *error = std::string(t.status().message());
    return nullptr;
  }
  return t->release();
}

bool moe_cuda_nccl_unique_id(std::string* id, std::string* error) {
  auto made = moe::NewNcclUniqueId();
  if (!made.ok()) {
    *error = std::string(made.status().message());
    return false;
  }
  *id = *std::move(made);
  return true;
}

void moe_cuda_decode_graphs(moe::Transport* nccl, moe::DecodeGraphFactory* out) { *out = moe::CudaDecodeGraphs(nccl); }

}  // extern "C"
