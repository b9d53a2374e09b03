"""Makes a random-init Hugging Face transformers MoE model of one family (from_config +
save_pretrained: nothing downloaded) and records, for every MoE layer, hidden rows, a routing
and what that layer's transformers experts module computes on them (the engine_driver --parity
input). Runs where transformers and torch are (the GPU machine); the project only reads the files.

  python3 bench/gpu/hf_parity.py --family qwen3_moe --out DIR [--tokens 64 --d 512 --f 256 ...]

DIR/model is the checkpoint, DIR/steps.safetensors the steps: hidden.L [T, d] BF16, topk_ids.L
[T, k] I32, topk_weights.L [T, k] F32, expected.L [T, d] F32.
"""
import argparse
import inspect
import json
import os

import torch
import transformers
from safetensors.torch import save_file


def config_for(family, a):
    common = dict(hidden_size=a.d, num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=8,
                  vocab_size=256, num_experts_per_tok=a.k)
    if family == "mixtral":
        return dict(common, intermediate_size=a.f, num_local_experts=a.experts)
    if family in ("qwen2_moe", "qwen3_moe"):
        extra = dict(shared_expert_intermediate_size=a.f) if family == "qwen2_moe" else dict(head_dim=a.d // 8)
        return dict(common, intermediate_size=2 * a.f, moe_intermediate_size=a.f, num_experts=a.experts,
                    decoder_sparse_step=1, mlp_only_layers=[0], **extra)
    # deepseek_v2 / deepseek_v3: layer 0 dense, one shared expert (the engine's), MLA attention
    return dict(common, intermediate_size=2 * a.f, moe_intermediate_size=a.f, n_routed_experts=a.experts,
                n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=96 if family == "deepseek_v3" else None,
                qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32, n_group=1, topk_group=1)


def moe_block(layer):
    for name in ("mlp", "block_sparse_moe"):
        block = getattr(layer, name, None)
        if block is not None and hasattr(block, "experts"):
            return block
    return None


def add_model_args(p):
    """The random-init model's shape (shared with hf_generate.py)."""
    p.add_argument("--family", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--f", type=int, default=256)
    p.add_argument("--seed", type=int, default=1)


def make_model(a):
    """A random-init model of a.family in BF16 (from_config: nothing downloaded)."""
    torch.manual_seed(a.seed)
    cfg = transformers.AutoConfig.for_model(a.family, **config_for(a.family, a))
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    # Random init draws weights with std 0.02: scale the experts up so that their outputs are
    # of order one and BF16 rounding, not underflow, is what the comparison sees.
    with torch.no_grad():
        for layer in model.model.layers:
            block = moe_block(layer)
            if block is not None:
                for prm in block.experts.parameters():
                    prm.mul_(10.0)
    return model


def main():
    p = argparse.ArgumentParser()
    add_model_args(p)
    p.add_argument("--tokens", type=int, default=64)
    a = p.parse_args()
    model = make_model(a)
    os.makedirs(a.out, exist_ok=True)
    model.save_pretrained(os.path.join(a.out, "model"))
    model = model.cuda().eval()
    steps = {}
    layers = []
    for idx, layer in enumerate(model.model.layers):
        block = moe_block(layer)
        if block is None:
            continue
        layers.append(idx)
        x = torch.randn(a.tokens, a.d, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(a.experts, device="cuda")[: a.k] for _ in range(a.tokens)])
        w = torch.rand(a.tokens, a.k, device="cuda") + 0.05
        w = w / w.sum(-1, keepdim=True)
        with torch.no_grad():
            # transformers 5: the experts module takes (hidden, top_k_index, top_k_weights).
            y = block.experts(x, ids, w.to(torch.bfloat16))
        steps[f"hidden.{idx}"] = x.cpu().contiguous()
        steps[f"topk_ids.{idx}"] = ids.to(torch.int32).cpu().contiguous()
        steps[f"topk_weights.{idx}"] = w.to(torch.bfloat16).float().cpu().contiguous()
        steps[f"expected.{idx}"] = y.float().cpu().contiguous()
    save_file(steps, os.path.join(a.out, "steps.safetensors"))
    block = moe_block(model.model.layers[layers[0]])
    print(json.dumps({"family": a.family, "transformers": transformers.__version__, "moe_layers": layers,
                      "experts_module": type(block.experts).__name__,
                      "forward": str(inspect.signature(block.experts.forward))}))


if __name__ == "__main__":
    main()
