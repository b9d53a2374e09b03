#!/usr/bin/env bash
# session 50: preload-down + route-one-block checks and A/B (temporary, not committed)
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/dist/gpu/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv
PART=${1:-1}
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
P=dist/gpu/prev/expert_layer_bench; R=dist/gpu/route/expert_layer_bench; L=dist/gpu/preload/expert_layer_bench; B=dist/gpu/bin/expert_layer_bench
ab() {  # ab NAME "BENCHES" SHAPE T [REPS]
  echo "== A/B $1 $3 T$4 $(date +%T) s=${SECONDS}"
  OUT=$OUT/ab_$1_$3_$4 BENCHES="$2" ROUNDS=${R_:-2} \
    ARGS="--reps ${5:-10} --shape $3 --tokens $4 --decode-only" bench/gpu/kernel_ab.sh 2>&1 | tail -9
}
tun() {  # tun NAME "TUNINGS" SHAPE T [REPS]
  echo "== TUN $1 $3 T$4 $(date +%T) s=${SECONDS}"
  OUT=$OUT/tun_$1_$3_$4 BENCHES=$B TUNINGS="$2" ROUNDS=${R_:-2} \
    ARGS="--reps ${5:-10} --shape $3 --tokens $4 --decode-only" bench/gpu/kernel_ab.sh 2>&1 | tail -9
}
if [ "$PART" = 1 ]; then
  timeout 240 dist/gpu/bin/cuda_kernels_test 2>&1 | grep -E "^\[  (FAILED|PASSED) |FAILED|Failure|error" | head -30; echo "tests rc=${PIPESTATUS[0]} s=${SECONDS}"
  $CS --tool memcheck --error-exitcode 3 dist/gpu/bin/cuda_kernels_test --gtest_filter='*DownPreload*:*LocalLayerFused*:*RouteRows*' 2>&1 | tail -2; echo "memcheck rc=${PIPESTATUS[0]} s=${SECONDS}"
  $CS --tool racecheck --racecheck-report all --error-exitcode 3 dist/gpu/bin/cuda_kernels_test --gtest_filter='*DownPreload*:*RouteRowsGather*' 2>&1 | tail -2; echo "racecheck rc=${PIPESTATUS[0]} s=${SECONDS}"
  ab t1 "$P $L" E128-k8-d2048-f768 1 20
  tun t1 "- down_preload=0 down_preload=2" E128-k8-d2048-f768 1 20
  ab route "$P $R" E128-k8-d2048-f768 1024
  ab route "$P $R" E128-k8-d2048-f768 8192
  ab route "$P $R" E32-k8-d7168-f2048 1024
  echo "== part 1 done s=${SECONDS}"
fi
if [ "$PART" = 3 ]; then
  timeout 240 dist/gpu/bin/cuda_kernels_test 2>&1 | grep -E "^\[  (FAILED|PASSED) |FAILED|Failure|error" | head -30; echo "tests rc=${PIPESTATUS[0]} s=${SECONDS}"
  $CS --tool memcheck --error-exitcode 3 dist/gpu/bin/cuda_kernels_test --gtest_filter='*DownPreload*:*LocalLayerFused*' 2>&1 | tail -2; echo "memcheck rc=${PIPESTATUS[0]} s=${SECONDS}"
  $CS --tool racecheck --racecheck-report all --error-exitcode 3 dist/gpu/bin/cuda_kernels_test --gtest_filter='*DownPreload*' 2>&1 | tail -2; echo "racecheck rc=${PIPESTATUS[0]} s=${SECONDS}"
  $CS --tool synccheck --error-exitcode 3 dist/gpu/bin/cuda_kernels_test --gtest_filter='*DownPreload*:*LocalLayerFused*' 2>&1 | tail -2; echo "synccheck rc=${PIPESTATUS[0]} s=${SECONDS}"
  R_=4 tun t1 "down_preload=0 down_preload=1 down_preload=2 down_preload=3" E128-k8-d2048-f768 1 20
  ab t1 "$P $B" E128-k8-d2048-f768 1 20
  ab e8 "$P $B" E8-k2-d4096-f14336 1 20
  ab e128t16 "$P $B" E128-k8-d2048-f768 16 20
  echo "== part 3 done s=${SECONDS}"
  [ "${VLLM:-0}" = 1 ] && nvidia-smi -L | grep -q H200 && OUT=$OUT/vllm REPS=15 ROUNDS=2 BENCH_ARGS=--padded-decode CELL_GAP_MS=500 bash bench/gpu/vllm_compare.sh 2>&1 | tail -16
  echo "== all done s=${SECONDS}"
fi
if [ "$PART" = 2 ]; then
  OUT=$OUT/vllm REPS=15 ROUNDS=2 BENCH_ARGS=--padded-decode CELL_GAP_MS=500 bash bench/gpu/vllm_compare.sh 2>&1 | tail -45
  echo "== vllm done s=${SECONDS}"
  [ "$SECONDS" -lt 400 ] && ab route "$P $R" E8-k2-d4096-f14336 4096
  [ "$SECONDS" -lt 450 ] && ab route "$P $R" E32-k8-d7168-f2048 4096
fi
