#!/usr/bin/env bash
# kernels/cuda/wgmma.cuh must be byte for byte what tools/gen_wgmma.py prints, and the check must
# notice a one-character edit of the header.
set -uo pipefail
runfiles="${TEST_SRCDIR:?}/${TEST_WORKSPACE:-moe_runtime}"
gen="$runfiles/tools/gen_wgmma.py"
header="$runfiles/kernels/cuda/wgmma.cuh"
[ -f "$header" ] || { echo "FAIL: $header missing"; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 "$gen" >"$tmp/want" || { echo "FAIL: the generator failed"; exit 1; }
if ! cmp -s "$tmp/want" "$header"; then
  diff "$tmp/want" "$header" | head -20
  echo "FAIL: kernels/cuda/wgmma.cuh differs from tools/gen_wgmma.py's output (regenerate it)"
  exit 1
fi
grep -q 'wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16' "$header" || { echo "FAIL: no m64n256 wrapper"; exit 1; }
sed 's/m64n128k16/m64n128k8/' "$header" >"$tmp/edited"
if cmp -s "$tmp/want" "$tmp/edited"; then
  echo "FAIL: the comparison does not see an edit"
  exit 1
fi
echo "PASS: wgmma.cuh is the generator's output"
