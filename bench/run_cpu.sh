#!/usr/bin/env bash
# CPU benchmarks of the runtime core, pinned to one core, medians over repetitions.
set -euo pipefail
cd "$(dirname "$0")/.."
bazel build //bench:eplb_bench //bench:route_plan_bench
reps="${REPS:-5}"
taskset -c 0 bazel-bin/bench/eplb_bench --benchmark_repetitions="$reps" --benchmark_report_aggregates_only=true \
  | grep -E 'median|^Benchmark|^---'
taskset -c 0 bazel-bin/bench/route_plan_bench --benchmark_repetitions="$reps" --benchmark_report_aggregates_only=true \
  | grep -E 'median|^Benchmark|^---'
