"""torch's dense GEMMs run back to back, each for a window of seconds: the ceilings of
vllm_compare.py's "ceiling" line (BF16 torch.mm; E4M3 torch._scaled_mm with 1 x 128 / 128 x 128
block scales where this torch takes them, else per-tensor scales) timed the way
bench/gpu/sustained.sh times the experts, so that FP8 against BF16 is read at the clock each one
holds on its own under the power limit, not at the clock the other left.

Prints one "sustained" line a GEMM (expert_layer_bench's fields, "shape": "dense-<n>", "T": n,
plus "tflops"), for sustained.sh's sampler to put the SM clock and board power beside.
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # bench/nearest_rank.py
from nearest_rank import median  # noqa: E402  (0x0DA's nearest rank)


def block_scaled(aq, bq, n, dev):
    """aq @ bq^T with A's scales 1 x 128 ([M, K/128]) and B's 128 x 128 ([K/128, N/128], square
    here) in the first layout this torch's _scaled_mm takes (it wants some of them
    outer-dim-major): (the call, the layout taken), or (None, "not run: " and the last refusal)."""
    why = "no layout taken"
    for sa in (torch.ones(n // 128, n, device=dev).t(), torch.ones(n, n // 128, device=dev)):
        for sb in (torch.ones(n // 128, n // 128, device=dev), torch.ones(n // 128, n // 128, device=dev).t()):
            try:
                torch._scaled_mm(aq, bq.t(), sa, sb, out_dtype=torch.bfloat16)
                return ((lambda sa=sa, sb=sb: torch._scaled_mm(aq, bq.t(), sa, sb, out_dtype=torch.bfloat16)),
                        "A 1x128 (stride %s), B 128x128 (stride %s)" % (sa.stride(), sb.stride()))
            except Exception as e:  # noqa: BLE001 (a refusal: this torch or cuBLAS takes no such scaling)
                why = str(e).splitlines()[0][:160]
    return None, "not run: " + why


def sustain(name, n, fn, ms):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    us = []
    start = int(time.time() * 1000)
    while int(time.time() * 1000) - start < ms:
        a.record()
        fn()
        b.record()
        b.synchronize()
        us.append(a.elapsed_time(b) * 1000.0)
    end = int(time.time() * 1000)
    mid = median(us)
    print(json.dumps({"kind": "sustained", "what": name, "shape": "dense-%d" % n, "T": n,
                      "start_unix_ms": start, "end_unix_ms": end, "calls": len(us),
                      "median_us": round(mid, 1), "tflops": round(2.0 * n ** 3 / (mid * 1e-6) / 1e12, 1)}),
          flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--ms", type=int, default=4000)
    a = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    x = torch.randn(a.n, a.n, device=dev).to(torch.bfloat16)
    w = torch.randn(a.n, a.n, device=dev).to(torch.bfloat16)
    xq, wq = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    sustain("dense_bf16", a.n, lambda: torch.mm(x, w.t()), a.ms)
    fn, why = block_scaled(xq, wq, a.n, dev)
    if fn is not None:
        sustain("dense_fp8_block", a.n, fn, a.ms)
    else:
        print(json.dumps({"kind": "note", "what": "dense_fp8_block " + why}), flush=True)
    one = torch.ones((), device=dev)
    sustain("dense_fp8_tensor", a.n, lambda: torch._scaled_mm(xq, wq.t(), one, one, out_dtype=torch.bfloat16), a.ms)


if __name__ == "__main__":
    main()
