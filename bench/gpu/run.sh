#!/usr/bin/env bash
# On the GPU machine, from the repository root after tools/gpu_bundle.sh (dist/gpu carried):
# GPU tests, compute-sanitizer memcheck + racecheck, and the expert-layer benchmark side by
# side with the PyTorch reference. Results land in $OUT (or ./gpu-out).
set -uo pipefail
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/dist/gpu/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
echo "== cuda_kernels_test"
dist/gpu/bin/cuda_kernels_test 2>&1 | tail -15 | tee "$OUT/cuda_kernels_test.txt"
if [ "${SANITIZE:-1}" = 1 ]; then
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool"
    compute-sanitizer --tool "$tool" --error-exitcode 3 dist/gpu/bin/cuda_kernels_test --gtest_brief=1 > "$OUT/sanitizer_$tool.txt" 2>&1
    echo "rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' "$OUT/sanitizer_$tool.txt" | tail -3 | tr '\n' ' ')"
  done
  # The grouped Hopper kernels' barriers at racecheck's full report level, and under synccheck:
  # the FP8 scale slots' WAR pairs showed only at that level (bench/RESULTS.md, 2026-12-04,
  # thirty-fifth and thirty-sixth sessions).
  for check in "racecheck --racecheck-report all" synccheck; do
    name="${check%% *}_grouped"
    # shellcheck disable=SC2086  # the tool and its options, split on purpose
    compute-sanitizer --tool $check --error-exitcode 3 dist/gpu/bin/cuda_kernels_test --gtest_filter='*GroupedSm90*' \
      --gtest_brief=1 > "$OUT/sanitizer_$name.txt" 2>&1
    echo "$name rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' "$OUT/sanitizer_$name.txt" | tail -3 | tr '\n' ' ')"
  done
fi
echo "== benchmark"
# At most 8 files come back: sanitizer logs are bundled into one archive at the end.
dist/gpu/bin/expert_layer_bench ${BENCH_ARGS:-} > "$OUT/ours.jsonl" 2> "$OUT/ours.err"; echo "ours rc=$?"; tail -3 "$OUT/ours.err"
python3 bench/gpu/torch_reference.py ${BENCH_ARGS:-} > "$OUT/torch.jsonl" 2> "$OUT/torch.err"; echo "torch rc=$?"; tail -3 "$OUT/torch.err"
python3 bench/gpu/report.py "$OUT/ours.jsonl" "$OUT/torch.jsonl" "$OUT/report.md" "$OUT/expert_layer.png"
grep breakdown "$OUT/ours.jsonl" || true
tar -C "$OUT" -czf "$OUT/logs.tgz" --remove-files $(cd "$OUT" && ls sanitizer_*.txt *.err gpu.txt cuda_kernels_test.txt 2>/dev/null) 2>/dev/null || true
if [ "${AB:-0}" = 1 ]; then
  echo "== A/B: every multi-expert GEMM through cublasGemmGroupedBatchedEx"
  MOE_CUDA_TUNING=gemm=grouped dist/gpu/bin/expert_layer_bench ${BENCH_ARGS:-} > "$OUT/ours_grouped.jsonl" 2>&1
  python3 bench/gpu/report.py "$OUT/ours_grouped.jsonl" "$OUT/torch.jsonl" "$OUT/report_grouped.md" > /dev/null
  cut -d'|' -f2-7 "$OUT/report_grouped.md"
fi
