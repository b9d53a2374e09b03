#!/usr/bin/env bash
# moe-controller end to end on real sockets: bearer-token authentication, the release lifecycle
# through moectl (register, walk, the promotion gate, idempotent retry, ordered rollback), a
# SIGKILLed controller restarting from its SQLite file with nothing lost, the watch stream,
# drain, and a Prometheus scrape.
set -u
CONTROLLER="$1"
MOECTL="$2"
TMP="$(mktemp -d "${TEST_TMPDIR:-/tmp}/controller.XXXXXX")"
source tests/control/check_lib.sh
pid=""
trap '[ -n "$pid" ] && kill -9 "$pid" 2>/dev/null; true' EXIT
start() {
  rm -f "$TMP/port" "$TMP/metrics.port"
  "$CONTROLLER" --store "$TMP/registry.db" --token_file "$TMP/token" --port_file "$TMP/port" \
    --metrics_port_file "$TMP/metrics.port" >>"$TMP/controller.log" 2>&1 &
  pid=$!
  for _ in $(seq 100); do [ -s "$TMP/port" ] && [ -s "$TMP/metrics.port" ] && return 0; sleep 0.1; done
  echo "FAIL controller did not start"; cat "$TMP/controller.log"; exit 1
}

head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TMP/token"
echo "not-the-token-at-all-0000" >"$TMP/wrong"
start
C=(--controller "127.0.0.1:$(cat "$TMP/port")" --token_file "$TMP/token")
W=(--controller "127.0.0.1:$(cat "$TMP/port")" --token_file "$TMP/wrong")

check "wrong token: list" 1 "token rejected" -- "$MOECTL" "${W[@]}" releases list
# $MOE_CONTROLLER and $MOE_TOKEN_FILE stand in for the flags; a failure with --json is a JSON
# error object on stdout, with the exit code in it.
check "environment defaults" 0 "RELEASE" -- env MOE_CONTROLLER="127.0.0.1:$(cat "$TMP/port")" \
  MOE_TOKEN_FILE="$TMP/token" "$MOECTL" releases list
check "json error object" 1 '"error":{"code":"UNAUTHENTICATED".*"exit":1' -- "$MOECTL" "${W[@]}" releases list --json
check "wrong token: register" 1 "token rejected" -- "$MOECTL" "${W[@]}" release register release-v18 --digest sha256:18
check "register needs a digest" 2 "bundle_digest" -- "$MOECTL" "${C[@]}" release register release-v18

cat >"$TMP/pass.json" <<'JSON'
{"hashOk": true, "manifestOk": true, "faultsOk": true, "rollbackOk": true, "shadowSamples": 100,
 "canarySamples": 200, "routesAttempted": 800, "routesDropped": 2, "steps": 240, "fallbackSteps": 24}
JSON
check "wrong token: promote" 1 "token rejected" -- "$MOECTL" "${W[@]}" promote release-v18 --evidence "$TMP/pass.json"
sed 's/"steps": 240/"steps": 240, "routeMismatches": 1, "staleAccepts": 2/' "$TMP/pass.json" >"$TMP/mismatch.json"

walk() {  # walk RELEASE: register and take it to CANARY
  check "register $1" 0 "$1 BUILT" -- "$MOECTL" "${C[@]}" release register "$1" --digest "sha256:$1"
  for s in VERIFIED LOADED SHADOW CANARY; do
    check "$1 -> $s" 0 "-> $s" -- "$MOECTL" "${C[@]}" release transition "$1" "$s" --reason "step $s"
  done
}
walk release-v18
check "ACTIVE only through the gate" 1 "Promote" -- "$MOECTL" "${C[@]}" release transition release-v18 ACTIVE --reason skip
check "promote v18" 0 "release-v18 ACTIVE" -- "$MOECTL" "${C[@]}" promote release-v18 --evidence "$TMP/pass.json"
walk release-v19
check "gate names failing clauses" 1 "N_route_mismatch = 0, N_stale_accept = 0" -- \
  "$MOECTL" "${C[@]}" promote release-v19 --evidence "$TMP/mismatch.json"
