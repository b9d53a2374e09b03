#!/usr/bin/env bash
# FP8 experts at decode sizes: the layer (expert_layer_bench's "fp8-graph" cell: route, tokens
# quantized and packed, the FP8 experts, combine, replayed as a CUDA graph) with the experts on
# the tensor-core GEMVs (small_batch_fp8.cu, what gemm=auto takes for at most 8 rows an expert)
# and forced onto the Hopper kernels (MOE_CUDA_TUNING=gemm=sm90), taking turns, ROUNDS rounds
# (even rounds the other way round). Prints "cell variant round µs" lines; the JSON lines land in
# $OUT/fp8_decode.jsonl.
#   there: bench/gpu/fp8_decode.sh            (carry dist; CELLS="E128-k8-d2048-f768:1 ...")
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/fp8_decode}"
ROUNDS="${ROUNDS:-2}"
REPS="${REPS:-20}"
CELLS="${CELLS:-E128-k8-d2048-f768:1 E128-k8-d2048-f768:16 E128-k8-d2048-f768:64 E128-k8-d2048-f768:128 \
E32-k8-d7168-f2048:16 E32-k8-d7168-f2048:128 E8-k2-d4096-f14336:1 E8-k2-d4096-f14336:128}"
export LD_LIBRARY_PATH="$PWD/dist/gpu/lib:$PWD/dist/gpu/bin:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
mkdir -p "$OUT"
log="$OUT/fp8_decode.jsonl"
: >"$log"
run() {  # variant round shape tokens
  local tuning=""
  [ "$1" = hopper ] && tuning="gemm=sm90"
  MOE_CUDA_TUNING="$tuning" dist/gpu/bin/expert_layer_bench --reps "$REPS" --shape "$3" --tokens "$4" |
    python3 -c '
import json, sys
variant, rnd = sys.argv[1], int(sys.argv[2])
for line in sys.stdin:
    if line.startswith("{"):
        c = json.loads(line)
        c.update(variant=variant, round=rnd)
        print(json.dumps(c))
        if c.get("kind") == "cell" and c.get("path") == "fp8-graph":
            print("%s:%d %s round %d %.1f" % (c["shape"], c["T"], variant, rnd, c["us"]), file=sys.stderr)
' "$1" "$2" >>"$log"
}
for round in $(seq 1 "$ROUNDS"); do
  order="gemv hopper"
  [ $((round % 2)) -eq 0 ] && order="hopper gemv"
  for cell in $CELLS; do
    for variant in $order; do run "$variant" "$round" "${cell%%:*}" "${cell##*:}"; done
  done
done
