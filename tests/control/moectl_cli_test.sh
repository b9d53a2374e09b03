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

# Spec 0x09's overlap fixture: both schedules, makespans 25 and 15, 8 units of overlap, the
# nine lifetimes; a schedule whose expert starts at its dispatch's launch is refused (exit 2),
# a task of 0 units is bad input (exit 2).
"$MOECTL" overlap --input "$EX/overlap-fixture.json" > "$TMP/overlap.json"
python3 - "$TMP/overlap.json" <<'PY' || fail=1
import json, sys
r = json.load(open(sys.argv[1]))
assert r["units"].startswith("analytical"), r["units"]  # 0x09F: synthetic units are not latency
assert r["makespan"] == {"serialized": 25, "overlapped": 15}, r["makespan"]
assert r["hidden_units"] == 10 and r["overlap_units"] == 8, r
assert r["overlapped"]["shared_path"] == [1, 6] and r["overlapped"]["reduce"] == [14, 15], r["overlapped"]
assert r["serialized"]["expert_0"] == [14, 18], r["serialized"]
assert r["buffer_lifetimes"]["shared_output"] == [6, 15] and r["buffer_lifetimes"]["send_1"] == [2, 8]
print("ok   overlap fixture")
PY
python3 -c "
import json; d=json.load(open('$EX/overlap-fixture.json'))
d['schedule']={'route_plan':[0,1],'pack_0':[1,2],'pack_1':[2,3],'dispatch_0':[2,5],'dispatch_1':[5,8],
  'shared_path':[1,6],'expert_0':[2,6],'expert_1':[10,12],'combine_0':[10,12],'combine_1':[12,14],'reduce':[14,15]}
json.dump(d, open('$TMP/overlap-early.json','w'))
d=json.load(open('$EX/overlap-fixture.json')); d['tasks'][5]['units']=0
json.dump(d, open('$TMP/overlap-zero.json','w'))"
check "overlap: expert before its dispatch completes" 2 "completion, not launch" -- "$MOECTL" overlap \
  --input "$TMP/overlap-early.json"
check "overlap: a task of 0 units" 2 "task shared_path: units 0" -- "$MOECTL" overlap --input "$TMP/overlap-zero.json"

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
python3 -c "
import json; d=json.load(open('$EX/trace-eight-routes.json')); d['d']=2**32
json.dump(d, open('$TMP/d32.json','w'))
d=json.load(open('$EX/trace-eight-routes.json')); d['num_experts']=2**32+1
json.dump(d, open('$TMP/e32.json','w'))"
check "d past int" 2 "d: 4294967296 outside \[1, 1048576\]" -- "$MOECTL" plan --trace "$TMP/d32.json"
check "num_experts past int" 2 "num_experts: 4294967297 outside" -- "$MOECTL" plan --trace "$TMP/e32.json"
echo '{"weight": [[4,2,1,1]], "num_replicas": 6, "num_groups": 2, "num_nodes": 2, "num_gpus": 4}' > "$TMP/eplb.json"
check "eplb non-divisible" 2 "num_replicas" -- "$MOECTL" eplb solve --input "$TMP/eplb.json"
check "missing file" 2 "cannot open" -- "$MOECTL" plan --trace "$TMP/none.json"
check "unknown command" 2 "moectl plan" -- "$MOECTL" frobnicate
# One exit-code table: 0 ok, 1 refused, 2 bad usage or input, 3 unavailable (docs/cli.md).
check "unknown flag" 2 "unknown flag --frobnicate" -- "$MOECTL" plan --frobnicate
check "a flag of dashes only" 2 "unknown flag ---" -- "$MOECTL" plan ---
check "watch --count -1" 2 "--count: must be >= 0" -- env MOE_TOKEN_FILE="$EX/eplb-fixture.json" "$MOECTL" watch \
  --controller 127.0.0.1:1 --count -1
check "version" 0 "^moectl [0-9]" -- "$MOECTL" --version
check "per-command help" 0 "moectl placement load ID \[--manifest FILE\]" -- "$MOECTL" placement load -h
out="$("$MOECTL" placement load --help)"
if grep -q "moectl plan --trace" <<<"$out"; then echo "FAIL per-command help lists other commands"; fail=1; else
  echo "ok   per-command help lists only its command"; fi
