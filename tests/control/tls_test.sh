#!/usr/bin/env bash
# The control plane over mutual TLS (rpc/tls.h), test CAs from tools/make_test_ca.sh: moectl with
# the controller's CA and a client certificate of it is served; a client of another CA, a client
# certificate of another CA and a plaintext client are refused (exit 3: the handshake fails);
# the controller's certificate files rotated in place (a directory symlink swapped to another
# CA's) are used without a restart, within the 10 s refresh.
set -u
CONTROLLER="$1"
MOECTL="$2"
TMP="$(mktemp -d "${TEST_TMPDIR:-/tmp}/tls.XXXXXX")"
source tests/control/check_lib.sh
pid=""
trap '[ -n "$pid" ] && kill -9 "$pid" 2>/dev/null; true' EXIT
tools/make_test_ca.sh "$TMP/ca1" >/dev/null && tools/make_test_ca.sh "$TMP/ca2" >/dev/null || { echo "FAIL CA"; exit 1; }
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TMP/token"
ln -s "$TMP/ca1" "$TMP/live"
"$CONTROLLER" --store "$TMP/registry.db" --token_file "$TMP/token" --port_file "$TMP/port" \
  --metrics_port_file "$TMP/metrics.port" --tls_cert "$TMP/live/node.pem" --tls_key "$TMP/live/node.key" \
  --tls_ca "$TMP/live/ca.pem" >"$TMP/controller.log" 2>&1 &
pid=$!
for _ in $(seq 100); do [ -s "$TMP/port" ] && break; sleep 0.1; done
C=(--controller "127.0.0.1:$(cat "$TMP/port")" --token_file "$TMP/token" --timeout 5)
as() { echo --tls_cert "$TMP/$1/operator.pem" --tls_key "$TMP/$1/operator.key" --tls_ca "$TMP/$2/ca.pem"; }

# shellcheck disable=SC2046
check "mTLS: operator of the controller's CA" 0 "RELEASE" -- "$MOECTL" "${C[@]}" $(as ca1 ca1) releases list
# shellcheck disable=SC2046
check "mTLS: register over TLS" 0 "release-v1 BUILT" -- "$MOECTL" "${C[@]}" $(as ca1 ca1) release register release-v1 --digest sha256:1
# shellcheck disable=SC2046
check "mTLS: a client trusting another CA is refused" 3 "certificate verify failed" -- \
  "$MOECTL" "${C[@]}" $(as ca2 ca2) releases list
# shellcheck disable=SC2046
check "mTLS: a client certificate of another CA is refused" 3 "UNAVAILABLE" -- \
  "$MOECTL" "${C[@]}" $(as ca2 ca1) releases list
check "mTLS: a plaintext client is refused" 3 "UNAVAILABLE" -- "$MOECTL" "${C[@]}" releases list
check "mTLS: a missing key is bad input" 2 "--tls_key" -- \
  "$MOECTL" "${C[@]}" --tls_cert "$TMP/ca1/operator.pem" --tls_ca "$TMP/ca1/ca.pem" releases list
check "mTLS: environment defaults" 0 "release-v1" -- env MOE_TLS_CERT="$TMP/ca1/operator.pem" \
  MOE_TLS_KEY="$TMP/ca1/operator.key" MOE_TLS_CA="$TMP/ca1/ca.pem" "$MOECTL" "${C[@]}" releases list

# Rotation: the controller's certificate, key and CA bundle now come from ca2.
ln -sfn "$TMP/ca2" "$TMP/live.new" && mv -T "$TMP/live.new" "$TMP/live"
rotated=1
for _ in $(seq 40); do
  # shellcheck disable=SC2046
  if "$MOECTL" "${C[@]}" $(as ca2 ca2) releases list >/dev/null 2>&1; then rotated=0; break; fi
  sleep 0.5
done
[ "$rotated" = 0 ] && echo "ok   rotated certificates served without a restart" || { echo "FAIL rotation"; fail=1; }
# shellcheck disable=SC2046
check "after rotation: the old CA's clients are refused" 3 "UNAVAILABLE" -- \
  "$MOECTL" "${C[@]}" $(as ca1 ca1) releases list
kill -0 "$pid" 2>/dev/null && echo "ok   the controller kept running" || { echo "FAIL controller exited"; fail=1; }

# A daemon given half of the TLS flags refuses to start, naming the flag.
"$CONTROLLER" --store "$TMP/other.db" --token_file "$TMP/token" --port_file "$TMP/port2" \
  --tls_cert "$TMP/ca1/node.pem" >"$TMP/half.log" 2>&1
rc=$?
[ "$rc" = 2 ] && grep -q -- "--tls_key" "$TMP/half.log" && echo "ok   half the TLS flags: exit 2 naming --tls_key" ||
  { echo "FAIL half the TLS flags: rc=$rc"; cat "$TMP/half.log"; fail=1; }
exit $fail
