#!/usr/bin/env bash
# Rows of the spec's fault table (0x0E) on real processes: four moe-rankd (UCX, rank agents on),
# moe-controller driving them, the engine driver sending steps.
#  - process-group generation differs   -> the placement load is rejected (nothing committed)
#  - release coordinates differ (0x0CB: a bundle's decode bucket is not rank 1's) -> the rank
#                                           refuses the placement load, naming the field
#  - runner parity differs (rank 2's trial passes compute something else, --inject_fault
#    trial_drift)                        -> shadow mismatches counted, the candidate blocked at
#                                           SHADOW -> CANARY and drained by the controller (never
#                                           CANARY, no canary step served by it), then retired;
#                                           the engine never sees a wrong output (driver exit 0)
#  - stale handle under a new generation -> every rank rejects the step naming the generation,
#                                           the engine re-plans and is served
#  - graph key differs (rank 1 has another decode bucket) -> every rank serves decode steps
#                                           eagerly with reason graph_key_mismatch
# (peer counts disagreeing and a killed peer: local_cluster_test; a faulting active candidate
# rolled back: live_rollout_test; a controller killed mid-rollout: controller_kill_test.)
set -uo pipefail
RANKD="$1" DRIVER="$2" M="$3" CONTROLLER="$4"
source deploy/cluster_lib.sh
source tests/control/check_lib.sh
work="$(mktemp -d "${TEST_TMPDIR:-/tmp}/faults.XXXXXX")"
ctl_pid="" driver=""
trap '[ -n "$driver" ] && kill "$driver" 2>/dev/null; [ -n "$ctl_pid" ] && kill "$ctl_pid" 2>/dev/null; stop_ranks' EXIT
token() { head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$1"; }
token "$work/token"
token "$work/agent_token"
"$M" checkpoint synth --experts 16 --d 64 --d_ff 128 --seed 5 --out "$work/model" >/dev/null
RANK1_FLAGS="--decode_bucket_tokens 4" RANK2_FLAGS="--inject_fault trial_drift" start_ranks "$RANKD" "$work" 4 "$work/model" \
  --agent_token_file "$work/agent_token" --timeout_ms 5000 || exit 1
ranks="$(for r in 0 1 2 3; do printf '127.0.0.1:%s,' "$(cat "$work/ports/$r.port")"; done)"
"$CONTROLLER" --store "$work/registry.db" --token_file "$work/token" --ranks "${ranks%,}" \
  --agent_token_file "$work/agent_token" --port_file "$work/ctl.port" --shadow_every 2 --canary_every 3 \
  --min_shadow 10 --min_canary 10 --max_fallback_ratio 1 >"$work/controller.log" 2>&1 &
ctl_pid=$!
for _ in $(seq 100); do [ -s "$work/ctl.port" ] && break; sleep 0.1; done
C=(--controller "127.0.0.1:$(cat "$work/ctl.port")" --token_file "$work/token")

# The placement the ranks booted on, registered and promoted with operator evidence.
"$M" placement synth --checkpoint "$work/model" --world 4 --placement_version 1 --extra_replicas 2 >"$work/v1.json"
check "bootstrap release-v1" 0 "release-v1 ACTIVE" -- "$M" "${C[@]}" rollout release-v1 --manifest "$work/v1.json" \
  --digest sha256:v1 --min_shadow 0 --min_canary 0 --evidence deploy/examples/promotion-evidence.json

# Process-group generation differs -> reject load.
"$M" placement synth --checkpoint "$work/model" --world 4 --placement_version 9 --extra_replicas 2 \
  --epoch 2 >"$work/v9.json"
"$M" "${C[@]}" release register release-v9 --digest sha256:v9 >/dev/null
"$M" "${C[@]}" release transition release-v9 VERIFIED --reason ok >/dev/null
check "process-group epoch differs: load rejected" 1 "epoch" -- "$M" "${C[@]}" placement load release-v9 --manifest "$work/v9.json"
check "nothing committed for it" 0 "release-v9 *VERIFIED" -- "$M" "${C[@]}" releases list

# Release bundle coordinates differ (0x0CB): a bundle naming decode bucket 8 is refused by rank 1,
# which runs --decode_bucket_tokens 4; nothing is committed for it.
"$M" placement synth --checkpoint "$work/model" --world 4 --placement_version 7 --extra_replicas 2 >"$work/v7.json"
# The bundle names the node each rank is on (moectl status --json); a copy naming another node for
# rank 2 never reaches VERIFIED.
nodes="$("$M" "${C[@]}" status --json | python3 -c 'import json,sys; print(",".join(r["status"].get("node","") for r in json.load(sys.stdin)["ranks"]))')"
"$M" bundle make --release release-v8 --checkpoint "$work/model" --manifest "$work/v7.json" --world 4 \
  --decode_bucket_tokens 8 --nodes "$(echo "$nodes" | awk -F, -v OFS=, '{$3="host-elsewhere"; print}')" \
  --out "$work/b8.json" >/dev/null
"$M" "${C[@]}" release register release-v8 --bundle "$work/b8.json" >/dev/null
check "bundle expecting rank 2 on another node: VERIFIED refused" 1 "topology.nodes\[2\]: the bundle expects node host-elsewhere, rank 2 is on" -- \
  "$M" "${C[@]}" release transition release-v8 VERIFIED --reason "controller verifies"
check "the refused bundle's release stays BUILT" 0 "release-v8 *BUILT" -- "$M" "${C[@]}" releases list
"$M" bundle make --release release-v7 --checkpoint "$work/model" --manifest "$work/v7.json" --world 4 \
  --decode_bucket_tokens 8 --nodes "$nodes" --out "$work/b7.json" >/dev/null
"$M" "${C[@]}" release register release-v7 --bundle "$work/b7.json" >/dev/null
check "bundle verified by the controller" 0 "-> VERIFIED" -- "$M" "${C[@]}" release transition release-v7 VERIFIED --reason "controller verifies"
check "bundle runtime coordinates differ: a rank refuses" 1 "runtime.decode_bucket_tokens: the release bundle says 8, rank 1 runs 4" -- \
  "$M" "${C[@]}" placement load release-v7
check "nothing committed for the refused bundle" 0 "release-v7 *VERIFIED" -- "$M" "${C[@]}" releases list

# Runner parity differs -> block canary.
"$DRIVER" --port_dir "$work/ports" --world 4 --checkpoint "$work/model" --rounds 1 --until_file "$work/stop" \
  --ready_file "$work/ready" >"$work/driver.log" 2>&1 &
driver=$!
for _ in $(seq 300); do [ -e "$work/ready" ] && break; sleep 0.1; done
"$M" placement synth --checkpoint "$work/model" --world 4 --placement_version 2 --extra_replicas 6 >"$work/v2.json"
check "runner parity differs: canary blocked" 1 "blocked at SHADOW -> CANARY and drained: .*shadow mismatches" -- \
  "$M" "${C[@]}" rollout release-v2 --manifest "$work/v2.json" --digest sha256:v2 --min_shadow 10 --min_canary 10
check "the candidate is drained by the controller" 0 "release-v2 *DRAINING" -- "$M" "${C[@]}" releases list
verdict() { if [ "$1" = 0 ]; then echo "ok   $2"; else echo "FAIL $2"; fail=1; fi; }
"$M" "${C[@]}" releases show release-v2 >"$work/v2-history.txt"
grep -Eq "SHADOW +-> DRAINING .*canary blocked: runner parity differs" "$work/v2-history.txt" &&
  ! grep -Eq -- "-> CANARY" "$work/v2-history.txt"
verdict $? "release-v2 went SHADOW -> DRAINING, never CANARY"
sed 's/^/     /' "$work/v2-history.txt"
"$M" "${C[@]}" status --json >"$work/status.json"
grep -Eq '"shadowMismatches": "[1-9][0-9]*"' "$work/status.json"
verdict $? "shadow mismatches counted on the ranks"
! grep -q '"trial": {[^}]*"version": "2"' <(tr -d '\n' <"$work/status.json")
verdict $? "trials of v2 stopped on every rank"
# No canary step was served by the candidate, on any rank (metric absent or 0).
served=0
for r in 0 1 2 3; do
  curl -s "http://127.0.0.1:$(cat "$work/metrics/$r.port")/metrics" >"$work/scrape$r.txt"
  grep -Eq '^moe_generation_steps_total\{.*placement_generation="2".*kind="canary".*\} [1-9]' "$work/scrape$r.txt" &&
    served=1
done
[ "$served" = 0 ]; verdict $? "no canary step served by placement-v2 (moe_generation_steps_total kind=canary)"
grep -Eq '^moe_shadow_steps_total\{.*placement_generation="2".*result="mismatch".*\} [1-9]' "$work/scrape2.txt"
verdict $? "rank 2 exports its shadow mismatches (moe_shadow_steps_total)"
# Spec 0x0DB's stale-handle acceptance counter, per generation: exported, and 0 (no fence broke).
grep -Eq '^moe_stale_accepts_total\{.*placement_generation="2".*\} 0$' "$work/scrape2.txt" &&
  ! grep -Eq '^moe_stale_accepts_total\{.*\} [1-9]' "$work/scrape2.txt"
verdict $? "rank 2 exports stale-handle acceptances per generation, none (moe_stale_accepts_total)"
if command -v promtool >/dev/null; then promtool check metrics <"$work/scrape2.txt"; verdict $? "promtool check metrics"; fi
check "a re-run of the rollout does not resurrect it" 1 "DRAINING" -- "$M" "${C[@]}" rollout release-v2 \
  --manifest "$work/v2.json" --min_shadow 10 --min_canary 10
check "the blocked candidate is retired" 0 "DRAINING -> RETIRED" -- "$M" "${C[@]}" drain release-v2 \
  --reason "runner parity differs"
check "every rank serves v1 again, trials stopped" 0 "v2 RETIRED/0" -- "$M" "${C[@]}" status
touch "$work/stop"
wait "$driver"
driver_rc=$?
driver=""
# The engine got only correct outputs: no failed step, no mismatch with the semantic reference,
# no generation split (steps aborted on every rank while trials changed are retried by the driver).
verdict $driver_rc "engine driver exit 0 (no failed step, no wrong output served)"
[ "$driver_rc" = 0 ] || tail -30 "$work/driver.log"
grep -E "^  (rank-steps|mismatches|steps retried|canary steps)" "$work/driver.log" | sed 's/^/     /'
! grep -q "^  canary steps" "$work/driver.log"
verdict $? "the engine was served no canary step"

# Graph key differs -> explicit eager fallback, on every rank alike (rank 0's scrape).
curl -s "http://127.0.0.1:$(cat "$work/metrics/0.port")/metrics" >"$work/scrape0.txt"
grep -Eq '^moe_decode_fallbacks_total\{.*reason="graph_key_mismatch".*\} [1-9]' "$work/scrape0.txt"
verdict $? "graph key differs on rank 1: decode steps fall back with graph_key_mismatch on rank 0 too"
! grep -Eq '^moe_decode_fallbacks_total\{.*reason="stable_buffer_unavailable".*\} [1-9]' "$work/scrape0.txt"
verdict $? "... before any other clause is looked at"

# Stale handle under a new generation -> reject handle and re-plan.
"$DRIVER" --port_dir "$work/ports" --world 4 --checkpoint "$work/model" --fault stale_generation \
  >"$work/stale.log" 2>&1
verdict $? "stale generation: every rank refuses naming expected_generation; the re-planned step is served"
sed 's/^/     /' "$work/stale.log"
exit $fail
