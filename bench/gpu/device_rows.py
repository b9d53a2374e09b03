"""A co-located engine's layer step with the rows on its GPU (issue 17), checked and timed.

Running moe-rankd processes (CUDA kernels, rank r on GPU r) on this host; one engine process per
rank, with its hidden rows in torch CUDA tensors on its rank's GPU, as vLLM / SGLang /
transformers hold them. Per cell, side by side:

  host ring    the rows copied to the host, through a step ring's slot, and the output copied back
               to the GPU (what an engine on a ring paid before device rows);
  device rows  the rows stay on the GPU: the ring's slots carry routing only (given as host
               tensors), and the rank reads and writes the engine's memory through CUDA IPC
               (``open_ring(device=...)``);
  + routing    the same with the router's top-k left on the GPU (CUDA tensors): the engine does
               not wait for its GPU at all to submit;
  in place     the same with the rows and routing already in the ring's device slot (an engine
               whose layers write there: ``next_slot`` views), so a submit copies nothing;
  view         in place, with the output read as the slot's own view (``wait(copy=False)``), so
               the wait launches no copy either.

Checks (exit status 1 when one fails): the five give the same output bit for bit, for every
cell; a NaN in the device rows is refused naming ``hidden.data[i]``, an expert id out of range or
beyond int32 on the GPU naming ``topk_ids[t][j]``, and the ring serves on.

Usage: device_rows.py --targets unix:/path/0.sock[,unix:/path/1.sock...] [--cells decode:1,prefill:2048]
(one engine process per rank, on GPU r, when more than one target is given)
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

import torch

from moe_runtime import RankClient, errors

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # bench/nearest_rank.py
from nearest_rank import median, quantile  # noqa: E402  (0x0DA's nearest rank)


def make_step(t: int, d: int, k: int, experts: int, gen: torch.Generator):
    hidden = (torch.randn(t, d, generator=gen, device=gen.device) * 0.5).to(torch.bfloat16)
    scores = torch.rand(t, experts, generator=gen, device=gen.device)
    w, ids = scores.topk(k, dim=1)
    w = torch.softmax(w, dim=1)
    return hidden, ids.to(torch.int32), w.float()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", required=True, help="each rank's engine target, comma-separated (rank order)")
    ap.add_argument("--cells", default="decode:1,decode:8,prefill:2048", help="phase:tokens per rank")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--spin_us", type=int, default=5000)
    ap.add_argument("--ready_timeout_s", type=float, default=0,
                    help="the rank's --timeout_ms in seconds: checks a hung engine's step (one rank only)")
    args = ap.parse_args()
    targets = args.targets.split(",")
    if len(targets) == 1:
        return engine(0, targets, args, None)
    # One engine process per rank, each on its rank's GPU (cuda:r), as a co-located engine is;
    # every step goes to every rank with the same step id, so they run in lockstep.
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(targets))
    procs = [ctx.Process(target=_engine_process, args=(r, targets, args, barrier)) for r in range(len(targets))]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return 1 if any(p.exitcode != 0 for p in procs) else 0


def _engine_process(rank: int, targets, args, barrier) -> None:
    sys.exit(engine(rank, targets, args, barrier))


def engine(rank: int, targets, args, barrier) -> int:
    world = len(targets)
    torch.cuda.set_device(rank)
    say = print if rank == 0 else (lambda *a, **k: None)
    cells = [(c.split(":")[0], int(c.split(":")[1])) for c in args.cells.split(",")]
    max_t = max(t for _, t in cells)
    gen = torch.Generator(device=f"cuda:{rank}")
    gen.manual_seed(7 + rank)
    failures = 0
    client = RankClient(targets[rank], timeout=60, rank=rank)
    client.wait_ready(60)
    host_ring = client.open_ring(max_tokens=max_t, d=args.d, k=args.k, slots=1, spin_us=args.spin_us)
    dev_ring = client.open_ring(max_tokens=max_t, d=args.d, k=args.k, slots=1, spin_us=args.spin_us,
                                device=f"cuda:{rank}")
    # The same without done events: the rank answers once the output is written, not once its
    # work is enqueued (the "sync" mode below).
    sync_ring = client.open_ring(max_tokens=max_t, d=args.d, k=args.k, slots=1, spin_us=args.spin_us,
                                 device=f"cuda:{rank}", done_events=False)
    if not dev_ring._done or sync_ring._done:
        print(f"FAIL: rank {rank}: done events {len(dev_ring._done)} / {len(sync_ring._done)} (want 1 / 0)")
        failures += 1
    if barrier is not None:
        barrier.wait()
    step_id = 1

    def run_host(hidden, ids, w, decode):
        nonlocal step_id
        step_id += 1
        r = host_ring.step(step_id, args.layer, hidden.cpu(), ids, w, decode=decode)
        return r.output.to(hidden.device), r

    def run_dev(hidden, ids, w, decode):
        nonlocal step_id
        step_id += 1
        r = dev_ring.step(step_id, args.layer, hidden, ids, w, decode=decode)
        return r.output, r

    # devr: the routing stays on the GPU too; inplace: as devr, with the rows and routing already
    # in the ring's device slot (an engine whose layers write there), so no copy at submit.
    # view: as inplace, the output read as the slot's own view (wait(copy=False)), no clone.
    # sync: as inplace, on the ring without done events (answered once the output is written).
    modes = ("host", "dev", "devr", "inplace", "view", "sync")

    say(f"# E{args.experts} k{args.k} d{args.d}, {world} rank(s), one engine process each, {args.steps} steps a "
        f"cell after {args.warmup}, ring spin {args.spin_us} us; engine-observed p50 / p99 (us) and rank-side "
        f"server p50 of rank 0 (every rank's p50 below with more than one)")
    say(f"{'cell':<14} {'host ring p50/p99':>20} {'device rows p50/p99':>22} {'+ routing p50/p99':>20} "
          f"{'host/dev':>9} {'host/devr':>9} {'server host/dev/devr':>22} {'equal':>6}")
    for phase, t in cells:
        decode = phase == "decode"
        hidden, ids, w = make_step(t, args.d, args.k, args.experts, gen)
        out_h, _ = run_host(hidden, ids, w, decode)
        out_d, _ = run_dev(hidden, ids.cpu(), w.cpu(), decode)
        out_r, _ = run_dev(hidden, ids, w, decode)
        step_id += 1
        dev_ring.submit_in_place(step_id, args.layer, t, args.k, decode=decode, device_routing=True)
        out_i = dev_ring.wait(60).output
        step_id += 1
        dev_ring.submit_in_place(step_id, args.layer, t, args.k, decode=decode, device_routing=True)
        out_v = dev_ring.wait(60, copy=False).output  # read before the slot's next submit
        step_id += 1
        out_s = sync_ring.step(step_id, args.layer, hidden, ids, w, decode=decode).output  # fills its slot
        equal = (torch.equal(out_h, out_d) and torch.equal(out_h, out_r) and torch.equal(out_h, out_i)
                 and torch.equal(out_h, out_v) and torch.equal(out_h, out_s))
        if not equal:
            for name, out in (("device rows", out_d), ("device rows + routing", out_r), ("in place", out_i),
                              ("in place, view", out_v), ("no done events", out_s)):
                diff = (out_h.float() - out.float()).abs().max().item()
                print(f"MISMATCH rank {rank} {phase}:{t} {name}: max |diff| {diff}")
            failures += 1
        # The router's top-k comes out on the GPU, as the rows do: the host ring and the device
        # rows without device routing copy it to the host inside the timed step (as an engine
        # would); "+ routing" hands the CUDA tensors over. Timed per step, the engine waiting for
        # its output on its GPU.
        times = {m: [] for m in modes}
        server = {m: [] for m in modes}
        parts = {m: [] for m in modes}  # (submit, wait, output-ready) per step
        stages = {m: [] for m in modes}
        seen = {m: [] for m in modes}  # device rings: submit to the answer seen (the rest of the wait: the client)
        for i in range(args.warmup + args.steps):
            for mode in modes:
                sid = step_id + 1
                torch.cuda.synchronize()
                start = time.perf_counter()
                if mode == "host":
                    host_ring.submit(sid, args.layer, hidden.cpu(), ids.cpu(), w.cpu(), decode=decode)
                    submitted = time.perf_counter()
                    r = host_ring.wait(60)
                    waited = time.perf_counter()
                    r.output.to("cuda")
                else:
                    if mode == "dev":
                        dev_ring.submit(sid, args.layer, hidden, ids.cpu(), w.cpu(), decode=decode)
                    elif mode == "devr":
                        dev_ring.submit(sid, args.layer, hidden, ids, w, decode=decode)
                    else:  # the slot holds this cell's rows and routing (written by devr just before)
                        ring = sync_ring if mode == "sync" else dev_ring
                        ring.submit_in_place(sid, args.layer, t, args.k, decode=decode, device_routing=True)
                    submitted = time.perf_counter()
                    ring = sync_ring if mode == "sync" else dev_ring
                    r = ring.wait(60, copy=mode != "view")
                    waited = time.perf_counter()
                    seen[mode].append((ring._completed_at - submitted) * 1e6)
                step_id = sid
                torch.cuda.current_stream().synchronize()
                done = time.perf_counter()
                if i >= args.warmup:
                    times[mode].append((done - start) * 1e6)
                    server[mode].append(r.record.server_latency_us)
                    parts[mode].append(((submitted - start) * 1e6, (waited - submitted) * 1e6, (done - waited) * 1e6))
                    stages[mode].append(r.record.stages_us)
        # The engine's own GPU work of a device-ring step without the rank (the rows' copy into
        # the slot and the output's clone, each waited for): what the engine pays alone.
        alone = []
        scratch = torch.empty_like(hidden)
        for i in range(args.warmup + args.steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            scratch.copy_(hidden)
            torch.cuda.current_stream().synchronize()
            scratch.clone()
            torch.cuda.current_stream().synchronize()
            if i >= args.warmup:
                alone.append((time.perf_counter() - start) * 1e6)
        p = {m: (median(v), quantile(v, 0.99)) for m, v in times.items()}
        srv = " / ".join(f"{median(server[m]):.1f}" for m in modes)
        say(f"{phase + ':' + str(t):<14} {p['host'][0]:>10.1f} / {p['host'][1]:>7.1f} "
              f"{p['dev'][0]:>12.1f} / {p['dev'][1]:>7.1f} {p['devr'][0]:>10.1f} / {p['devr'][1]:>7.1f} "
              f"{p['host'][0] / p['dev'][0]:>8.2f}x {p['host'][0] / p['devr'][0]:>8.2f}x {srv:>22} "
              f"{'yes' if equal else 'NO':>6}")
        say(f"    in place: p50 / p99 {p['inplace'][0]:.1f} / {p['inplace'][1]:.1f}, host / in place "
            f"{p['host'][0] / p['inplace'][0]:.2f}x; output as the slot's view: {p['view'][0]:.1f} / "
            f"{p['view'][1]:.1f}; in place without done events: {p['sync'][0]:.1f} / {p['sync'][1]:.1f}")
        say(f"    engine alone (copy in, sync, clone, sync): p50 {median(alone):.1f}")
        if world > 1:
            print(f"    rank {rank} p50: " + ", ".join(f"{m} {p[m][0]:.1f}" for m in modes), flush=True)
        for mode in modes:
            sub, wai, out = (median([x[j] for x in parts[mode]]) for j in range(3))
            st = {n: median([x[n] for x in stages[mode]]) for n in stages[mode][0]}
            seen_at = f" (answer seen at {median(seen[mode]):.1f})" if seen[mode] else ""
            say(f"    {mode:<4} engine: submit {sub:.1f}, wait {wai:.1f}{seen_at}, output ready {out:.1f}; "
                "rank stages: " +
                  ", ".join(f"{n} {v:.1f}" for n, v in st.items()))

    # Two steps in flight on a two-slot ring with done events, each output read (cloned on the
    # current stream) right after its wait: each slot's event must order its own step's output.
    pipe = client.open_ring(max_tokens=max_t, d=args.d, k=args.k, slots=2, spin_us=args.spin_us,
                            device=f"cuda:{rank}")
    t_pipe = max_t
    steps_in = [make_step(t_pipe, args.d, args.k, args.experts, gen) for _ in range(2)]
    want = [run_host(h, i, w, False)[0] for h, i, w in steps_in]
    bad_pipe = 0
    for _ in range(10):
        for h, i, w in steps_in:
            step_id += 1
            pipe.submit(step_id, args.layer, h, i, w)
        for j in range(2):
            if not torch.equal(pipe.wait(60).output, want[j]):
                bad_pipe += 1
    pipe.close()
    if bad_pipe:
        print(f"FAIL: rank {rank}: {bad_pipe} of 20 pipelined outputs differ from the host ring's")
        failures += 1
    else:
        say(f"pipelined: 20 outputs of {t_pipe} rows, two in flight, equal to the host ring's")

    # Bad input on rank 0 (a NaN in the device rows, an expert id out of range or beyond int32 on
    # the GPU): refused there naming the value, ABORTED on the other ranks (the refusal joins the
    # step's agreement), and every ring serves on.
    hidden, ids, w = make_step(4, args.d, args.k, args.experts, gen)
    bad = hidden.clone()
    bad[2, 5] = float("nan")
    bad_ids = ids.clone()
    bad_ids[1, 3] = args.experts
    wide = ids.to(torch.int64)
    wide[3, 0] = 2**40 + 1  # would wrap into range if narrowed
    # (decode steps are planned on the host, which reads the routing back; prefill steps on the
    # GPU, which reads it in place and reads back only the refused route)
    cases = (("a NaN row", bad, ids, f"hidden.data[{2 * args.d + 5}]: not finite", True),
             ("an expert out of range", hidden, bad_ids, f"topk_ids[1][3]: expert {args.experts} outside", True),
             ("an expert out of range (prefill)", hidden, bad_ids,
              f"topk_ids[1][3]: expert {args.experts} outside", False),
             ("an id beyond int32", hidden, wide, "topk_ids[3][0]: expert -2147483648 outside", True))
    for name, h, i, want, dec in cases:
        try:
            if rank == 0:
                run_dev(h, i, w, dec)
            else:
                run_dev(hidden, ids, w, dec)
            print(f"FAIL: rank {rank}: the step with {name} was served")
            failures += 1
        except errors.InvalidArgument as e:
            if rank != 0 or want not in str(e):
                print(f"FAIL: rank {rank}: the refusal of {name} does not name {want}: {e}")
                failures += 1
            else:
                say(f"{name} refused: {e}")
        except errors.Aborted as e:
            if rank == 0:
                print(f"FAIL: rank 0 got ABORTED for {name}: {e}")
                failures += 1
    out_d, _ = run_dev(hidden, ids, w, True)
    out_h, _ = run_host(hidden, ids, w, True)
    if not torch.equal(out_d, out_h):
        print(f"FAIL: rank {rank}: after the refusals the device ring's output differs")
        failures += 1
    # An engine whose GPU work hangs past the rank's timeout (--ready_timeout_s, the rank's
    # --timeout_ms): the step is answered DEADLINE_EXCEEDED naming the ready event, the rank
    # does not wait on, and once the engine's GPU is free again the ring serves on.
    if world == 1 and args.ready_timeout_s > 0:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.cuda._sleep(100_000_000)  # calibration: ~50 ms of GPU spinning
        torch.cuda.synchronize()
        per_s = 100_000_000 / (time.perf_counter() - t0)
        torch.cuda._sleep(int(per_s * (args.ready_timeout_s + 2)))  # the engine's GPU busy past the timeout
        start = time.perf_counter()
        try:
            run_dev(hidden, ids, w, True)
            print("FAIL: a step whose ready event had not fired was served")
            failures += 1
        except errors.DeadlineExceeded as e:
            waited = time.perf_counter() - start
            if "device_rows.ready_event" not in str(e) or waited > args.ready_timeout_s + 1.5:
                print(f"FAIL: the hung engine's step: {e} after {waited:.1f} s")
                failures += 1
            else:
                say(f"a hung engine's step answered after {waited:.1f} s: {e}")
        torch.cuda.synchronize()
        out_d, _ = run_dev(hidden, ids, w, True)
        if not torch.equal(out_d, out_h):
            print("FAIL: after the hung engine's step the device ring's output differs")
            failures += 1
    dev_ring.close()
    sync_ring.close()
    host_ring.close()
    client.close()
    print(f"device_rows rank {rank}: {failures} failure(s)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
