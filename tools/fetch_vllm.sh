#!/usr/bin/env bash
# Fetches the peer for issue 19's comparison (bench/gpu/vllm_compare.py): vLLM's release wheel
# from PyPI, of which only the fused-MoE Triton source (fused_moe.py, utils.py) and its tuned configs are unpacked, into
# .peers/vllm-<version>/ (git-excluded: the peer's code never enters the repository). Carry
# .peers to the GPU machine beside dist/.
#   tools/fetch_vllm.sh [VERSION]   (default 0.33.0, the newest release on 2026-12-01)
set -euo pipefail
cd "$(dirname "$0")/.."
ver="${1:-0.33.0}"
dest=".peers/vllm-$ver"
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qx '/.peers/' "$exclude" 2>/dev/null || echo '/.peers/' >>"$exclude"
if [ -f "$dest/vllm/model_executor/layers/fused_moe/fused_moe.py" ] && [ -f "$dest/vllm/model_executor/layers/fused_moe/utils.py" ]; then echo "$dest: present"; exit 0; fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
/usr/bin/python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "vllm==$ver"
mkdir -p "$dest"
/usr/bin/python3 - "$tmp"/vllm-*.whl "$dest" <<'PY'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
keep = [n for n in z.namelist() if n.startswith("vllm/model_executor/layers/fused_moe/")
        and (n.endswith("/fused_moe.py") or n.endswith("/fused_moe/utils.py") or "/configs/" in n and n.endswith(".json"))]
z.extractall(sys.argv[2], keep)
print("%s: %d files of %s" % (sys.argv[2], len(keep), sys.argv[1].rsplit("/", 1)[-1]))
PY
