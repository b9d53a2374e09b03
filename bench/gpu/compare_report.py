"""The comparison's report, from the lines of earlier runs (no GPU): each cell's median over the
rounds of the project's bench (expert_layer_bench's "cell" lines) and of vLLM's timing
(vllm_compare.py's "cell" lines), the project's figure the faster of its graph-replayed
device-offset path and its eager prefill path; "compare" lines on stdout (what vllm_plot.py
draws) and a Markdown table. vllm_compare.sh runs it after its rounds:

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


def report(ours, peer, md_path):
    """The "compare" lines (the pair the table and vllm_plot.py show, decided here only) and the
    table: each cell's median over the rounds, the project's figure the faster of its
    graph-replayed device-offset path and its eager prefill path, where the bench ran both.
    `peer`: (shape, T) -> vLLM's cell lines, one a round, in the order timed."""
    rows = []
    for (name, t), cells in peer.items():
        us = median([c["us"] for c in cells])
        paths = [(median(ours[(name, t, p)]), p) for p in ("decode-graph", "prefill") if (name, t, p) in ours]
        mine, mine_path = min(paths) if paths else (None, "-")
        if mine:
            print(json.dumps({"kind": "compare", "shape": name, "T": t, "project_us": round(mine, 1),
                              "project_path": mine_path, "vllm_us": round(us, 1),
                              "weight_read_us": ours.get((name, t, "weight_read"), [None])[0],
                              "project_over_vllm": round(mine / us, 3), "rounds": len(cells),
                              "project_rounds_us": ours[(name, t, mine_path)],
                              "vllm_rounds_us": [c["us"] for c in cells]}), flush=True)
        padded = ours.get((name, t, "decode-padded-graph"))
        rows.append((name, t, mine, mine_path, median(padded) if padded else None, us, cells[0]["config_source"]))
    if md_path:
        with open(md_path, "w") as md:
            md.write("| shape | T | project µs | project path | project padded runner µs | vLLM Triton µs | "
                     "project ÷ vLLM | vLLM config |\n|---|---|---|---|---|---|---|---|\n")
            for name, t, mine, mine_path, padded, us, source in rows:
                best = min(x for x in (mine, padded) if x) if (mine or padded) else None
                md.write("| %s | %d | %s | %s | %s | %.1f | %s | %s |\n" % (
                    name, t, "%.1f" % mine if mine else "-", mine_path, "%.1f" % padded if padded else "-", us,
                    "%.2f" % (best / us) if best else "-", source.split(" (")[0]))


def peer_cells(paths):
    """(shape, T) -> vLLM's cell lines (vllm_compare.py's output), one a round."""
    peer = {}
    for path in paths:
        for c in json_lines(path):
            if c.get("kind") == "cell" and c.get("impl") == "vllm-triton":
                peer.setdefault((c["shape"], c["T"]), []).append(c)
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