check "promote v19 drains v18" 0 "release-v18 DRAINING" -- \
  "$MOECTL" "${C[@]}" promote release-v19 --evidence "$TMP/pass.json" --request_id promote-v19
rows_before="$("$MOECTL" "${C[@]}" releases show release-v19 | grep -c ' -> ')"
check "promote retry is idempotent" 0 "release-v18 DRAINING" -- \
  "$MOECTL" "${C[@]}" promote release-v19 --evidence "$TMP/pass.json" --request_id promote-v19
rows_after="$("$MOECTL" "${C[@]}" releases show release-v19 | grep -c ' -> ')"
[ "$rows_before" = "$rows_after" ] && echo "ok   retry wrote nothing ($rows_after transitions)" || { echo "FAIL retry wrote rows"; fail=1; }
check "request id reused for another request" 1 "request_id" -- \
  "$MOECTL" "${C[@]}" release transition release-v19 DRAINING --reason x --request_id promote-v19
check "rollback needs a DRAINING prior" 2 "prior_release_id" -- \
  "$MOECTL" "${C[@]}" rollback release-v19 --prior release-v19
check "rollback order" 0 "release-v19 *ACTIVE *-> DRAINING.*" -- \
  "$MOECTL" "${C[@]}" rollback release-v19 --prior release-v18 --reason "candidate faulted" --request_id rb-1
"$MOECTL" "${C[@]}" releases show release-v18 >"$TMP/v18.txt"
grep -q "DRAINING   -> ACTIVE" "$TMP/v18.txt" && echo "ok   v18 re-activated after v19 stopped" || { echo "FAIL v18"; cat "$TMP/v18.txt"; fail=1; }
check "retire drained candidate" 0 "DRAINING -> RETIRED" -- \
  "$MOECTL" "${C[@]}" release transition release-v19 RETIRED --reason "handles drained"

# SIGKILL the controller and restart it on the same file: everything committed is still there.
"$MOECTL" "${C[@]}" releases list --json >"$TMP/before.json"
kill -9 "$pid"; wait "$pid" 2>/dev/null
start
C=(--controller "127.0.0.1:$(cat "$TMP/port")" --token_file "$TMP/token")
"$MOECTL" "${C[@]}" releases list --json >"$TMP/after.json"
if cmp -s "$TMP/before.json" "$TMP/after.json"; then echo "ok   registry survives SIGKILL"; else
  echo "FAIL registry changed across restart"; diff "$TMP/before.json" "$TMP/after.json"; fail=1; fi
check "list after restart" 0 "release-v18 *ACTIVE" -- "$MOECTL" "${C[@]}" releases list
check "rollback retry after restart" 0 "release-v18" -- \
  "$MOECTL" "${C[@]}" rollback release-v19 --prior release-v18 --reason "candidate faulted" --request_id rb-1

# Watch: the history of one release at once, then new transitions as they commit.
check "watch replays a release's history" 0 "RETIRED" -- "$MOECTL" "${C[@]}" watch release-v19 --count 7
last="$("$MOECTL" "${C[@]}" watch --json --timeout_s 1 | tail -1 | sed 's/.*"seq": *"\{0,1\}\([0-9]*\).*/\1/')"
"$MOECTL" "${C[@]}" watch --json --after "$last" --count 3 --timeout_s 20 >"$TMP/watch.jsonl" 2>&1 &
watcher=$!
sleep 0.5
check "register v20" 0 "release-v20 BUILT" -- "$MOECTL" "${C[@]}" release register release-v20 --digest sha256:v20
for s in VERIFIED LOADED SHADOW; do
  check "release-v20 -> $s" 0 "-> $s" -- "$MOECTL" "${C[@]}" release transition release-v20 "$s" --reason "step $s"
done
wait "$watcher"
[ "$(grep -c '"releaseId": *"release-v20"' "$TMP/watch.jsonl")" = 3 ] && tail -1 "$TMP/watch.jsonl" | grep -q SHADOW &&
  echo "ok   watch streamed the 3 new transitions in order" || { echo "FAIL watch"; cat "$TMP/watch.jsonl"; fail=1; }
