#!/usr/bin/env bash
# Issue 17's co-located path with the rows on the engine's GPU, one call on the GPU machine
# (bench/RESULTS.md): the floor (expert_layer_bench, the layer's kernels alone in-process on one
# GPU, graph replay for decode) at each cell's total T, then RANKS (default 1) moe-rankd (CUDA
# kernels + NCCL, one GPU each) and one Python engine process per rank holding its rows in torch
# CUDA tensors, stepping through a step ring with the rows through the host and through one with
# the rows (and routing) on the GPU (CUDA IPC), checked bit for bit (bench/gpu/device_rows.py). Run from the repository root with dist/gpu (tools/gpu_bundle.sh);
# dist/wheels may hold grpcio and protobuf wheels for a Python without them. ENGINE=cpp: a C++
# engine (bench/gpu/cpp_device_rows) instead of the Python one, on one rank; LAYERS=L with it: a
# checkpoint of L MoE layers in Hugging Face layout, the C++ engine's steps walking them.
#   LD_LIBRARY_PATH=$PWD/dist/gpu/lib:/usr/local/cuda/lib64 bench/gpu/device_rows.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0
B="${B:-dist/gpu/bin}"
CELLS="${CELLS:-decode:1,decode:8,prefill:2048}"
SPIN="${RING_SPIN_US:-5000}"
source bench/gpu/python_env.sh || exit 1
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
RANKS="${RANKS:-1}"
if [ "${FLOOR:-1}" != 0 ]; then
  echo "== floor: expert_layer_bench E128-k8-d2048-f768 at the cells' total tokens (x$RANKS)"
  for cell in ${CELLS//,/ }; do
    "$B/expert_layer_bench" --shape E128-k8-d2048-f768 --tokens "$((${cell#*:} * RANKS))" 2>&1 | grep -v '^#'
  done
fi
work="$(mktemp -d /tmp/device-rows.XXXXXX)"
LAYERS="${LAYERS:-1}"
layer_args=()
[ "$LAYERS" = 1 ] || layer_args=(--layers "$LAYERS")
"$B/moectl" checkpoint synth --experts 128 --d 2048 --d_ff 768 --seed 5 --version rows-1 "${layer_args[@]}" \
  --out "$work/ckpt" >/dev/null || { echo "checkpoint synth failed"; exit 1; }
RANKD="${RANKD:-$B/moe-rankd}"
source deploy/cluster_lib.sh
SKIP_BUILD=1 choose_backend "$RANKS"
echo "== $RANKS rank(s) of $RANKD: $BACKEND_NAME, ring spin $SPIN us"
trap 'stop_ranks; rm -rf "$work"' EXIT
start_ranks "$RANKD" "$work" "$RANKS" "$work/ckpt" --ring_spin_us "$SPIN" --max_step_tokens 16384 \
  --timeout_ms 3000 ${RANKD_EXTRA:-} || exit 1
targets="$(cat "$work/ports/0.engine")"
for ((r = 1; r < RANKS; r++)); do targets="$targets,$(cat "$work/ports/$r.engine")"; done
if [ "${ENGINE:-python}" = cpp ]; then
  # A C++ engine instead (bench/gpu/cpp_device_rows.cc: the C++ client's ring, done events and
  # not in turns, against gRPC), one rank.
  [ "$RANKS" = 1 ] || { echo "ENGINE=cpp drives one rank"; exit 2; }
  "$B/cpp_device_rows" --target "$targets" --cells "$CELLS" --steps "${STEPS:-300}" "${layer_args[@]}"
else
  "$PY" bench/gpu/device_rows.py --targets "$targets" --cells "$CELLS" --spin_us "$SPIN" --steps "${STEPS:-200}" \
    --ready_timeout_s 3
fi
rc=$?
[ "$rc" = 0 ] || tail -20 "$work/rank0.log"
# Decode steps by path (eager, recorded: launched from a lone rank's recorded CUDA graph, ...).
echo "== rank 0's decode steps by path"
"$PY" -c 'import sys, urllib.request
print(urllib.request.urlopen("http://127.0.0.1:%s/metrics" % open(sys.argv[1]).read().strip()).read().decode())' \
  "$work/metrics/0.port" | grep '^moe_steps_total{.*phase="decode"' || echo "(no scrape)"
exit "$rc"
