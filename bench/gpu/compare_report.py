"""The comparison's report, from the lines of earlier runs (no GPU): each cell's median over the
rounds of the project's bench (expert_layer_bench's "cell" lines) and of vLLM's timing
(vllm_compare.py's "cell" lines), the project's figure the faster of its graph-replayed
device-offset path and its eager prefill path; "compare" lines on stdout (what vllm_plot.py
draws) and a Markdown table. FP8 cells (vLLM's "vllm-triton-fp8" lines, E4M3 with 128 x 128 block
scales) pair with the project's FP8 layer ("fp8" eager, "fp8-graph" replayed), in a table of their
own. With --clocks (an nvidia-smi sampler's lines "unix_ms, SM MHz, W" run beside the rounds), each
side's mean SM clock over its cell's wall-clock windows (expert_layer_bench's "window" lines,
vllm_compare.py's cells' own) goes into the compare lines and the table: a ratio taken at two
different clocks (one side hot, the other cool) shows as such. vllm_compare.sh runs it after its
rounds.

Issue 19's goal, cell by cell (BF16): 1.2x faster than vLLM, i.e. at most vLLM's time / 1.2,
where that target is not below the cell's floor: the larger of the hit experts' weight read at
the run's copy ceiling (expert_layer_bench's weight_read_us) and its FLOPs at the run's dense
BF16 rate (the bench's "ceiling" line). Where 1.2x is below the floor no kernel can meet it, and
the cell is judged by the nearest goal that can be met: ahead of vLLM. The compare lines carry
"goal_us", "floor_us" and "goal" (met / not met / ahead / behind), the table a column of each.

  python3 bench/gpu/compare_report.py --ours ours_1.jsonl ours_2.jsonl \
      --peer vllm_1.jsonl vllm_2.jsonl [--clocks clocks.csv] [--md report.md] > vllm.jsonl
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # bench/nearest_rank.py
from nearest_rank import median  # noqa: E402  (0x0DA's nearest rank; a2a_report takes it from here)


def json_lines(path):
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                yield json.loads(line)


def ours_cells(paths):
    """(shape, T, path) -> the project's times over the rounds (one file a round),
    (shape, T, "weight_read") -> [the weight-read time], (shape, T, "flops") -> [the layer's
    FLOPs], ("ceiling",) -> the dense BF16 TFLOP/s of each round and (shape, T, "window") -> the
    cell's wall-clock windows [(start, end) Unix ms], one a round."""
    cells = {}
    for path in paths:
        for c in json_lines(path):
            if c.get("impl") != "moe-runtime":
                continue
            if c.get("kind") == "cell":
                cells.setdefault((c["shape"], c["T"], c["path"]), []).append(c["us"])
                cells[(c["shape"], c["T"], "weight_read")] = [c["weight_read_us"]]
                if c.get("tflops") and not c["path"].startswith("fp8"):
                    cells[(c["shape"], c["T"], "flops")] = [c["tflops"] * c["us"] * 1e6]
            elif c.get("kind") == "ceiling" and c.get("dense_bf16_tflops"):
                cells.setdefault(("ceiling",), []).append(c["dense_bf16_tflops"])
            elif c.get("kind") == "window":
                cells.setdefault((c["shape"], c["T"], "window"), []).append((c["start_unix_ms"], c["end_unix_ms"]))
    return cells


def clock_samples(path):
    """A clock sampler's lines "unix_ms, SM MHz, W" (bench/gpu/clock_sampler.sh) -> [(unix_ms,
    MHz, W)]; lines without all three (the sampler's last, cut short) or that do not parse are
    skipped."""
    samples = []
    with open(path) as f:
        for line in f:
            parts = [p.strip() for p in line.split(",")]
            try:
                if len(parts) == 3:
                    samples.append((int(parts[0]), float(parts[1]), float(parts[2])))
            except ValueError:
                pass
    return samples


def mean_clock(samples, windows):
    """The mean SM clock (MHz, rounded) over the samples inside any of `windows`; None without
    samples there."""
    inside = [mhz for ms, mhz, _ in samples if any(a <= ms <= b for a, b in windows)]
    return round(sum(inside) / len(inside)) if inside else None


# The project's paths each peer is compared with (the faster of them, medians over the rounds).
PATHS = {"vllm-triton": ("decode-graph", "prefill"), "vllm-triton-fp8": ("fp8-graph", "fp8")}
PRECISION = {"vllm-triton": "bf16", "vllm-triton-fp8": "fp8"}


GOAL_RATIO = 1.2  # issue 19: 1.2x faster than vLLM


def goal(ours, name, t, mine, vllm_us):
    """(target µs, floor µs, verdict) of issue 19's goal for a BF16 cell; the floor and the
    verdict None where the bench gave no weight-read time."""
    target = vllm_us / GOAL_RATIO
    read = ours.get((name, t, "weight_read"), [None])[0]
    if read is None or mine is None:
        return target, None, None
    floor = read
    flops, dense = ours.get((name, t, "flops")), ours.get(("ceiling",))
    if flops and dense:
        floor = max(floor, flops[0] / (median(dense) * 1e12) * 1e6)
    if target >= floor:
        return target, floor, "met" if mine <= target else "not met"
    return target, floor, "ahead" if mine < vllm_us else "behind"


