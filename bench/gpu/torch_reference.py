"""PyTorch reference of the local expert layer, timed on the same GPU in the same run as
expert_layer_bench: sort routes by expert, gather rows, torch._grouped_mm for gate, up and down,
SiLU-mul, gate-weighted index_add. Prints one JSON object per line."""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # bench/nearest_rank.py
from nearest_rank import median  # noqa: E402  (0x0DA's nearest rank)

SHAPES = [
    ("E128-k8-d2048-f768", 128, 8, 2048, 768, [1, 16, 128, 1024, 8192]),
    ("E32-k8-d7168-f2048", 32, 8, 7168, 2048, [16, 128, 1024, 4096]),
    ("E8-k2-d4096-f14336", 8, 2, 4096, 14336, [1, 128, 8192]),
]


def median_us(fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    return median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    us = median_us(lambda: a @ b, args.reps)
    print(json.dumps({"kind": "ceiling", "impl": "pytorch", "dense_bf16_tflops": round(2 * n ** 3 / (us * 1e-6) / 1e12, 1),
                      "torch": torch.__version__}), flush=True)
    del a, b
    shapes = SHAPES if not args.quick else [("E128-k8-d2048-f768", 128, 8, 2048, 768, [1, 1024])]
    for name, e, k, d, f, tokens in shapes:
        w_gate = torch.randn(e, f, d, device=dev, dtype=torch.bfloat16) / d ** 0.5
        w_up = torch.randn(e, f, d, device=dev, dtype=torch.bfloat16) / d ** 0.5
        w_down = torch.randn(e, d, f, device=dev, dtype=torch.bfloat16) / f ** 0.5
        # [E, K, N] views with column-major last two dims, as grouped_mm wants them.
        wg, wu, wd = w_gate.transpose(1, 2), w_up.transpose(1, 2), w_down.transpose(1, 2)
        for t in tokens:
            x = torch.randn(t, d, device=dev, dtype=torch.bfloat16)
            topk = torch.rand(t, e, device=dev).topk(k, dim=1).indices.to(torch.int32)
            gates = torch.softmax(torch.rand(t, k, device=dev), dim=1)

            def layer():
                flat = topk.reshape(-1)
                order = torch.argsort(flat, stable=True)
                token = order // k
                xs = x.index_select(0, token)
                counts = torch.bincount(flat, minlength=e)
                offs = torch.cumsum(counts, 0).to(torch.int32)
                g = torch._grouped_mm(xs, wg, offs=offs)
                u = torch._grouped_mm(xs, wu, offs=offs)
                h = torch.nn.functional.silu(g) * u
                y = torch._grouped_mm(h, wd, offs=offs)
                y = y * gates.reshape(-1)[order].unsqueeze(1).to(y.dtype)
                out = torch.zeros(t, d, device=dev, dtype=torch.float32)
                out.index_add_(0, token, y.float())
                return out.to(torch.bfloat16)

            us = median_us(layer, args.reps)
            flops = 6.0 * t * k * d * f
            print(json.dumps({"kind": "cell", "impl": "pytorch", "shape": name, "T": t, "us": round(us, 1),
                              "tflops": round(flops / (us * 1e-6) / 1e12, 2)}), flush=True)


if __name__ == "__main__":
    main()
