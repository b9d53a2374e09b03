#!/usr/bin/env bash
# session 52 (temporary, not committed): on an H200, E128 T=1 beside vLLM; on an H100, the SM
# clock sampled while the one-token step runs with and without the idle gap before each cell.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/dist/gpu/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv
B=dist/gpu/bin/expert_layer_bench
if nvidia-smi -L | grep -q H200; then
  OUT=$OUT/vllm REPS=15 ROUNDS=2 BENCH_ARGS="--padded-decode --shape E128-k8-d2048-f768 --tokens 1" \
    VLLM_ARGS="--shape E128-k8-d2048-f768 --tokens 1" CELL_GAP_MS=500 bash bench/gpu/vllm_compare.sh 2>&1 | tail -8
else
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 20 > $OUT/clk.csv &
  smi=$!
  sleep 0.5
  for g in 0 500 0 500; do
    echo "gap=$g start $(date +%T.%N)"
    $B --reps 20 --shape E128-k8-d2048-f768 --tokens 1 --decode-only --cell_gap_ms $g 2>/dev/null | grep '"kind": "cell"' | grep -o '"path": "[^"]*"\|"us": [0-9.]*' | tr '\n' ' '
    echo " end $(date +%T.%N)"
  done
  sleep 0.3; kill $smi
  echo "SM clock samples (MHz: count):"; awk -F', ' '{print $2}' $OUT/clk.csv | sort | uniq -c | sort -rn | head -6
fi
echo "== all done s=${SECONDS}"
