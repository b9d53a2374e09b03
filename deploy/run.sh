#!/usr/bin/env bash
# The main job at this stage: plan the spec's eight-route fixture trace (0x03A1) and its
# peer-slot variant (0x07B), printing the physical plan and every ledger, then solve the EPLB
# fixture (0x08C). Later stages grow this into a local cluster of moe-rankd processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bazel build //control:moectl >/dev/null 2>&1 || bazel build //control:moectl
MOECTL=bazel-bin/control/moectl
echo "== moectl plan --trace deploy/examples/trace-eight-routes.json"
"$MOECTL" plan --trace deploy/examples/trace-eight-routes.json
echo
echo "== moectl plan --trace deploy/examples/trace-peer-order.json (peer-slot order [2,0,3,1])"
"$MOECTL" plan --trace deploy/examples/trace-peer-order.json | sed -n '1,20p'
echo
echo "== moectl eplb solve --input deploy/examples/eplb-fixture.json"
"$MOECTL" eplb solve --input deploy/examples/eplb-fixture.json
