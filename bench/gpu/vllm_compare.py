"""vLLM's Triton fused-MoE kernel beside the project's expert layer: same GPU, same run, same
routings (issue 19's comparison runner).

The peer's code never enters the repository. `--vllm DIR` names a copy of vLLM's source kept
outside it (a release wheel unpacked, e.g. .peers/vllm-0.33.0 by bench/gpu/vllm_compare.sh); this
runner reads `fused_moe_kernel` and the @triton.jit helpers it calls, and `get_default_config`,
out of DIR's vllm/model_executor/layers/fused_moe/fused_moe.py at run time, and vLLM's tuned
configs for the GPU from DIR's configs/ folder, as vLLM picks them (the file for E, N = the
intermediate size and the device name; the entry whose M is nearest the token count).

What it times, per cell, the way vLLM's `fused_experts` runs one MoE layer in BF16: the gate/up
kernel, SiLU-and-mul, the down kernel with the routed weights multiplied in, and the sum over the
top-k. vLLM's CUDA alignment op (`moe_align_block_size`) is replaced by an equivalent written
here in torch and left out of the time (as issue 19's table does); vLLM's small-batch rule that
skips the alignment (each (token, expert) pair its own block when T*k*4 <= E) is followed.
SiLU-and-mul (a CUDA op in vLLM) is a small Triton kernel of this runner's, the sum `torch.sum`
(vLLM's `moe_sum` is one kernel too). Each cell is timed eagerly and as CUDA-graph replay and the
faster of the two is vLLM's figure (vLLM captures graphs up to its largest capture size); the
project's figure is the faster of its graph-replayed device-offset path (run for T <= 128, and
above wherever it takes the Hopper grouped kernels) and its eager prefill path (host offsets);
the table names which, and shows the padded runner beside it where the bench ran it.

FP8 (`--dtype fp8` or `both`): the same layer as vLLM's fused_experts runs it for a checkpoint in
DeepSeek-V3's format (use_fp8_w8a8, block_shape [128, 128]): E4M3 weights with one scale per
128 x 128 block (quantized here, untimed), the hidden rows quantized per token and 128 values
before the gate/up kernel, the SiLU-and-mul output quantized the same way before the down kernel,
with vLLM's tuned H200 file for block FP8 where it has one (the "...,dtype=fp8_w8a8,block_shape=
[128,128].json" of E and N) and get_default_config's block-FP8 rule otherwise, and the swap-AB
choice vLLM makes on Hopper (enable_swap_ab, read out of DIR's fused_moe/utils.py). The two
quantizations are one Triton kernel of this runner's (the down one fused with SiLU-and-mul: one
pass fewer than vLLM's, in the peer's favour); vLLM calls per_token_group_quant_fp8 for both.
Its lines are "vllm-triton-fp8"; the project's side is expert_layer_bench's FP8 layer ("fp8",
"fp8-graph": the tokens quantized once and packed, the FP8 experts, combine), as
moe-rankd --expert_dtype fp8 runs it. Both are checked against the FP32 layer with the
dequantized weights (relative L2 under 0.1: activation rounding to E4M3 is a few percent).

A "ceiling" line times torch's dense GEMMs at 8192^3 taking turns: BF16 (torch.mm) and E4M3
(torch._scaled_mm, per-tensor scales, and with 1 x 128 / 128 x 128 block scales where this torch
and cuBLAS take them), so FP8's dense rate over BF16's on this GPU, under the same clocks, sits
beside the layer's ratio.

Shapes with no tuned file for this GPU (E32 k8 d7168 f2048 in BF16 in vLLM 0.33.0): vLLM's
default config, or with --tune_missing (vllm_compare.sh passes it unless TUNE_MISSING=0) the
fastest of the default and the configs vLLM's tuned files for this GPU pick at the nearest M, each
timed eagerly on the cell (what a user who tunes the shape with vLLM's benchmark_moe.py would run,
on the space vLLM's tuner has narrowed for the GPU; the cell's "searched_us" lists them).

Routings: the files expert_layer_bench --routing_out wrote for the same cells (int32 top-k ids,
then float32 gates). Every cell's output is checked against an FP32 reference.

Rounds: vllm_compare.sh runs the bench and this timing ROUNDS times, taking turns (so that
neither side always runs on the GPU the other has just heated), then compare_report.py, which
needs no GPU, takes each cell's median over the rounds of both sides and writes the "compare"
lines and the table from them.

  python3 bench/gpu/vllm_compare.py --vllm DIR --routing_dir R [--ours ours.jsonl ...] [--reps 40]
      [--dtype bf16|fp8|both] [--tune_missing] [--md report.md] > vllm.jsonl
"""
import argparse
import ast
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
import types