check "help for everything" 0 "moectl rollout ID" -- "$MOECTL" help
check "error as JSON" 2 '"error":{"code":"INVALID_ARGUMENT","message":"--trace: required","exit":2}' -- \
  "$MOECTL" plan --json
start_s=$(date +%s)
check "controller unreachable" 3 "UNAVAILABLE" -- env MOE_CONTROLLER=127.0.0.1:1 MOE_TOKEN_FILE="$EX/eplb-fixture.json" \
  "$MOECTL" releases list --timeout 2
[ $(($(date +%s) - start_s)) -le 10 ] && echo "ok   unreachable within --timeout" || { echo "FAIL --timeout"; fail=1; }
check "negative timeout" 2 "--timeout" -- "$MOECTL" releases list --controller 127.0.0.1:1 --timeout -3

# Placements offline: synth, show, the migration plan between two, the memory budget.
"$MOECTL" checkpoint synth --experts 8 --d 64 --d_ff 128 --out "$TMP/c8.safetensors" >/dev/null
"$MOECTL" placement synth --checkpoint "$TMP/c8.safetensors" --world 4 --placement_version 1 --extra_replicas 0 >"$TMP/p1.json"
"$MOECTL" placement synth --checkpoint "$TMP/c8.safetensors" --world 4 --placement_version 2 --extra_replicas 4 >"$TMP/p2.json"
check "placement show" 0 "placement-v2: 12 slots, 8 logical experts" -- "$MOECTL" placement show --manifest "$TMP/p2.json" --world 4
# 8 of 12 target slots keep their weights; the 4 new copies of experts 0-3 cross nodes (49152 B each).
check "placement diff" 0 "retained 8 (393216 B), local duplicates 0 (0 B), same-node copies 0 (0 B), cross-node copies 4 (196608 B)" -- \
  "$MOECTL" placement diff --from "$TMP/p1.json" --to "$TMP/p2.json" --world 4 --checkpoint "$TMP/c8.safetensors"
check "placement diff peak" 0 "peak during the overlap 589824 B" -- \
  "$MOECTL" placement diff --from "$TMP/p1.json" --to "$TMP/p2.json" --world 4 --expert_bytes 49152
check "placement diff over budget" 2 "over the budget of 500000" -- \
  "$MOECTL" placement diff --from "$TMP/p1.json" --to "$TMP/p2.json" --world 4 --expert_bytes 49152 --budget_bytes 500000
# The ranks copy the 8 retained slots too, so they hold 8 + 12 copies at once (983040 B): a
# budget above the shared-storage peak but below that is refused.
check "placement diff materialized peak" 0 "as the ranks materialize it (retained copies copied) 983040 B" -- \
  "$MOECTL" placement diff --from "$TMP/p1.json" --to "$TMP/p2.json" --world 4 --expert_bytes 49152
check "placement diff over budget as materialized" 2 "will hold 983040 bytes at once" -- \
  "$MOECTL" placement diff --from "$TMP/p1.json" --to "$TMP/p2.json" --world 4 --expert_bytes 49152 --budget_bytes 700000
check "placement show bad file" 2 "--manifest" -- "$MOECTL" placement show --manifest "$TMP/c8.safetensors" --world 4
# Release bundles: made from a checkpoint with recorded digests and a placement, verified by
# re-reading every expert; a bundle whose digest does not match its contents, a consistent bundle
# with one wrong expert digest and a checkpoint changed under its bundle are each refused, naming
# the field.
"$MOECTL" checkpoint synth --layers 2 --family qwen3_moe --experts 8 --d 64 --d_ff 64 --seed 3 --version ck-b \
  --out "$TMP/bm" >/dev/null
"$MOECTL" placement synth --checkpoint "$TMP/bm" --world 2 --placement_version 2 --extra_replicas 2 >"$TMP/bp.json"
check "bundle make" 0 "wrote .*rel-2, sha256:" -- "$MOECTL" bundle make --release rel-2 --prior rel-1 \
  --checkpoint "$TMP/bm" --manifest "$TMP/bp.json" --world 2 --out "$TMP/bundle.json"
check "bundle verify" 0 "verified rel-2 sha256:" -- "$MOECTL" bundle verify "$TMP/bundle.json"
check "bundle make --out unwritable" 2 "--out $TMP/no-dir/b.json: cannot write" -- "$MOECTL" bundle make \
  --release rel-2 --checkpoint "$TMP/bm" --manifest "$TMP/bp.json" --world 2 --out "$TMP/no-dir/b.json"
