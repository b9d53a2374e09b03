#!/usr/bin/env bash
# Issue 19's comparison on the GPU machine: the project's expert layer (expert_layer_bench, graph
# replay for T <= 128) and vLLM's Triton fused-MoE kernel with its tuned H200 configs
# (bench/gpu/vllm_compare.py), same GPU, same run, same shapes and routings.
#   here:  tools/gpu_bundle.sh && tools/fetch_vllm.sh      (dist/gpu, .peers/vllm-<version>)
#   there: bench/gpu/vllm_compare.sh                       (carry dist and .peers)
# One shape or T: BENCH_ARGS="--shape S --tokens T" VLLM_ARGS="--shape S --tokens T".
# Results in $OUT (default gpu-out): ours_R.jsonl and vllm_R.jsonl a round, the merged vllm.jsonl
# ("compare" lines: medians over the rounds, each side's mean SM clock) and vllm_compare.md.
set -uo pipefail
OUT="${OUT:-gpu-out}"
VLLM="${VLLM:-$(ls -d .peers/vllm-* | sort -V | tail -1)}"
REPS="${REPS:-40}"
# Rounds: the bench and vLLM's timing take turns (even rounds vLLM first), each cell's median
# over the rounds is compared (a single call's figures move by 5-10% with the GPU's heat).
ROUNDS="${ROUNDS:-2}"
# Both sides leave the GPU idle this long before each cell is timed (--cell_gap_ms), so that a
# cell does not inherit the heat and power state of the one before it: vLLM's cells, timed from
# Python between compiles and reference checks, started at ~1980 MHz while the bench's ran back to
# back (E32 T = 1024 at 1448-1642 MHz right after the E8 T = 8192 cells; bench/RESULTS.md,
# 2026-12-03 and 2026-12-04). 0: back to back, as before 2026-12-04 (thirty-ninth session).
CELL_GAP_MS="${CELL_GAP_MS:-1000}"
mkdir -p "$OUT" "$OUT/routing"
export LD_LIBRARY_PATH="$PWD/dist/gpu/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
# The SM clock and board power every 50 ms beside the rounds ($OUT/clocks.csv: unix_ms, MHz, W):
# the report gives each side's mean clock over its cells' windows.
# shellcheck source=bench/gpu/clock_sampler.sh
. bench/gpu/clock_sampler.sh
start_clock_sampler "$OUT/clocks.csv" 50
ours() {  # round $1 (round 1 writes the routings that every round of vLLM reads)
  local extra=()
  [ "$1" -eq 1 ] && extra=(--routing_out "$OUT/routing")
  # shellcheck disable=SC2086
  dist/gpu/bin/expert_layer_bench --reps "$REPS" --cell_gap_ms "$CELL_GAP_MS" "${extra[@]}" ${BENCH_ARGS:-} >"$OUT/ours_$1.jsonl" 2>"$OUT/ours_$1.err"
  local rc=$?
  echo "expert_layer_bench round $1 rc=$rc"
  [ "$rc" -eq 0 ] || { tail -5 "$OUT/ours_$1.err"; return 1; }
}
peer() {
  # shellcheck disable=SC2086
  local tune=(--tune_missing)  # shapes vLLM has no tuned file for: its best sibling config (vllm_compare.py)
  [ "${TUNE_MISSING:-1}" = 0 ] && tune=()
  python3 bench/gpu/vllm_compare.py --vllm "$VLLM" --routing_dir "$OUT/routing" --reps "$REPS" \
    --cell_gap_ms "$CELL_GAP_MS" "${tune[@]}" ${VLLM_ARGS:-} \
    >"$OUT/vllm_$1.jsonl" 2>"$OUT/vllm_$1.err"
  local rc=$?
  echo "vllm_compare round $1 rc=$rc"
  [ "$rc" -eq 0 ] || { tail -3 "$OUT/vllm_$1.err"; return 1; }
}
ours 1 || exit 1
peer 1 || exit 1
for r in $(seq 2 "$ROUNDS"); do
  if [ $((r % 2)) -eq 0 ]; then
    peer "$r" && ours "$r" || exit 1
  else
    ours "$r" && peer "$r" || exit 1
  fi
done
ours_files=() peer_files=()
for r in $(seq 1 "$ROUNDS"); do
  ours_files+=("$OUT/ours_$r.jsonl")
  peer_files+=("$OUT/vllm_$r.jsonl")
done
python3 bench/gpu/compare_report.py --ours "${ours_files[@]}" --peer "${peer_files[@]}" \
  --clocks "$OUT/clocks.csv" --md "$OUT/vllm_compare.md" >"$OUT/vllm.jsonl"
rc=$?
echo "merge rc=$rc ($ROUNDS rounds)"
grep -h '"ceiling"' "$OUT"/ours_*.jsonl "$OUT"/vllm_*.jsonl
cat "$OUT/vllm_compare.md"
rm -rf "$OUT/routing"
exit "$rc"
