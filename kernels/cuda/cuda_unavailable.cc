// Selected by BUILD when the build has no --config=cuda.
#include "kernels/api.h"

namespace moe::kernels {

absl::StatusOr<std::unique_ptr<ExpertKernels>> CreateCudaKernels() {
  return absl::UnimplementedError("this build has no CUDA kernels (build with --config=cuda)");
}

}  // namespace moe::kernels
