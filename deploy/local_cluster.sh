#!/usr/bin/env bash
# A local cluster on one machine: a synthetic checkpoint, RANKS moe-rankd processes (CPU kernels,
# UCX over the loopback interface; two "nodes" of RANKS/2 ranks), and the engine driver, which
# runs prefill, decode, mixed and oversize steps under uniform and hot-expert routing, checks
# every output against the direct semantic computation and prints a summary. The ranks are
# stopped with SIGTERM (drain) at the end. Exit status: the driver's (0 = no failures, no
# mismatches).
set -euo pipefail
cd "$(dirname "$0")/.."
RANKS="${RANKS:-4}"
ROUNDS="${ROUNDS:-3}"
bazel build //server:moe-rankd //server:engine_driver //control:moectl >/dev/null 2>&1 ||
  bazel build //server:moe-rankd //server:engine_driver //control:moectl
source deploy/cluster_lib.sh
work="$(mktemp -d)"
trap 'stop_ranks; rm -rf "$work"' EXIT
bazel-bin/control/moectl checkpoint synth --experts 16 --d 256 --d_ff 512 --seed 7 --version checkpoint-0001 \
  --out "$work/checkpoint.safetensors"
start_ranks bazel-bin/server/moe-rankd "$work" "$RANKS" "$work/checkpoint.safetensors"
echo "started $RANKS ranks: gRPC ports $(for f in "$work"/ports/*.port; do printf '%s ' "$(cat "$f")"; done)"
set +e
bazel-bin/server/engine_driver --port_dir "$work/ports" --world "$RANKS" --checkpoint "$work/checkpoint.safetensors" \
  --rounds "$ROUNDS"
status=$?
set -e
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
