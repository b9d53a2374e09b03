// Where NCCL and CUDA runtime codes become absl::Status for the runtime code that calls them
// directly (the NCCL transport, the CUDA decode graph), through moe::ForeignError: the code's
// name, its message, the failing expression and file:line. The kernels have their own for CUDA
// and cuBLAS (kernels/cuda/checks.h, same format: kernels/ sees nothing of runtime/).
#ifndef MOE_RUNTIME_TRANSPORT_GPU_CHECKS_H_
#define MOE_RUNTIME_TRANSPORT_GPU_CHECKS_H_

#include <cuda_runtime.h>
#include <nccl.h>

#include "absl/strings/str_cat.h"

#include "runtime/status.h"

namespace moe {

inline absl::Status NcclError(ncclResult_t r, const char* expr, const char* file, int line) {
  return ForeignError(absl::StatusCode::kUnavailable, "NCCL", absl::StrCat("ncclResult ", static_cast<int>(r)),
                      ncclGetErrorString(r), expr, file, line);
}

inline absl::Status CudaRuntimeError(cudaError_t e, const char* expr, const char* file, int line) {
  const absl::StatusCode code =
      e == cudaErrorMemoryAllocation ? absl::StatusCode::kResourceExhausted : absl::StatusCode::kInternal;
  return ForeignError(code, "CUDA", cudaGetErrorName(e), cudaGetErrorString(e), expr, file, line);
}

}  // namespace moe

// ncclInProgress is not a failure: a nonblocking communicator's call was queued.
#define NCCL_RETURN_IF_ERROR(expr)                                   \
  do {                                                               \
    const ncclResult_t moe_nccl_ = (expr);                           \
    if (moe_nccl_ != ncclSuccess && moe_nccl_ != ncclInProgress) {   \
      return ::moe::NcclError(moe_nccl_, #expr, __FILE__, __LINE__); \
    }                                                                \
  } while (0)

#define CUDART_RETURN_IF_ERROR(expr)                                                                        \
  do {                                                                                                      \
    const cudaError_t moe_cudart_ = (expr);                                                                 \
    if (moe_cudart_ != cudaSuccess) return ::moe::CudaRuntimeError(moe_cudart_, #expr, __FILE__, __LINE__); \
  } while (0)

#endif  // MOE_RUNTIME_TRANSPORT_GPU_CHECKS_H_
