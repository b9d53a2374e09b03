#!/usr/bin/env bash
# A/B of two (or more) builds of the expert kernels in one call: runs each build's
# expert_layer_bench in turn, ROUNDS times, on the same shapes and routings, and prints the
# medians side by side (bench/gpu/kernel_ab.py). Builds are named by their binaries:
#
#   BENCHES="dist/gpu/prev/expert_layer_bench dist/gpu/bin/expert_layer_bench" \
#     ROUNDS=2 ARGS="--reps 20 --shape E128-k8-d2048-f768" bench/gpu/kernel_ab.sh
#
# Or one build under several CudaTuning settings (MOE_CUDA_TUNING, kernels/api.h), "-" for the
# defaults; each setting is a variant named "tuning:<spec>":
#
#   BENCHES=dist/gpu/bin/expert_layer_bench TUNINGS="- fp8_epilogue_quant=0" ROUNDS=4 \
#     ARGS="--reps 10 --shape E128-k8-d2048-f768 --tokens 8192" bench/gpu/kernel_ab.sh
#
# SUSTAIN_MS=2000 also runs each build's BF16 and FP8 experts back to back for that long (the
# "fp8" cells, T >= 1024: expert_layer_bench --sustain_ms), with nvidia-smi sampling the SM clock
# beside them, and prints those medians with each window's mean clock: a kernel change is judged
# at the power limit a serving GPU runs at as well as in bursts (bench/RESULTS.md, 2026-12-04,
# thirty-fifth session: one launch at a time and back to back disagreed).
#
#   BENCHES="dist/gpu/prev/expert_layer_bench dist/gpu/bin/expert_layer_bench" ROUNDS=3 SUSTAIN_MS=2000 \
#     ARGS="--reps 5 --shape E8-k2-d4096-f14336 --tokens 8192" bench/gpu/kernel_ab.sh
#
# Every JSON line of every run lands in $OUT/kernel_ab.jsonl with "build" and "round" added.
# Paths are relative to the repository root (the script runs there). Even rounds run the builds
# in reverse order, so that neither always runs first after the other.
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${BENCHES:?space-separated expert_layer_bench binaries}"
TUNINGS="${TUNINGS:-}"
if [ -n "$TUNINGS" ]; then  # variants of the first binary, one a setting
  bin="${BENCHES%% *}"
  BENCHES=""
  for spec in $TUNINGS; do BENCHES="$BENCHES tuning:$spec"; done
fi
ROUNDS="${ROUNDS:-2}"
ARGS="${ARGS:---reps 20}"
OUT="${OUT:-/tmp/kernel_ab}"
mkdir -p "$OUT"
log="$OUT/kernel_ab.jsonl"
: > "$log"
samples=()
if [ -n "${SUSTAIN_MS:-}" ]; then
  case "$SUSTAIN_MS" in *[!0-9]*) echo "kernel_ab: SUSTAIN_MS=$SUSTAIN_MS: want milliseconds" >&2; exit 2 ;; esac
  ARGS="$ARGS --sustain_ms $SUSTAIN_MS"
  # shellcheck source=bench/gpu/clock_sampler.sh
  . bench/gpu/clock_sampler.sh
  start_clock_sampler "$OUT/samples.csv" 50
  samples=("$OUT/samples.csv")
fi
reversed="$(echo "$BENCHES" | tr ' ' '\n' | grep -v '^$' | tac | tr '\n' ' ')"
for round in $(seq 1 "$ROUNDS"); do
  order="$BENCHES"
  [ $((round % 2)) -eq 0 ] && order="$reversed"
  for bench in $order; do
    cmd=("$bench") tuning="${MOE_CUDA_TUNING:-}"
    if [ "${bench#tuning:}" != "$bench" ]; then
      cmd=("$bin") tuning="${bench#tuning:}"
      [ "$tuning" = - ] && tuning=""
    fi
    # shellcheck disable=SC2086
    MOE_CUDA_TUNING="$tuning" "${cmd[@]}" $ARGS 2> "$OUT/kernel_ab.err" | python3 -c '
import json, sys
build, rnd = sys.argv[1], int(sys.argv[2])
for line in sys.stdin:
    line = line.strip()
    if line.startswith("{"):
        rec = json.loads(line)
        rec["build"], rec["round"] = build, rnd
        print(json.dumps(rec))
' "$bench" "$round" >> "$log" || {
      echo "kernel_ab: $bench or the line filter failed (its stderr, then the filter's above):" >&2
      tail -5 "$OUT/kernel_ab.err" >&2
      exit 1
    }
  done
done
sleep 0.2  # the sampler's last lines
python3 bench/gpu/kernel_ab.py "$log" "${samples[@]}"
