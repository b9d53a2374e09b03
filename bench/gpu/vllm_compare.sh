#!/usr/bin/env bash
# Issue 19's comparison on the GPU machine: the project's expert layer (expert_layer_bench, graph
# replay for T <= 128) and vLLM's Triton fused-MoE kernel with its tuned H200 configs
# (bench/gpu/vllm_compare.py), same GPU, same run, same shapes and routings.
#   here:  tools/gpu_bundle.sh && tools/fetch_vllm.sh      (dist/gpu, .peers/vllm-<version>)
#   there: bench/gpu/vllm_compare.sh                       (carry dist and .peers)
# One shape or T: BENCH_ARGS="--shape S --tokens T" VLLM_ARGS="--shape S --tokens T".
# Results in $OUT (default gpu-out): ours.jsonl, vllm.jsonl, vllm_compare.md.
set -uo pipefail
OUT="${OUT:-gpu-out}"
VLLM="${VLLM:-$(ls -d .peers/vllm-* | sort -V | tail -1)}"
REPS="${REPS:-40}"
mkdir -p "$OUT" "$OUT/routing"
export LD_LIBRARY_PATH="$PWD/dist/gpu/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
dist/gpu/bin/expert_layer_bench --reps "$REPS" --routing_out "$OUT/routing" ${BENCH_ARGS:-} >"$OUT/ours.jsonl" 2>"$OUT/ours.err"
rc=$?
echo "expert_layer_bench rc=$rc"
[ "$rc" -eq 0 ] || { tail -5 "$OUT/ours.err"; exit 1; }
python3 bench/gpu/vllm_compare.py --vllm "$VLLM" --routing_dir "$OUT/routing" --ours "$OUT/ours.jsonl" \
  --reps "$REPS" --md "$OUT/vllm_compare.md" ${VLLM_ARGS:-} >"$OUT/vllm.jsonl" 2>"$OUT/vllm.err"
rc=$?
echo "vllm_compare rc=$rc"
tail -3 "$OUT/vllm.err"
grep '"ceiling"' "$OUT/ours.jsonl"
cat "$OUT/vllm_compare.md"
rm -rf "$OUT/routing"
exit "$rc"