check "bundle make --expert_dtype fp8" 0 "wrote" -- "$MOECTL" bundle make --release rel-2 --checkpoint "$TMP/bm" \
  --manifest "$TMP/bp.json" --world 2 --expert_dtype fp8 --out "$TMP/bundle-fp8.json"
check "bundle make --expert_dtype int4" 2 "--expert_dtype: 'INT4'" -- "$MOECTL" bundle make \
  --release rel-2 --checkpoint "$TMP/bm" --manifest "$TMP/bp.json" --world 2 --expert_dtype int4 --out "$TMP/x.json"
grep -q '"dtype": "FP8"' "$TMP/bundle-fp8.json" && grep -q '"dtype": "BF16"' "$TMP/bundle.json"
[ $? = 0 ] && echo "ok   bundles name the experts' precision (runtime.dtype FP8 / BF16)" || {
  echo "FAIL bundles name the experts' precision"
  fail=1
}
check "bundle make --nodes: one node a rank" 2 "topology.nodes: not a list of 2 node names" -- "$MOECTL" bundle make \
  --release rel-2 --checkpoint "$TMP/bm" --manifest "$TMP/bp.json" --world 2 --nodes host-a --out "$TMP/x.json"
check "bundle make --nodes" 0 "wrote" -- "$MOECTL" bundle make --release rel-2 --checkpoint "$TMP/bm" \
  --manifest "$TMP/bp.json" --world 2 --nodes host-a,host-b --out "$TMP/bundle-nodes.json"
check "bundle verify: the nodes are under its digest" 0 "verified rel-2" -- "$MOECTL" bundle verify "$TMP/bundle-nodes.json"
python3 - "$TMP" <<'PY'
import hashlib, json, sys
d = sys.argv[1]
b = json.load(open(f"{d}/bundle.json"))
def digest(x):
    body = {k: v for k, v in x.items() if k != "digest"}
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(canon.encode()).hexdigest()
assert digest(b) == b["digest"], "canonical digest differs from the CLI's"
t = json.loads(json.dumps(b)); t["runtime"]["decode_bucket_tokens"] = 16
json.dump(t, open(f"{d}/tampered.json", "w"))
w = json.loads(json.dumps(b)); layer = sorted(w["checkpoint"]["digests"])[-1]
w["checkpoint"]["digests"][layer][5] = "0" * 64; w["digest"] = digest(w)
json.dump(w, open(f"{d}/wrong_expert.json", "w"))
e = json.loads(json.dumps(b)); e["runtime"]["etp"] = 2; e["digest"] = digest(e)
json.dump(e, open(f"{d}/etp.json", "w"))
print("ok   bundle digest is the canonical JSON's SHA-256 (python recomputes it)")
open(f"{d}/wrong_layer", "w").write(layer)
PY
[ $? = 0 ] || fail=1
check "bundle: contents changed after its digest" 2 "digest: the bundle says" -- "$MOECTL" bundle verify "$TMP/tampered.json"
check "bundle: a coordinate the runtime does not read (under a good digest)" 2 "runtime.etp: unknown member" -- \
  "$MOECTL" bundle verify "$TMP/etp.json"
check "bundle: one wrong expert digest" 2 "checkpoint.digests\[\"$(cat "$TMP/wrong_layer")\"\]\[5\]" -- \
  "$MOECTL" bundle verify "$TMP/wrong_expert.json"
python3 - "$TMP/bm/model.safetensors" <<'PY'
import sys
p = sys.argv[1]
data = bytearray(open(p, "rb").read())
n = int.from_bytes(data[:8], "little")
data[8 + n + 100] ^= 0x40  # one weight of the first tensor
open(p, "wb").write(data)
PY
check "bundle: a checkpoint changed under its bundle" 2 "the checkpoint's expert hashes to" -- \
  "$MOECTL" bundle verify "$TMP/bundle.json"
cp -r "$TMP/bm" "$TMP/bm-nodigests" && rm -f "$TMP/bm-nodigests/moe_checkpoint.json"
check "bundle make needs recorded digests" 2 "no digest recorded" -- "$MOECTL" bundle make --release r --checkpoint \
  "$TMP/bm-nodigests" --manifest "$TMP/bp.json" --world 2 --out "$TMP/x.json"
exit $fail
