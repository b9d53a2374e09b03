#!/usr/bin/env bash
# Issue 17 from a C++ engine: the floor (expert_layer_bench, the layer's kernels alone in-process,
# graph replay) at each cell's tokens, then one moe-rankd (CUDA kernels + NCCL, one GPU) and
# bench/gpu/cpp_device_rows: the C++ client's step ring with the rows and routing in the engine's
# GPU memory, with and without the rank's done events (timed in turns), and the same step through
# gRPC; every ring output equal bit for bit to the gRPC answer. Run from the repository root with
# dist/gpu (tools/gpu_bundle.sh), under bench/gpu/with_mps.sh for a co-located engine:
#   LD_LIBRARY_PATH=$PWD/dist/gpu/lib:$PWD/dist/gpu/bin:/usr/local/cuda/lib64 \
#     bench/gpu/with_mps.sh bench/gpu/cpp_device_rows.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0
B="${B:-dist/gpu/bin}"
CELLS="${CELLS:-decode:1,decode:8}"
if [ "${FLOOR:-1}" != 0 ]; then
  echo "== floor: expert_layer_bench E128-k8-d2048-f768 at the cells' tokens"
  for cell in ${CELLS//,/ }; do
    "$B/expert_layer_bench" --shape E128-k8-d2048-f768 --tokens "${cell#*:}" 2>&1 | grep '"decode-graph"'
  done
fi
work="$(mktemp -d /tmp/cpp-device-rows.XXXXXX)"
"$B/moectl" checkpoint synth --experts 128 --d 2048 --d_ff 768 --seed 5 --version rows-1 --out "$work/ckpt" >/dev/null ||
  { echo "checkpoint synth failed"; exit 1; }
RANKD="${RANKD:-$B/moe-rankd}"
source deploy/cluster_lib.sh
SKIP_BUILD=1 choose_backend 1
echo "== 1 rank of $RANKD: $BACKEND_NAME ${RANKD_EXTRA:-}"
trap 'stop_ranks; rm -rf "$work"' EXIT
start_ranks "$RANKD" "$work" 1 "$work/ckpt" --ring_spin_us 5000 --max_step_tokens 16384 --timeout_ms 3000 \
  ${RANKD_EXTRA:-} || exit 1
"$B/cpp_device_rows" --target "$(cat "$work/ports/0.engine")" --cells "$CELLS" --steps "${STEPS:-300}"
rc=$?
[ "$rc" = 0 ] || tail -20 "$work/rank0.log"
exit "$rc"
