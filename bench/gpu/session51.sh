#!/usr/bin/env bash
# session 51: the kept down-preload variant (temporary, not committed)
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/dist/gpu/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
P=dist/gpu/prev/expert_layer_bench; B=dist/gpu/bin/expert_layer_bench
ab() {  # ab NAME SHAPE T REPS ROUNDS
  echo "== A/B $1 $2 T$3 $(date +%T) s=${SECONDS}"
  OUT=$OUT/ab_$1 BENCHES="$P $B" ROUNDS=$5 ARGS="--reps $4 --shape $2 --tokens $3 --decode-only" bench/gpu/kernel_ab.sh 2>&1 | tail -5
}
timeout 240 dist/gpu/bin/cuda_kernels_test 2>&1 | grep -E "^\[  (FAILED|PASSED) |FAILED|Failure|error" | head -30; echo "tests rc=${PIPESTATUS[0]} s=${SECONDS}"
$CS --tool memcheck --error-exitcode 3 dist/gpu/bin/cuda_kernels_test --gtest_filter='*DownPreload*:*LocalLayerFused*' 2>&1 | tail -2; echo "memcheck rc=${PIPESTATUS[0]} s=${SECONDS}"
$CS --tool racecheck --racecheck-report all --error-exitcode 3 dist/gpu/bin/cuda_kernels_test --gtest_filter='*DownPreload*' 2>&1 | tail -2; echo "racecheck rc=${PIPESTATUS[0]} s=${SECONDS}"
ab t1 E128-k8-d2048-f768 1 20 4
ab t16 E128-k8-d2048-f768 16 10 2
ab e8t1 E8-k2-d4096-f14336 1 10 2
echo "== gap question $(date +%T) s=${SECONDS}"
for g in 0 500 0 500; do $B --reps 20 --shape E128-k8-d2048-f768 --tokens 1 --decode-only --cell_gap_ms $g 2>/dev/null | grep '"kind": "cell"' | grep -o '"path": "[^"]*"\|"us": [0-9.]*\|"cold_l2": [0-9]' | tr '\n' ' ' ; echo " gap=$g"; done
if nvidia-smi -L | grep -q H200; then
  OUT=$OUT/vllm REPS=15 ROUNDS=2 BENCH_ARGS=--padded-decode CELL_GAP_MS=500 bash bench/gpu/vllm_compare.sh 2>&1 | tail -16
fi
echo "== all done s=${SECONDS}"