check "drain refuses the serving release" 1 "ACTIVE" -- "$MOECTL" "${C[@]}" drain release-v18
check "drain a shadowed candidate" 0 "DRAINING -> RETIRED" -- "$MOECTL" "${C[@]}" drain release-v20 --reason abandoned
check "register v30" 0 "release-v30 BUILT" -- "$MOECTL" "${C[@]}" release register release-v30 --digest sha256:v30
for s in VERIFIED LOADED; do
  check "release-v30 -> $s" 0 "-> $s" -- "$MOECTL" "${C[@]}" release transition release-v30 "$s" --reason "step $s"
done
check "drain a loaded release that never served" 0 "LOADED -> RETIRED" -- "$MOECTL" "${C[@]}" drain release-v30
check "watch rejects a negative seq" 2 "after" -- "$MOECTL" "${C[@]}" watch --after -1

curl -sf "http://127.0.0.1:$(cat "$TMP/metrics.port")/metrics" >"$TMP/scrape.txt" || { echo "FAIL scrape"; fail=1; }
grep -q 'moe_controller_releases{state="ACTIVE"} 1' "$TMP/scrape.txt" && grep -q 'moe_controller_releases{state="RETIRED"} 3' "$TMP/scrape.txt" \
  && echo "ok   metrics show the registry" || { echo "FAIL metrics"; grep moe_controller "$TMP/scrape.txt"; fail=1; }
if command -v promtool >/dev/null; then
  promtool check metrics <"$TMP/scrape.txt" && echo "ok   promtool check metrics" || { echo "FAIL promtool"; fail=1; }
fi

# Release bundles: the controller computes the digest of a registered bundle and verifies the
# bundle itself before VERIFIED (every expert re-read from the checkpoint, the placement's
# digests); one wrong expert digest in an otherwise consistent bundle never reaches VERIFIED.
"$MOECTL" checkpoint synth --layers 2 --family qwen3_moe --experts 8 --d 64 --d_ff 64 --seed 5 --version ck-21 \
  --out "$TMP/model" >/dev/null
"$MOECTL" placement synth --checkpoint "$TMP/model" --world 4 --placement_version 3 >"$TMP/p3.json"
"$MOECTL" bundle make --release release-v21 --prior release-v18 --checkpoint "$TMP/model" --manifest "$TMP/p3.json" \
  --world 4 --out "$TMP/b21.json" >/dev/null
digest21="$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['digest'])" "$TMP/b21.json")"
check "register a bundle: its digest is the release's" 0 "release-v21 BUILT $digest21" -- \
  "$MOECTL" "${C[@]}" release register release-v21 --bundle "$TMP/b21.json"
check "a bundle with another digest beside it" 2 "bundle_digest" -- \
  "$MOECTL" "${C[@]}" release register release-v21 --bundle "$TMP/b21.json" --digest sha256:other
check "a bundle of another release" 2 "bundle_json.release_id" -- \
  "$MOECTL" "${C[@]}" release register release-v99 --bundle "$TMP/b21.json"
check "the controller verifies the bundle: VERIFIED" 0 "BUILT *-> VERIFIED" -- \
  "$MOECTL" "${C[@]}" release transition release-v21 VERIFIED --reason "bundle verified by the controller"
python3 - "$TMP/b21.json" "$TMP/b22.json" <<'PY'
import hashlib, json, sys
b = json.load(open(sys.argv[1]))
b["release_id"] = "release-v22"
layer = sorted(b["checkpoint"]["digests"])[0]
b["checkpoint"]["digests"][layer][3] = "f" * 64
body = {k: v for k, v in b.items() if k != "digest"}
b["digest"] = "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
json.dump(b, open(sys.argv[2], "w"))
open(sys.argv[2] + ".layer", "w").write(layer)
PY
check "register a bundle with one wrong expert digest" 0 "release-v22 BUILT" -- \
  "$MOECTL" "${C[@]}" release register release-v22 --bundle "$TMP/b22.json"
