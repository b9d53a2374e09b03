#!/usr/bin/env bash
# The release lifecycle on a real moe-controller: a bearer token, a SQLite registry in a temp
# directory, two releases walked BUILT -> CANARY with moectl, the promotion gate refusing evidence
# with a route mismatch and passing the spec's 0x0D fixture counters, an ordered rollback, a
# SIGKILL + restart that loses nothing, and the transition timeline.
# (The controller does not yet drive rank agents: see docs/api.md, "Control plane".)
set -euo pipefail
cd "$(dirname "$0")/.."
bazel build //control:moectl //control/controller:moe-controller >/dev/null 2>&1 ||
  bazel build //control:moectl //control/controller:moe-controller
work="$(mktemp -d)"
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$work"' EXIT
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/token"
start() {
  rm -f "$work/port"
  bazel-bin/control/controller/moe-controller --store "$work/registry.db" --token_file "$work/token" \
    --port_file "$work/port" >>"$work/controller.log" 2>&1 &
  pid=$!
  for _ in $(seq 100); do [ -s "$work/port" ] && break; sleep 0.1; done
  C=(--controller "127.0.0.1:$(cat "$work/port")" --token_file "$work/token")
}
moectl() { bazel-bin/control/moectl "${C[@]}" "$@"; }
start
for rel in release-v18 release-v19; do
  moectl release register "$rel" --digest "sha256:bundle-$rel" >/dev/null
  for s in VERIFIED LOADED SHADOW CANARY; do moectl release transition "$rel" "$s" --reason "demo: $s" >/dev/null; done
  if [ "$rel" = release-v19 ]; then
    sed 's/"routeMismatches": 0/"routeMismatches": 3/' deploy/examples/promotion-evidence.json >"$work/bad.json"
    echo "-- promote release-v19 with 3 route mismatches in its canary:"
    moectl promote "$rel" --evidence "$work/bad.json" 2>&1 | sed 's/^.*moectl: [A-Z_]*: /   refused: /' || true
  fi
  echo "-- promote $rel with the 0x0D fixture counters: $(moectl promote "$rel" --evidence deploy/examples/promotion-evidence.json)"
done
echo "-- rollback release-v19 to release-v18:"
moectl rollback release-v19 --prior release-v18 --reason "demo: candidate faulted" --request_id demo-rollback | sed 's/^/   /'
moectl release transition release-v19 RETIRED --reason "demo: handles drained" >/dev/null
echo "-- SIGKILL the controller and restart it on the same registry file"
kill -9 "$pid"; wait "$pid" 2>/dev/null || true
start
echo "-- rollback retried after the restart (same request id): $(moectl rollback release-v19 --prior release-v18 \
  --reason 'demo: candidate faulted' --request_id demo-rollback --json | grep -c '"seq"') recorded transitions returned"
echo
moectl releases list
echo
moectl releases show release-v19 | tail -n +4
