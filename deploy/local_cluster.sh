#!/usr/bin/env bash
# A local cluster on one machine: a small multi-layer model in Hugging Face layout, RANKS moe-rankd processes (two "nodes"
# of RANKS/2 ranks; CPU kernels and UCX over the loopback interface, or CUDA kernels and NCCL
# with one GPU per rank where there are RANKS GPUs: see choose_backend), and the engine driver, which
# runs prefill, decode, mixed and oversize steps under uniform and hot-expert routing, checks
# every output against the direct semantic computation and prints a summary. The ranks are
# stopped with SIGTERM (drain) at the end. Exit status: the driver's (0 = no failures, no
# mismatches).
set -euo pipefail
cd "$(dirname "$0")/.."
RANKS="${RANKS:-4}"
ROUNDS="${ROUNDS:-3}"
# Binaries: built here unless given (SKIP_BUILD=1 with RANKD / DRIVER / MOECTL, e.g.
# from tools/gpu_bundle.sh on a GPU machine without Bazel).
RANKD="${RANKD:-bazel-bin/server/moe-rankd}" DRIVER="${DRIVER:-bazel-bin/server/engine_driver}"
M="${MOECTL:-bazel-bin/control/moectl}"
if [ -z "${SKIP_BUILD:-}" ]; then
  bazel build //server:moe-rankd //server:engine_driver //control:moectl >/dev/null 2>&1 ||
    bazel build //server:moe-rankd //server:engine_driver //control:moectl
fi
source deploy/cluster_lib.sh
choose_backend "$RANKS"
work="$(mktemp -d)"
trap 'stop_ranks; rm -rf "$work"' EXIT
# A small Qwen3-MoE-layout model the project writes itself (no download): 4 MoE layers of 16
# experts, sharded with an index, the way Hugging Face ships models.
"$M" checkpoint synth --layers 4 --family qwen3_moe --experts 16 --d 256 --d_ff 512 --shard_mb 16 --seed 7 \
  --version checkpoint-0001 --out "$work/model"
start_ranks "$RANKD" "$work" "$RANKS" "$work/model"
echo "started $RANKS ranks ($BACKEND_NAME): engine sockets $(for f in "$work"/ports/*.engine; do printf '%s ' "$(cat "$f")"; done)"
set +e
"$DRIVER" --port_dir "$work/ports" --world "$RANKS" --checkpoint "$work/model" \
  --rounds "$ROUNDS"
status=$?
set -e
if [ "$status" -ne 0 ]; then
  for f in "$work"/rank*.log; do echo "== $f"; tail -20 "$f"; done
fi
echo
echo "== a scrape of rank 0's metrics (http://127.0.0.1:$(cat "$work/metrics/0.port")/metrics)"
scrape="$work/scrape.txt"
curl -s "http://127.0.0.1:$(cat "$work/metrics/0.port")/metrics" >"$scrape" || true
grep -E '^moe_(steps_total|routes_total|decode_fallbacks_total|active_placement)' "$scrape" | head -12 || true
if command -v promtool >/dev/null 2>&1; then
  promtool check metrics <"$scrape" && echo "promtool check metrics: ok"
fi
echo
echo "== SIGTERM: drain and exit"
stop_ranks
grep -h "drained" "$work"/rank*.log | sed 's/^/  /'
exit $status
