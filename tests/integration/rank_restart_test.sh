#!/usr/bin/env bash
# A moe-rankd that restarts re-registers its generations: moe-controller (--reconcile_interval_s 1)
# sees the restarted rank serving its boot placement instead of the ACTIVE release's, prepares
# the release's placement on it again (from the manifest the registry recorded) and activates it.
set -uo pipefail
RANKD="$1" MOECTL="$2" CONTROLLER="$3"
work="$(mktemp -d "${TEST_TMPDIR:-/tmp}/restart.XXXXXX")"
source tests/control/check_lib.sh
rank_pid="" ctl_pid=""
trap '[ -n "$rank_pid" ] && kill -9 "$rank_pid" 2>/dev/null; [ -n "$ctl_pid" ] && kill -9 "$ctl_pid" 2>/dev/null; true' EXIT
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/token"
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/agent_token"
"$MOECTL" checkpoint synth --experts 8 --d 64 --d_ff 128 --seed 3 --out "$work/model" >/dev/null
start_rank() {  # start_rank LISTEN
  rm -f "$work/rank.port"
  mkdir -p "$work/rv"
  "$RANKD" --rank 0 --world 1 --rendezvous_dir "$work/rv" --checkpoint "$work/model" --listen "$1" \
    --port_file "$work/rank.port" --agent_token_file "$work/agent_token" >>"$work/rank.log" 2>&1 &
  rank_pid=$!
  for _ in $(seq 100); do [ -s "$work/rank.port" ] && return 0; sleep 0.1; done
  echo "FAIL rank did not start"; cat "$work/rank.log"; exit 1
}
start_rank 127.0.0.1:0
port="$(cat "$work/rank.port")"
"$CONTROLLER" --store "$work/registry.db" --token_file "$work/token" --ranks "127.0.0.1:$port" \
  --agent_token_file "$work/agent_token" --port_file "$work/ctl.port" --reconcile_interval_s 1 \
  >"$work/controller.log" 2>&1 &
ctl_pid=$!
for _ in $(seq 100); do [ -s "$work/ctl.port" ] && break; sleep 0.1; done
C=(--controller "127.0.0.1:$(cat "$work/ctl.port")" --token_file "$work/token")
EV=deploy/examples/promotion-evidence.json

"$MOECTL" placement synth --checkpoint "$work/model" --world 1 --placement_version 2 --extra_replicas 3 \
  >"$work/v2.json"
"$MOECTL" "${C[@]}" release register release-v2 --digest sha256:v2 >/dev/null
"$MOECTL" "${C[@]}" release transition release-v2 VERIFIED --reason ok >/dev/null
check "load placement-v2" 0 "LOADED" -- "$MOECTL" "${C[@]}" placement load release-v2 --manifest "$work/v2.json"
"$MOECTL" "${C[@]}" release transition release-v2 SHADOW --reason s >/dev/null
"$MOECTL" "${C[@]}" release transition release-v2 CANARY --reason c >/dev/null
check "promote v2" 0 "release-v2 ACTIVE" -- "$MOECTL" "${C[@]}" promote release-v2 --evidence "$EV"
check "the rank serves v2" 0 "v2 ACTIVE" -- "$MOECTL" "${C[@]}" status

kill -9 "$rank_pid"; wait "$rank_pid" 2>/dev/null
start_rank "127.0.0.1:$port"   # back on the address the controller knows, with only placement-v1
ok=1
for _ in $(seq 50); do
  "$MOECTL" "${C[@]}" status >"$work/status.txt" 2>&1
  grep -Eq "^0 +127.0.0.1:$port +v2 " "$work/status.txt" && { ok=0; break; }
  sleep 0.2
done
cat "$work/status.txt" | sed 's/^/     /'
verdict() { if [ "$1" = 0 ]; then echo "ok   $2"; else echo "FAIL $2"; fail=1; fi; }
[ "$(grep -c "(TCP port $port:" "$work/rank.log")" = 2 ]; verdict $? "the rank process restarted on its address"
verdict "$ok" "the restarted rank is back on placement-v2 within seconds"
grep -q "reconcile: every rank serves placement-v2 of release-v2 again" "$work/controller.log"
verdict $? "the controller logged the re-registration"
grep -Eq "v1 DRAINING/0  v2 ACTIVE/0 \(r[0-9]+ d[0-9]+ c0 l[0-9]+\)" "$work/status.txt"
verdict $? "placement-v2 prepared again on the restarted rank (a fresh process, booted on placement-v1)"
exit $fail
