#!/usr/bin/env bash
# The hardening findings, on real processes: two moe-rankd (UCX, agent API on TCP) and a hostile
# engine (hostile_client). Each check failed on the code before the fix:
#  - a request whose sizes wrap in 64 bits killed the rank; now INVALID_ARGUMENT
#  - NaN / Inf BF16 rows and an unknown phase were served; now INVALID_ARGUMENT (peer ABORTED)
#  - step ids differing between ranks waited out the 10 s timeout; now ABORTED at once, both ids
#  - a registered region truncated before a step read it: SIGBUS; now FAILED_PRECONDITION
#  - the TCP port served steps, RegisterRegion, health and reflection to anyone; now refused
#  - UCX listened on every interface, gRPC on a second unpublished port; now only the
#    configured interface and one gRPC port
# and afterwards every rank still serves valid steps (the engine driver, outputs checked).
set -uo pipefail
RANKD="$1" DRIVER="$2" M="$3" HOSTILE="$4"
source deploy/cluster_lib.sh
work="$(mktemp -d "${TEST_TMPDIR:-/tmp}/hardening.XXXXXX")"
trap 'stop_ranks' EXIT
fail=0
verdict() { if [ "$1" = 0 ]; then echo "ok   $2"; else echo "FAIL $2"; fail=1; fi; }
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/agent_token"
"$M" checkpoint synth --experts 8 --d 64 --d_ff 128 --seed 3 --out "$work/model" >/dev/null
start_ranks "$RANKD" "$work" 2 "$work/model" --agent_token_file "$work/agent_token" --timeout_ms 10000 || exit 1
t0="$(cat "$work/ports/0.engine")" t1="$(cat "$work/ports/1.engine")"

"$HOSTILE" overflow "$t0"; verdict $? "sizes that wrap in 64 bits are INVALID_ARGUMENT"
kill -0 "${RANK_PIDS[0]}"; verdict $? "rank 0 is alive after them"
"$HOSTILE" bad_values "$t0" "$t1"; verdict $? "non-finite BF16 rows and unknown phases are INVALID_ARGUMENT"
"$HOSTILE" step_mismatch "$t0" "$t1"; verdict $? "differing step ids: ABORTED on both ranks at once"
"$HOSTILE" shrink "$t0" "$t1"; verdict $? "a shrunk region: FAILED_PRECONDITION, its peer ABORTED"
kill -0 "${RANK_PIDS[0]}"; verdict $? "rank 0 is alive after it (no SIGBUS)"
"$HOSTILE" unauthenticated "127.0.0.1:$(cat "$work/ports/0.port")"
verdict $? "the TCP port refuses steps, regions, health and reflection without credentials"

for r in 0 1; do
  pid="${RANK_PIDS[$r]}"
  ss -ltnpH | grep "pid=$pid," >"$work/listen$r.txt"
  ! awk '{print $4}' "$work/listen$r.txt" | grep -vE '^(127\.0\.0\.1|\[::ffff:127\.0\.0\.1\]):[0-9]+$' | grep -q .
  verdict $? "rank $r listens on 127.0.0.1 only ($(awk '{print $4}' "$work/listen$r.txt" | tr '\n' ' '))"
  ports="$(awk '{print $4}' "$work/listen$r.txt" | sed 's/.*://' | tr '\n' ' ')"
  n="$("$HOSTILE" grpc_ports $ports)"
  [ "$n" = 1 ]; verdict $? "rank $r answers gRPC on exactly one TCP port, the published one ($n found)"
done

"$DRIVER" --port_dir "$work/ports" --world 2 --checkpoint "$work/model" --rounds 1 --prefill_tokens 8 \
  >"$work/driver.log" 2>&1
verdict $? "every rank serves valid steps afterwards (engine driver, outputs checked)"
grep -E "mismatch" "$work/driver.log" | tail -2
[ "$fail" = 0 ] || { for r in 0 1; do tail -5 "$work/rank$r.log"; done; }
exit "$fail"
