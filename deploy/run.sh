#!/usr/bin/env bash
# The main job: (1) plan the spec's fixture trace offline and print the physical plan and its
# ledgers; (2) the release lifecycle on moe-controller (deploy/controller_demo.sh); (3) a local
# cluster of moe-rankd processes with the engine driver, every output checked against the direct
# semantic computation (deploy/local_cluster.sh); (4) a new placement rolled out to the ranks and
# back by moe-controller under live traffic (deploy/live_rollout.sh); (5) where the Prometheus
# rules, the Grafana dashboard and the deployment manifests are.
set -euo pipefail
cd "$(dirname "$0")/.."
bazel build //control:moectl >/dev/null 2>&1 || bazel build //control:moectl
echo "== moectl plan --trace deploy/examples/trace-eight-routes.json (spec 0x03A1)"
bazel-bin/control/moectl plan --trace deploy/examples/trace-eight-routes.json
echo
echo "== moectl eplb solve --input deploy/examples/eplb-fixture.json (spec 0x08C)"
bazel-bin/control/moectl eplb solve --input deploy/examples/eplb-fixture.json
echo
echo "== moe-controller: release lifecycle, promotion gate, rollback, restart (deploy/controller_demo.sh)"
deploy/controller_demo.sh
echo
echo "== local cluster: ${RANKS:-4} moe-rankd processes over UCX + engine driver"
deploy/local_cluster.sh
echo
echo "== live rollout: moe-controller rolls placement-v2 out to ${RANKS:-4} ranks and back while the engine driver runs"
deploy/live_rollout.sh
echo
echo "== observability and deployment (docs/deployment.md)"
/usr/bin/python3 - <<'PY'
import json, yaml
rules = [r for g in yaml.safe_load(open("deploy/prometheus/moe-rules.yml"))["groups"] for r in g["rules"]]
dash = json.load(open("deploy/grafana/moe-runtime.json"))
panels = [p for p in dash["panels"] if p["type"] != "row"]
print("  Prometheus rules:  deploy/prometheus/moe-rules.yml (%d recording, %d alerts; scrape jobs moe-rankd, moe-controller)"
      % (sum("record" in r for r in rules), sum("alert" in r for r in rules)))
print("  Grafana dashboard: deploy/grafana/moe-runtime.json (%d panels); drawn from a live Prometheus: docs/dashboard.png"
      % len(panels))
print("  Kubernetes:        kubectl kustomize deploy/kubernetes/overlays/h200-ep2   (also overlays/cpu-ep4)")
print("  container image:   deploy/container/Containerfile;  systemd units: deploy/systemd/")
PY
