"""Plots a vllm_compare.sh run: for every cell, the project's time and the time to read the hit
experts' weights once at the measured copy ceiling, both as a fraction of vLLM's Triton time,
with issue 19's goal (1 / 1.2) drawn across. Usage:

    vllm_plot.py VLLM.jsonl OUT.png [bf16|fp8]   (the vllm.jsonl that vllm_compare.sh leaves in $OUT)

fp8 draws the block-FP8 cells (VLLM_ARGS="--dtype fp8"): both sides' FP8 layers, and the weight
read at one byte a value (the bench reports it for BF16's two; the block scales add 1/16384).

It draws vllm_compare.py's "compare" lines, which hold the project's figure that script chose
(the faster of its eager prefill and graph-replayed decode paths) beside vLLM's, and each side's
mean SM clock (project / vLLM) under a cell's label where the run sampled it. Needs
matplotlib (not a project dependency: install it where you plot).
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    return [json.loads(line) for line in open(path) if line.strip().startswith("{")]


def main(vllm_path, out_path, precision="bf16"):
    if precision not in ("bf16", "fp8"):
        sys.exit(__doc__)
    cells = [r for r in load(vllm_path) if r.get("kind") == "compare" and r.get("precision", "bf16") == precision]
    if not cells:
        sys.exit(f"{vllm_path}: no {precision} compare lines (vllm_compare.py run without --ours, or not the merged "
                 "file?)")
    # Where the run sampled the clock (vllm_compare.sh), each side's mean SM clock under its label:
    # a ratio taken with one side hotter than the other reads as such.
    labels = [f"{r['shape'].split('-')[0]} T={r['T']}" +
              (f"\n{r['project_sm_mhz']}/{r['vllm_sm_mhz']} MHz" if r.get("project_sm_mhz") and r.get("vllm_sm_mhz")
               else "") for r in cells]
    ratio = [r["project_us"] / r["vllm_us"] for r in cells]
    per_value = 0.5 if precision == "fp8" else 1.0  # weight_read_us is for two bytes a value
    read = [(r["weight_read_us"] or 0) * per_value / r["vllm_us"] for r in cells]
    fig, ax = plt.subplots(figsize=(10, 4.2))
    x = range(len(cells))
    ax.bar([i - 0.2 for i in x], ratio, width=0.4, label="project ÷ vLLM Triton (time)")
    ax.bar([i + 0.2 for i in x], read, width=0.4, label="weight read at the copy ceiling ÷ vLLM", color="0.75")
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.axhline(1 / 1.2, color="tab:red", linestyle="--", linewidth=1, label="issue 19 goal (1.2× faster)")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, rotation=30, ha="right")
    ax.set_ylabel("time ÷ vLLM's (lower is faster)")
    ax.set_title("Expert layer on one H200: the project and vLLM's Triton fused-MoE kernel, same routings" +
                 (" (block FP8 both)" if precision == "fp8" else ""))
    ax.set_ylim(0, max([1.3] + [1.25 * v for v in ratio + read]))
    ax.legend(fontsize=8, loc="upper center", ncol=3)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    main(*sys.argv[1:])
