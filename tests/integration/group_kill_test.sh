#!/usr/bin/env bash
# Process-group epochs under load (issue: a group that re-forms after a rank is lost). Four
# moe-rankd processes join moe-controller's group (--world 4; no shared directory); the engine
# driver runs steps the whole time, every output checked against the semantic computation, with
# UNAVAILABLE / ABORTED / DEADLINE_EXCEEDED counted as retryable (--tolerate_faults).
#   1. 20 times, at a random point: kill -9 a random rank and start its replacement (same rank
#      id, new process). Every step is correct or retryable, never wrong; the group serves a new
#      epoch after each; the time from the replacement's start to the first correct step is
#      printed as a distribution and must stay within 10 s.
#   2. A rank killed with no replacement: after --survivor_grace_s the controller forms an epoch
#      over the survivors, which refuse it (the lost rank held the only copy of some experts), so
#      the group waits; the replacement brings it back.
#   3. A placement with every expert on two ranks: a lost rank is re-formed around, and the three
#      survivors serve steps correctly.
#   4. moe-controller killed -9 and restarted under load: the ranks keep serving, the controller
#      adopts their epoch (no re-form), and no step fails.
#
# WORLD (default 4) ranks; on a machine with WORLD GPUs and moe-rankd's CUDA backend beside it
# (tools/gpu_bundle.sh; bench/gpu/group_recovery.sh) the ranks run CUDA kernels over NCCL, whose
# communicator is rebuilt for every epoch. D and DFF set the checkpoint's shape (16 experts).
set -uo pipefail
RANKD="$1" DRIVER="$2" MOECTL="$3" CONTROLLER="$4"
KILLS="${KILLS:-20}"
WORLD="${WORLD:-4}"
MODEL="--experts 16 --d ${D:-64} --d_ff ${DFF:-128}"
victim=$((WORLD - 1))
work="$(mktemp -d "${TEST_TMPDIR:-/tmp}/groupkill.XXXXXX")"
source deploy/cluster_lib.sh
source tests/control/check_lib.sh
SKIP_BUILD=1 choose_backend "$WORLD"
echo "     $WORLD ranks: $BACKEND_NAME"
ctl_pid="" driver=""
trap '[ -n "$driver" ] && kill "$driver" 2>/dev/null; stop_ranks; [ -n "$ctl_pid" ] && kill "$ctl_pid" 2>/dev/null; true' EXIT
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/token"
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/agent_token"
"$MOECTL" checkpoint synth --layers 2 --family qwen3_moe $MODEL --seed 5 \
  --version checkpoint-0001 --out "$work/model" >/dev/null
now_ms() { date +%s%3N; }
fails=0
bad() {
  echo "FAIL $*"
  fails=$((fails + 1))
}

start_controller() {  # start_controller EXTRA_FLAGS...
  rm -f "$work/ctl.port"
  "$CONTROLLER" --store "$work/registry.db" --token_file "$work/token" --world "$WORLD" \
    --agent_token_file "$work/agent_token" --port_file "$work/ctl.port" --metrics_port_file "$work/ctl.metrics" \
    "$@" >>"$work/controller.log" 2>&1 &
  ctl_pid=$!
  for _ in $(seq 100); do [ -s "$work/ctl.port" ] && break; sleep 0.1; done
  CONTROLLER_ADDR="127.0.0.1:$(cat "$work/ctl.port")"
  C=(--controller "$CONTROLLER_ADDR" --token_file "$work/token")
}
group_json() { "$MOECTL" "${C[@]}" --json group status 2>/dev/null; }
# serving_epoch: the epoch the group serves (0 while it re-forms).
serving_epoch() {
  group_json | python3 -c 'import json,sys; s=json.load(sys.stdin); print(s["view"].get("epoch",0) if s.get("state")=="SERVING" else 0)' 2>/dev/null || echo 0
}
# await_serving ABOVE MEMBERS TIMEOUT_S: until the group serves an epoch above ABOVE with MEMBERS members.
await_serving() {
  local above="$1" members="$2" deadline=$(($(date +%s) + $3)) s
  while [ "$(date +%s)" -le "$deadline" ]; do
    s="$(group_json | python3 -c 'import json,sys; s=json.load(sys.stdin); v=s.get("view",{}); print(int(v.get("epoch",0)), len(v.get("members",[])), s.get("state"))' 2>/dev/null)"
    set -- $s
    if [ "${3:-}" = SERVING ] && [ "${1:-0}" -gt "$above" ] && [ "${2:-0}" -eq "$members" ]; then echo "$1"; return 0; fi
    sleep 0.05
  done
  return 1
}

