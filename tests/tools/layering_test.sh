#!/usr/bin/env bash
# tools/check_layering.sh on the tree's sources (must hold), then on copies with one planted
# violation each (must fail, naming the file and the rule).
set -uo pipefail
runfiles="${TEST_SRCDIR:?}/${TEST_WORKSPACE:-moe_runtime}"
check="$runfiles/tools/check_layering.sh"
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

out="$("$check" "$runfiles" 2>&1)"; rc=$?
echo "$out"
[ "$rc" -eq 0 ] || fail "the tree itself violates the layering (rc $rc)"
[[ "$out" == *"layering holds"* ]] || fail "no 'layering holds' line on the tree"
n=$(echo "$out" | sed -nE 's/^check_layering: ([0-9]+) files.*/\1/p')
[ "${n:-0}" -ge 100 ] || fail "only ${n:-0} files scanned: the filegroups do not reach the sources"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# plant FILE LINE EXPECT: copy the tree, append LINE to FILE, expect rc 1 and EXPECT in the output.
plant() {
  local file="$1" line="$2" expect="$3" tree="$tmp/t$RANDOM"
  mkdir -p "$tree"
  cp -rL "$runfiles"/{kernels,runtime,rpc,server,control} "$tree"/
  chmod -R u+w "$tree"
  printf '%s\n' "$line" >> "$tree/$file"
  local got rc
  got="$("$check" "$tree" 2>&1)"; rc=$?
  if [ "$rc" -ne 1 ]; then fail "planted '$line' in $file: rc $rc, want 1"; fi
  # Matched in the shell, not through `echo | grep -q` under pipefail (grep may exit before echo
  # has written, and the pipeline then fails on SIGPIPE: seen once in CI).
  if [[ "$got" != *"$file:"* || "$got" != *"$expect"* ]]; then
    fail "planted '$line' in $file: output does not name the file and '$expect':"$'\n'"$got"
  fi
  rm -rf "$tree"
}
plant control/moectl_remote.cc '#include "server/metrics.h"' 'control/ may not include server/metrics.h'
plant server/rankd_main.cc '#include "control/trace.h"' 'server/ may not include control/trace.h'
plant rpc/grpc_status.h '#include "server/tensor_codec.h"' 'rpc/ may not include server/tensor_codec.h'
plant runtime/ids.h '#include <grpcpp/grpcpp.h>' 'runtime/ may not include grpcpp/grpcpp.h'
plant runtime/exec/layer_executor.cc '#include "proto/moe/v1/expert_layer.pb.h"' 'runtime/ may not include proto/'
plant kernels/api.h '#include "runtime/ids.h"' 'kernels/ may not include runtime/ids.h'
plant runtime/plan/route_plan.cc 'static const char* v = std::getenv("X");' 'only a binary'"'"'s main reads flags'
plant rpc/daemon_util.cc 'auto l = absl::GetFlag(FLAGS_listen);' 'only a binary'"'"'s main reads flags'

# What is allowed stays allowed: a main reads flags; a comment may name a forbidden header.
tree="$tmp/ok"; mkdir -p "$tree"; cp -rL "$runfiles"/{kernels,runtime,rpc,server,control} "$tree"/; chmod -R u+w "$tree"
printf '%s\n' 'static const char* home = std::getenv("HOME");' >> "$tree/server/rankd_main.cc"
printf '%s\n' '// not an include: server/metrics.h' >> "$tree/control/trace.cc"
"$check" "$tree" >/dev/null 2>&1 || fail "a main's getenv or a comment counted as a violation"

if [ "$fails" -ne 0 ]; then echo "$fails failure(s)"; exit 1; fi
echo "layering_test: all checks passed"
