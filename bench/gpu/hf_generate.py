"""Greedy generate() of a random-init transformers MoE model alone and through the ranks
(moe_runtime.hf), side by side (issue 18; bench/RESULTS.md). Runs where torch and transformers
are (the GPU machine), with the ranks started by bench/gpu/hf_generate.sh.

  python3 bench/gpu/hf_generate.py make --family qwen3_moe --out DIR/model
  python3 bench/gpu/hf_generate.py compare --model DIR/model --targets unix:/s/0.sock,unix:/s/1.sock

`make` writes a model made with from_config + save_pretrained (hf_parity.make_model: nothing
downloaded; the experts' weights scaled by 10, so that they matter). `compare` runs, for
16 prompts of 16 tokens (one batch):
  1. generate(max_new_tokens=32, greedy) with the model alone, timed;
  2. the same with every MoE block's experts served by the ranks (attach), timed;
  3. one forward pass in parity mode: each MoE layer's ranks' output against the block's own
     experts module on the same input (relative L2), and the final logits alone vs through
     the ranks (relative L2).
Prints one JSON line.
"""
import argparse
import copy
import json
import os
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hf_parity import add_model_args, make_model, moe_block  # noqa: E402

from moe_runtime import RankGroup  # noqa: E402
from moe_runtime.hf import attach, detach  # noqa: E402


def make(a):
    make_model(a).save_pretrained(a.out)
    print(json.dumps({"family": a.family, "out": a.out}))


def generate(model, prompts, new_tokens):
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompts, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens,
                             pad_token_id=0)
    torch.cuda.synchronize()
    return out[:, prompts.shape[1]:], time.perf_counter() - start


class Fp32Experts(torch.nn.Module):
    """A block's experts module computed in FP32 (weights upcast, the gate-weighted sum in FP32),
    rounded to BF16 once: the semantic computation the ranks implement, as a second reference
    beside transformers' BF16 experts (which add the gate-weighted outputs in BF16)."""

    def __init__(self, experts):
        super().__init__()
        self.inner = copy.deepcopy(experts).float()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self.inner(hidden_states.float(), top_k_index, top_k_weights.float()).to(hidden_states.dtype)


def agreement(x_tokens, y_tokens):
    same = [bool(torch.equal(x, y)) for x, y in zip(x_tokens, y_tokens)]
    return sum(same), float(sum(int((x == y).sum()) for x, y in zip(x_tokens, y_tokens))) / x_tokens.numel()


def rel(x, y):
    return float((x - y).norm() / y.norm())


def compare(a):
    torch.manual_seed(a.seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).cuda().eval()
    vocab = model.config.vocab_size
    prompts = torch.randint(1, vocab, (a.prompts, a.prompt_len), device="cuda")
    generate(model, prompts[:2], 2)  # warm-up
    alone, t_alone = generate(model, prompts, a.new_tokens)
    with torch.no_grad():
        logits_alone = model(prompts).logits.float()
    # The same model with FP32 experts (the semantic computation), for reference.
    bf16_experts = {idx: moe_block(l).experts for idx, l in enumerate(model.model.layers) if moe_block(l) is not None}
    for idx, e in bf16_experts.items():
        moe_block(model.model.layers[idx]).experts = Fp32Experts(e)
    fp32, _ = generate(model, prompts, a.new_tokens)
    with torch.no_grad():
        logits_fp32 = model(prompts).logits.float()
    for idx, e in bf16_experts.items():
        moe_block(model.model.layers[idx]).experts = e
    group = RankGroup(a.targets.split(","), timeout=120)
    if a.rings:
        # --device_rings: rank r's ring keeps its rows on GPU r (the rank's), shared by CUDA IPC.
        devices = [f"cuda:{r}" for r in range(group.size)] if a.device_rings else None
        group.use_rings(max_tokens=a.prompts * a.prompt_len, d=model.config.hidden_size,
                        k=model.config.num_experts_per_tok, spin_us=a.spin_us, devices=devices)
    originals = attach(model, group, parity=True)
    with torch.no_grad():
        logits_ranks = model(prompts).logits.float()
    blocks = {idx: moe_block(model.model.layers[idx]) for idx in originals}
    layer_errors = {idx: max(b.experts.errors) for idx, b in blocks.items()}
    detach(model, originals)
    attach(model, group, keep_weights=True)
    generate(model, prompts[:2], 2)  # warm-up through the ranks
    ranks, t_ranks = generate(model, prompts, a.new_tokens)
    same = [bool(torch.equal(x, y)) for x, y in zip(alone, ranks)]
    first_diff = [int((x != y).nonzero()[0]) if not s else None for x, y, s in zip(alone, ranks, same)]
    tokens = a.prompts * a.new_tokens
    print(json.dumps({
        "family": model.config.model_type, "transformers": transformers.__version__,
        "moe_layers": sorted(originals), "prompts": a.prompts, "new_tokens": a.new_tokens,
        "same_prompts": sum(same), "first_difference": first_diff,
        "token_agreement": agreement(alone, ranks)[1],
        "ranks_vs_fp32_experts": agreement(fp32, ranks), "bf16_vs_fp32_experts": agreement(fp32, alone),
        "logits_rel_l2": rel(logits_ranks, logits_alone),
        "logits_rel_l2_ranks_vs_fp32": rel(logits_ranks, logits_fp32),
        "logits_rel_l2_bf16_vs_fp32": rel(logits_alone, logits_fp32),
        "layer_rel_l2_max": {str(k): v for k, v in layer_errors.items()},
        "tokens_per_s_alone": tokens / t_alone, "tokens_per_s_ranks": tokens / t_ranks,
        "rings": a.rings, "device_rings": a.device_rings, "retried": group.retried,
    }))
    group.close()


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    add_model_args(sub.add_parser("make"))
    c = sub.add_parser("compare")
    c.add_argument("--model", required=True)
    c.add_argument("--targets", required=True)
    c.add_argument("--prompts", type=int, default=16)
    c.add_argument("--prompt_len", type=int, default=16)
    c.add_argument("--new_tokens", type=int, default=32)
    c.add_argument("--rings", type=int, default=1)
    c.add_argument("--device_rings", type=int, default=0)
    c.add_argument("--spin_us", type=int, default=2000)
    c.add_argument("--seed", type=int, default=2)
    a = p.parse_args()
    make(a) if a.cmd == "make" else compare(a)


if __name__ == "__main__":
    main()
