"""Plots a vllm_compare.sh run: for every cell, the project's time and the time to read the hit
experts' weights once at the measured copy ceiling, both as a fraction of vLLM's Triton time,
with issue 19's goal (1 / 1.2) drawn across. Usage:

    vllm_plot.py OURS.jsonl VLLM.jsonl OUT.png     (the files vllm_compare.sh leaves in $OUT)

The project's time is the faster of its eager prefill and graph-replayed decode paths, as in
vllm_compare.py's table. Needs matplotlib (not a project dependency: install it where you plot).
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    return [json.loads(line) for line in open(path) if line.strip().startswith("{")]


def main(ours_path, vllm_path, out_path):
    ours, vllm = load(ours_path), load(vllm_path)
    theirs = {(r["shape"], r["T"]): r["us"] for r in vllm if "us" in r and "shape" in r}
    best, floor = {}, {}
    for r in ours:
        if r.get("kind") != "cell":
            continue
        key = (r["shape"], r["T"])
        floor[key] = r["weight_read_us"]
        if r["path"] in ("prefill", "decode-graph"):
            best[key] = min(best.get(key, float("inf")), r["us"])
    cells = [k for k in theirs if k in best]
    labels = [f"{s.split('-')[0]} T={t}" for s, t in cells]
    ratio = [best[k] / theirs[k] for k in cells]
    read = [floor[k] / theirs[k] for k in cells]
    fig, ax = plt.subplots(figsize=(10, 4.2))
    x = range(len(cells))
    ax.bar([i - 0.2 for i in x], ratio, width=0.4, label="project ÷ vLLM Triton (time)")
    ax.bar([i + 0.2 for i in x], read, width=0.4, label="weight read at the copy ceiling ÷ vLLM", color="0.75")
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.axhline(1 / 1.2, color="tab:red", linestyle="--", linewidth=1, label="issue 19 goal (1.2× faster)")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, rotation=30, ha="right")
    ax.set_ylabel("time ÷ vLLM's (lower is faster)")
    ax.set_title("Expert layer on one H200: the project and vLLM's Triton fused-MoE kernel, same routings")
    ax.set_ylim(0, 1.3)
    ax.legend(fontsize=8, loc="upper center", ncol=3)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
