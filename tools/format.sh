#!/usr/bin/env bash
# Formats the C++ sources with clang-format and the repository's .clang-format (Google style,
# 120 columns). `tools/format.sh` rewrites files in place; `tools/format.sh --check [ROOT]` changes
# nothing, lists the files that differ and exits 1 if any does (tests/tools:format_test).
set -uo pipefail
mode=fix
if [ "${1:-}" = "--check" ]; then mode=check; shift; fi
root="${1:-$(cd "$(dirname "$0")/.." && pwd)}"
cd "$root" || { echo "format: no such directory: $root" >&2; exit 2; }
command -v clang-format >/dev/null || { echo "format: clang-format is not installed (tools/setup.sh installs it)" >&2; exit 2; }
[ -f .clang-format ] || { echo "format: no .clang-format in $root" >&2; exit 2; }

files=()
while IFS= read -r -d '' f; do files+=("$f"); done < <(
  find -L kernels runtime rpc server control tests bench -type f \
    \( -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' \) -print0 2>/dev/null | sort -z)
if [ "${#files[@]}" -eq 0 ]; then echo "format: no sources under $root" >&2; exit 2; fi

if [ "$mode" = fix ]; then
  clang-format -i --style=file "${files[@]}"
  echo "format: ${#files[@]} files formatted"
  exit 0
fi
# One clang-format over every file; each file that differs is named in its diagnostics.
mapfile -t differ < <(clang-format --style=file --dry-run "${files[@]}" 2>&1 |
  sed -nE 's/^(.+):[0-9]+:[0-9]+: (warning|error): .*/\1/p' | sort -u)
for f in "${differ[@]}"; do echo "not formatted: $f"; done
bad=${#differ[@]}
if [ "$bad" -ne 0 ]; then
  echo "format: $bad of ${#files[@]} files differ from clang-format (run tools/format.sh)"
  exit 1
fi
echo "format: ${#files[@]} files formatted as .clang-format says"
