#!/usr/bin/env bash
# Client-observed layer-step latency on one GPU, side by side in one call (bench/RESULTS.md):
#  - the floor: the layer's kernels alone in-process (expert_layer_bench, CUDA-graph replay for
#    T <= 128) at E128 k8 d2048 f768 for each T;
#  - the same layer through one moe-rankd service in-process (api_overhead_bench with the CUDA
#    kernels over one-member NCCL): gRPC unary, stream, shared-memory regions and a step ring,
#    with the ring's threads spinning 50 us (the default) and 5000 us before they sleep.
# Run from the repository root on the GPU machine with the bundle (tools/gpu_bundle.sh):
#   LD_LIBRARY_PATH=$PWD/dist/gpu/lib:/usr/local/cuda/lib64 bench/gpu/step_latency.sh [TOKENS]
set -uo pipefail
B="${B:-dist/gpu/bin}"
TOKENS="${1:-1,8,2048}"
echo "== floor: expert_layer_bench, E128-k8-d2048-f768"
for t in ${TOKENS//,/ }; do
  "$B/expert_layer_bench" --shape E128-k8-d2048-f768 --tokens "$t" 2>&1
done
for spin in 50 5000; do
  echo "== api_overhead_bench, ring spin ${spin} us"
  MOE_BENCH_KERNELS=cuda MOE_BENCH_EXPERTS=128 MOE_BENCH_DFF=768 MOE_BENCH_TOKENS="$TOKENS" \
    MOE_BENCH_RING_SPIN_US="$spin" "$B/api_overhead_bench"
done
