#!/usr/bin/env bash
# On the GPU machine, from the repository root after tools/gpu_bundle.sh (dist/gpu carried):
# the decode path (eager and CUDA-graph replay) of the expert-layer benchmark with one of the
# kernels' switches on and off side by side, interleaved per shape: KNOB=pdl (default:
# programmatic dependent launch) or KNOB=fused_layer (LocalLayer's fused one-token kernels
# against its stages); any 0/1 key of kernels/api.h CudaTuning works (MOE_CUDA_TUNING="$KNOB=0|1").
# TOKENS=<T> keeps one token count. COLD="0 1" also runs every cell with the L2 scrubbed before
# each repetition (--cold-l2).
# Output: JSON lines on stdout, each tagged with the knob, its value, the round and cold_l2.
set -uo pipefail
export LD_LIBRARY_PATH="$PWD/dist/gpu/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
REPS="${REPS:-30}"
KNOB="${KNOB:-pdl}"
for shape in ${SHAPES:-E128-k8-d2048-f768 E32-k8-d7168-f2048 E8-k2-d4096-f14336}; do
  for round in 1 2; do
    for cold in ${COLD:-0}; do
      flag=""
      [ "$cold" = 1 ] && flag="--cold-l2"
      for on in 1 0; do
        MOE_CUDA_TUNING="$KNOB=$on" dist/gpu/bin/expert_layer_bench --shape "$shape" --decode-only --reps "$REPS" ${TOKENS:+--tokens $TOKENS} $flag \
          | grep '"kind": "cell"' | sed "s/^{/{\"knob\": \"$KNOB\", \"on\": $on, \"round\": $round, /"
      done
    done
  done
done