# --- 1. kill -9 under load, replacements --------------------------------------------------------
start_controller --reconcile_interval_s 1
start_ranks "$RANKD" "$work" "$WORLD" "$work/model" --agent_token_file "$work/agent_token" --timeout_ms 3000
epoch="$(await_serving 0 "$WORLD" 30)" || { bad "the group did not form"; tail -20 "$work/controller.log"; exit 1; }
echo "ok   $WORLD ranks joined through the controller: serving epoch $epoch"
group_json | python3 -c 'import json,sys; s=json.load(sys.stdin); print("     nodes:", s["view"]["nodeOfRank"])'
"$DRIVER" --port_dir "$work/ports" --world "$WORLD" --checkpoint "$work/model" --rounds 1 --until_file "$work/stop" \
  --tolerate_faults --events_file "$work/events" --max_retries 2 >"$work/driver.log" 2>&1 &
driver=$!
sleep 2
: >"$work/recoveries"
for ((i = 1; i <= KILLS; i++)); do
  sleep "0.$((RANDOM % 9 + 1))"
  r=$((RANDOM % WORLD))
  kill -9 "${RANK_PIDS[$r]}" 2>/dev/null
  wait "${RANK_PIDS[$r]}" 2>/dev/null
  start_ms="$(now_ms)"
  start_rank "$r" nowait
  if ! next="$(await_serving "$epoch" "$WORLD" 30)"; then
    bad "kill $i (rank $r): no epoch served within 30 s of the replacement starting"
    tail -5 "$work/controller.log"
    break
  fi
  ready_ms="$(now_ms)"
  # The first correct step after the replacement started.
  first_ok=""
  for _ in $(seq 600); do
    first_ok="$(awk -v t="$start_ms" '$1 >= t && $2 == "ok" {print $1; exit}' "$work/events")"
    [ -n "$first_ok" ] && break
    sleep 0.05
  done
  echo "$i $r $epoch $next $((ready_ms - start_ms)) $([ -n "$first_ok" ] && echo $((first_ok - start_ms)) || echo none)" \
    >>"$work/recoveries"
  epoch="$next"
done
touch "$work/stop"
wait "$driver"
rc=$?
driver=""
echo "     kill  rank  epoch  ->  epoch  serving_ms  first_ok_step_ms"
awk '{printf "     %4s  %4s  %5s  ->  %5s  %10s  %16s\n", $1, $2, $3, $4, $5, $6}' "$work/recoveries"
grep -E "^  (rank-steps|mismatches|steps retried)" "$work/driver.log" | sed 's/^/     /'
[ "$rc" -eq 0 ] || { bad "driver: a step failed with a non-retryable error or a wrong output (rc $rc)"; tail -20 "$work/driver.log"; }
n="$(wc -l <"$work/recoveries")"
[ "$n" -eq "$KILLS" ] || bad "$n of $KILLS kills recovered"
echo "     epochs re-formed on a rank's data-plane report: $(grep -c 'reports epoch .* failed' "$work/controller.log")"
python3 - "$work/recoveries" <<'EOF' || fails=$((fails + 1))
import math, sys
rows = [l.split() for l in open(sys.argv[1])]
ok = [int(r[5]) for r in rows if r[5] != "none"]
for r in rows:
    if r[5] != "none" and int(r[5]) > 10000:
        print("     kill %s: the first correct step came %s ms after the replacement started" % (r[0], r[5]))
serving = [int(r[4]) for r in rows]
# A recovery with no correct step for 30 s: some rank serves the epoch but its steps keep failing
# (a data plane that failed inside the epoch and was not re-formed).
stalls = [r[0] for r in rows if r[5] == "none"]
if stalls:
    print("FAIL kill(s) %s: no correct step within 30 s of the replacement starting" % ", ".join(stalls)); sys.exit(1)
if not ok:
    print("FAIL no recovery saw a correct step"); sys.exit(1)
q = lambda v, p: sorted(v)[max(1, math.ceil(p * len(v) - 1e-9)) - 1]  # 0x0DA's nearest rank
print("ok   replacement start -> new epoch serving on every rank: min %d ms, median %d ms, p90 %d ms, max %d ms" %
      (min(serving), q(serving, 0.5), q(serving, 0.9), max(serving)))
print("     replacement start -> the engine driver's first correct step: min %d ms, median %d ms, p90 %d ms, "
      "max %d ms" % (min(ok), q(ok, 0.5), q(ok, 0.9), max(ok)))
if max(serving) > 10000:
    print("FAIL the group served a new epoch more than 10 s after a replacement started"); sys.exit(1)
EOF
# Every series the alert and recording rules read exists in live scrapes of a rank and the controller.
curl -s "http://127.0.0.1:$(cat "$work/metrics/0.port")/metrics" >"$work/scrape_rank.txt"
curl -s "http://127.0.0.1:$(cat "$work/ctl.metrics")/metrics" >"$work/scrape_controller.txt"
# An interpreter with PyYAML: Debian's python3-yaml here, the image's python3 on the GPU machine.
rules_py=/usr/bin/python3
/usr/bin/python3 -c 'import yaml' 2>/dev/null || rules_py=python3
check "the Prometheus rules read only series the daemons export" 0 "^ok" -- "$rules_py" \
  tools/check_rule_metrics.py deploy/prometheus/moe-rules.yml "$work/scrape_rank.txt" "$work/scrape_controller.txt"
stop_ranks
kill "$ctl_pid" 2>/dev/null
wait "$ctl_pid" 2>/dev/null
ctl_pid=""

