#!/usr/bin/env bash
# The layering of moe-runtime as a check (docs/architecture.md, shared DESIGN.md "Libraries and
# folders"): reads every #include and environment/flag read under ROOT (default: the repository)
# and prints one line per violation, "file:line: rule: the line". Exits 1 when there is any.
#
#   kernels/  knows nothing above it: no runtime/, rpc/, server/, control/, proto/, gRPC, protobuf
#   runtime/  uses kernels/ only; never proto/ or gRPC/protobuf types, never rpc/ server/ control/
#   rpc/      the shared gRPC edge: proto/, runtime/, kernels/; never server/ or control/
#   server/   never control/          control/  never server/
#   libraries read no flags or environment (getenv, absl::GetFlag): only a binary's *_main.cc does
set -uo pipefail
root="${1:-$(cd "$(dirname "$0")/.." && pwd)}"
cd "$root" || { echo "check_layering: no such directory: $root" >&2; exit 2; }

# dir|forbidden include prefixes (extended regex on the quoted/bracketed path)
rules=(
  'kernels|^(runtime|rpc|server|control|proto)/|^grpcpp?/|^google/protobuf/|\.pb\.h$'
  'runtime|^(rpc|server|control|proto)/|^grpcpp?/|^google/protobuf/|\.pb\.h$'
  'rpc|^(server|control)/'
  'server|^control/'
  'control|^server/'
)

violations=0
scanned=0
for rule in "${rules[@]}"; do
  dir="${rule%%|*}"
  forbidden="${rule#*|}"
  [ -d "$dir" ] || continue
  while IFS= read -r -d '' f; do
    scanned=$((scanned + 1))
    # #include "x" or #include <x>: "line:path"
    while IFS=: read -r line path; do
      if printf '%s\n' "$path" | grep -Eq "$forbidden"; then
        echo "$f:$line: $dir/ may not include $path"
        violations=$((violations + 1))
      fi
    done < <(grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*["<]' "$f" |
             sed -E 's/^([0-9]+):[^"<]*["<]([^">]+)[">].*/\1:\2/')
    case "$f" in
      *_main.cc) ;;
      *)
        while IFS= read -r hit; do
          [ -n "$hit" ] || continue
          echo "$f:${hit%%:*}: libraries take options structs; only a binary's main reads flags or the environment: ${hit#*:}"
          violations=$((violations + 1))
        done < <(grep -nE '(std::)?\bgetenv[[:space:]]*\(|absl::GetFlag[[:space:]]*\(' "$f" | grep -vE '^[0-9]+:[[:space:]]*//')
        ;;
    esac
  done < <(find -L "$dir" -type f \( -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' \) -print0 | sort -z)
done

if [ "$scanned" -eq 0 ]; then
  echo "check_layering: no sources under $root" >&2
  exit 2
fi
if [ "$violations" -ne 0 ]; then
  echo "check_layering: $violations violation(s) in $scanned files"
  exit 1
fi
echo "check_layering: $scanned files, layering holds"
