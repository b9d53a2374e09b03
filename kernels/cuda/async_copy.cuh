// Shared-memory barriers (mbarrier) and the TMA unit's bulk copies into shared memory (sm_90),
// shared by the Hopper grouped GEMMs (grouped_sm90.cu) and the decode family's down kernel
// that loads its weights while the gate/up kernel runs (small_batch.cu).
//
// A copy is counted in its barrier's transaction bytes: one thread announces the bytes it
// expects (MbarExpectTx, which is also that thread's arrival), the copies complete them, and
// the barrier's phase flips once both the arrivals and the bytes are in (MbarWait).
#ifndef MOE_KERNELS_CUDA_ASYNC_COPY_CUH_
#define MOE_KERNELS_CUDA_ASYNC_COPY_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace moe::kernels::cuda {

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void MbarInit(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SmemAddr(bar)), "r"(count) : "memory");
}

// Makes barriers initialized by this thread visible to the async proxy (the TMA unit) and the
// cluster; the block's threads still need a barrier (__syncthreads) before using them.
__device__ __forceinline__ void MbarInitFence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

__device__ __forceinline__ void MbarWait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(SmemAddr(bar)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void MbarArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(SmemAddr(bar)) : "memory");
}

__device__ __forceinline__ void MbarExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SmemAddr(bar)), "r"(bytes) : "memory");
}

// `bytes` (a multiple of 16) from global to shared memory, both 16-byte aligned, by the TMA
// unit's bulk copy, counted in `bar`'s transaction bytes.
__device__ __forceinline__ void BulkLoad(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(SmemAddr(dst)),
      "l"(src), "r"(bytes), "r"(SmemAddr(bar))
      : "memory");
}

}  // namespace moe::kernels::cuda

#endif  // MOE_KERNELS_CUDA_ASYNC_COPY_CUH_
