#!/usr/bin/env bash
# Four moe-rankd processes over UCX on this machine, driven through the gRPC API:
#  - prefill, decode, mixed and oversize steps under uniform and hot routing, zero-token ranks
#    included: every output equals the semantic computation (0 mismatches);
#  - a malformed request on one rank: INVALID_ARGUMENT naming the field there, ABORTED on the
#    others at once, and the next step is served everywhere;
#  - a live Prometheus scrape in the exposition format (promtool check metrics when installed);
#  - a rank killed with SIGKILL: every live rank answers the next step with an error within
#    the collective timeout, no hang;
#  - SIGTERM drains the remaining ranks.
set -uo pipefail
RANKD="$1" DRIVER="$2" MOECTL="$3"
source deploy/cluster_lib.sh
work="$(mktemp -d "${TEST_TMPDIR:-/tmp}/cluster.XXXXXX")"
trap 'stop_ranks' EXIT
fail=0
check() { if [ "$1" = 0 ]; then echo "ok   $2"; else echo "FAIL $2"; fail=1; fi; }

"$MOECTL" checkpoint synth --experts 8 --d 64 --d_ff 128 --seed 3 --out "$work/ckpt.safetensors" >/dev/null
start_ranks "$RANKD" "$work" 4 "$work/ckpt.safetensors" --timeout_ms 3000 || exit 1

"$DRIVER" --port_dir "$work/ports" --world 4 --checkpoint "$work/ckpt.safetensors" --rounds 1 --prefill_tokens 24 \
  >"$work/driver.log" 2>&1
check $? "driver: all scenarios served"
grep -q "mismatches          0" "$work/driver.log"; check $? "driver: zero mismatches"
grep -q "rank-steps          40 (failed 0)" "$work/driver.log"; check $? "driver: 40 rank-steps, none failed"

"$DRIVER" --port_dir "$work/ports" --world 4 --checkpoint "$work/ckpt.safetensors" --fault bad_input >"$work/bad.log" 2>&1
check $? "malformed request: INVALID_ARGUMENT on its rank, ABORTED on the others, next step served"
cat "$work/bad.log" | sed 's/^/     /'

curl -s "http://127.0.0.1:$(cat "$work/metrics/1.port")/metrics" >"$work/scrape.txt"
grep -q '^moe_steps_total{.*status="ok"' "$work/scrape.txt"; check $? "metrics: steps by status"
grep -q '^moe_steps_total{.*status="invalid_argument"' "$work/scrape.txt"; check $? "metrics: the rejected step is counted on its rank"
grep -q '^# TYPE moe_step_latency_seconds histogram' "$work/scrape.txt"; check $? "metrics: latency histogram"
if command -v promtool >/dev/null; then promtool check metrics <"$work/scrape.txt"; check $? "promtool check metrics"; fi

kill -KILL "${RANK_PIDS[3]}"
wait "${RANK_PIDS[3]}" 2>/dev/null
start=$(date +%s)
"$DRIVER" --port_dir "$work/ports" --world 4 --checkpoint "$work/ckpt.safetensors" --fault dead_rank --dead_rank 3 \
  >"$work/dead.log" 2>&1
check $? "killed rank: every live rank errors"
took=$(( $(date +%s) - start ))
[ "$took" -le 10 ]; check $? "killed rank: errors within the timeout (${took}s)"
cat "$work/dead.log" | sed 's/^/     /'

unset 'RANK_PIDS[3]'
stop_ranks
drained=$(grep -l "drained, exiting" "$work"/rank[012].log | wc -l)
[ "$drained" = 3 ]; check $? "SIGTERM drained the 3 live ranks"
exit $fail