if [ "$WORLD" -lt 2 ]; then
  echo "     (parts 2 and 3 need survivors: WORLD >= 2)"
else
# --- 2. no replacement, a placement that needs the lost rank: the group waits --------------------
start_controller --reconcile_interval_s 1 --survivor_grace_s 1
start_ranks "$RANKD" "$work" "$WORLD" "$work/model" --agent_token_file "$work/agent_token" --timeout_ms 3000
epoch="$(await_serving 0 "$WORLD" 30)" || bad "the group did not form again"
kill -9 "${RANK_PIDS[$victim]}"
wait "${RANK_PIDS[$victim]}" 2>/dev/null
sleep 4
state="$(group_json | python3 -c 'import json,sys; s=json.load(sys.stdin); print(s["state"], "|", s["reason"])')"
case "$state" in
  WAITING*"could not serve"*"no replica"*) echo "ok   survivors refuse an epoch without rank $victim's experts: $state" ;;
  *) bad "survivors without a replacement: $state" ;;
esac
# Readiness (gRPC health of the engine API) follows the epoch; liveness stays SERVING.
engine_health() { /usr/bin/python3 tools/health_probe.py "$(cat "$work/ports/0.engine")" moe.v1.ExpertLayerService; }
check "a survivor's engine API is NOT_SERVING while the group waits" 1 "^NOT_SERVING" -- engine_health
check "its process is alive (health of the whole server)" 0 "^SERVING" -- /usr/bin/python3 tools/health_probe.py \
  "$(cat "$work/ports/0.engine")"
start_rank "$victim" nowait
if e="$(await_serving "$epoch" "$WORLD" 30)"; then echo "ok   the replacement brings the group back: epoch $e"; else bad "no epoch after the replacement"; fi
check "the engine API is SERVING again" 0 "^SERVING" -- engine_health
stop_ranks
kill "$ctl_pid" 2>/dev/null
wait "$ctl_pid" 2>/dev/null
ctl_pid=""

# --- 3. every expert on two ranks: the survivors re-form and serve -------------------------------
start_controller --reconcile_interval_s 1 --survivor_grace_s 1
start_ranks "$RANKD" "$work" "$WORLD" "$work/model" --agent_token_file "$work/agent_token" --timeout_ms 3000 \
  --extra_replicas 16
epoch="$(await_serving 0 "$WORLD" 30)" || bad "the replicated group did not form"
kill -9 "${RANK_PIDS[$victim]}"
wait "${RANK_PIDS[$victim]}" 2>/dev/null
if e="$(await_serving "$epoch" "$victim" 15)"; then
  echo "ok   every expert still has a copy: the survivors serve epoch $e without rank $victim"
  check "the survivors' steps are correct" 0 "mismatches *0" -- "$DRIVER" --port_dir "$work/ports" --world "$victim" \
    --checkpoint "$work/model" --rounds 1
else
  bad "the survivors did not re-form"
  tail -5 "$work/controller.log"
fi
fi

# --- 4. a controller restart under load: the ranks keep serving, the controller adopts their epoch
stop_ranks
if [ -n "$ctl_pid" ]; then kill "$ctl_pid" 2>/dev/null; wait "$ctl_pid" 2>/dev/null; fi
start_controller --reconcile_interval_s 1
start_ranks "$RANKD" "$work" "$WORLD" "$work/model" --agent_token_file "$work/agent_token" --timeout_ms 3000
epoch="$(await_serving 0 "$WORLD" 30)" || bad "the group did not form before the controller restart"
"$DRIVER" --port_dir "$work/ports" --world "$WORLD" --checkpoint "$work/model" --rounds 1 --until_file "$work/stop4" \
  >"$work/driver4.log" 2>&1 &
driver=$!
sleep 1
kill -9 "$ctl_pid"
wait "$ctl_pid" 2>/dev/null
sleep 1  # steps go on with no controller
# The same address (not port 0): the ranks hold it and reconnect there.
start_controller --reconcile_interval_s 1 --listen "$CONTROLLER_ADDR"
if e="$(await_serving $((epoch - 1)) "$WORLD" 30)" && [ "$e" = "$epoch" ]; then
  echo "ok   controller killed and restarted: epoch $epoch adopted, no re-form ($(group_json | python3 -c 'import json,sys; print(json.load(sys.stdin)["reason"])'))"
else
  bad "after the controller restart the group serves epoch ${e:-none}, not the adopted $epoch"
  tail -5 "$work/controller.log"
fi
sleep 1
touch "$work/stop4"
wait "$driver"
rc=$?
driver=""
if [ "$rc" -eq 0 ]; then
  echo "ok   no step failed across the controller restart ($(grep -E '^  rank-steps' "$work/driver4.log" | tr -s ' '))"
else
  bad "a step failed across the controller restart (driver rc $rc)"
  tail -5 "$work/driver4.log"
fi
fails=$((fails + fail))
[ "$fails" -eq 0 ] && echo "PASS" || { echo "$fails failures"; exit 1; }