def report(ours, peer, md_path, clocks=None):
    """The "compare" lines (the pair the table and vllm_plot.py show, decided here only) and the
    tables: each cell's median over the rounds, the project's figure the faster of its
    graph-replayed device-offset path and its eager path, where the bench ran both.
    `peer`: (impl, shape, T) -> vLLM's cell lines, one a round, in the order timed. `clocks`:
    clock_samples' [(unix_ms, SM MHz, W)] taken beside the rounds, or None."""
    rows = {impl: [] for impl in PATHS}
    for (impl, name, t), cells in peer.items():
        us = median([c["us"] for c in cells])
        paths = [(median(ours[(name, t, p)]), p) for p in PATHS[impl] if (name, t, p) in ours]
        mine, mine_path = min(paths) if paths else (None, "-")
        mhz = (None, None)
        if clocks is not None:
            mhz = (mean_clock(clocks, ours.get((name, t, "window"), [])),
                   mean_clock(clocks, [(c["start_unix_ms"], c["end_unix_ms"]) for c in cells if "start_unix_ms" in c]))
        target, floor, verdict = goal(ours, name, t, mine, us) if impl == "vllm-triton" else (None, None, None)
        if mine:
            line = {"kind": "compare", "precision": PRECISION[impl], "shape": name, "T": t,
                    "project_us": round(mine, 1), "project_path": mine_path, "vllm_us": round(us, 1),
                    "weight_read_us": ours.get((name, t, "weight_read"), [None])[0],
                    "project_over_vllm": round(mine / us, 3), "rounds": len(cells),
                    "project_rounds_us": ours[(name, t, mine_path)],
                    "vllm_rounds_us": [c["us"] for c in cells]}
            if verdict is not None:
                line["goal_us"], line["floor_us"], line["goal"] = round(target, 1), round(floor, 1), verdict
            if clocks is not None:
                line["project_sm_mhz"], line["vllm_sm_mhz"] = mhz
            print(json.dumps(line), flush=True)
        padded = ours.get((name, t, "decode-padded-graph")) if impl == "vllm-triton" else None
        rows[impl].append((name, t, mine, mine_path, median(padded) if padded else None, us,
                           cells[0]["config_source"], mhz, (target, floor, verdict)))
    if md_path:
        with open(md_path, "w") as md:
            for impl, title in (("vllm-triton", ""), ("vllm-triton-fp8", "FP8 experts (E4M3, 128 x 128 block "
                                                                          "scales), both sides\n\n")):
                if not rows[impl]:
                    continue
                md.write(title)
                goals = impl == "vllm-triton"
                md.write("| shape | T | project µs | project path | project padded runner µs | vLLM Triton µs | "
                         "project ÷ vLLM | vLLM config |%s%s\n|---|---|---|---|---|---|---|---|%s%s\n" % (
                             " SM MHz, project / vLLM |" if clocks is not None else "",
                             " vLLM ÷ 1.2 µs | floor µs | goal |" if goals else "",
                             "---|" if clocks is not None else "", "---|---|---|" if goals else ""))
                for name, t, mine, mine_path, padded, us, source, mhz, (target, floor, verdict) in rows[impl]:
                    best = min(x for x in (mine, padded) if x) if (mine or padded) else None
                    md.write("| %s | %d | %s | %s | %s | %.1f | %s | %s |%s%s\n" % (
                        name, t, "%.1f" % mine if mine else "-", mine_path, "%.1f" % padded if padded else "-", us,
                        "%.2f" % (best / us) if best else "-", source.split(" (")[0],
                        " %s / %s |" % tuple("-" if m is None else str(m) for m in mhz) if clocks is not None else "",
                        goal_cells(target, floor, verdict) if goals else ""))
                md.write("\n")


def goal_cells(target, floor, verdict):
    """The table's goal columns: the 1.2x target, the floor, and the verdict (where 1.2x is below
    the floor, the nearest goal that can be met: ahead of vLLM)."""
    if verdict is None:
        return " %.1f | - | - |" % target
    what = {"met": "1.2x met", "not met": "1.2x not met", "ahead": "ahead (1.2x below the floor)",
            "behind": "behind (1.2x below the floor)"}[verdict]
    return " %.1f | %.1f | %s |" % (target, floor, what)


def peer_cells(paths):
    """(impl, shape, T) -> vLLM's cell lines (vllm_compare.py's output), one a round."""
    peer = {}
    for path in paths:
        for c in json_lines(path):
            if c.get("kind") == "cell" and c.get("impl") in PATHS:
                peer.setdefault((c["impl"], c["shape"], c["T"]), []).append(c)
    return peer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ours", nargs="+", required=True, help="expert_layer_bench's lines, one file a round")
    ap.add_argument("--peer", nargs="+", required=True, help="vllm_compare.py's lines, one file a round")
    ap.add_argument("--md", default="")
    ap.add_argument("--clocks", default="", help="nvidia-smi samples beside the rounds: unix_ms, SM MHz, W")
    a = ap.parse_args(argv)
    peer = peer_cells(a.peer)
    if not peer:
        print("compare_report: no vLLM cell lines in %s" % " ".join(a.peer), file=sys.stderr)
        return 1
    report(ours_cells(a.ours), peer, a.md, clock_samples(a.clocks) if a.clocks else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())


