#!/usr/bin/env bash
# FP8 experts across RANKS GPUs of one host (moe-rankd --expert_dtype fp8: packed FP8 rows over
# NCCL between the ranks), in one call: nccl_executor_test's FP8 case (one process per GPU,
# against the CPU FP8 reference), tests/integration/fp8_cluster_test.sh on CUDA kernels + NCCL,
# and client-observed steps with BF16 and then FP8 experts (bench/gpu/cluster_latency.sh). From
# the repository root with dist/gpu (tools/gpu_bundle.sh):
#   LD_LIBRARY_PATH=$PWD/dist/gpu/lib:/usr/local/cuda/lib64 RANKS=2 bench/gpu/fp8_group.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 SKIP_BUILD=1
B="${B:-dist/gpu/bin}"
RANKS="${RANKS:-2}"
rc=0
"$B/nccl_executor_test" --gtest_filter='*Fp8*' || rc=1
RANKS="$RANKS" tests/integration/fp8_cluster_test.sh "$B/moe-rankd" "$B/engine_driver" "$B/moectl" || rc=1
for dtype in bf16 fp8; do
  echo "== cluster_latency, --expert_dtype $dtype"
  FLOOR=$([ "$dtype" = bf16 ] && echo 1 || echo 0) RANKS="$RANKS" RANKD_EXTRA="--expert_dtype $dtype" \
    CELLS="${CELLS:-decode:1,decode:8,prefill:2048,prefill:8192}" STEPS="${STEPS:-100}" \
    bench/gpu/cluster_latency.sh || rc=1
done
exit "$rc"
