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

srcs=(--include='*.h' --include='*.cc' --include='*.cu' --include='*.cuh')
report="$(mktemp)"
trap 'rm -f "$report"' EXIT
scanned=0
for rule in "${rules[@]}"; do
  dir="${rule%%|*}"
  forbidden="${rule#*|}"
  [ -d "$dir" ] || continue
  scanned=$((scanned + $(find -L "$dir" -type f \( -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' \) | wc -l)))
  # #include "x" or #include <x>, one grep over the folder: "file:line:path".
  grep -RnE "${srcs[@]}" '^[[:space:]]*#[[:space:]]*include[[:space:]]*["<]' "$dir" |
    sed -E 's/^([^:]+):([0-9]+):[^"<]*["<]([^">]+)[">].*/\1:\2:\3/' |
    RE="$forbidden" DIR="$dir" awk -F: '$3 ~ ENVIRON["RE"] { printf "%s:%s: %s/ may not include %s\n", $1, $2, ENVIRON["DIR"], $3 }' >>"$report"
  # Flags and the environment: only a binary's *_main.cc reads them (comment lines aside).
  grep -RnE "${srcs[@]}" '(std::)?\bgetenv[[:space:]]*\(|absl::GetFlag[[:space:]]*\(' "$dir" |
    grep -vE '^[^:]+_main\.cc:' | grep -vE '^[^:]+:[0-9]+:[[:space:]]*//' |
    sed -E 's/^([^:]+):([0-9]+):(.*)$/\1:\2: libraries take options structs; only a binary'"'"'s main reads flags or the environment: \3/' >>"$report"
done
violations=$(wc -l <"$report")
cat "$report"

if [ "$scanned" -eq 0 ]; then
  echo "check_layering: no sources under $root" >&2
  exit 2
fi
if [ "$violations" -ne 0 ]; then
  echo "check_layering: $violations violation(s) in $scanned files"
  exit 1
fi
echo "check_layering: $scanned files, layering holds"
