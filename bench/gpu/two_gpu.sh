#!/usr/bin/env bash
# Every measurement that waits for a machine with two GPUs (nvidia-h200-x2), in one call, each
# part's output in $OUT (default gpu-out) and a one-line verdict per part on stdout:
#  1. issue 20: group recovery with CUDA kernels and NCCL (bench/gpu/group_recovery.sh, 20 kills);
#  2. issue 17: client-observed step latency on two ranks through rings and gRPC, with the floor
#     (bench/gpu/cluster_latency.sh);
#  3. issue 17: a co-located engine per rank with its rows on its GPU, under MPS
#     (RANKS=2 bench/gpu/device_rows.sh), the floor at the cells' total tokens;
#  4. issue 18: transformers generate() through two ranks, host and device rings
#     (bench/gpu/hf_generate.sh);
#  5. issue 19: FP8 experts across the two ranks, packed FP8 rows over NCCL (bench/gpu/fp8_group.sh).
# From the repository root with dist/gpu (tools/gpu_bundle.sh); PARTS="1 2 3 4 5" picks parts.
#   LD_LIBRARY_PATH=$PWD/dist/gpu/lib:/usr/local/cuda/lib64 bench/gpu/two_gpu.sh
set -uo pipefail
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
# shellcheck source=bench/gpu/parts.sh
source "$(dirname "$0")/parts.sh"  # part NAME TIMEOUT_S COMMAND..., rc
for p in ${PARTS:-1 2 3 4 5}; do
  case "$p" in
    1) part group_recovery 300 env OUT="$OUT" WORLD=2 bench/gpu/group_recovery.sh ;;
    2) part cluster_latency 240 bench/gpu/cluster_latency.sh ;;
    3) part device_rows 240 env RANKS=2 CELLS="decode:1,decode:8,prefill:2048" STEPS=100 \
      bench/gpu/with_mps.sh bench/gpu/device_rows.sh ;;
    4) part hf_generate 240 env RANKS=2 DEVICE_RINGS="0 1" bench/gpu/with_mps.sh bench/gpu/hf_generate.sh ;;
    5) part fp8_group 400 env RANKS=2 bench/gpu/fp8_group.sh ;;
    *) echo "two_gpu: unknown part $p"; rc=1 ;;
  esac
done
exit "$rc"
