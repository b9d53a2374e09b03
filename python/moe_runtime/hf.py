"""Hugging Face transformers adapter: a model's routed experts served by the ranks.

transformers 5 gives every MoE family (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3, ...) a
sparse block whose router picks ``top_k_index`` / ``top_k_weights`` and whose ``experts`` module
computes ``experts(hidden [T, d], top_k_index [T, k], top_k_weights [T, k]) -> [T, d]``.
:func:`attach` replaces each block's ``experts`` module with :class:`RankExperts`, which makes
that one call to the ranks (one layer step, with the block's own routing); the router, the
shared experts, attention and everything else stay in the engine's process.

    from moe_runtime import RankGroup
    from moe_runtime.hf import attach
    group = RankGroup(["unix:/tmp/moe/0.sock", "unix:/tmp/moe/1.sock"])
    attach(model, group)           # the ranks serve the checkpoint `model` was loaded from
    model.generate(...)

The ranks must serve the same checkpoint (the directory ``save_pretrained`` wrote, or the one
the model was loaded from); their layer indices are the decoder layers' indices.

With one engine process driving every rank (this adapter), a step's tokens are split into one
contiguous share per rank and every rank is called for every layer step, also with zero tokens.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import nn

from moe_runtime.client import StepInput
from moe_runtime.group import RankGroup


def moe_blocks(model: nn.Module) -> Dict[int, nn.Module]:
    """Decoder layer index -> its sparse MoE block (the module with an ``experts`` child)."""
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is None:
        raise ValueError("model: no .model.layers (not a transformers decoder-only model)")
    out = {}
    for idx, layer in enumerate(layers):
        for name in ("mlp", "block_sparse_moe", "feed_forward"):
            block = getattr(layer, name, None)
            if block is not None and isinstance(getattr(block, "experts", None), nn.Module):
                out[idx] = block
                break
    return out


class RankExperts(nn.Module):
    """Stands in for a block's experts module: one layer step on the ranks per call."""

    def __init__(self, group: RankGroup, layer: int, decode_tokens: int = 8, timeout: Optional[float] = None,
                 reference: Optional[nn.Module] = None):
        super().__init__()
        self.group = group
        self.layer = layer
        self.decode_tokens = decode_tokens  # tokens per rank up to which a step is a decode step
        self.timeout = timeout
        self.calls = 0
        # Parity mode: the original experts module also runs on every call, and the relative L2
        # error of the ranks' output against it is appended to `errors`.
        self.reference = reference
        self.errors: List[float] = []

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        ids = top_k_index.reshape(x.shape[0], -1)
        w = top_k_weights.reshape(x.shape[0], -1)
        p, t = self.group.size, x.shape[0]
        bounds = [t * r // p for r in range(p + 1)]
        if self.group.device_rings and x.is_cuda and x.dtype == torch.bfloat16:
            # Rings with device rows: the rows and routing stay on the GPU (each rank's share is
            # copied GPU to GPU into its ring's device slot).
            xh = x.detach().contiguous()
            ih = ids.detach()  # ids past int32 are refused by the ring (never narrowed into range)
            wh = w.detach().float()
        else:
            # One host copy of the step's tensors; each rank gets a view of its rows.
            xh = x.detach().contiguous().cpu()
            ih = ids.detach().cpu()  # narrowed to int32 by routing_arrays, which refuses ids past it
            wh = w.detach().float().cpu()
        inputs: List[StepInput] = [
            StepInput(xh[bounds[r] : bounds[r + 1]], ih[bounds[r] : bounds[r + 1]], wh[bounds[r] : bounds[r + 1]])
            for r in range(p)
        ]
        decode = max(bounds[r + 1] - bounds[r] for r in range(p)) <= self.decode_tokens
        results = self.group.step(self.layer, inputs, decode=decode, timeout=self.timeout)
        self.calls += 1
        out = torch.cat([r.output for r in results], dim=0) if t else xh.new_zeros((0, shape[-1]))
        out = out.to(device=hidden_states.device, dtype=hidden_states.dtype).reshape(shape)
        if self.reference is not None and t:
            with torch.no_grad():
                want = self.reference(hidden_states, top_k_index, top_k_weights).float()
            den = want.norm().item()
            self.errors.append((out.float() - want).norm().item() / (den if den > 0 else 1.0))
        return out


def attach(model: nn.Module, group: RankGroup, *, decode_tokens: int = 8, keep_weights: bool = False,
           parity: bool = False, timeout: Optional[float] = None) -> Dict[int, nn.Module]:
    """Replaces every MoE block's experts module of ``model`` with :class:`RankExperts` over
    ``group``. Returns the original modules by layer (for :func:`detach`); with
    ``keep_weights=False`` their parameters are moved to the meta device to free memory, and
    detach is then impossible. ``parity=True`` keeps them and runs them beside the ranks on every
    call (RankExperts.errors: the relative L2 error of each call)."""
    originals = {}
    for idx, block in moe_blocks(model).items():
        originals[idx] = block.experts
        if not keep_weights and not parity:
            block.experts.to("meta")
        block.experts = RankExperts(group, idx, decode_tokens=decode_tokens, timeout=timeout,
                                    reference=originals[idx] if parity else None)
    if not originals:
        raise ValueError("model: no MoE block with an experts module found")
    return originals


def detach(model: nn.Module, originals: Dict[int, nn.Module]) -> None:
    """Puts the original experts modules back (attach(..., keep_weights=True))."""
    blocks = moe_blocks(model)
    for idx, module in originals.items():
        blocks[idx].experts = module
