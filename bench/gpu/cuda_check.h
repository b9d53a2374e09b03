// CHECK_CUDA(x): exits with the file, line, call and CUDA's message when a runtime call fails. For the
// benchmarks without status types to return (expert_layer_bench, and the standalone nvcc probes
// read_pattern.cu and graph_launch.cu).
#ifndef MOE_BENCH_GPU_CUDA_CHECK_H_
#define MOE_BENCH_GPU_CUDA_CHECK_H_

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK_CUDA(x)                                                                         \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

#endif  // MOE_BENCH_GPU_CUDA_CHECK_H_
