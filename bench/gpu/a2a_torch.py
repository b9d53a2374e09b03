"""torch.distributed all_to_all_single (NCCL) moving the same splits as a2a_bench, same run.
Launch: python3 bench/gpu/a2a_torch.py (spawns one process per GPU)."""
import json
import os
import random
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOKENS, HIDDEN, TOPK, EXPERTS = 4096, 7168, 8, 256


def count_matrix(p):
    # The same construction as a2a_bench (uniform top-k); the seed differs, the statistics do not.
    rng = random.Random(1)
    counts = [[0] * p for _ in range(p)]
    for src in range(p):
        for _ in range(TOKENS):
            for e in rng.sample(range(EXPERTS), TOPK):
                counts[src][e // (EXPERTS // p)] += 1
    return counts


def worker(rank, p, port):
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=p)
    torch.cuda.set_device(rank)
    counts = count_matrix(p)
    send = [counts[rank][j] * HIDDEN for j in range(p)]
    recv = [counts[j][rank] * HIDDEN for j in range(p)]
    a = torch.ones(sum(send), dtype=torch.bfloat16, device="cuda")
    b = torch.empty(sum(recv), dtype=torch.bfloat16, device="cuda")
    times_d, times_c = [], []
    for r in range(13):
        torch.cuda.synchronize()
        s = torch.cuda.Event(enable_timing=True); m = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
        s.record()
        dist.all_to_all_single(b, a, recv, send)
        m.record()
        dist.all_to_all_single(a, b, send, recv)
        e.record()
        e.synchronize()
        if r >= 3:
            times_d.append(s.elapsed_time(m) * 1000)
            times_c.append(m.elapsed_time(e) * 1000)
    remote = sum(send[j] * 2 for j in range(p) if j != rank)
    dm, cm = statistics.median(times_d), statistics.median(times_c)
    print(json.dumps({"kind": "a2a", "impl": "torch all_to_all_single", "gpus": p, "slot": rank, "dispatch_us": round(dm, 1),
                      "combine_us": round(cm, 1), "remote_bytes": remote, "dispatch_gbps": round(remote / (dm * 1e3), 1),
                      "combine_gbps": round(remote / (cm * 1e3), 1)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    p = torch.cuda.device_count()
    mp.spawn(worker, args=(p, 29511), nprocs=p)
