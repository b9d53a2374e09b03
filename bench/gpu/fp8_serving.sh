#!/usr/bin/env bash
# FP8 experts in the serving path (moe-rankd --expert_dtype): the co-located engine's steps
# (bench/gpu/device_rows.sh: a Python engine with its rows in torch CUDA tensors, a step ring,
# E128 k8 d2048 f768) against the same rank with BF16 experts, the two alternated ROUNDS times
# in one call, under MPS. The floor (the BF16 layer's kernels in-process) is printed once. From
# the repository root with dist/gpu (tools/gpu_bundle.sh):
#   LD_LIBRARY_PATH=$PWD/dist/gpu/lib:/usr/local/cuda/lib64 bench/gpu/fp8_serving.sh
set -uo pipefail
export CELLS="${CELLS:-decode:1,decode:8,prefill:2048,prefill:8192}" STEPS="${STEPS:-100}"
ROUNDS="${ROUNDS:-2}"
rc=0
floor=1
for ((round = 1; round <= ROUNDS; round++)); do
  for dtype in bf16 fp8; do
    echo "== round $round: --expert_dtype=$dtype"
    FLOOR=$floor RANKD_EXTRA="--expert_dtype=$dtype" bench/gpu/with_mps.sh bench/gpu/device_rows.sh || rc=1
    floor=0
  done
done
exit "$rc"
