#!/usr/bin/env bash
# On the GPU machine, from the repository root after tools/gpu_bundle.sh (dist/gpu carried):
# the decode path (eager and CUDA-graph replay) of the expert-layer benchmark, with
# programmatic dependent launch on and off side by side (MOE_CUDA_PDL), interleaved per shape.
# Output: JSON lines on stdout, each tagged with "pdl".
set -uo pipefail
export LD_LIBRARY_PATH="$PWD/dist/gpu/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
REPS="${REPS:-30}"
for shape in ${SHAPES:-E128-k8-d2048-f768 E32-k8-d7168-f2048 E8-k2-d4096-f14336}; do
  for round in 1 2; do
    for pdl in 1 0; do
      MOE_CUDA_PDL=$pdl dist/gpu/bin/expert_layer_bench --shape "$shape" --decode-only --reps "$REPS" \
        | grep '"kind": "cell"' | sed "s/^{/{\"pdl\": $pdl, \"round\": $round, /"
    done
  done
done
