#!/usr/bin/env bash
# Every measurement issue 23 asks of one host with 4 or 8 GPUs (nvidia-h200-x4 / -x8), in one
# call, one rank per GPU; each part's output in $OUT (default gpu-out) and a one-line verdict per
# part on stdout:
#  1. a2a: the runtime's dispatch and combine (a2a_bench: NCCL transport and kernels, one process
#     per GPU; prefill BF16 and FP8 at DeepEP's normal shape, decode 128 tokens per rank under
#     graph replay, the NVLink one-direction ceiling of the same run) and the torch
#     all_to_all_single peer moving the same splits (a2a_torch.py), ROUNDS rounds taking turns,
#     then the goals' table (bench/gpu/a2a_report.py: $OUT/a2a.md);
#  2. local_cluster: deploy/local_cluster.sh on CUDA kernels + NCCL, 0 failures and mismatches;
#  3. live_rollout: deploy/live_rollout.sh, a placement rollout and rollback under live traffic;
#  4. group_recovery: a rank killed under load KILLS times (bench/gpu/group_recovery.sh);
#  5. cluster_latency: client-observed layer-step latency with the floor (bench/gpu/cluster_latency.sh);
#  6. fp8_group: FP8 experts on every GPU, packed FP8 rows over NCCL (bench/gpu/fp8_group.sh).
# From the repository root with the whole dist/gpu (tools/gpu_bundle.sh; carry dist), where
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0):
#   LD_LIBRARY_PATH=$PWD/dist/gpu/lib:/usr/local/cuda/lib64 bench/gpu/many_gpu.sh
# PARTS="1 2 3 4 5 6" picks parts; GPUS the rank count (default: every GPU of the host). A device
# call runs at most 600 s: split the parts over calls (e.g. PARTS="1 2 3", then PARTS="4 5").
set -uo pipefail
OUT="${OUT:-gpu-out}"
B="${B:-dist/gpu/bin}"
ROUNDS="${ROUNDS:-2}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
GPUS="${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}"
export OUT B ROUNDS GPUS
if [ "${GPUS:-0}" -lt 2 ]; then
  echo "many_gpu: $GPUS GPUs here; these parts need one GPU per rank and at least two" >&2
  exit 2
fi
echo "many_gpu: $GPUS ranks, one GPU each"
# The deploy scripts take the bundle's binaries (no Bazel on the GPU machine).
export SKIP_BUILD=1 RANKD="$B/moe-rankd" DRIVER="$B/engine_driver" MOECTL="$B/moectl" CONTROLLER="$B/moe-controller"
# shellcheck source=bench/gpu/parts.sh
source "$(dirname "$0")/parts.sh"  # part NAME TIMEOUT_S COMMAND..., rc
if [ "${1:-}" = --a2a ]; then  # part 1 (run by part() below, under its timeout)
  # The runtime and the torch peer in turns (the peer first in even rounds), on the first GPUS
  # GPUs (both use every GPU they see).
  CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((GPUS - 1)))"
  export CUDA_VISIBLE_DEVICES
  for r in $(seq 1 "$ROUNDS"); do
    for side in $([ $((r % 2)) -eq 1 ] && echo "ours torch" || echo "torch ours"); do
      if [ "$side" = ours ]; then
        "$B/a2a_bench" 20 >"$OUT/a2a_ours_$r.jsonl" || exit 1
      else
        python3 bench/gpu/a2a_torch.py >"$OUT/a2a_torch_$r.jsonl" || exit 1
      fi
    done
  done
  # Against issue 23's goals: the slowest member's median over the rounds (bench/gpu/a2a_report.py).
  python3 bench/gpu/a2a_report.py --ours "$OUT"/a2a_ours_*.jsonl --torch "$OUT"/a2a_torch_*.jsonl \
    --md "$OUT/a2a.md" >"$OUT/a2a_goals.jsonl" || exit 1
  cat "$OUT/a2a.md"
  exit 0
fi
for p in ${PARTS:-1 2 3 4 5 6}; do
  case "$p" in
    1) part a2a 300 "$0" --a2a ;;
    2) part local_cluster 300 env RANKS="$GPUS" deploy/local_cluster.sh ;;
    3) part live_rollout 300 env RANKS="$GPUS" deploy/live_rollout.sh ;;
    4) part group_recovery 400 env OUT="$OUT" WORLD="$GPUS" KILLS="${KILLS:-20}" bench/gpu/group_recovery.sh ;;
    5) part cluster_latency 240 env RANKS="$GPUS" CELLS="decode:1,decode:8,decode:128,prefill:2048" STEPS=100 \
      bench/gpu/cluster_latency.sh ;;
    6) part fp8_group 400 env RANKS="$GPUS" CELLS="decode:8,prefill:2048" bench/gpu/fp8_group.sh ;;
    *) echo "many_gpu: unknown part $p"; rc=1 ;;
  esac
done
exit "$rc"
