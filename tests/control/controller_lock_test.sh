#!/usr/bin/env bash
# One moe-controller per registry file, on real processes: a second controller on the same store
# refuses to start (exit 1) naming the holder's pid and host, and the first one keeps serving
# every write; once the holder is SIGKILLed the lock is gone with it and a new controller starts
# on the same file (the stale holder line left in the lock file does not block it). A controller
# on another file is not affected.
set -u
CONTROLLER="$1"
MOECTL="$2"
TMP="$(mktemp -d "${TEST_TMPDIR:-/tmp}/controller_lock.XXXXXX")"
source tests/control/check_lib.sh
pids=()
trap 'for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done; true' EXIT
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TMP/token"
start() {  # start NAME STORE: a controller in the background; its pid in $started
  rm -f "$TMP/$1.port"
  "$CONTROLLER" --store "$2" --token_file "$TMP/token" --port_file "$TMP/$1.port" --metrics_port_file "" \
    >"$TMP/$1.log" 2>&1 &
  started=$!
  pids+=("$started")
  for _ in $(seq 100); do [ -s "$TMP/$1.port" ] && return 0; sleep 0.1; done
  echo "FAIL controller $1 did not start"; cat "$TMP/$1.log"; exit 1
}

start first "$TMP/registry.db"
first=$started
C=(--controller "127.0.0.1:$(cat "$TMP/first.port")" --token_file "$TMP/token")
check "first controller accepts writes" 0 "release-v1 BUILT" -- \
  "$MOECTL" "${C[@]}" release register release-v1 --digest sha256:v1

# The second one on the same file: refused at start, naming the holder. (Bounded: a controller
# that does start would serve until killed.)
check "second controller on the same registry refuses to start" 1 \
  "held by another moe-controller (pid $first on host $(hostname)" -- \
  timeout 20 "$CONTROLLER" --store "$TMP/registry.db" --token_file "$TMP/token" --port_file "$TMP/second.port" \
  --metrics_port_file ""
[ ! -s "$TMP/second.port" ]; r=$?
[ $r = 0 ] && echo "ok   ... and never served" || { echo "FAIL the second controller served"; fail=1; }
grep -q "pid $first on host" "$TMP/registry.db.lock" && echo "ok   the lock file names the holder" ||
  { echo "FAIL lock file"; cat "$TMP/registry.db.lock"; fail=1; }
check "the first keeps serving writes" 0 "release-v1 BUILT -> VERIFIED" -- \
  "$MOECTL" "${C[@]}" release transition release-v1 VERIFIED --reason ok
check "another registry file is another lock" 0 "served" -- bash -c "
  '$CONTROLLER' --store '$TMP/other.db' --token_file '$TMP/token' --port_file '$TMP/other.port' --metrics_port_file '' \
    >'$TMP/other.log' 2>&1 & p=\$!
  for _ in \$(seq 100); do [ -s '$TMP/other.port' ] && break; sleep 0.1; done
  [ -s '$TMP/other.port' ] && echo served; r=\$?; kill \$p; wait \$p; exit \$r"

# The holder dies without cleaning up: the kernel drops its lock, a new controller takes over.
kill -9 "$first"; wait "$first" 2>/dev/null
start third "$TMP/registry.db"
third=$started
grep -q "pid $third on host" "$TMP/registry.db.lock" && echo "ok   a new controller takes over after SIGKILL" ||
  { echo "FAIL takeover"; cat "$TMP/third.log" "$TMP/registry.db.lock"; fail=1; }
C=(--controller "127.0.0.1:$(cat "$TMP/third.port")" --token_file "$TMP/token")
check "... with every write the first one made" 0 "release-v1 *VERIFIED" -- "$MOECTL" "${C[@]}" releases list
exit $fail
