"""The comparison's report, from the lines of earlier runs (no GPU): each cell's median over the
rounds of the project's bench (expert_layer_bench's "cell" lines) and of vLLM's timing
(vllm_compare.py's "cell" lines), the project's figure the faster of its graph-replayed
device-offset path and its eager prefill path; "compare" lines on stdout (what vllm_plot.py
draws) and a Markdown table. FP8 cells (vLLM's "vllm-triton-fp8" lines, E4M3 with 128 x 128 block
scales) pair with the project's FP8 layer ("fp8" eager, "fp8-graph" replayed), in a table of their
own. vllm_compare.sh runs it after its rounds:

  python3 bench/gpu/compare_report.py --ours ours_1.jsonl ours_2.jsonl \
      --peer vllm_1.jsonl vllm_2.jsonl [--md report.md] > vllm.jsonl
"""
import argparse
import json
import sys


def json_lines(path):
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                yield json.loads(line)


def ours_cells(paths):
    """(shape, T, path) -> the project's times over the rounds (one file a round), and
    (shape, T, "weight_read") -> [the weight-read time]."""
    cells = {}
    for path in paths:
        for c in json_lines(path):
            if c.get("kind") == "cell" and c.get("impl") == "moe-runtime":
                cells.setdefault((c["shape"], c["T"], c["path"]), []).append(c["us"])
                cells[(c["shape"], c["T"], "weight_read")] = [c["weight_read_us"]]
    return cells


def median(values):
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else 0.5 * (v[len(v) // 2 - 1] + v[len(v) // 2])


# The project's paths each peer is compared with (the faster of them, medians over the rounds).
PATHS = {"vllm-triton": ("decode-graph", "prefill"), "vllm-triton-fp8": ("fp8-graph", "fp8")}
PRECISION = {"vllm-triton": "bf16", "vllm-triton-fp8": "fp8"}


def report(ours, peer, md_path):
    """The "compare" lines (the pair the table and vllm_plot.py show, decided here only) and the
    tables: each cell's median over the rounds, the project's figure the faster of its
    graph-replayed device-offset path and its eager path, where the bench ran both.
    `peer`: (impl, shape, T) -> vLLM's cell lines, one a round, in the order timed."""
    rows = {impl: [] for impl in PATHS}
    for (impl, name, t), cells in peer.items():
        us = median([c["us"] for c in cells])
        paths = [(median(ours[(name, t, p)]), p) for p in PATHS[impl] if (name, t, p) in ours]
        mine, mine_path = min(paths) if paths else (None, "-")
        if mine:
            print(json.dumps({"kind": "compare", "precision": PRECISION[impl], "shape": name, "T": t,
                              "project_us": round(mine, 1), "project_path": mine_path, "vllm_us": round(us, 1),
                              "weight_read_us": ours.get((name, t, "weight_read"), [None])[0],
                              "project_over_vllm": round(mine / us, 3), "rounds": len(cells),
                              "project_rounds_us": ours[(name, t, mine_path)],
                              "vllm_rounds_us": [c["us"] for c in cells]}), flush=True)
        padded = ours.get((name, t, "decode-padded-graph")) if impl == "vllm-triton" else None
        rows[impl].append((name, t, mine, mine_path, median(padded) if padded else None, us,
                           cells[0]["config_source"]))
    if md_path:
        with open(md_path, "w") as md:
            for impl, title in (("vllm-triton", ""), ("vllm-triton-fp8", "FP8 experts (E4M3, 128 x 128 block "
                                                                          "scales), both sides\n\n")):
                if not rows[impl]:
                    continue
                md.write(title)
                md.write("| shape | T | project µs | project path | project padded runner µs | vLLM Triton µs | "
                         "project ÷ vLLM | vLLM config |\n|---|---|---|---|---|---|---|---|\n")
                for name, t, mine, mine_path, padded, us, source in rows[impl]:
                    best = min(x for x in (mine, padded) if x) if (mine or padded) else None
                    md.write("| %s | %d | %s | %s | %s | %.1f | %s | %s |\n" % (
                        name, t, "%.1f" % mine if mine else "-", mine_path, "%.1f" % padded if padded else "-", us,
                        "%.2f" % (best / us) if best else "-", source.split(" (")[0]))
                md.write("\n")


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
    a = ap.parse_args(argv)
    peer = peer_cells(a.peer)
    if not peer:
        print("compare_report: no vLLM cell lines in %s" % " ".join(a.peer), file=sys.stderr)
        return 1
    report(ours_cells(a.ours), peer, a.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())


