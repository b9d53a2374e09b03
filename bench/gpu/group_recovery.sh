#!/usr/bin/env bash
# Process-group recovery on the GPU machine (issue: a group that re-forms after a rank is lost):
# tests/integration/group_kill_test.sh over WORLD (default 2) ranks with CUDA kernels and NCCL,
# one GPU each, so every epoch builds a new NCCL communicator from the unique id the epoch's
# peer slot 0 sends through moe-controller. Run from the repository root after
# tools/gpu_bundle.sh (dist/gpu carried):
#   LD_LIBRARY_PATH=$PWD/dist/gpu/lib:/usr/local/cuda/lib64 bench/gpu/group_recovery.sh
# Logs of the controller and every rank go to $OUT (or ./gpu-out) as group_recovery_logs.tgz.
set -uo pipefail
B="${B:-dist/gpu/bin}"
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
export TEST_TMPDIR="$(mktemp -d /tmp/group-recovery.XXXXXX)"
WORLD="${WORLD:-2}" KILLS="${KILLS:-20}" D="${D:-512}" DFF="${DFF:-1024}" \
  bash tests/integration/group_kill_test.sh "$B/moe-rankd" "$B/engine_driver" "$B/moectl" "$B/moe-controller"
rc=$?
tar -C "$TEST_TMPDIR" -czf "$OUT/group_recovery_logs.tgz" --exclude model . 2>/dev/null || true
exit "$rc"
