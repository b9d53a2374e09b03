#!/usr/bin/env bash
# session 54 (temporary, not committed): on an H200, the whole issue-19 table beside vLLM with
# main's kernels (the one-token down preload has not run on an H200); on an H100, nothing.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/dist/gpu/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.limit --format=csv
if nvidia-smi -L | grep -q H200; then
  OUT=$OUT/vllm REPS=15 ROUNDS=2 BENCH_ARGS=--padded-decode CELL_GAP_MS=500 timeout 560 bash bench/gpu/vllm_compare.sh 2>&1 | tail -30
  cat $OUT/vllm/vllm_compare.md 2>/dev/null | head -40
else
  echo 'an H100: nothing to run'
fi
echo "== all done s=${SECONDS}"
