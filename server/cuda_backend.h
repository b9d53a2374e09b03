// The CUDA backend of moe-rankd (CUDA kernels + the NCCL transport), loaded with dlopen from
// libmoe_cuda.so when --kernels=cuda or --transport=nccl asks for it.
//
// Why a plugin: cuBLASLt, cuBLAS, NCCL and cudart carry ~125 KB of static thread-local storage.
// Linked into the executable, that TLS is reserved in every thread's stack, and civetweb (the
// Prometheus exposer's server) starts its threads with a fixed 100 KB stack, which then cannot
// hold it: the exposer fails with "Cannot create threads". Libraries loaded with dlopen get their
// TLS allocated on demand instead, so the daemon keeps its metrics and the CPU build links no
// CUDA library at all.
#ifndef MOE_SERVER_CUDA_BACKEND_H_
#define MOE_SERVER_CUDA_BACKEND_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"

#include "kernels/api.h"
#include "runtime/exec/decode_graph.h"
#include "runtime/transport/transport.h"

namespace moe {

struct NcclBackendOptions {
  int slot = 0;
  int size = 1;
  int device = 0;
  std::string unique_id;       // NcclOptions::unique_id (empty: through rendezvous_dir)
  std::string rendezvous_dir;  // member 0 publishes the NCCL unique id here
  int connect_timeout_ms = 60000;
  bool host_agreement = true;  // NcclOptions::host_agreement
  int wait_poll_us = 0;        // NcclOptions::wait_poll_us
};

// The plugin file CudaBackend::Load opens for `path`: libmoe_cuda.so next to this executable
// when `path` is empty.
std::string CudaBackendFile(const std::string& path);

// The plugin interface's version, compiled into both sides: bump it whenever a type that
// crosses the dlopen boundary changes (kernels::ExpertKernels' virtual methods, CudaTuning,
// NcclBackendOptions, Transport, DecodeStepGraph), so that a daemon refuses a libmoe_cuda.so
// built from other sources instead of calling through a stale vtable. The two structs' sizes are
// compared as well.
inline constexpr int kCudaPluginAbi = 10;

class CudaBackend {
 public:
  // Loads the plugin (`path`; empty: libmoe_cuda.so next to this executable) and hands it the
  // kernels' switches (the plugin holds its own copy of the kernels library). The library stays
  // loaded for the life of the process.
  static absl::StatusOr<CudaBackend> Load(const std::string& path, const kernels::CudaTuning& tuning = {});

  // Makes `device` current and creates the CUDA kernels on it (every call binds it again).
  absl::StatusOr<std::unique_ptr<kernels::ExpertKernels>> CreateKernels(int device) const;
  absl::StatusOr<std::unique_ptr<Transport>> CreateNccl(const NcclBackendOptions& options) const;
  // A new NCCL unique id (NewNcclUniqueId) for a group this rank is the first member of.
  absl::StatusOr<std::string> NcclUniqueId() const;
  // Decode graphs over a transport from CreateNccl (which must outlive them).
  DecodeGraphFactory DecodeGraphs(Transport* nccl) const;

  using KernelsFactory = kernels::ExpertKernels* (*)(int device, std::string* error);
  using NcclFactory = Transport* (*)(const NcclBackendOptions* options, std::string* error);
  using GraphsFactory = void (*)(Transport* nccl, DecodeGraphFactory* out);
  using TuningSetter = void (*)(const kernels::CudaTuning* tuning);
  using UniqueIdMaker = bool (*)(std::string* id, std::string* error);
  using AbiReporter = int (*)(int* tuning_bytes, int* nccl_options_bytes);

 private:
  KernelsFactory kernels_ = nullptr;
  NcclFactory nccl_ = nullptr;
  GraphsFactory graphs_ = nullptr;
  UniqueIdMaker unique_id_ = nullptr;
};

}  // namespace moe

// The plugin's entry points (C linkage so dlsym finds them by name). On failure they return
// null and describe the error in `*error`.
extern "C" {
moe::kernels::ExpertKernels* moe_cuda_create_kernels(int device, std::string* error);
moe::Transport* moe_cuda_create_nccl(const moe::NcclBackendOptions* options, std::string* error);
void moe_cuda_decode_graphs(moe::Transport* nccl, moe::DecodeGraphFactory* out);
void moe_cuda_set_tuning(const moe::kernels::CudaTuning* tuning);
bool moe_cuda_nccl_unique_id(std::string* id, std::string* error);
// kCudaPluginAbi as the plugin was built, with sizeof(CudaTuning) and sizeof(NcclBackendOptions).
int moe_cuda_abi(int* tuning_bytes, int* nccl_options_bytes);
}

#endif  // MOE_SERVER_CUDA_BACKEND_H_
