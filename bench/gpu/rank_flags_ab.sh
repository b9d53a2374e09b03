#!/usr/bin/env bash
# A/B of moe-rankd flag sets on a co-located engine's steps, in one call: runs
# bench/gpu/device_rows.sh (one rank, FLOOR=0) once per flag set and engine, in turns, ROUNDS
# times (even rounds in reverse order), each run's output in $OUT/ab.<engine>.<set>.<round>.txt and
# its p50 lines on stdout. Flag sets are separated by '|'; an empty set is the defaults; a word
# RANKD=path in a set runs that moe-rankd (with the libmoe_cuda.so beside it: another build).
#   FLAGS="--cuda_tuning=capture_branches=1|" ENGINES="cpp python" ROUNDS=2 \
#     bench/gpu/with_mps.sh bench/gpu/rank_flags_ab.sh
#   FLAGS="RANKD=dist/gpu/prev/moe-rankd|" bench/gpu/with_mps.sh bench/gpu/rank_flags_ab.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${FLAGS:?flag sets separated by |}"
ROUNDS="${ROUNDS:-2}"
ENGINES="${ENGINES:-cpp python}"
OUT="${OUT:-/tmp/rank_flags_ab}"
mkdir -p "$OUT"
IFS='|' read -r -a sets <<< "$FLAGS"
[ "${FLAGS: -1}" = '|' ] && sets+=("")  # a trailing '|': the defaults last
n=${#sets[@]}
failed=0
for round in $(seq 1 "$ROUNDS"); do
  for engine in $ENGINES; do
    for ((j = 0; j < n; j++)); do
      i=$j
      [ $((round % 2)) -eq 0 ] && i=$((n - 1 - j))
      log="$OUT/ab.$engine.$i.$round.txt"
      echo "== round $round, $engine, set $i: '${sets[$i]}'"
      rankd="dist/gpu/bin/moe-rankd" flags=""
      for w in ${sets[$i]}; do
        case "$w" in RANKD=*) rankd="${w#RANKD=}" ;; *) flags="$flags $w" ;; esac
      done
      ENGINE="$engine" FLOOR=0 RANKD="$rankd" RANKD_EXTRA="$flags" bench/gpu/device_rows.sh > "$log" 2>&1 || {
        echo "   failed (rc $?): $log"; failed=1; }
      grep -iE 'p50|fail|mismatch|path="recorded"' "$log" | head -24
    done
  done
done
exit "$failed"
