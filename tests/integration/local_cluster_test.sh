#!/usr/bin/env bash
# RANKS (default 4) moe-rankd processes on this machine, driven through the gRPC API (CPU kernels
# over UCX; CUDA kernels over NCCL where choose_backend finds a GPU per rank and the CUDA backend):
#  - prefill, decode, mixed and oversize steps under uniform and hot routing, zero-token ranks
#    included: every output equals the semantic computation (0 mismatches);
#  - a malformed request on one rank: INVALID_ARGUMENT naming the field there, ABORTED on the
#    others at once, and the next step is served everywhere;
#  - a live Prometheus scrape in the exposition format (promtool check metrics when installed);
#  - a rank killed with SIGKILL: every live rank answers the next step with an error within
#    the collective timeout, no hang;
#  - SIGTERM drains the remaining ranks.
# With RANKS=1 (one GPU) the checks that need a peer (the malformed request seen from another
# rank, the killed rank) do not apply and are reported as such; the others run.
set -uo pipefail
RANKD="$1" DRIVER="$2" MOECTL="$3"
RANKS="${RANKS:-4}"
last=$((RANKS - 1))
source deploy/cluster_lib.sh
choose_backend "$RANKS"
echo "backend: $BACKEND_NAME"
work="$(mktemp -d "${TEST_TMPDIR:-/tmp}/cluster.XXXXXX")"
trap 'stop_ranks' EXIT
fail=0
check() { if [ "$1" = 0 ]; then echo "ok   $2"; else echo "FAIL $2"; fail=1; fi; }

# A DeepSeek-V3-layout model: layer 0 dense (the engine's), MoE layers 1-3, two shards + index.
"$MOECTL" checkpoint synth --layers 4 --family deepseek_v3 --first_dense 1 --experts 8 --d 64 --d_ff 128 --seed 3 \
  --shard_mb 1 --version ckpt-3 --out "$work/ckpt" >/dev/null
start_ranks "$RANKD" "$work" "$RANKS" "$work/ckpt" --timeout_ms 3000 || exit 1

"$DRIVER" --port_dir "$work/ports" --world "$RANKS" --checkpoint "$work/ckpt" --rounds 1 --prefill_tokens 24 \
  >"$work/driver.log" 2>&1
check $? "driver: all scenarios served"
grep -q "mismatches          0" "$work/driver.log"; check $? "driver: zero mismatches"
grep -q "rank-steps          $((10 * RANKS)) (failed 0, retryable 0)" "$work/driver.log"
check $? "driver: $((10 * RANKS)) rank-steps, none failed"
grep -q "8 experts x 3 MoE layers" "$work/driver.log"; check $? "driver: steps over the model's 3 MoE layers"
# The same scenarios submitted through step rings (shared memory + futex doorbell) on every rank.
"$DRIVER" --port_dir "$work/ports" --world "$RANKS" --checkpoint "$work/ckpt" --rounds 1 --prefill_tokens 24 --ring \
  >"$work/ring.log" 2>&1
check $? "driver over step rings: all scenarios served"
grep -q "submission: step rings on $RANKS ranks" "$work/ring.log" && grep -q "mismatches          0" "$work/ring.log"
check $? "driver over step rings: every rank's ring, zero mismatches"
grep -q "checkpoint load: 3/3 layers" "$work/rank0.log"; check $? "rank 0 logged its load progress"
curl -s "http://127.0.0.1:$(cat "$work/metrics/0.port")/metrics" >"$work/load.txt"
grep -q '^moe_checkpoint_load_layers{.*state="done"} 3' "$work/load.txt"; check $? "metrics: load progress (3 of 3 layers)"

if [ "$RANKS" -lt 2 ]; then
  echo "n/a  malformed request and killed rank: need two ranks"
  curl -s "http://127.0.0.1:$(cat "$work/metrics/0.port")/metrics" >"$work/scrape.txt"
  grep -q '^moe_steps_total{.*status="ok"' "$work/scrape.txt"; check $? "metrics: steps by status"
  grep -q '^# TYPE moe_step_latency_seconds histogram' "$work/scrape.txt"; check $? "metrics: latency histogram"
  if command -v promtool >/dev/null; then promtool check metrics <"$work/scrape.txt"; check $? "promtool check metrics"; fi
  stop_ranks
  grep -q "drained, exiting" "$work/rank0.log"; check $? "SIGTERM drained the rank"
  exit $fail
fi

"$DRIVER" --port_dir "$work/ports" --world "$RANKS" --checkpoint "$work/ckpt" --fault bad_input >"$work/bad.log" 2>&1
check $? "malformed request: INVALID_ARGUMENT on its rank, ABORTED on the others, next step served"
cat "$work/bad.log" | sed 's/^/     /'
"$DRIVER" --port_dir "$work/ports" --world "$RANKS" --checkpoint "$work/ckpt" --fault bad_layer >"$work/layer.log" 2>&1
check $? "a layer the model does not serve: INVALID_ARGUMENT naming it on its rank, ABORTED on the others, next step served"
cat "$work/layer.log" | sed 's/^/     /'
# The same through step rings: rank 1's bad step arrives in its ring slot, is rejected there and
# still aborts its peers at once; every rank serves the next step.
"$DRIVER" --port_dir "$work/ports" --world "$RANKS" --checkpoint "$work/ckpt" --fault bad_layer --ring \
  >"$work/ring_layer.log" 2>&1 && grep -q "submission: step rings on $RANKS ranks" "$work/ring_layer.log"
check $? "over step rings, a layer the model does not serve: rejected in the ring on its rank, ABORTED on the others, next step served"

curl -s "http://127.0.0.1:$(cat "$work/metrics/1.port")/metrics" >"$work/scrape.txt"
grep -q '^moe_steps_total{.*status="ok"' "$work/scrape.txt"; check $? "metrics: steps by status"
grep -q '^moe_steps_total{.*status="invalid_argument"' "$work/scrape.txt"; check $? "metrics: the rejected step is counted on its rank"
grep -q '^# TYPE moe_step_latency_seconds histogram' "$work/scrape.txt"; check $? "metrics: latency histogram"
if command -v promtool >/dev/null; then promtool check metrics <"$work/scrape.txt"; check $? "promtool check metrics"; fi

kill -KILL "${RANK_PIDS[$last]}"
wait "${RANK_PIDS[$last]}" 2>/dev/null
start=$(date +%s)
"$DRIVER" --port_dir "$work/ports" --world "$RANKS" --checkpoint "$work/ckpt" --fault dead_rank --dead_rank "$last" \
  >"$work/dead.log" 2>&1
check $? "killed rank: every live rank errors"
took=$(( $(date +%s) - start ))
[ "$took" -le 10 ]; check $? "killed rank: errors within the timeout (${took}s)"
cat "$work/dead.log" | sed 's/^/     /'

unset "RANK_PIDS[$last]"
stop_ranks
drained=0
for ((r = 0; r < last; r++)); do grep -q "drained, exiting" "$work/rank$r.log" && drained=$((drained + 1)); done
[ "$drained" = "$last" ]; check $? "SIGTERM drained the $last live ranks"
exit $fail
