#!/usr/bin/env bash
# session 54 (temporary, not committed): this session's executor and agreement changes (count
# conservation, rejected steps, load committed after the step) on the GPU paths.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/dist/gpu/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
timeout 400 dist/gpu/bin/nccl_executor_test 2>&1 | grep -E "^\[ *(RUN|OK|FAILED|PASSED|SKIPPED) |Failure|error|Expected|Which is|Actual" | head -80
echo "nccl_executor_test rc=${PIPESTATUS[0]}"
timeout 150 dist/gpu/bin/cuda_kernels_test 2>&1 | tail -3
echo "== all done s=${SECONDS}"
