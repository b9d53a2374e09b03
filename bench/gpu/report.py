"""Joins expert_layer_bench and torch_reference output (JSON lines) into a markdown table and a
plot. Usage: report.py OURS.jsonl TORCH.jsonl OUT.md [OUT.png]"""
import json
import sys


def load(path):
    rows = []
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            rows.append(json.loads(line))
    return rows


def main():
    ours, ref = load(sys.argv[1]), load(sys.argv[2])
    ceil = next(r for r in ours if r["kind"] == "ceiling")
    tceil = next((r for r in ref if r["kind"] == "ceiling"), {})
    dense, copy = ceil["dense_bf16_tflops"], ceil["copy_tbps"]
    refcells = {(r["shape"], r["T"]): r for r in ref if r["kind"] == "cell"}
    lines = [f"Ceilings measured in this run: cuBLAS BF16 8192^3 {dense} TFLOP/s "
             f"(PyTorch matmul {tceil.get('dense_bf16_tflops', '?')}), device copy {copy} TB/s (read+write); "
             f"kernels: {ceil['kernels']}.", "",
             "| shape | T | path | ours µs | ours TFLOP/s | ours TB/s | PyTorch µs | PyTorch TFLOP/s | speed-up | % of dense | experts hit | weight-read µs | ours / weight-read |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    plot = []
    for r in ours:
        if r["kind"] != "cell" or r.get("path", "").startswith("fp8"):  # FP8 experts: vllm_compare.py's table
            continue
        p = refcells.get((r["shape"], r["T"]))
        speed = p["us"] / r["us"] if p else float("nan")
        adj = (f" (interleaved {100 * r['dense_interleaved_fraction']:.1f}% of {r['dense_interleaved_tflops']})"
               if r.get("dense_interleaved_tflops", 0) > 0 else "")
        lines.append(f"| {r['shape']} | {r['T']} | {r.get('path', '-')} | {r['us']} | {r['tflops']} | {r['bytes_per_s_tb']} | "
                     f"{p['us'] if p else '-'} | {p['tflops'] if p else '-'} | {speed:.2f}× | "
                     f"{100 * r['dense_fraction']:.1f}%{adj} | {r['experts_hit']} | {r['weight_read_us']} | "
                     f"{r['us'] / r['weight_read_us']:.2f}× |")
        if r.get("path", "prefill") == "prefill" or r["T"] <= 16:
            plot.append((f"{r['shape'].split('-')[0]} T={r['T']} {r.get('path', '')}", r["tflops"], p["tflops"] if p else 0))
    open(sys.argv[3], "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))
    if len(sys.argv) > 4:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(11, 4.5))
        xs = range(len(plot))
        ax.bar([x - 0.2 for x in xs], [p[1] for p in plot], 0.4, label="moe-runtime")
        ax.bar([x + 0.2 for x in xs], [p[2] for p in plot], 0.4, label="PyTorch _grouped_mm reference")
        ax.axhline(dense, color="k", ls="--", lw=1, label=f"cuBLAS dense {dense} TFLOP/s")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([p[0] for p in plot], rotation=45, ha="right", fontsize=8)
        ax.set_ylabel("TFLOP/s (useful)")
        ax.set_title("Local expert layer on one H200 (pack -> SwiGLU experts -> combine)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(sys.argv[4], dpi=110)


if __name__ == "__main__":
    main()
