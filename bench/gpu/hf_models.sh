#!/usr/bin/env bash
# Issue 16's checks on the GPU machine, one call (run from the repository root with dist/gpu from
# tools/gpu_bundle.sh; OUT is where the log goes):
#  1. per family (mixtral, qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3): a random-init
#     transformers model saved with save_pretrained, served by two ranks (CPU kernels + UCX)
#     and by one rank (CUDA kernels + NCCL); every MoE layer's outputs against what the
#     transformers experts module computes on the same rows and routing (engine_driver --parity);
#  2. a >= 20 GB checkpoint directory loaded by one rank of two (checkpoint_load_bench) against
#     `cat` of the same files, page cache dropped before each (posix_fadvise), then warm.
# RANKD_EXTRA / DRIVER_EXTRA add flags to the ranks / the driver (FP8 experts: RANKD_EXTRA=
# "--expert_dtype fp8" DRIVER_EXTRA="--expert_dtype fp8 --parity_tolerance 0.1"); SKIP_LOAD=1
# leaves out part 2.
set -euo pipefail
export LD_LIBRARY_PATH="$PWD/dist/gpu/lib:/usr/local/cuda/lib64" NCCL_NVLS_ENABLE=0
PY="${PY:-/opt/torch/.venv/bin/python3}"
B=dist/gpu/bin
RANKD="$B/moe-rankd"
work="$(mktemp -d /tmp/hf.XXXXXX)"
source deploy/cluster_lib.sh
trap 'stop_ranks; rm -rf "$work"' EXIT
nvidia-smi -L
for fam in ${FAMILIES:-mixtral qwen2_moe qwen3_moe deepseek_v2 deepseek_v3}; do
  echo "== $fam"
  "$PY" bench/gpu/hf_parity.py --family "$fam" --out "$work/$fam" 2>&1 | grep -v -i warn | tail -3
  "$B/moectl" checkpoint inspect "$work/$fam/model" --world 2 | sed -n 2,6p
  for ranks in 2 1; do
    [ "$ranks" = 2 ] && BACKEND=cpu choose_backend 2 || choose_backend 1
    # shellcheck disable=SC2086
    start_ranks "$RANKD" "$work/$fam/r$ranks" "$ranks" "$work/$fam/model" ${RANKD_EXTRA:-}
    echo "-- $ranks rank(s), $BACKEND_NAME ${RANKD_EXTRA:-}"
    # shellcheck disable=SC2086
    "$B/engine_driver" --port_dir "$work/$fam/r$ranks/ports" --world "$ranks" --checkpoint "$work/$fam/model" \
      --parity "$work/$fam/steps.safetensors" ${DRIVER_EXTRA:-} || echo "PARITY FAILED: $fam, $ranks rank(s)"
    stop_ranks
  done
done

[ "${SKIP_LOAD:-0}" = 1 ] && exit 0
echo "== load: a >= 20 GB checkpoint directory"
big="$work/big"
"$PY" - "$big" <<'PYEOF'
import json, os, sys, torch
from safetensors.torch import save_file
out = sys.argv[1]; os.makedirs(out, exist_ok=True)
d, f, experts, layers = 7168, 2048, 64, 4  # DeepSeek-V3's expert shape, 3 x 7168 x 2048 x 2 B = 88 MB an expert
cfg = dict(model_type="deepseek_v3", hidden_size=d, num_hidden_layers=layers, num_experts_per_tok=8,
           n_routed_experts=experts, moe_intermediate_size=f, first_k_dense_replace=0, dtype="bfloat16")
json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
wm = {}; n = 0
for l in range(layers):
    for half in range(2):
        t = {}
        for e in range(half * experts // 2, (half + 1) * experts // 2):
            p = f"model.layers.{l}.mlp.experts.{e}."
            t[p + "gate_proj.weight"] = torch.randn(f, d, dtype=torch.bfloat16)
            t[p + "up_proj.weight"] = torch.randn(f, d, dtype=torch.bfloat16)
            t[p + "down_proj.weight"] = torch.randn(d, f, dtype=torch.bfloat16)
        n += 1; name = f"model-{n:05d}-of-{2 * layers:05d}.safetensors"
        save_file(t, os.path.join(out, name)); wm.update({k: name for k in t})
json.dump({"metadata": {}, "weight_map": wm}, open(os.path.join(out, "model.safetensors.index.json"), "w"))
PYEOF
sync
du -sh "$big"
drop() { "$PY" -c "import os,sys
for n in os.listdir(sys.argv[1]):
    fd=os.open(os.path.join(sys.argv[1],n),os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED); os.close(fd)" "$big"; }
bytes=$(cat "$big"/*.safetensors | wc -c)
for cache in cold warm; do
  [ "$cache" = cold ] && drop
  s=$(date +%s%N); cat "$big"/*.safetensors >/dev/null; e=$(date +%s%N)
  awk -v b="$bytes" -v ns="$((e - s))" -v c="$cache" \
    'BEGIN { printf "cat (%s): %d bytes in %.3f s = %.2f GB/s\n", c, b, ns / 1e9, b / ns }'
  [ "$cache" = cold ] && drop
  for t in 8 16; do
    "$B/checkpoint_load_bench" --checkpoint "$big" --world 2 --rank 0 --threads "$t" | sed "s/^/load ($cache): /"
    [ "$cache" = cold ] && drop
  done
  "$B/checkpoint_load_bench" --checkpoint "$big" --world 1 --rank 0 --threads 16 | sed "s/^/load ($cache): /"
done
