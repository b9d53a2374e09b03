#!/usr/bin/env bash
# Issue 17's "host work flat in T": step_host_bench on the CUDA kernels (one member, one GPU,
# E128 k8 d2048 f768, prefill T = 256..8192), the host plan and the device plan, the rows and
# routing on the host and in kernel memory (--in_place). With MOE_CUDA_TUNING=blocking_sync=1
# the host's waits for the kernels block instead of spin, and MOE_BENCH_NCCL_WAIT_POLL_US=50
# makes the NCCL waits sleep between polls, so the step thread's CPU time is its host work; one
# pass spinning (the defaults) gives the wall times. From the repository root with
# dist/gpu (tools/gpu_bundle.sh):
#   LD_LIBRARY_PATH=$PWD/dist/gpu/lib:/usr/local/cuda/lib64 bench/gpu/step_host.sh
set -uo pipefail
B="${B:-dist/gpu/bin}"
REPS="${REPS:-9}"
rc=0
for mode in "host plan, host rows:" "device plan, host rows:--device_plan" \
  "host plan, in place:--in_place" "device plan, in place:--device_plan --in_place"; do
  echo "== ${mode%%:*}, waits blocking"
  MOE_BENCH_KERNELS=cuda MOE_CUDA_TUNING=blocking_sync=1 MOE_BENCH_NCCL_WAIT_POLL_US=50 "$B/step_host_bench" --reps "$REPS" ${mode#*:} || rc=1
done
echo "== device plan, in place, waits spinning (the default)"
MOE_BENCH_KERNELS=cuda "$B/step_host_bench" --reps "$REPS" --device_plan --in_place || rc=1
exit "$rc"
