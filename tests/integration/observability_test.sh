#!/usr/bin/env bash
# The deployment's observability, live: moe-controller and two moe-rankd under mutual TLS, set up
# as deploy/kubernetes runs them (plaintext health-only ports for probes, --health_listen), the
# engine driver serving steps, and a real Prometheus (Debian's) scraping all three every second
# with deploy/prometheus/moe-rules.yml loaded. Checks:
#   1. probes: each --health_listen port answers health in plaintext (the controller SERVING, a
#      rank's readiness SERVING once its epoch is bound) while the TLS ports refuse plaintext;
#   2. Prometheus scrapes every target and evaluates every recording and alerting rule without
#      error (/api/v1/rules);
#   3. the Grafana dashboard (deploy/grafana/moe-runtime.json): every metric it reads exists in
#      live scrapes, every query is valid PromQL and returns data (the alert table may be empty);
#   4. a peer killed (-9): rank 0's readiness turns NOT_SERVING while the group re-forms, and its
#      liveness (the whole server) stays SERVING.
# PNG_OUT=/abs/path.png (with python3-matplotlib) also draws the dashboard's time-series panels
# from Prometheus: `PNG_OUT=$PWD/docs/dashboard.png bazel run //tests/integration:observability_test`.
set -uo pipefail
RANKD="$1" DRIVER="$2" MOECTL="$3" CONTROLLER="$4"
WORLD=2
work="$(mktemp -d "${TEST_TMPDIR:-/tmp}/observe.XXXXXX")"
source deploy/cluster_lib.sh
source tests/control/check_lib.sh
ctl_pid="" driver="" prom=""
trap '[ -n "$driver" ] && kill "$driver" 2>/dev/null; [ -n "$prom" ] && kill "$prom" 2>/dev/null; stop_ranks;
  [ -n "$ctl_pid" ] && kill "$ctl_pid" 2>/dev/null; true' EXIT
free_port() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
probe() { /usr/bin/python3 tools/health_probe.py "$@"; }
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/token"
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/agent_token"
tools/make_test_ca.sh "$work/ca" >/dev/null
TLS=(--tls_cert "$work/ca/node.pem" --tls_key "$work/ca/node.key" --tls_ca "$work/ca/ca.pem")
"$MOECTL" checkpoint synth --layers 2 --family qwen3_moe --experts 16 --d 64 --d_ff 128 --seed 5 \
  --version checkpoint-0001 --out "$work/model" >/dev/null

# --- 1. the daemons, as the Kubernetes manifests run them -----------------------------------------
ctl_health="$(free_port)"
"$CONTROLLER" --store "$work/registry.db" --token_file "$work/token" --world "$WORLD" \
  --agent_token_file "$work/agent_token" --port_file "$work/ctl.port" --metrics_port_file "$work/ctl.metrics" \
  --health_listen "127.0.0.1:$ctl_health" "${TLS[@]}" >"$work/controller.log" 2>&1 &
ctl_pid=$!
for _ in $(seq 100); do [ -s "$work/ctl.port" ] && break; sleep 0.1; done
CONTROLLER_ADDR="127.0.0.1:$(cat "$work/ctl.port")"
rank_health=()
for ((r = 0; r < WORLD; r++)); do
  rank_health[$r]="$(free_port)"
  export "RANK${r}_FLAGS=--health_listen 127.0.0.1:${rank_health[$r]}"
done
start_ranks "$RANKD" "$work" "$WORLD" "$work/model" --agent_token_file "$work/agent_token" --listen 127.0.0.1:0 \
  "${TLS[@]}" || { echo "FAIL the ranks did not start"; tail -20 "$work/controller.log"; exit 1; }
check "controller: plaintext health port SERVING under mutual TLS" 0 "^SERVING" -- probe "127.0.0.1:$ctl_health"
check "controller: its TLS port refuses a plaintext client" 2 "UNAVAILABLE" -- probe "$CONTROLLER_ADDR"
for ((r = 0; r < WORLD; r++)); do
  check "rank $r: readiness (moe.v1.ExpertLayerService) SERVING on its plaintext health port" 0 "^SERVING" -- \
    probe "127.0.0.1:${rank_health[$r]}" moe.v1.ExpertLayerService
done

"$DRIVER" --port_dir "$work/ports" --world "$WORLD" --checkpoint "$work/model" --rounds 1 --until_file "$work/stop" \
  >"$work/driver.log" 2>&1 &
driver=$!

