// The one place where CUDA and cuBLAS error codes become absl::Status: the code's name, its
// message, the failing expression and file:line (the pattern of NCCL's checks.h).
#ifndef MOE_KERNELS_CUDA_CHECKS_H_
#define MOE_KERNELS_CUDA_CHECKS_H_

#include <cuda_runtime.h>

#include <cublas_v2.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace moe::kernels {

inline absl::Status CudaError(cudaError_t e, const char* expr, const char* file, int line) {
  const absl::StatusCode code =
      e == cudaErrorMemoryAllocation ? absl::StatusCode::kResourceExhausted : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat("CUDA error ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ") in `",
                                         expr, "` at ", file, ":", line));
}

inline absl::Status CublasError(cublasStatus_t e, const char* expr, const char* file, int line) {
  const absl::StatusCode code =
      e == CUBLAS_STATUS_NOT_SUPPORTED ? absl::StatusCode::kUnimplemented : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat("cuBLAS error ", cublasGetStatusName(e), " (", cublasGetStatusString(e),
                                         ") in `", expr, "` at ", file, ":", line));
}

}  // namespace moe::kernels

#define CUDA_RETURN_IF_ERROR(expr)                                                                                \
  do {                                                                                                            \
    const cudaError_t moe_cuda_err_ = (expr);                                                                     \
    if (moe_cuda_err_ != cudaSuccess) return ::moe::kernels::CudaError(moe_cuda_err_, #expr, __FILE__, __LINE__); \
  } while (0)

#define CUBLAS_RETURN_IF_ERROR(expr)                                                  \
  do {                                                                                \
    const cublasStatus_t moe_cublas_err_ = (expr);                                    \
    if (moe_cublas_err_ != CUBLAS_STATUS_SUCCESS)                                     \
      return ::moe::kernels::CublasError(moe_cublas_err_, #expr, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: launch-configuration errors surface here.
#define CUDA_RETURN_IF_LAUNCH_FAILED() CUDA_RETURN_IF_ERROR(cudaGetLastError())

#endif  // MOE_KERNELS_CUDA_CHECKS_H_
