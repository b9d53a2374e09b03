// Programmatic dependent launch (Hopper): a kernel launched with the programmatic-serialization
// attribute may start while the kernel before it on the stream is still running; it reads
// nothing the earlier work produced until WaitForPredecessor() returns (which waits for the
// predecessor's completion and the visibility of its writes). Its blocks then take the SM slots
// the predecessor's last blocks leave, so launch latency and the predecessor's tail overlap.
//
// The protocol every kernel of the decode chain follows:
//   1. WaitForPredecessor() before reading any input produced by earlier stream work (a no-op
//      when the kernel was launched without the attribute);
//   2. ReleaseDependents() only after that wait, so a dependent that reads this kernel's own
//      inputs (never its outputs) before its wait finds them complete;
//   3. a kernel may read before its wait only inputs of the launch sequence it belongs to that
//      the previous kernel of the sequence also only reads (e.g. the down projection's weights
//      and offsets while the gate/up kernel runs).
// CudaTuning::pdl = false (kernels/api.h; "pdl=0") turns the attribute off, for side-by-side
// measurements: CreateCudaKernels hands it to SetLaunchSwitches (launch.h).
#ifndef MOE_KERNELS_CUDA_PDL_CUH_
#define MOE_KERNELS_CUDA_PDL_CUH_

#include <cuda_runtime.h>

#include <utility>

namespace moe::kernels::cuda {

__device__ __forceinline__ void WaitForPredecessor() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void ReleaseDependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// Whether launches carry the attribute (SetLaunchSwitches, device_kernels.cu).
bool PdlEnabled();

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic serialization on the
// previous work of `stream` when PDL is enabled.
template <typename... Params, typename... Args>
cudaError_t LaunchDependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                            Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = PdlEnabled() ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace moe::kernels::cuda

#endif  // MOE_KERNELS_CUDA_PDL_CUH_
