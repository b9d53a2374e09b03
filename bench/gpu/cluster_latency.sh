#!/usr/bin/env bash
# Client-observed layer-step latency on a local cluster of RANKS (default 2) moe-rankd processes,
# one GPU each (CUDA kernels + NCCL), side by side in one call with the floor (bench/RESULTS.md,
# issue 17):
#  - the floor: the same layer's kernels alone in-process on one GPU at the same total tokens
#    (expert_layer_bench, CUDA-graph replay for T <= 128);
#  - cluster_step_bench against the ranks: every rank called every step by its own engine thread,
#    through a step ring and through gRPC, decode and prefill cells.
# The layer is E128 k8 d2048 f768 (a synthetic checkpoint of one MoE layer, made here).
# Run from the repository root on the GPU machine with the bundle (tools/gpu_bundle.sh):
#   LD_LIBRARY_PATH=$PWD/dist/gpu/lib:/usr/local/cuda/lib64 bench/gpu/cluster_latency.sh
# Environment: RANKS, CELLS (phase:tokens-per-rank list), MODES (ring,grpc), STEPS, RING_SPIN_US (the ranks' and the
# engine threads' spin before they sleep, default 5000), RANKD (another moe-rankd, with its
# libmoe_cuda.so beside it: side-by-side runs), RANKD_EXTRA (more moe-rankd flags), FLOOR=0 (skip
# the floor), CKPT (keep the synthetic checkpoint in this directory across runs).
set -uo pipefail
B="${B:-dist/gpu/bin}"
RANKS="${RANKS:-2}"
CELLS="${CELLS:-decode:1,decode:8,prefill:256,prefill:2048,prefill:8192}"
STEPS="${STEPS:-200}"
SPIN="${RING_SPIN_US:-5000}"
export NCCL_NVLS_ENABLE=0

if [ "${FLOOR:-1}" != 0 ]; then
  echo "== floor: expert_layer_bench E128-k8-d2048-f768 at the cluster's total tokens (x$RANKS)"
  for cell in ${CELLS//,/ }; do
    t=$((${cell#*:} * RANKS))
    "$B/expert_layer_bench" --shape E128-k8-d2048-f768 --tokens "$t" 2>&1 | grep -v '^#'
  done
fi

work="$(mktemp -d /tmp/cluster-latency.XXXXXX)"
# CKPT: a checkpoint directory kept across runs (made there on first use).
ckpt="${CKPT:-$work/ckpt}"
if [ ! -e "$ckpt/model.safetensors.index.json" ] && [ ! -e "$ckpt/model.safetensors" ]; then
  "$B/moectl" checkpoint synth --experts 128 --d 2048 --d_ff 768 --seed 5 --version lat-1 --out "$ckpt" >/dev/null ||
    { echo "checkpoint synth failed"; exit 1; }
fi
RANKD="${RANKD:-$B/moe-rankd}"
source deploy/cluster_lib.sh
SKIP_BUILD=1 choose_backend "$RANKS"
echo "== $RANKS ranks of $RANKD: $BACKEND_NAME, ring spin $SPIN us"
trap 'stop_ranks' EXIT
# shellcheck disable=SC2086
start_ranks "$RANKD" "$work" "$RANKS" "$ckpt" --ring_spin_us "$SPIN" --max_step_tokens 16384 ${RANKD_EXTRA:-} || exit 1
"$B/cluster_step_bench" --port_dir "$work/ports" --world "$RANKS" --experts 128 --d 2048 --k 8 --cells "$CELLS" \
  --steps "$STEPS" --spin_us "$SPIN" --modes "${MODES:-ring,grpc}"
rc=$?
stop_ranks
[ "$rc" = 0 ] || tail -20 "$work/rank0.log"
rm -rf "$work"
exit "$rc"
