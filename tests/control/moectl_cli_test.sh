#!/usr/bin/env bash
# moectl end to end: exit codes, field-naming messages, and the JSON contract.
set -u
MOECTL="$1"
EX="deploy/examples"
TMP="${TEST_TMPDIR:-$(mktemp -d)}"
source tests/control/check_lib.sh

check "plan text" 0 "p1.t0 -> \[8.22, 82.2, 822.0\]" -- "$MOECTL" plan --trace "$EX/trace-eight-routes.json"
check "plan json keys" 0 '"expert_offsets"' -- "$MOECTL" plan --trace "$EX/trace-eight-routes.json" --json
"$MOECTL" plan --trace "$EX/trace-peer-order.json" --json > "$TMP/peer.json"
python3 - "$TMP/peer.json" <<'PY' || fail=1
import json, sys
r = json.load(open(sys.argv[1]))
for key in ["count_matrix", "send_splits", "send_offsets", "recv_splits", "expert_offsets", "outputs", "ledgers"]:
    assert key in r, key
assert r["send_splits"][0] == [1, 1, 0, 2], r["send_splits"]
assert r["recv_splits"][1] == [0, 2, 0, 1], r["recv_splits"]
assert r["ledgers"]["lifetimes"]["peak_bytes"] == 904
print("ok   plan json contract")
PY
check "eplb solve" 0 '"phy2log":\[\[1,0,0,0,2,2,3,3\]\]' -- "$MOECTL" eplb solve --input "$EX/eplb-fixture.json"

printf '{"d": 3, "num_experts": ' > "$TMP/malformed.json"
check "malformed json" 2 "malformed JSON" -- "$MOECTL" plan --trace "$TMP/malformed.json"
python3 -c "
import json; d=json.load(open('$EX/trace-eight-routes.json')); d['hidden']['1'][0]=[3,30]
json.dump(d, open('$TMP/shape.json','w'))"
check "wrong shape" 2 "hidden.1\[0\]" -- "$MOECTL" plan --trace "$TMP/shape.json"
python3 -c "
import json; d=json.load(open('$EX/trace-eight-routes.json')); del d['placement']['slots'][5]
[r.pop('physical_slot') for r in d['routes']]
json.dump(d, open('$TMP/noslot.json','w'))"
check "expert without slot" 2 "no compatible slot holds logical expert 3" -- "$MOECTL" plan --trace "$TMP/noslot.json"
python3 -c "
import json; d=json.load(open('$EX/trace-eight-routes.json')); d['process_group']['peers']=[0,1,2]
json.dump(d, open('$TMP/group.json','w'))"
check "slot outside group" 2 "outside the process group" -- "$MOECTL" plan --trace "$TMP/group.json"
echo '{"weight": [[4,2,1,1]], "num_replicas": 6, "num_groups": 2, "num_nodes": 2, "num_gpus": 4}' > "$TMP/eplb.json"
check "eplb non-divisible" 2 "num_replicas" -- "$MOECTL" eplb solve --input "$TMP/eplb.json"
check "missing file" 2 "cannot open" -- "$MOECTL" plan --trace "$TMP/none.json"
check "unknown command" 2 "moectl plan" -- "$MOECTL" frobnicate
exit $fail