check "... it never reaches VERIFIED" 1 "VERIFIED refused for release-v22.*checkpoint.digests\[\"$(cat "$TMP/b22.json.layer")\"\]\[3\]" -- \
  "$MOECTL" "${C[@]}" release transition release-v22 VERIFIED --reason "claimed"
check "... and stays BUILT" 0 "release-v22 *BUILT" -- "$MOECTL" "${C[@]}" releases list
# A consistent bundle whose runtime field has the wrong type: refused naming it, the controller
# serving on.
python3 - "$TMP/b21.json" "$TMP/b23.json" <<'PY'
import hashlib, json, sys
b = json.load(open(sys.argv[1]))
b["release_id"] = "release-v23"
b["runtime"]["decode_bucket_tokens"] = "eight"
body = {k: v for k, v in b.items() if k != "digest"}
b["digest"] = "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
json.dump(b, open(sys.argv[2], "w"))
PY
"$MOECTL" "${C[@]}" release register release-v23 --bundle "$TMP/b23.json" >/dev/null
check "a malformed runtime field never reaches VERIFIED" 1 "runtime.decode_bucket_tokens" -- \
  "$MOECTL" "${C[@]}" release transition release-v23 VERIFIED --reason "claimed"
check "... and the controller serves on" 0 "release-v23 *BUILT" -- "$MOECTL" "${C[@]}" releases list
# A read-only token (--read_token_file): moectl's reads work with it, every write is refused
# (PERMISSION_DENIED, exit 1) and commits nothing; the same token as --token_file is refused at
# start (exit 2 naming the flag).
check "read token equal to the operators' refused" 2 "read_token_file: holds the same token" -- \
  "$CONTROLLER" --store "$TMP/other.db" --token_file "$TMP/token" --read_token_file "$TMP/token"
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TMP/read.token"
kill "$pid"; wait "$pid" 2>/dev/null
rm -f "$TMP/port" "$TMP/metrics.port"
"$CONTROLLER" --store "$TMP/registry.db" --token_file "$TMP/token" --read_token_file "$TMP/read.token" \
  --port_file "$TMP/port" --metrics_port_file "$TMP/metrics.port" >>"$TMP/controller.log" 2>&1 &
pid=$!
for _ in $(seq 100); do [ -s "$TMP/port" ] && break; sleep 0.1; done
C=(--controller "127.0.0.1:$(cat "$TMP/port")" --token_file "$TMP/token")
R=(--controller "127.0.0.1:$(cat "$TMP/port")" --token_file "$TMP/read.token")
"$MOECTL" "${C[@]}" releases list --json >"$TMP/before-read.json"
check "read token: list" 0 "release-v23 *BUILT" -- "$MOECTL" "${R[@]}" releases list
check "read token: show" 0 "release-v18" -- "$MOECTL" "${R[@]}" releases show release-v18
check "read token: register refused" 1 "PERMISSION_DENIED: RegisterRelease: the read-only token" -- \
  "$MOECTL" "${R[@]}" release register release-v24 --digest sha256:24
check "read token: transition refused" 1 "PERMISSION_DENIED: TransitionRelease" -- \
  "$MOECTL" "${R[@]}" release transition release-v23 VERIFIED --reason x
check "read token: rollback refused" 1 "PERMISSION_DENIED: Rollback" -- \
  "$MOECTL" "${R[@]}" rollback release-v18 --prior release-v19
"$MOECTL" "${C[@]}" releases list --json >"$TMP/after-read.json"
cmp -s "$TMP/before-read.json" "$TMP/after-read.json" && echo "ok   the read token changed nothing" ||
  { echo "FAIL the read token changed the registry"; diff "$TMP/before-read.json" "$TMP/after-read.json"; fail=1; }
check "operators' token still writes" 0 "release-v24 BUILT" -- \
  "$MOECTL" "${C[@]}" release register release-v24 --digest sha256:24
exit $fail
