#!/usr/bin/env bash
# The BF16 and FP8 experts each run back to back for a few seconds (expert_layer_bench
# --sustain_ms) with the GPU's SM clock and board power sampled beside them (nvidia-smi every
# 50 ms), so that a kernel's sustained time can be read against the clock it ran at. Prints each
# window's median call time and the mean clock and power over its samples (the window's first
# 500 ms left out, while the clock settles).
# DENSE=1 adds torch's dense 8192^3 GEMMs (BF16, E4M3 block-scaled and per-tensor;
# bench/gpu/dense_sustained.py), each on its own the same way: the ceilings' FP8 / BF16 ratio at
# the clocks they hold alone. CELLS="" runs only those.
#   there: bench/gpu/sustained.sh      (carry dist; CELLS="E128-k8-d2048-f768:8192 ...", MS=4000, DENSE=1)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/sustained}"
MS="${MS:-4000}"
CELLS="${CELLS-E128-k8-d2048-f768:8192 E32-k8-d7168-f2048:4096 E8-k2-d4096-f14336:8192}"
export LD_LIBRARY_PATH="$PWD/dist/gpu/lib:$PWD/dist/gpu/bin:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
mkdir -p "$OUT"
# shellcheck source=bench/gpu/clock_sampler.sh
. bench/gpu/clock_sampler.sh
start_clock_sampler "$OUT/samples.csv" 50
: >"$OUT/sustained.jsonl"
for cell in $CELLS; do
  dist/gpu/bin/expert_layer_bench --reps 5 --shape "${cell%%:*}" --tokens "${cell##*:}" --sustain_ms "$MS" |
    grep '"sustained"' >>"$OUT/sustained.jsonl"
done
if [ "${DENSE:-0}" = 1 ]; then
  python3 bench/gpu/dense_sustained.py --ms "$MS" | tee -a "$OUT/dense.log" | grep '"sustained"' >>"$OUT/sustained.jsonl"
fi
sleep 0.2
python3 - "$OUT/sustained.jsonl" "$OUT/samples.csv" <<'PY'
import json, sys
sys.path.insert(0, "bench/gpu")
from compare_report import clock_samples
samples = clock_samples(sys.argv[2])
print("shape | T | what | median µs | calls | SM MHz (mean) | W (mean) | samples | TFLOP/s")
for line in open(sys.argv[1]):
    r = json.loads(line)
    inside = [s for s in samples if r["start_unix_ms"] + 500 <= s[0] <= r["end_unix_ms"]]
    mhz = sum(s[1] for s in inside) / len(inside) if inside else float("nan")
    watts = sum(s[2] for s in inside) / len(inside) if inside else float("nan")
    print(f"{r['shape']} | {r['T']} | {r['what']} | {r['median_us']:.1f} | {r['calls']} | {mhz:.0f} | {watts:.0f} | {len(inside)} | {r.get('tflops', '')}")
PY
