#!/usr/bin/env bash
# tools/format.sh --check on the tree's sources (must pass), then on a copy with one file
# unformatted (must fail naming it).
set -uo pipefail
runfiles="${TEST_SRCDIR:?}/${TEST_WORKSPACE:-moe_runtime}"
format="$runfiles/tools/format.sh"
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

out="$("$format" --check "$runfiles" 2>&1)"; rc=$?
echo "$out" | tail -20
[ "$rc" -eq 0 ] || fail "sources differ from clang-format (rc $rc): run tools/format.sh"
n=$(echo "$out" | sed -nE 's/^format: ([0-9]+) files formatted.*/\1/p')
[ "${n:-0}" -ge 150 ] || fail "only ${n:-0} files checked: the filegroups do not reach the sources"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cp -rL "$runfiles"/{kernels,runtime,rpc,server,control,.clang-format} "$tmp"/
chmod -R u+w "$tmp"
printf '%s\n' 'int  Unformatted( int a ){return a;}' >> "$tmp/runtime/status.cc"
got="$("$format" --check "$tmp" 2>&1)"; rc=$?
[ "$rc" -eq 1 ] || fail "an unformatted file passed (rc $rc)"
[[ "$got" == *"not formatted: runtime/status.cc"* ]] || fail "the unformatted file is not named:"$'\n'"$got"

if [ "$fails" -ne 0 ]; then echo "$fails failure(s)"; exit 1; fi
echo "format_test: all checks passed"
