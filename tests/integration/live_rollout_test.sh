#!/usr/bin/env bash
# deploy/live_rollout.sh as a test: a placement rolled out to four ranks and rolled back by
# moe-controller while the engine driver runs steps. Requires: no failed step, no mismatch, no
# step answered under two generations, the timeline v1 -> v2 -> v1, shadow and canary steps of v2
# on every rank with the gate read from the ranks' counters, and v2 retired on every rank;
# then a rank is killed and the next placement load stops at once, naming it, committing nothing.
set -uo pipefail
# Over mutual TLS (TLS=1): moectl -> controller -> rank agents -> each other.
export RANKD="$1" DRIVER="$2" MOECTL="$3" CONTROLLER="$4" SKIP_BUILD=1 KILL_RANK_CHECK=1 TLS=1
out="${TEST_TMPDIR:-/tmp}/rollout.out"
deploy/live_rollout.sh >"$out" 2>&1
rc=$?
cat "$out"
fail=0
check() { if [ "$1" = 0 ]; then echo "ok   $2"; else echo "FAIL $2"; fail=1; fi; }
check $rc "live rollout: driver exit 0 (no failed step, no mismatch, no generation split)"
grep -q "mutual TLS on the control plane and the rank agents" "$out"; check $? "the rollout ran over mutual TLS"
grep -q "release-v2 *BUILT *-> VERIFIED .*rollout: bundle verified by the controller" "$out" &&
  grep -q "bundle sha256:[0-9a-f]* runtime coordinates checked" "$out"
check $? "release-v2 rolled out from a release bundle: verified by the controller, coordinates checked by every rank"
grep -Eq "the ranks' kernels build: cpu:[0-9a-f]{16} " "$out" &&
  grep -Eq "a bundle pinning another kernels build: .*runtime.kernel_build: the release bundle says cpu:0000000000000000, rank [0-9] runs cpu:[0-9a-f]{16}.*; release-v5 is VERIFIED$" "$out"
check $? "the ranks report their kernels build, and refuse a bundle pinning another (nothing committed)"
grep -q "rank-steps .*(failed 0, retryable 0)" "$out"; check $? "no failed rank-step"
grep -q "mismatches          0" "$out"; check $? "zero mismatches"
grep -Eq "placement-v1: steps [0-9]+-[0-9]+  placement-v2: steps [0-9]+-[0-9]+  placement-v1: steps" "$out"
check $? "timeline v1 -> v2 -> v1"
[ "$(grep -c 'v1 ACTIVE/0  v2 RETIRED/0' "$out")" = 4 ]; check $? "v2 retired, v1 active on all four ranks"
grep -q "release-v2 *DRAINING *-> RETIRED" "$out"; check $? "candidate committed RETIRED after the ranks drained it"
grep -q "a late retry of the v2 promotion was answered with the recorded result; the ranks stay on: v1$" "$out"
check $? "a late retry of an old promotion does not switch the ranks back"
grep -q "a 56-slot placement over the memory budget: manifest: the migration to placement-v4 peaks at [0-9]* bytes of expert weights, over the budget of 31457280; ranks now hold: v1 ACTIVE/0 v2 RETIRED/0$" "$out"
check $? "a placement whose migration peaks over the budget is refused before any rank prepares it"
grep -q "release-v2 LOADED placement-v2" "$out"; check $? "the EPLB placement fits the budget"
grep -q "stopping the serving release by hand is refused: to: release-v1 serves placement-v1" "$out"
check $? "an ACTIVE release serving a placement leaves ACTIVE only through promote/rollback"
grep -Eq "balancedness \(mean/max rank load, every layer\): before 0\.[0-9]+, after 0\.[0-9]+" "$out"
check $? "EPLB plan from the observed load printed with balancedness before/after"
# The group re-forms without rank 1: the load stops at once, naming rank 1 or the re-forming group.
grep -Eq "killed rank: placement load refused after [0-9] s: .*(rank 1 \(127.0.0.1:[0-9]+\)|the group is re-forming)" "$out"
check $? "a killed rank stops the next placement load within seconds, naming the rank or the re-forming group"
grep -q "killed rank: release-v3 is VERIFIED" "$out"; check $? "nothing committed for the failed load"
grep -Eq "shadow samples of placement-v2: (2[0-9]|[3-9][0-9]|[1-9][0-9]{2,}) / 20" "$out"
check $? "moectl rollout waited until every rank ran 20 shadow steps of v2"
grep -Eq "canary steps of placement-v2: (1[2-9]|[2-9][0-9]|[1-9][0-9]{2,}) / 12" "$out"
check $? "... and served 12 canary steps with it"
grep -Eq "release-v2 ACTIVE; release-v1 DRAINING \(ranks: [1-9][0-9]* shadow samples, 0 mismatches, [1-9][0-9]* canary steps" "$out"
check $? "the promotion gate read the ranks' counters (no shadow mismatch)"
grep -Eq "canary steps +[1-9][0-9]* \(served by a candidate" "$out"; check $? "canary steps answered correctly (checked by the driver)"
grep -Eq "v2 ACTIVE/[0-9]+ \(r[0-9]+ d[0-9]+ c[1-9][0-9]* l[0-9]+\)" "$out"
check $? "placement-v2 slots copied from the ranks holding them (0x08F), digests checked"
exit $fail
