"""torch.distributed all_to_all_single (NCCL) moving the same splits as a2a_bench, same run.
Prefill: 4096 tokens per rank, BF16 rows and FP8 rows (7168 + 224 bytes, as uint8); decode:
128 tokens per rank, BF16, eager and (when torch can capture it) CUDA-graph replay. Transfer
only: torch does no packing or combine here, so its figures are a lower bound for a torch-built
layer. Launch: python3 bench/gpu/a2a_torch.py (spawns one process per GPU)."""
import json
import os
import random
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # bench/nearest_rank.py
from nearest_rank import median  # noqa: E402  (0x0DA's nearest rank)

HIDDEN, TOPK, EXPERTS = 7168, 8, 256
PREFILL_TOKENS, DECODE_TOKENS = 4096, 128
FP8_ROW = HIDDEN + HIDDEN // 128 * 4


def count_matrix(p, tokens, seed):
    # The same construction as a2a_bench (uniform top-k); the generator differs, the statistics do not.
    rng = random.Random(seed)
    counts = [[0] * p for _ in range(p)]
    for src in range(p):
        for _ in range(tokens):
            for e in rng.sample(range(EXPERTS), TOPK):
                counts[src][e // (EXPERTS // p)] += 1
    return counts


def timed(fn_d, fn_c, reps, warm):
    times_d, times_c = [], []
    for r in range(reps + warm):
        dist.barrier()
        torch.cuda.synchronize()
        s, m, e = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        s.record()
        fn_d()
        m.record()
        fn_c()
        e.record()
        e.synchronize()
        if r >= warm:
            times_d.append(s.elapsed_time(m) * 1000)
            times_c.append(m.elapsed_time(e) * 1000)
    return median(times_d), median(times_c)


def worker(rank, p, port):
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=p,
                            device_id=torch.device("cuda", rank))
    counts = count_matrix(p, PREFILL_TOKENS, 1)
    for payload, row in (("bf16", HIDDEN * 2), ("fp8", FP8_ROW)):
        send = [counts[rank][j] * row for j in range(p)]
        recv = [counts[j][rank] * row for j in range(p)]
        a = torch.ones(sum(send), dtype=torch.uint8, device="cuda")
        b = torch.empty(sum(recv), dtype=torch.uint8, device="cuda")
        back_send = [counts[j][rank] * HIDDEN for j in range(p)]
        back_recv = [counts[rank][j] * HIDDEN for j in range(p)]
        c = torch.empty(sum(back_send), dtype=torch.bfloat16, device="cuda")
        d = torch.empty(sum(back_recv), dtype=torch.bfloat16, device="cuda")
        dm, cm = timed(lambda: dist.all_to_all_single(b, a, recv, send),
                       lambda: dist.all_to_all_single(d, c, back_recv, back_send), 10, 3)
        remote = sum(send[j] for j in range(p) if j != rank)
        remote_bf16 = sum(counts[rank][j] * HIDDEN * 2 for j in range(p) if j != rank)
        print(json.dumps({"kind": "a2a", "impl": "torch all_to_all_single", "payload": payload, "gpus": p, "slot": rank,
                          "dispatch_us": round(dm, 1), "combine_us": round(cm, 1), "remote_bytes": remote,
                          "dispatch_gbps": round(remote / (dm * 1e3), 1),
                          "combine_gbps": round(remote_bf16 / (cm * 1e3), 1)}), flush=True)
    counts = count_matrix(p, DECODE_TOKENS, 2)
    send = [counts[rank][j] * HIDDEN for j in range(p)]
    recv = [counts[j][rank] * HIDDEN for j in range(p)]
    a = torch.ones(sum(send), dtype=torch.bfloat16, device="cuda")
    b = torch.empty(sum(recv), dtype=torch.bfloat16, device="cuda")
    d = torch.empty(sum(send), dtype=torch.bfloat16, device="cuda")
    dispatch = lambda: dist.all_to_all_single(b, a, recv, send)
    combine = lambda: dist.all_to_all_single(d, b, send, recv)
    dm, cm = timed(dispatch, combine, 50, 5)
    print(json.dumps({"kind": "decode", "impl": "torch all_to_all_single eager", "payload": "bf16", "gpus": p,
                      "slot": rank, "tokens": DECODE_TOKENS, "dispatch_us": round(dm, 1), "combine_us": round(cm, 1)}),
          flush=True)
    try:
        stream = torch.cuda.Stream()
        gd, gc = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            dispatch(); combine()  # warm the communicator outside capture
            torch.cuda.synchronize()
            with torch.cuda.graph(gd, stream=stream):
                dispatch()
            with torch.cuda.graph(gc, stream=stream):
                combine()
        dm, cm = timed(gd.replay, gc.replay, 50, 5)
        print(json.dumps({"kind": "decode", "impl": "torch all_to_all_single graph", "payload": "bf16", "gpus": p,
                          "slot": rank, "tokens": DECODE_TOKENS, "dispatch_us": round(dm, 1),
                          "combine_us": round(cm, 1)}), flush=True)
    except Exception as e:  # noqa: BLE001 - report, keep the eager figures
        print(json.dumps({"kind": "decode", "impl": "torch graph capture failed", "error": str(e)[:200]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    p = torch.cuda.device_count()
    mp.spawn(worker, args=(p, 29511), nprocs=p)
