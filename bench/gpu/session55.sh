#!/usr/bin/env bash
# session 55 (temporary, not committed): count conservation etc. on the NCCL path, then on an
# H200 the issue-19 table in what time is left.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/dist/gpu/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.limit --format=csv
timeout 200 dist/gpu/bin/nccl_executor_test 2>&1 | grep -E "^\[ *(RUN|OK|FAILED|PASSED|SKIPPED) |Failure|error|Expected|Which is|Actual" | head -80
echo "nccl_executor_test rc=${PIPESTATUS[0]} s=${SECONDS}"
timeout 100 dist/gpu/bin/cuda_kernels_test 2>&1 | tail -3
echo "cuda_kernels_test s=${SECONDS}"
if nvidia-smi -L | grep -q H200; then
  left=$((585 - SECONDS))
  OUT=$OUT/vllm REPS=15 ROUNDS=2 BENCH_ARGS=--padded-decode CELL_GAP_MS=500 timeout $left bash bench/gpu/vllm_compare.sh 2>&1 | tail -30
  cat $OUT/vllm/vllm_compare.md 2>/dev/null | head -40
fi
echo "== all done s=${SECONDS}"
