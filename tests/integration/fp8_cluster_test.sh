#!/usr/bin/env bash
# FP8 experts across real moe-rankd processes (CPU kernels + UCX, or CUDA + NCCL where
# choose_backend finds a GPU per rank): a DeepSeek-V3-layout checkpoint stored in block-scaled
# FP8, served with --expert_dtype fp8 by RANKS (default 3) ranks, so that routed rows travel
# between them as packed FP8 rows:
#  - every output equals the FP8 reference (the checkpoint's experts in 128 x 128 blocks, rows per
#    128 values; engine_driver --expert_dtype fp8): 0 mismatches, over gRPC and over step rings;
#  - a malformed request on one rank leaves every rank serving the next FP8 step (two ranks or more);
#  - the BF16 reference does not accept those outputs (the check can tell the precisions apart);
#  - ranks started with different --expert_dtype abort every step, naming expert_dtype (two
#    ranks or more);
#  - an unknown --expert_dtype is refused at start-up, naming the flag.
set -uo pipefail
RANKD="$1" DRIVER="$2" MOECTL="$3"
RANKS="${RANKS:-3}"
source deploy/cluster_lib.sh
choose_backend "$RANKS"
echo "backend: $BACKEND_NAME"
work="$(mktemp -d "${TEST_TMPDIR:-/tmp}/fp8.XXXXXX")"
trap 'stop_ranks' EXIT
fail=0
check() { if [ "$1" = 0 ]; then echo "ok   $2"; else echo "FAIL $2"; fail=1; fi; }

"$MOECTL" checkpoint synth --layers 3 --family deepseek_v3 --first_dense 1 --experts 8 --d 256 --d_ff 128 --seed 5 \
  --dtype F8_E4M3 --version fp8-1 --out "$work/ckpt" >/dev/null
check $? "an FP8 checkpoint (F8_E4M3, 128 x 128 block scales)"
start_ranks "$RANKD" "$work" "$RANKS" "$work/ckpt" --timeout_ms 3000 --expert_dtype fp8 || exit 1
grep -q "experts in fp8" "$work/rank0.log"; check $? "rank 0 serves its experts in FP8"
curl -s "http://127.0.0.1:$(cat "$work/metrics/0.port")/metrics" >"$work/scrape.txt"
grep -q '^moe_build_info{.*expert_dtype="fp8"' "$work/scrape.txt"
check $? "metrics: moe_build_info names expert_dtype fp8"

drive() { "$DRIVER" --port_dir "$work/ports" --world "$RANKS" --checkpoint "$work/ckpt" --rounds 1 --prefill_tokens 24 "$@"; }
drive --expert_dtype fp8 >"$work/driver.log" 2>&1
check $? "driver: all scenarios served"
grep -q "mismatches          0" "$work/driver.log"; check $? "driver: zero mismatches against the FP8 reference"
grep -q "rank-steps          $((10 * RANKS)) (failed 0, retryable 0)" "$work/driver.log"
check $? "driver: $((10 * RANKS)) rank-steps, none failed"
drive --expert_dtype fp8 --ring >"$work/ring.log" 2>&1
check $? "driver over step rings: all scenarios served"
grep -q "mismatches          0" "$work/ring.log"; check $? "driver over step rings: zero mismatches"
if [ "$RANKS" -ge 2 ]; then
  drive --expert_dtype fp8 --fault bad_input >"$work/bad.log" 2>&1
  check $? "malformed request: INVALID_ARGUMENT on its rank, ABORTED on the others, next FP8 step served"
else
  echo "n/a  malformed request seen from another rank: needs two ranks"
fi
drive --expert_dtype bf16 >"$work/bf16.log" 2>&1
[ $? != 0 ] && ! grep -q "mismatches          0" "$work/bf16.log"
check $? "the BF16 reference finds the FP8 outputs different"
stop_ranks

# Rank 0 with BF16 experts, the others FP8: every step aborts on every rank, naming the setting.
if [ "$RANKS" -lt 2 ]; then
  echo "n/a  different --expert_dtype across ranks: needs two ranks"
else
# (A rank's own flags come before the common ones, and the last of a flag wins: none in common.)
for ((r = 1; r < RANKS; r++)); do export "RANK${r}_FLAGS=--expert_dtype fp8"; done
start_ranks "$RANKD" "$work/mixed" "$RANKS" "$work/ckpt" --timeout_ms 3000 || exit 1
for ((r = 1; r < RANKS; r++)); do unset "RANK${r}_FLAGS"; done
grep -q "experts in bf16" "$work/mixed/rank0.log" && grep -q "experts in fp8" "$work/mixed/rank1.log"
check $? "rank 0 in BF16, rank 1 in FP8"
"$DRIVER" --port_dir "$work/mixed/ports" --world "$RANKS" --checkpoint "$work/ckpt" --rounds 1 \
  --prefill_tokens 8 --max_retries 0 --expert_dtype fp8 >"$work/mixed.log" 2>&1
[ $? != 0 ] && grep -q "expert_dtype" "$work/mixed.log"
check $? "different --expert_dtype across ranks: steps refused naming expert_dtype"
stop_ranks
fi

"$RANKD" --rank 0 --world 1 --checkpoint "$work/ckpt" --expert_dtype fp16 >"$work/bad.log" 2>&1
rc=$?
[ "$rc" = 2 ] && grep -q -- "--expert_dtype: 'fp16'" "$work/bad.log"
check $? "--expert_dtype fp16 refused at start-up (exit $rc)"
exit $fail
