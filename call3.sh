#!/usr/bin/env bash
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/dist/gpu/lib:$PWD/dist/gpu/bin:/usr/local/cuda/lib64
B=dist/gpu/bin
timeout 300 $B/cuda_kernels_test 2>&1 | grep -E "^\[  (PASSED|FAILED)|Failure|FAILED" | head
mkdir -p $OUT/trace
for b in dist/gpu/prev $B; do
  MOE_BENCH_KERNELS=cuda timeout 60 $b/step_host_bench --reps 9 --device_plan --in_place --tokens 2048,8192 2>/dev/null | tail -2
done
MOE_BENCH_KERNELS=cuda timeout 60 $B/step_host_bench --reps 9 --tokens 2048 | tail -1
MOE_BENCH_KERNELS=cuda timeout 60 $B/step_host_bench --reps 5 --device_plan --in_place --tokens 2048 --trace_allocs 2> $OUT/trace/device_inplace.txt | tail -1
for s in "E128-k8-d2048-f768" "E8-k2-d4096-f14336"; do
  timeout 200 ncu --clock-control none -k 'regex:GroupedGemm|Quantize|nvjet' --launch-skip 0 --launch-count 40 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis $B/expert_layer_bench --reps 3 --shape $s --tokens 8192 > $OUT/sol_$s.txt 2>&1
  echo "== $s"
  grep -E "^  [a-zA-Z_].*\(|^    Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy" $OUT/sol_$s.txt |
    sed -E 's/^  (void )?(moe::kernels::cuda::<unnamed>::)?([A-Za-z0-9_]+(<[^>]*>)?).*/\3/' | paste - - - - - - | awk '{$1=$1; print}' | sort | uniq -c | sort -rn | head -30
done
OUT=$OUT KERNELS='regex:GroupedGemmKernel<.*\(bool\)1>' SKIP=0 COUNT=2 timeout 200 bench/gpu/profile_kernels.sh \
  $B/expert_layer_bench --reps 2 --shape E128-k8-d2048-f768 --tokens 8192 2>&1 | tail -40