import torch
import triton
import triton.language as tl

from compare_report import median, ours_cells, report  # the table and the compare lines (no GPU needed)
from dense_sustained import block_scaled  # the block-scaled dense GEMM in the layout this torch takes
from torch_reference import median_us  # events around each call, after 3 warm-up calls; the median

SHAPES = [
    ("E128-k8-d2048-f768", 128, 8, 2048, 768, [1, 16, 128, 1024, 8192]),
    ("E8-k2-d4096-f14336", 8, 2, 4096, 14336, [1, 128, 8192]),
    ("E32-k8-d7168-f2048", 32, 8, 7168, 2048, [16, 1024, 4096]),
]
FUSED = "vllm/model_executor/layers/fused_moe"


def load_peer(vllm_dir):
    """The kernel module and get_default_config, read out of the peer's fused_moe.py."""
    path = os.path.join(vllm_dir, FUSED, "fused_moe.py")
    src = open(path).read()
    tree = ast.parse(src)
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    if "fused_moe_kernel" not in funcs:
        sys.exit("%s: no fused_moe_kernel" % path)
    jitted = {name for name, n in funcs.items() if any("jit" in ast.unparse(d) for d in n.decorator_list)}
    # fused_moe_kernel and every @triton.jit function it calls, transitively.
    want, todo = [], ["fused_moe_kernel"]
    while todo:
        name = todo.pop()
        if name in want:
            continue
        want.append(name)
        for n in ast.walk(funcs[name]):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in jitted:
                todo.append(n.func.id)
    # Triton compiles from source files: the extracted functions go into a module of their own.
    body = "import triton\nimport triton.language as tl\n\n" + "\n\n".join(
        ast.get_source_segment(src, funcs[n]) if not funcs[n].decorator_list else
        "\n".join("@" + ast.unparse(d) for d in funcs[n].decorator_list) + "\n" + ast.get_source_segment(src, funcs[n])
        for n in reversed(want))
    tmp = tempfile.mkdtemp(prefix="vllm_peer_")
    mod_path = os.path.join(tmp, "vllm_peer_fused_moe.py")
    open(mod_path, "w").write(body)
    spec = importlib.util.spec_from_file_location("vllm_peer_fused_moe", mod_path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # get_default_config, with what it reads from vLLM's environment stubbed to a CUDA platform.
    ns = {"envs": types.SimpleNamespace(VLLM_BATCH_INVARIANT=False),
          "current_platform": types.SimpleNamespace(is_rocm=lambda: False),
          "should_moe_wna16_use_cuda": lambda *a, **k: False,
          "next_power_of_2": lambda n: 1 << (max(int(n), 1) - 1).bit_length()}
    exec(compile(ast.Module(body=[funcs["get_default_config"]], type_ignores=[]), path, "exec"), ns)
    return mod.fused_moe_kernel, ns["get_default_config"], want


def load_swap_ab(vllm_dir):
    """vLLM's enable_swap_ab (fused_moe/utils.py), with its platform query answered by torch."""
    path = os.path.join(vllm_dir, FUSED, "utils.py")
    src = open(path).read()
    fn = [n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "enable_swap_ab"]
    if not fn:
        sys.exit("%s: no enable_swap_ab" % path)
    fn[0].decorator_list = []  # functools.lru_cache: not needed for a pure function here
    cap = torch.cuda.get_device_capability()
    ns = {"current_platform": types.SimpleNamespace(is_device_capability=lambda c: cap == divmod(c, 10))}
    exec(compile(ast.Module(body=fn, type_ignores=[]), path, "exec"), ns)
    return ns["enable_swap_ab"]


def tuned_configs(vllm_dir, e, n, device_name, dtype_suffix=""):
    name = "E=%d,N=%d,device_name=%s%s.json" % (e, n, device_name.replace(" ", "_"), dtype_suffix)
    path = os.path.join(vllm_dir, FUSED, "configs", name)
    if not os.path.exists(path):
        return None, name
    # Keys are token counts; some files also carry metadata ("triton_version").
    return {int(k): v for k, v in json.load(open(path)).items() if k.isdigit()}, name


def sibling_configs(vllm_dir, device_name, m, dtype_suffix=""):
    """The configs vLLM's own tuning picked on this GPU for other shapes of the same dtype: from
    every tuned file of the device (and dtype), the entry whose M is nearest `m`; distinct, in a
    fixed order. A shape with no tuned file is searched over these (--tune_missing), as a user
    would tune it with vLLM's benchmark_moe.py, on a search space vLLM's tuner has already
    narrowed for this GPU."""
    tail = "device_name=%s%s.json" % (device_name.replace(" ", "_"), dtype_suffix)
    found = set()
    folder = os.path.join(vllm_dir, FUSED, "configs")
    for name in sorted(os.listdir(folder)):
        if not name.endswith(tail) or not name.startswith("E="):
            continue
        with open(os.path.join(folder, name)) as f:
            entries = {int(k): v for k, v in json.load(f).items() if k.isdigit()}
        if entries:
            found.add(json.dumps(entries[min(entries, key=lambda x: (abs(x - m), x))], sort_keys=True))
    return [json.loads(c) for c in sorted(found)]


def align(topk, e, block_m):
    """What vLLM's moe_align_block_size computes: route indices grouped by expert, each expert's
    group padded to a multiple of block_m with the value T*k; the expert of each block; the
    padded total."""
    flat = topk.reshape(-1).long()
    routes = flat.numel()
    counts = torch.bincount(flat, minlength=e)
    padded = (counts + block_m - 1) // block_m * block_m
    cap = routes + e * (block_m - 1)
    sorted_ids = torch.full((cap,), routes, dtype=torch.int32, device=topk.device)
    order = torch.argsort(flat, stable=True)
    start_sorted = torch.cumsum(counts, 0) - counts
    start_padded = torch.cumsum(padded, 0) - padded
    ex = flat[order]
    dest = start_padded[ex] + (torch.arange(routes, device=topk.device) - start_sorted[ex])
    sorted_ids[dest] = order.int()
    expert_ids = torch.zeros((cap + block_m - 1) // block_m, dtype=torch.int32, device=topk.device)
    per_block = torch.repeat_interleave(torch.arange(e, device=topk.device, dtype=torch.int32), padded // block_m)
    expert_ids[: per_block.numel()] = per_block
    post = padded.sum().reshape(1).int()
    return sorted_ids, expert_ids, post


@triton.jit
def silu_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n_cols
    g = tl.load(x_ptr + row * stride_x + cols, mask=m).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=m).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (g / (1.0 + tl.exp(-g)) * u).to(tl.bfloat16), mask=m)


@triton.jit
def quant_rows_kernel(x_ptr, q_ptr, s_ptr, n_cols, stride_x, stride_q, stride_s, SILU: tl.constexpr,
                      GROUPS: tl.constexpr):
    """One row a program: E4M3 with one scale per 128 values (amax / 448, as vLLM's
    per_token_group_quant_fp8), of the row itself or of SiLU(gate) * up rounded to BF16."""
    row = tl.program_id(0)
    g = tl.arange(0, GROUPS)
    cols = g[:, None] * 128 + tl.arange(0, 128)[None, :]
    m = cols < n_cols
    if SILU:
        a = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=m, other=0.0).to(tl.float32)
        v = (a / (1.0 + tl.exp(-a)) * u).to(tl.bfloat16).to(tl.float32)
    else:
        v = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(v), axis=1), 1e-10) / 448.0
    q = tl.clamp(v / scale[:, None], -448.0, 448.0).to(tl.float8e4nv)
    tl.store(q_ptr + row * stride_q + cols, q, mask=m)
    tl.store(s_ptr + row * stride_s + g, scale, mask=g * 128 < n_cols)


