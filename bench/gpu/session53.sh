#!/usr/bin/env bash
# session 53 (temporary, not committed): on an H200, E128 T=1 beside vLLM; on an H100, how long
# the idle gap must be for the one-token step to run faster, with the memory clock sampled.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/dist/gpu/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.mem,power.limit --format=csv
B=dist/gpu/bin/expert_layer_bench
if nvidia-smi -L | grep -q H200; then
  OUT=$OUT/vllm REPS=15 ROUNDS=2 BENCH_ARGS="--padded-decode --shape E128-k8-d2048-f768 --tokens 1" \
    VLLM_ARGS="--shape E128-k8-d2048-f768 --tokens 1" CELL_GAP_MS=500 bash bench/gpu/vllm_compare.sh 2>&1 | tail -8
else
  echo 'an H100: nothing to run (the gap sweep ran already)'
fi
echo "== all done s=${SECONDS}"
