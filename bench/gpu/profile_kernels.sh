#!/usr/bin/env bash
# Where a kernel's warps wait, on the GPU machine: Nsight Compute's stall samples of the kernels
# whose names match KERNELS, in one run of a command, summed by what the warps waited for
# (bench/gpu/ncu_stalls.py). ncu leaves the clocks alone (--clock-control none, METHOD.md).
#
#   KERNELS='regex:GroupedGemm' SKIP=2 COUNT=2 bench/gpu/profile_kernels.sh \
#     dist/gpu/bin/expert_layer_bench --reps 2 --shape E128-k8-d2048-f768 --tokens 8192
#
# KERNELS matches ncu's demangled names, whose template arguments read "(int)128, (bool)1":
# the FP8 kernels (last argument true) are 'regex:GroupedGemmKernel<.*\(bool\)1>'.
#
# Writes $OUT/profile/{ncu.log,details.txt,sass.csv,stalls.txt}; prints stalls.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ $# -ge 1 ] || { echo "usage: KERNELS=... [SKIP=n] [COUNT=n] $0 command [args...]" >&2; exit 2; }
: "${KERNELS:?ncu -k filter, e.g. regex:GroupedGemm}"
OUT="${OUT:-/tmp}/profile"
mkdir -p "$OUT"
ncu --clock-control none --kernel-name-base demangled -k "$KERNELS" --launch-skip "${SKIP:-0}" \
  --launch-count "${COUNT:-2}" --section SpeedOfLight --section SourceCounters --section WarpStateStats \
  --import-source no -f -o "$OUT/report" "$@" > "$OUT/ncu.log" 2>&1
ncu --import "$OUT/report.ncu-rep" --print-details all > "$OUT/details.txt"
ncu --import "$OUT/report.ncu-rep" --page source --print-source sass --csv > "$OUT/sass.csv"
rm -f "$OUT/report.ncu-rep"
python3 bench/gpu/ncu_stalls.py "$OUT/sass.csv" | tee "$OUT/stalls.txt"