def quantize_blocks(w):
    """[E, N, K] BF16 -> E4M3 [E, N, K] and FP32 scales [E, N / 128, K / 128], amax / 448 a block."""
    e, n, k = w.shape
    blocks = w.float().view(e, n // 128, 128, k // 128, 128)
    scale = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-10) / 448.0
    q = (blocks / scale[:, :, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(e, n, k).contiguous(), scale.contiguous()


def dequantize_blocks(q, scale):
    e, n, k = q.shape
    return (q.float().view(e, n // 128, 128, k // 128, 128) * scale[:, :, None, :, None]).view(e, n, k)


class VllmLayer:
    """One MoE layer as vLLM's fused_experts runs it, with the alignment done ahead (untimed)."""

    def __init__(self, kernel, config, x, w1, w2, topk, gates, fp8=None, swap_ab=None):
        """fp8: None (BF16), or (w1 scales, w2 scales) with w1, w2 in E4M3 (block FP8)."""
        self.kernel, self.x, self.w1, self.w2 = kernel, x, w1, w2
        self.fp8, self.swap_ab = fp8, swap_ab
        t, k = topk.shape
        e, f = w1.shape[0], w2.shape[2]
        self.t, self.k, self.f, self.d = t, k, f, x.shape[1]
        self.config = dict(config)
        bm = self.config["BLOCK_SIZE_M"]
        self.naive = t * k * 4 <= e  # vLLM's rule for skipping the alignment
        if self.naive:
            self.sorted_ids, self.expert_ids = None, topk.reshape(-1).contiguous()
            self.post = torch.full((1,), t * k * bm, dtype=torch.int32, device=x.device)
            self.em = t * k * bm
        else:
            self.sorted_ids, self.expert_ids, self.post = align(topk, e, bm)
            self.em = self.sorted_ids.numel()
            if t < bm:
                self.em = min(self.em, t * k * bm)
        self.gates = gates.contiguous()
        self.c1 = torch.empty(t, k, 2 * f, dtype=torch.bfloat16, device=x.device)
        self.c2 = torch.empty(t * k, f, dtype=torch.bfloat16, device=x.device)
        self.c3 = torch.empty(t, k, self.d, dtype=torch.bfloat16, device=x.device)
        self.out = torch.empty(t, self.d, dtype=torch.bfloat16, device=x.device)
        if fp8 is not None:
            self.xq = torch.empty(t, self.d, dtype=torch.float8_e4m3fn, device=x.device)
            self.xs = torch.empty(t, self.d // 128, dtype=torch.float32, device=x.device)
            self.c2q = torch.empty(t * k, f, dtype=torch.float8_e4m3fn, device=x.device)
            self.c2s = torch.empty(t * k, triton.cdiv(f, 128), dtype=torch.float32, device=x.device)
        self.params = set(kernel.arg_names)

    def gemm(self, a, b, c, mul_routed_weight, top_k, a_scale=None, b_scale=None):
        cfg = dict(self.config)
        block_k = cfg.pop("BLOCK_SIZE_K")
        cfg.pop("SPLIT_K", None)
        fp8 = b_scale is not None
        if fp8:  # as invoke_fused_moe_triton_kernel: K tiles within a scale block, swap-AB on Hopper
            block_k = min(block_k, 128)
        swap = bool(fp8 and self.swap_ab(cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"]))
        args = dict(
            a_ptr=a, b_ptr=b, c_ptr=c, b_bias_ptr=None, a_scale_ptr=a_scale, b_scale_ptr=b_scale,
            topk_weights_ptr=self.gates if mul_routed_weight else None, sorted_token_ids_ptr=self.sorted_ids,
            expert_ids_ptr=self.expert_ids, num_tokens_post_padded_ptr=self.post, N=b.shape[1], K=b.shape[2],
            EM=self.em, num_valid_tokens=self.t * self.k, stride_am=a.stride(0), stride_ak=a.stride(1),
            stride_be=b.stride(0), stride_bk=b.stride(2), stride_bn=b.stride(1), stride_cm=c.stride(1),
            stride_cn=c.stride(2), stride_asm=a_scale.stride(0) if fp8 else 0,
            stride_ask=a_scale.stride(1) if fp8 else 0, stride_bse=b_scale.stride(0) if fp8 else 0,
            stride_bsk=b_scale.stride(2) if fp8 else 0, stride_bsn=b_scale.stride(1) if fp8 else 0,
            stride_bbe=0, stride_bbn=0, group_n=128 if fp8 else 0, group_k=128 if fp8 else 0,
            naive_block_assignment=self.naive, BLOCK_SIZE_K=block_k, SPLIT_K=1, MUL_ROUTED_WEIGHT=mul_routed_weight,
            top_k=top_k, compute_type=tl.bfloat16, use_fp8_w8a8=fp8, use_int8_w8a8=False, use_int8_w8a16=False,
            per_channel_quant=False, HAS_BIAS=False, SWAP_AB=swap, USE_TD=False)
        missing = self.params - set(args) - set(cfg)
        if missing:
            sys.exit("the peer's fused_moe_kernel takes arguments this runner does not know: %s" % sorted(missing))
        args = {k: v for k, v in args.items() if k in self.params}
        em, n = self.em, b.shape[1]
        grid = lambda meta: (triton.cdiv(em, meta["BLOCK_SIZE_M"]) * triton.cdiv(n, meta["BLOCK_SIZE_N"]),)
        self.kernel[grid](**args, **cfg)

    def __call__(self):
        if self.fp8 is not None:
            return self.call_fp8()
        self.gemm(self.x, self.w1, self.c1, False, self.k)
        rows = self.t * self.k
        c1 = self.c1.view(rows, 2 * self.f)
        silu_mul_kernel[(rows, triton.cdiv(self.f, 1024))](c1, self.c2, self.f, c1.stride(0), self.c2.stride(0),
                                                          BLOCK=1024)
        self.gemm(self.c2, self.w2, self.c3, True, 1)
        torch.sum(self.c3, dim=1, out=self.out)
        return self.out

    def call_fp8(self):
        w1s, w2s = self.fp8
        groups = lambda n: triton.next_power_of_2(triton.cdiv(n, 128))
        quant_rows_kernel[(self.t,)](self.x, self.xq, self.xs, self.d, self.x.stride(0), self.xq.stride(0),
                                     self.xs.stride(0), SILU=False, GROUPS=groups(self.d))
        self.gemm(self.xq, self.w1, self.c1, False, self.k, self.xs, w1s)
        rows = self.t * self.k
        c1 = self.c1.view(rows, 2 * self.f)
        quant_rows_kernel[(rows,)](c1, self.c2q, self.c2s, self.f, c1.stride(0), self.c2q.stride(0),
                                   self.c2s.stride(0), SILU=True, GROUPS=groups(self.f))
        self.gemm(self.c2q, self.w2, self.c3, True, 1, self.c2s, w2s)
        torch.sum(self.c3, dim=1, out=self.out)
        return self.out


def dense_ceiling(reps):
    """torch's dense 8192^3 GEMMs taking turns: BF16 and E4M3 (per-tensor scales; 1 x 128 and
    128 x 128 block scales where torch and cuBLAS take them). TFLOP/s, medians."""
    n = 8192
    dev = torch.device("cuda")
    a = torch.randn(n, n, device=dev).to(torch.bfloat16)
    b = torch.randn(n, n, device=dev).to(torch.bfloat16)
    aq, bq = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev)
    runs = {"bf16": lambda: torch.mm(a, b.t()),
            "fp8_tensor": lambda: torch._scaled_mm(aq, bq.t(), one, one, out_dtype=torch.bfloat16)}
    block, block_note = block_scaled(aq, bq, n, dev)
    if block is not None:
        runs["fp8_block"] = block
    times = {k: [] for k in runs}
    for f in runs.values():
        f()
    torch.cuda.synchronize()
    for _ in range(reps):
        for name, f in runs.items():
            times[name].append(_time_once(f))
    flops = 2.0 * n ** 3
    out = {"kind": "ceiling", "impl": "torch", "n": n, "block_scaling": block_note}
    for name, ts in times.items():
        out[name + "_tflops"] = round(flops / (median(ts) * 1e-6) / 1e12, 1)
    out["fp8_tensor_over_bf16"] = round(out["fp8_tensor_tflops"] / out["bf16_tflops"], 3)
    if "fp8_block_tflops" in out:
        out["fp8_block_over_bf16"] = round(out["fp8_block_tflops"] / out["bf16_tflops"], 3)
    return out


def _time_once(fn):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1000.0


def reference(x, w1, w2, topk, gates):
    t, k = topk.shape
    f = w2.shape[2]
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    flat = topk.reshape(-1).long()
    tok = torch.arange(t, device=x.device).repeat_interleave(k)
    g = gates.reshape(-1)
    for e in torch.unique(flat).tolist():
        sel = (flat == e).nonzero().squeeze(1)
        h = x[tok[sel]].float() @ w1[e].float().t()
        a = torch.nn.functional.silu(h[:, :f]) * h[:, f:]
        out.index_add_(0, tok[sel], (a @ w2[e].float().t()) * g[sel, None])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm", required=True)
    ap.add_argument("--routing_dir", required=True)
    ap.add_argument("--ours", nargs="*", default=[])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--cell_gap_ms", type=int, default=0,
                    help="the GPU left idle that long before each cell is timed (expert_layer_bench's flag)")
    ap.add_argument("--md", default="")
    ap.add_argument("--shape", default="")
    ap.add_argument("--tokens", default="", help="comma-separated T instead of the shape's list (as the bench ran)")
    ap.add_argument("--dtype", choices=("bf16", "fp8", "both"), default="bf16")
    ap.add_argument("--tune_missing", action="store_true",
                    help="a shape with no tuned file: the fastest of vLLM's default and the configs its tuned files "
                         "for this GPU pick at the nearest M (sibling_configs), each timed eagerly")
    a = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    device_name = torch.cuda.get_device_name(dev)
    kernel, default_config, extracted = load_peer(a.vllm)
    print(json.dumps({"kind": "peer", "impl": "vllm-triton", "source": os.path.abspath(a.vllm),
                      "functions": extracted, "device": device_name, "triton": triton.__version__,
                      "torch": torch.__version__}), flush=True)
    swap_ab = load_swap_ab(a.vllm)
    if a.dtype != "bf16":
        print(json.dumps(dense_ceiling(a.reps)), flush=True)
    ours = ours_cells(a.ours)
    peer = {}
    bad = 0
    for (name, e, k, d, f, tokens), fp8 in [(sh, p) for sh in SHAPES for p in (False, True)
                                            if (a.dtype == "both" or (a.dtype == "fp8") == p)]:
        if a.shape and a.shape != name:
            continue
        w1 = (torch.randn(e, 2 * f, d, device=dev) / math.sqrt(d)).to(torch.bfloat16)
        w2 = (torch.randn(e, d, f, device=dev) / math.sqrt(f)).to(torch.bfloat16)
        impl, scales, suffix = "vllm-triton", None, ""
        if fp8:
            impl, suffix = "vllm-triton-fp8", ",dtype=fp8_w8a8,block_shape=[128,128]"
            (w1, s1), (w2, s2) = quantize_blocks(w1), quantize_blocks(w2)
            scales = (s1, s2)
            w1_ref, w2_ref = dequantize_blocks(w1, s1), dequantize_blocks(w2, s2)
        else:
            w1_ref, w2_ref = w1, w2
        tuned, cfg_file = tuned_configs(a.vllm, e, f, device_name, suffix)
        for t in [int(x) for x in a.tokens.split(",")] if a.tokens else tokens:
            path = os.path.join(a.routing_dir, "%s-T%d.bin" % (name, t))
            raw = open(path, "rb").read()
            if len(raw) != t * k * 8:
                sys.exit("%s: %d bytes, want %d" % (path, len(raw), t * k * 8))
            topk = torch.frombuffer(bytearray(raw[: t * k * 4]), dtype=torch.int32).view(t, k).to(dev)
            gates = torch.frombuffer(bytearray(raw[t * k * 4:]), dtype=torch.float32).view(t, k).to(dev)
            x = torch.randn(t, d, device=dev).to(torch.bfloat16)
            if tuned:
                config, source = tuned[min(tuned, key=lambda m: abs(m - t))], "tuned " + cfg_file
            elif fp8:
                config = default_config(t, e, f, d, k, "fp8_w8a8", [128, 128])
                source = "vLLM default (no tuned file %s)" % cfg_file
            else:
                config, source = default_config(t, e, f, d, k, None), "vLLM default (no tuned file %s)" % cfg_file
            searched = []
            if not tuned and a.tune_missing:
                for cand in [config] + [c for c in sibling_configs(a.vllm, device_name, t, suffix) if c != config]:
                    trial = VllmLayer(kernel, cand, x, w1, w2, topk, gates, scales, swap_ab)
                    searched.append((median_us(trial, max(5, a.reps // 4)), cand))
                    del trial
                config = min(searched, key=lambda p: p[0])[1]
                source = "searched: fastest of %d %s configs (no tuned file %s)" % (len(searched), device_name, cfg_file)
            layer = VllmLayer(kernel, config, x, w1, w2, topk, gates, scales, swap_ab)
            layer.out.fill_(float("nan"))
            out = layer().float()
            ref = reference(x, w1_ref, w2_ref, topk, gates)
            rel = ((out - ref).norm() / ref.norm()).item()
            # BF16: rounding only. FP8: the activations' E4M3 rounding too (a few percent).
            ok = math.isfinite(rel) and rel < (0.1 if fp8 else 2e-2)
            bad += not ok
            if a.cell_gap_ms > 0:  # idle before the cell, as the bench's --cell_gap_ms
                torch.cuda.synchronize()
                time.sleep(a.cell_gap_ms / 1000.0)
            for _ in range(3):
                layer()
            torch.cuda.synchronize()
            start_ms = int(time.time() * 1000)  # the timing's wall-clock window, for a clock sampler beside it
            eager = median_us(layer, a.reps)
            graph = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                layer()
                with torch.cuda.graph(graph, stream=s):
                    layer()
            torch.cuda.current_stream().wait_stream(s)
            replay = median_us(graph.replay, a.reps)
            us = min(replay, eager)
            cell = {"kind": "cell", "impl": impl, "shape": name, "T": t, "us": round(us, 1),
                    "us_eager": round(eager, 1), "us_graph": round(replay, 1), "naive_blocks": layer.naive,
                    "config": config, "config_source": source, "rel_l2": rel, "ok": ok,
                    "searched_us": [round(u, 1) for u, _ in searched],
                    "start_unix_ms": start_ms, "end_unix_ms": int(time.time() * 1000)}
            print(json.dumps(cell), flush=True)
            peer[(impl, name, t)] = [cell]
            del layer, graph
            torch.cuda.empty_cache()
    report(ours, peer, a.md)
    if bad:
        print("%d cells of vLLM's kernel differ from the FP32 reference" % bad, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