# --- 2. Prometheus with the rules --------------------------------------------------------------------
prom_port="$(free_port)"
# The rules as shipped but for their groups' evaluation interval (30 s): 1 s, for a short test.
sed 's/^\(    interval:\) 30s$/\1 1s/' deploy/prometheus/moe-rules.yml >"$work/moe-rules.yml"
grep -q '^    interval: 1s$' "$work/moe-rules.yml" || { echo "FAIL moe-rules.yml has no 30 s group interval to shorten"; exit 1; }
rules="$work/moe-rules.yml"
{
  echo "global: {scrape_interval: 1s, evaluation_interval: 1s}"
  echo "rule_files: ['$rules']"
  echo "scrape_configs:"
  echo "  - job_name: moe-rankd"
  echo "    static_configs: [{targets: [$(for r in $(seq 0 $((WORLD - 1))); do printf "'127.0.0.1:%s'," "$(cat "$work/metrics/$r.port")"; done | sed 's/,$//')]}]"
  echo "  - job_name: moe-controller"
  echo "    static_configs: [{targets: ['127.0.0.1:$(cat "$work/ctl.metrics")']}]"
} >"$work/prometheus.yml"
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
  --web.listen-address="127.0.0.1:$prom_port" >"$work/prometheus.log" 2>&1 &
prom=$!
PROM="http://127.0.0.1:$prom_port"
api() { curl -s "$PROM/api/v1/$1"; }
for _ in $(seq 100); do api status/buildinfo >/dev/null 2>&1 && break; sleep 0.1; done
# Scrapes and rule evaluations for a while under traffic (the 5 m rate windows need two samples).
sleep "${OBSERVE_S:-15}"
api targets >"$work/targets.json"
check "Prometheus scrapes all $((WORLD + 1)) targets (up)" 0 "^ok" -- /usr/bin/python3 -c '
import json, sys
t = json.load(open(sys.argv[1]))["data"]["activeTargets"]
bad = [x["scrapeUrl"] + ": " + x["lastError"] for x in t if x["health"] != "up"]
print("ok" if len(t) == int(sys.argv[2]) and not bad else "targets %d, down: %s" % (len(t), bad))' \
  "$work/targets.json" "$((WORLD + 1))"
api rules >"$work/rules.json"
check "Prometheus evaluates every rule of moe-rules.yml without error" 0 "^ok" -- /usr/bin/python3 -c '
import json, sys
g = json.load(open(sys.argv[1]))["data"]["groups"]
rules = [r for x in g for r in x["rules"]]
bad = [r["name"] + ": " + r.get("lastError", "") for r in rules if r["health"] != "ok"]
rec = [r for r in rules if r["type"] == "recording"]
print("ok %d rules (%d recording)" % (len(rules), len(rec)) if rules and not bad else "bad: %s" % bad)' "$work/rules.json"

# --- 3. the dashboard -------------------------------------------------------------------------------
curl -s "http://127.0.0.1:$(cat "$work/metrics/0.port")/metrics" >"$work/scrape_rank.txt"
curl -s "http://127.0.0.1:$(cat "$work/ctl.metrics")/metrics" >"$work/scrape_controller.txt"
check "every metric the dashboard reads exists in live scrapes" 0 "^ok" -- /usr/bin/python3 \
  tools/check_rule_metrics.py --rules deploy/prometheus/moe-rules.yml deploy/grafana/moe-runtime.json \
  "$work/scrape_rank.txt" "$work/scrape_controller.txt"
check "every dashboard query is valid and returns data from Prometheus" 0 "^ok" -- /usr/bin/python3 \
  tools/check_dashboard.py --prometheus "$PROM" --rate_interval 10s --may_be_empty "Alerts firing" \
  deploy/grafana/moe-runtime.json
if [ -n "${PNG_OUT:-}" ]; then
  /usr/bin/python3 tools/check_dashboard.py --prometheus "$PROM" --rate_interval 10s --may_be_empty "Alerts firing" \
    --png "$PNG_OUT" --range_s "${OBSERVE_S:-15}" deploy/grafana/moe-runtime.json | tail -1
fi
touch "$work/stop"
wait "$driver"
rc=$?
driver=""
[ "$rc" -eq 0 ] || { echo "FAIL engine driver (rc $rc)"; tail -5 "$work/driver.log"; fail=1; }
grep -E "^  (rank-steps|mismatches)" "$work/driver.log" | sed 's/^/     /'

# --- 4. a lost peer: readiness drops while the group re-forms, liveness stays --------------------
kill -9 "${RANK_PIDS[1]}"
ready=SERVING
for _ in $(seq 100); do
  ready="$(probe "127.0.0.1:${rank_health[0]}" moe.v1.ExpertLayerService 2>&1)"
  [ "$ready" = NOT_SERVING ] && break
  sleep 0.1
done
if [ "$ready" = NOT_SERVING ]; then echo "ok   rank 1 killed: rank 0's readiness NOT_SERVING (the group re-forms)"; else
  echo "FAIL rank 1 killed: rank 0's readiness still $ready after 10 s"; fail=1; fi
check "rank 0's liveness (the whole server) still SERVING" 0 "^SERVING" -- probe "127.0.0.1:${rank_health[0]}"
exit "$fail"
