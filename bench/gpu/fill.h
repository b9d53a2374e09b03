#ifndef MOE_BENCH_GPU_FILL_H_
#define MOE_BENCH_GPU_FILL_H_
#include <cuda_runtime.h>

#include <cstdint>

namespace moe::bench {
cudaError_t FillRandomBf16(void* p, int64_t n, uint64_t seed, float scale, cudaStream_t stream);
// Leaves the L2 holding nothing of earlier work (reads a buffer four times its size).
cudaError_t ScrubL2(cudaStream_t stream);
}  // namespace moe::bench
#endif  // MOE_BENCH_GPU_FILL_H_
