#!/usr/bin/env bash
# A placement rollout and rollback under live traffic on a local cluster: RANKS moe-rankd
# processes with their RankAgentService on, moe-controller driving them, and the engine driver
# running steps (every output checked against the semantic computation) the whole time.
#   release-v1 = the placement the ranks start with (placement-v1), registered and promoted;
#   release-v2 = placement-v2, computed by EPLB from the expert load the ranks observed (expert 0 is
#                hot in half of the driver's steps), loaded on every rank beside v1, tried in
#                SHADOW (sampled steps also run on v2, outputs compared) and CANARY (sampled
#                steps served by v2), promoted through the gate read from the ranks' counters
#                (every rank switches new steps to v2), then rolled back: every rank
#                re-activates v1, drains v2's handles to zero and retires it.
# The gate's thresholds are lowered for a demo of seconds (10 shadow and canary samples), and
# its fallback ratio is not enforced: CPU ranks have no decode graphs and the driver sends
# oversize decode steps on purpose.
# Exit status: the driver's (0 = no failed step, no mismatch, no step split across generations).
set -euo pipefail
cd "$(dirname "$0")/.."
RANKS="${RANKS:-4}"
# Binaries: built here unless given (the integration test passes Bazel's test-runfiles copies).
RANKD="${RANKD:-bazel-bin/server/moe-rankd}" DRIVER="${DRIVER:-bazel-bin/server/engine_driver}"
M="${MOECTL:-bazel-bin/control/moectl}" CONTROLLER="${CONTROLLER:-bazel-bin/control/controller/moe-controller}"
if [ -z "${SKIP_BUILD:-}" ]; then
  targets=(//server:moe-rankd //server:engine_driver //control:moectl //control/controller:moe-controller)
  bazel build "${targets[@]}" >/dev/null 2>&1 || bazel build "${targets[@]}"
fi
source deploy/cluster_lib.sh
work="$(mktemp -d "${TEST_TMPDIR:-/tmp}/rollout.XXXXXX")"
ctl_pid=""
driver=""
# A failed step of the walk (set -e) must not leave the live-traffic driver running: it would
# retry against the stopped ranks until its --until_file appears, which is never.
trap '{ [ -z "$driver" ] || kill "$driver" 2>/dev/null || true; }; [ -n "$ctl_pid" ] && kill "$ctl_pid" 2>/dev/null;
  stop_ranks; rm -rf "$work"' EXIT
ts() { date +%H:%M:%S.%N | cut -c1-12; }
token() { head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$1"; }
token "$work/token"
token "$work/agent_token"
# Four MoE layers of 16 experts in Hugging Face layout; a slot moves with all its layers.
$M checkpoint synth --layers 4 --family qwen3_moe --experts 16 --d 128 --d_ff 256 --seed 7 --version checkpoint-0001 \
  --out "$work/model" >/dev/null
choose_backend "$RANKS"
echo "$(ts)  $RANKS ranks: $BACKEND_NAME"
# TLS=1: mutual TLS between moectl, the controller and the rank agents (and between the agents
# that copy slots from each other), with a test CA (tools/make_test_ca.sh).
TLS_FLAGS=()
if [ "${TLS:-0}" = 1 ]; then
  tools/make_test_ca.sh "$work/ca" >/dev/null
  TLS_FLAGS=(--tls_cert "$work/ca/node.pem" --tls_key "$work/ca/node.key" --tls_ca "$work/ca/ca.pem")
  export MOE_TLS_CERT="$work/ca/operator.pem" MOE_TLS_KEY="$work/ca/operator.key" MOE_TLS_CA="$work/ca/ca.pem"
  echo "$(ts)  mutual TLS on the control plane and the rank agents (test CA in $work/ca)"
fi
# Expert weights: 3 x d x d_ff BF16 = 196608 bytes an expert in one layer, 786432 a slot with its
# 4 layers; a migration may peak at 40 slots. The controller forms the ranks' process group
# (--world): the ranks join it with --controller, no shared directory.
"$CONTROLLER" --store "$work/registry.db" --token_file "$work/token" \
  --world "$RANKS" --agent_token_file "$work/agent_token" --port_file "$work/ctl.port" \
  --expert_bytes 196608 --migration_budget_bytes $((40 * 786432)) \
  --shadow_every 2 --canary_every 3 --min_shadow 10 --min_canary 10 --max_fallback_ratio 1 \
  ${TLS_FLAGS[@]+"${TLS_FLAGS[@]}"} >"$work/controller.log" 2>&1 &
ctl_pid=$!
for _ in $(seq 100); do [ -s "$work/ctl.port" ] && break; sleep 0.1; done
CONTROLLER_ADDR="127.0.0.1:$(cat "$work/ctl.port")"
start_ranks "$RANKD" "$work" "$RANKS" "$work/model" \
  --agent_token_file "$work/agent_token" ${TLS_FLAGS[@]+"${TLS_FLAGS[@]}"}
C=(--controller "127.0.0.1:$(cat "$work/ctl.port")" --token_file "$work/token")
ctl() { $M "${C[@]}" "$@"; }
# The ranks serve their first epoch; the controller drives their agents once it saw them ready.
for _ in $(seq 100); do ctl status 2>/dev/null | grep -q unreachable || break; sleep 0.1; done
echo "$(ts)  process group: $(ctl group status | head -1)"

walk_and_load() {  # walk_and_load RELEASE MANIFEST_JSON: register, verify, prepare on every rank
  ctl release register "$1" --digest "sha256:$(sha256sum "$2" | cut -c1-16)" >/dev/null
  ctl release transition "$1" VERIFIED --reason "bundle digests checked" >/dev/null
  echo "$(ts)  $(ctl placement load "$1" --manifest "$2")"
}
# release-v1: the placement the ranks started with (preparing it again is a no-op).
$M placement synth --checkpoint "$work/model" --world "$RANKS" --placement_version 1 \
  --extra_replicas 2 >"$work/placement-v1.json"
walk_and_load release-v1 "$work/placement-v1.json"
ctl release transition release-v1 SHADOW --reason "already serving" >/dev/null
ctl release transition release-v1 CANARY --reason "already serving" >/dev/null
# The bootstrap release is the placement the ranks started with: there is nothing to try, so its
# gate inputs come from an operator file.
echo "$(ts)  promote: $(ctl promote release-v1 --evidence deploy/examples/promotion-evidence.json)"

"$DRIVER" --port_dir "$work/ports" --world "$RANKS" --checkpoint "$work/model" \
  --rounds 2 --until_file "$work/stop" --ready_file "$work/ready" >"$work/driver.log" 2>&1 &
driver=$!
for _ in $(seq 300); do [ -e "$work/ready" ] && break; sleep 0.1; done
echo "$(ts)  engine driver running steps"
echo "$(ts)  EPLB over the load the ranks count in two seconds of traffic (moectl rebalance --dry_run --window_s 2):"
ctl rebalance --dry_run --window_s 2 --num_replicas 20 --out "$work/placement-v2.json" --checkpoint "$work/model" \
  --placement_version 2 | grep -E "^(load:|0 |1 |2 |3 |balancedness|wrote|EPLB|EXPERT +ROUTES|RANK)" | sed 's/^/      /'
# release-v2 is a release bundle (moectl bundle make): the checkpoint's per-layer expert digests,
# the EPLB placement, the ranks' runtime coordinates and the topology under one digest. moectl
# rollout walks it under live traffic: register the bundle, VERIFIED once the controller verified
# it itself (every expert re-read, the placement's digests), load the bundle's placement on every
# rank (each checks the bundle's runtime coordinates against its own), SHADOW (every 2nd step
# also runs on placement-v2, its output compared with placement-v1's), CANARY (every 3rd step
# also served by placement-v2), each trial until every rank counted enough, then the promotion
# through the gate read from the ranks' counters (no evidence file).
kernel_build="$(ctl status --json | python3 -c 'import json, sys; print(json.load(sys.stdin)["ranks"][0]["status"]["kernelBuild"])')"
echo "$(ts)  the ranks' kernels build: $kernel_build (moectl status --json: ranks[].status.kernelBuild)"
$M bundle make --release release-v2 --prior release-v1 --checkpoint "$work/model" \
  --manifest "$work/placement-v2.json" --world "$RANKS" --kernel_build "$kernel_build" \
  --out "$work/bundle-v2.json" | sed "s/^/$(ts)  /"
echo "$(ts)  moectl rollout release-v2 --bundle:"
ctl rollout release-v2 --bundle "$work/bundle-v2.json" --min_shadow 20 --min_canary 12 | sed 's/^/      /'
echo "$(ts)  rollout done; what the registry recorded for the bundle:"
ctl releases show release-v2 | grep -E "BUILT +-> VERIFIED|VERIFIED +-> LOADED" | sed 's/^/      /'
sleep 2
echo "$(ts)  cluster after the promotion:"
ctl status | sed 's/^/      /'
echo "$(ts)  rollback release-v2 -> release-v1:"
ctl rollback release-v2 --prior release-v1 --reason "operator rollback under traffic" | sed 's/^/      /'
sleep 2
touch "$work/stop"
set +e
wait "$driver"
status=$?
set -e
retry="$(ctl promote release-v2 --request_id rollout-release-v2:promote 2>&1)" &&
  retry="answered with the recorded result"
echo "$(ts)  a late retry of the v2 promotion was $retry; the ranks stay on: $(ctl status | awk 'NR > 1 {print $3}' | sort -u | xargs)"
$M placement synth --checkpoint "$work/model" --world "$RANKS" --placement_version 4 \
  --extra_replicas 40 >"$work/placement-v4.json"
ctl release register release-v4 --digest sha256:v4 >/dev/null
ctl release transition release-v4 VERIFIED --reason "bundle digests checked" >/dev/null
echo "$(ts)  a 56-slot placement over the memory budget: $(ctl placement load release-v4 --manifest "$work/placement-v4.json" \
  2>&1 | sed 's/.*moectl: [A-Z_]*: //'); ranks now hold: $(ctl status | awk 'NR == 2 {print $4, $5, $6, $7}')"
# A bundle pinning another kernels build is refused by the ranks, nothing committed.
$M placement synth --checkpoint "$work/model" --world "$RANKS" --placement_version 5 --extra_replicas 4 \
  >"$work/placement-v5.json"
$M bundle make --release release-v5 --checkpoint "$work/model" --manifest "$work/placement-v5.json" \
  --world "$RANKS" --kernel_build "cpu:0000000000000000" --out "$work/bundle-v5.json" >/dev/null
ctl release register release-v5 --bundle "$work/bundle-v5.json" >/dev/null
ctl release transition release-v5 VERIFIED --reason "controller verifies" >/dev/null
echo "$(ts)  a bundle pinning another kernels build: $(ctl placement load release-v5 2>&1 | sed 's/.*moectl: [A-Z_]*: //'); release-v5 is $(ctl releases list | awk '$1 == "release-v5" {print $2}')"
echo "$(ts)  stopping the serving release by hand is refused: $(ctl release transition release-v1 DRAINING \
  --reason manual 2>&1 | sed 's/.*moectl: [A-Z_]*: //')"
echo "$(ts)  cluster after the rollback:"
ctl status | sed 's/^/      /'
grep -A20 "== local cluster summary" "$work/driver.log"
if [ -n "${KILL_RANK_CHECK:-}" ]; then
  # A rank dies before the next rollout: loading a placement must stop and say which rank, not hang.
  kill -9 "${RANK_PIDS[1]}"
  $M placement synth --checkpoint "$work/model" --world "$RANKS" --placement_version 3 \
    --extra_replicas 4 >"$work/placement-v3.json"
  ctl release register release-v3 --digest sha256:v3 >/dev/null
  ctl release transition release-v3 VERIFIED --reason "bundle digests checked" >/dev/null
  start_s=$(date +%s)
  if out="$(ctl placement load release-v3 --manifest "$work/placement-v3.json" 2>&1)"; then
    echo "killed rank: placement load succeeded?!"; status=1
  else
    echo "killed rank: placement load refused after $(($(date +%s) - start_s)) s: ${out#*moectl: }"
  fi
  echo "killed rank: release-v3 is $(ctl releases list | awk '$1 == "release-v3" {print $2}')"
fi
[ -n "${KEEP_LOGS:-}" ] && cp "$work/driver.log" "$work/controller.log" "$KEEP_LOGS/" 2>/dev/null
exit $status
