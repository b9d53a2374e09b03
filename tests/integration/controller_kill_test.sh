#!/usr/bin/env bash
# moe-controller SIGKILLed at random points of 20 placement rollouts on a live 4-rank cluster.
# Each round k: register release-k, verify, load placement-v(k+1) on every rank, shadow, canary,
# promote (every rank switches), retire release-(k-1) (every rank retires its placement once no
# handle holds it). The controller is killed at a random moment of the round, restarted on the
# same SQLite file (it reconciles the ranks with the ACTIVE release), and the round is re-run
# with the same request ids. Required: every re-run completes; the registry stays a legal chain
# (the controller refuses to start otherwise); after every round each rank's active generation
# is the ACTIVE release's placement and the previous placement is retired; the engine driver,
# running steps the whole time, ends with 0 failed steps and 0 mismatches.
set -uo pipefail
RANKD="$1" DRIVER="$2" MOECTL="$3" CONTROLLER="$4"
ROUNDS="${ROUNDS:-20}"
source deploy/cluster_lib.sh
work="$(mktemp -d "${TEST_TMPDIR:-/tmp}/ctlkill.XXXXXX")"
ctl_pid=""
trap '[ -n "$ctl_pid" ] && kill -9 "$ctl_pid" 2>/dev/null; stop_ranks' EXIT
fail=0
check() { if [ "$1" = 0 ]; then echo "ok   $2"; else echo "FAIL $2"; fail=1; fi; }
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/token"
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/agent_token"
"$MOECTL" checkpoint synth --experts 8 --d 64 --d_ff 128 --seed 5 --out "$work/model" >/dev/null
start_ranks "$RANKD" "$work" 4 "$work/model" --agent_token_file "$work/agent_token" --timeout_ms 5000 \
  --extra_replicas 0 || exit 1
ranks="$(for r in 0 1 2 3; do printf '127.0.0.1:%s,' "$(cat "$work/ports/$r.port")"; done)"

start_controller() {
  rm -f "$work/ctl.port"
  "$CONTROLLER" --store "$work/registry.db" --token_file "$work/token" --ranks "${ranks%,}" \
    --agent_token_file "$work/agent_token" --port_file "$work/ctl.port" >>"$work/controller.log" 2>&1 &
  ctl_pid=$!
  for _ in $(seq 100); do [ -s "$work/ctl.port" ] && return 0; sleep 0.05; done
  echo "controller did not start:"; tail -5 "$work/controller.log"; return 1
}
ctl() { "$MOECTL" --controller "127.0.0.1:$(cat "$work/ctl.port")" --token_file "$work/token" "$@"; }
EV=deploy/examples/promotion-evidence.json

round() {  # round K: every command idempotent by its request id
  local k=$1 v=$(($1 + 1)) id="release-$1"
  ctl release register "$id" --digest "sha256:$k" --request_id "$id:reg" >/dev/null || return 1
  ctl release transition "$id" VERIFIED --reason v --request_id "$id:verified" >/dev/null || return 1
  ctl placement load "$id" --manifest "$work/placement-v$v.json" --request_id "$id:load" >/dev/null || return 1
  ctl release transition "$id" SHADOW --reason s --request_id "$id:shadow" >/dev/null || return 1
  ctl release transition "$id" CANARY --reason c --request_id "$id:canary" >/dev/null || return 1
  ctl promote "$id" --evidence "$EV" --request_id "$id:promote" >/dev/null || return 1
  if [ "$k" -gt 0 ]; then  # the ranks refuse while a step still holds the old placement: retry
    for _ in $(seq 50); do
      ctl release transition "release-$((k - 1))" RETIRED --reason done --request_id "$id:retire-prior" \
        >/dev/null 2>&1 && return 0
      sleep 0.05
    done
    return 1
  fi
}

for ((k = 0; k <= ROUNDS; k++)); do
  "$MOECTL" placement synth --checkpoint "$work/model" --world 4 --placement_version $((k + 1)) \
    --extra_replicas $((k % 5)) >"$work/placement-v$((k + 1)).json"
done
start_controller || exit 1
round 0 || { echo "FAIL round 0"; exit 1; }
"$DRIVER" --port_dir "$work/ports" --world 4 --checkpoint "$work/model" --rounds 1 --prefill_tokens 16 \
  --until_file "$work/stop" >"$work/driver.log" 2>&1 &
driver=$!

killed_mid=0
RANDOM=20261129
for ((k = 1; k <= ROUNDS; k++)); do
  round "$k" >/dev/null 2>&1 &
  bg=$!
  sleep "0.$(printf '%03d' $((RANDOM % 250)))"
  kill -9 "$ctl_pid"; wait "$ctl_pid" 2>/dev/null
  if kill -0 "$bg" 2>/dev/null; then killed_mid=$((killed_mid + 1)); fi
  wait "$bg" 2>/dev/null
  start_controller || { fail=1; break; }
  if ! round "$k"; then echo "FAIL round $k did not complete after the restart"; fail=1; break; fi
  want="v$((k + 1))"
  active="$(ctl status | awk 'NR > 1 {print $3}' | sort -u)"
  [ "$active" = "$want" ] || { echo "FAIL round $k: ranks active '$active', want $want"; fail=1; }
  ctl status | grep -q "v$k RETIRED/0" || { echo "FAIL round $k: placement-v$k not retired"; ctl status; fail=1; }
done
check $fail "$ROUNDS rounds: each completed after a SIGKILL, ranks on the ACTIVE release's placement, prior retired"
echo "     ($killed_mid of $ROUNDS kills landed while the round was still running)"
[ "$killed_mid" -ge $((ROUNDS / 4)) ]; check $? "kills landed mid-rollout in at least a quarter of the rounds"
ctl releases list --json | grep -c '"RELEASE_STATE_RETIRED"' >"$work/retired"
[ "$(cat "$work/retired")" = "$ROUNDS" ]; check $? "every superseded release RETIRED in the registry ($(cat "$work/retired"))"
touch "$work/stop"
wait "$driver"
check $? "engine driver: no failed step, no mismatch, no generation split during all rollouts"
grep -E "^  (rank-steps|mismatches|steps retried|generation timeline|GENERATION)" "$work/driver.log" | cut -c1-300 |
  sed 's/^/     /'
grep -E " error " "$work/driver.log" | head -5 | sed 's/^/     /'
grep -E "reconcile" "$work/controller.log" | head -3 | sed 's/^/     /'
exit $fail
