#include "server/cuda_backend.h"

#include <dlfcn.h>
#include <unistd.h>

#include <climits>

#include "absl/strings/str_cat.h"

namespace moe {
namespace {

std::string NextToExecutableFile(const char* name) {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return name;
  std::string exe(buf, n);
  const size_t slash = exe.rfind('/');
  return slash == std::string::npos ? name : exe.substr(0, slash + 1) + name;
}

}  // namespace

std::string CudaBackendFile(const std::string& path) {
  return path.empty() ? NextToExecutableFile("libmoe_cuda.so") : path;
}

absl::StatusOr<CudaBackend> CudaBackend::Load(const std::string& path, const kernels::CudaTuning& tuning) {
  const std::string file = CudaBackendFile(path);
  void* lib = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda backend ", file, ": ", dlerror(), " (build it with tools/gpu_bundle.sh or --config=gpu)"));
  }
  // A plugin built from other sources would be called through stale vtables and struct layouts.
  const auto abi = reinterpret_cast<AbiReporter>(dlsym(lib, "moe_cuda_abi"));
  int tuning_bytes = 0, nccl_bytes = 0;
  const int version = abi != nullptr ? abi(&tuning_bytes, &nccl_bytes) : 0;
  if (version != kCudaPluginAbi || tuning_bytes != static_cast<int>(sizeof(kernels::CudaTuning)) ||
      nccl_bytes != static_cast<int>(sizeof(NcclBackendOptions))) {
    dlclose(lib);
    return absl::FailedPreconditionError(absl::StrCat(
        "cuda backend ", file, ": plugin interface ", version, " (", tuning_bytes, "/", nccl_bytes,
        " bytes), this daemon's is ", kCudaPluginAbi, " (", sizeof(kernels::CudaTuning), "/",
        sizeof(NcclBackendOptions), "): use the libmoe_cuda.so built with this moe-rankd (tools/gpu_bundle.sh)"));
  }
  CudaBackend b;
  b.kernels_ = reinterpret_cast<KernelsFactory>(dlsym(lib, "moe_cuda_create_kernels"));
  b.nccl_ = reinterpret_cast<NcclFactory>(dlsym(lib, "moe_cuda_create_nccl"));
  b.graphs_ = reinterpret_cast<GraphsFactory>(dlsym(lib, "moe_cuda_decode_graphs"));
  b.unique_id_ = reinterpret_cast<UniqueIdMaker>(dlsym(lib, "moe_cuda_nccl_unique_id"));
  const auto set_tuning = reinterpret_cast<TuningSetter>(dlsym(lib, "moe_cuda_set_tuning"));
  if (b.kernels_ == nullptr || b.nccl_ == nullptr || b.graphs_ == nullptr || b.unique_id_ == nullptr ||
      set_tuning == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("cuda backend ", file, ": entry points missing"));
  }
  set_tuning(&tuning);
  return b;
}

absl::StatusOr<std::unique_ptr<kernels::ExpertKernels>> CudaBackend::CreateKernels(int device) const {
  std::string error;
  std::unique_ptr<kernels::ExpertKernels> k(kernels_(device, &error));
  if (k == nullptr) return absl::UnavailableError(absl::StrCat("cuda kernels on device ", device, ": ", error));
  return k;
}

absl::StatusOr<std::unique_ptr<Transport>> CudaBackend::CreateNccl(const NcclBackendOptions& options) const {
  std::string error;
  std::unique_ptr<Transport> t(nccl_(&options, &error));
  if (t == nullptr) return absl::UnavailableError(absl::StrCat("nccl: ", error));
  return t;
}

absl::StatusOr<std::string> CudaBackend::NcclUniqueId() const {
  std::string id, error;
  if (!unique_id_(&id, &error)) return absl::UnavailableError(absl::StrCat("nccl unique id: ", error));
  return id;
}

DecodeGraphFactory CudaBackend::DecodeGraphs(Transport* nccl) const {
  DecodeGraphFactory f;
  graphs_(nccl, &f);
  return f;
}

}  // namespace moe
