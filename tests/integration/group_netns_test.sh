#!/usr/bin/env bash
# Three "hosts" on one machine: network namespaces the test makes and removes itself, each with
# its own host name (a UTS namespace per rank), a veth pair into a bridge and an address of its
# own (10.<n>.<m>.0/24, picked per run). moe-controller listens on the bridge; four moe-rankd
# processes (host-a: ranks 0 and 1, host-b: rank 2, host-c: rank 3) join its process group with
# --controller only: no shared directory, no --node (each declares its host name), UCX over TCP
# between the hosts. Checks:
#   - the topology the controller formed is the hosts' names, in rank order;
#   - the engine driver's steps are all correct (0 mismatches, 0 failed);
#   - the route classes follow that topology: on ranks 2 and 3 (alone on their hosts) every
#     remote route is inter-node; on ranks 0 and 1 (sharing host-a) some remote routes are not.
# Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2, as CI has.
set -uo pipefail
RANKD="$1" DRIVER="$2" MOECTL="$3" CONTROLLER="$4"
work="$(mktemp -d "${TEST_TMPDIR:-/tmp}/netns.XXXXXX")"
sock="$(mktemp -d /tmp/moe-sock.XXXXXX)"  # a socket path has at most 107 characters
source tests/control/check_lib.sh
tag="m$$"
tag="${tag:0:8}"
net="10.$((100 + $$ % 100)).$(($$ / 100 % 250))"
bridge="br-$tag"
hosts=(host-a host-b host-c)
pids=()
cleanup() {
  for p in "${pids[@]}"; do { kill -9 "$p"; wait "$p"; } 2>/dev/null; done
  for i in 0 1 2; do ip netns del "$tag-$i" 2>/dev/null; ip link del "v$tag$i" 2>/dev/null; done
  ip link del "$bridge" 2>/dev/null
  rm -rf "$sock"
  true
}
trap cleanup EXIT
if ! ip link add "$bridge" type bridge 2>"$work/ip.err"; then
  echo "FAIL cannot create network namespaces here: $(cat "$work/ip.err") (the test needs root)"
  exit 1
fi
ip addr add "$net.1/24" dev "$bridge" && ip link set "$bridge" up || exit 1
for i in 0 1 2; do
  ns="$tag-$i"
  ip netns add "$ns" || exit 1
  ip link add "v$tag$i" type veth peer name eth0 netns "$ns" || exit 1
  ip link set "v$tag$i" master "$bridge" up
  ip netns exec "$ns" ip addr add "$net.$((10 + i))/24" dev eth0
  ip netns exec "$ns" ip link set eth0 up
  ip netns exec "$ns" ip link set lo up
done
echo "ok   three hosts: ${hosts[*]} on $net.0/24 (namespaces $tag-0..2, bridge $bridge)"

head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/token"
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/agent_token"
"$MOECTL" checkpoint synth --layers 2 --family qwen3_moe --experts 16 --d 64 --d_ff 128 --seed 9 \
  --version checkpoint-0001 --out "$work/model" >/dev/null
"$CONTROLLER" --store "$work/registry.db" --token_file "$work/token" --world 4 --agent_token_file "$work/agent_token" \
  --listen "$net.1:0" --port_file "$work/ctl.port" >"$work/controller.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -s "$work/ctl.port" ] && break; sleep 0.1; done
ctl="$net.1:$(cat "$work/ctl.port")"
C=(--controller "$ctl" --token_file "$work/token")
mkdir -p "$work/ports" "$work/metrics"
host_of=(0 0 1 2)
for r in 0 1 2 3; do
  h="${host_of[$r]}"
  ip="$net.$((10 + h))"
  echo "unix:$sock/$r.sock" >"$work/ports/$r.engine"
  # A UTS namespace of its own with the host's name, inside the host's network namespace.
  ip netns exec "$tag-$h" unshare --uts -- sh -c "hostname ${hosts[$h]} && UCX_TLS=tcp exec \"\$@\"" rankd \
    "$RANKD" --rank "$r" --world 4 --controller "$ctl" --agent_token_file "$work/agent_token" \
    --checkpoint "$work/model" --ucx_host "$ip" --listen "$ip:0" --engine_socket "$sock/$r.sock" \
    --metrics_listen "$ip:0" --metrics_port_file "$work/metrics/$r.port" --port_file "$work/ports/$r.port" \
    >"$work/rank$r.log" 2>&1 &
  pids+=($!)
done
for r in 0 1 2 3; do
  for _ in $(seq 300); do [ -s "$work/ports/$r.port" ] && break; sleep 0.1; done
  [ -s "$work/ports/$r.port" ] || { echo "FAIL rank $r did not join"; tail -5 "$work/rank$r.log"; tail -5 "$work/controller.log"; exit 1; }
done
nodes="$("$MOECTL" "${C[@]}" --json group status | python3 -c 'import json,sys; print(",".join(json.load(sys.stdin)["view"]["nodeOfRank"]))')"
if [ "$nodes" = "host-a,host-a,host-b,host-c" ]; then
  echo "ok   topology from the hosts' names: $nodes"
else
  echo "FAIL topology: $nodes"
  fail=1
fi
"$MOECTL" "${C[@]}" group status | sed 's/^/     /'
check "steps across three hosts: all correct" 0 "mismatches *0" -- "$DRIVER" --port_dir "$work/ports" --world 4 \
  --checkpoint "$work/model" --rounds 2
# Route classes per rank from each rank's metrics (read inside its host's namespace).
for r in 0 1 2 3; do
  h="${host_of[$r]}"
  ip netns exec "$tag-$h" curl -s "http://$net.$((10 + h)):$(cat "$work/metrics/$r.port")/metrics" >"$work/scrape$r"
done
python3 - "$work" <<'EOF' || fail=1
import re, sys
def routes(r):
    out = {}
    for line in open(f"{sys.argv[1]}/scrape{r}"):
        m = re.match(r'moe_routes_total\{.*kind="(\w+)".*\} (\S+)', line)
        if m: out[m.group(1)] = out.get(m.group(1), 0) + float(m.group(2))  # summed over the phases
    return out
ok = True
for r in range(4):
    c = routes(r)
    remote, inter = c.get("remote", 0), c.get("inter_node", 0)
    alone = r >= 2
    good = remote > 0 and inter > 0 and ((inter == remote) if alone else (inter < remote))
    print("%s   rank %d (%s): %d remote routes, %d inter-node" % ("ok " if good else "FAIL", r,
          "alone on its host" if alone else "shares host-a", remote, inter))
    ok = ok and good
sys.exit(0 if ok else 1)
EOF
[ "$fail" -eq 0 ] && echo "PASS" || exit 1
