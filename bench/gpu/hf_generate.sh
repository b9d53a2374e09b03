#!/usr/bin/env bash
# Issue 18's check on the GPU machine (RANKS GPUs, default two), one call: per family, a
# random-init transformers model saved with save_pretrained, served by RANKS ranks (CUDA kernels +
# NCCL, one GPU each), and
# greedy generate() of 16 prompts x 32 tokens with the model alone against the same model whose
# MoE experts are served by the ranks through the Python client (bench/gpu/hf_generate.py).
# Run from the repository root with dist/gpu (tools/gpu_bundle.sh); dist/wheels may hold grpcio
# and protobuf wheels for a Python without them (the GPU machine reaches no package index).
set -uo pipefail
export LD_LIBRARY_PATH="$PWD/dist/gpu/lib:/usr/local/cuda/lib64" NCCL_NVLS_ENABLE=0
B=dist/gpu/bin
RANKD="$B/moe-rankd"
source bench/gpu/python_env.sh || exit 1
"$PY" -c "import grpc, google.protobuf, torch, transformers; print('grpcio', grpc.__version__, 'protobuf', google.protobuf.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
work="$(mktemp -d /tmp/hfgen.XXXXXX)"
source deploy/cluster_lib.sh
trap 'stop_ranks; rm -rf "$work"' EXIT
RANKS="${RANKS:-2}"  # ranks (one GPU each); DEVICE_RINGS="0 1" runs host rings, then rings with device rows
rc=0
for fam in ${FAMILIES:-mixtral qwen2_moe qwen3_moe deepseek_v3}; do
  echo "== $fam"
  "$PY" bench/gpu/hf_generate.py make --family "$fam" --out "$work/$fam/model" 2>&1 | grep -v -i warn | tail -1
  SKIP_BUILD=1 choose_backend "$RANKS"
  start_ranks "$RANKD" "$work/$fam" "$RANKS" "$work/$fam/model" || { rc=1; continue; }
  targets="$(cat "$work/$fam/ports/0.engine")"
  for ((r = 1; r < RANKS; r++)); do targets="$targets,$(cat "$work/$fam/ports/$r.engine")"; done
  for dev in ${DEVICE_RINGS:-0}; do
    "$PY" bench/gpu/hf_generate.py compare --model "$work/$fam/model" --targets "$targets" --device_rings "$dev" 2>&1 |
      grep -v -i warn | tail -3 || rc=1
  done
  stop_ranks
done
exit $rc
