"""The EP dispatch and combine figures of bench/gpu/many_gpu.sh (part 1) against issue 23's goals,
from the lines a2a_bench and a2a_torch.py wrote, one file each a round (no GPU needed):

- prefill (DeepEP's normal shape), BF16 and FP8 rows: each side's GB/s per direction (the median
  over rounds of each member's figure, then the slowest member: a step waits for it), ours ÷
  torch for the same bytes (goal >= 0.9), and ours against DeepEP's published 153 / 158 GB/s
  (H800; an H200's NVLink is faster, so the ceiling measured in the same run is shown beside);
- decode, 128 tokens per rank under graph replay: dispatch and combine µs (the slowest member's
  median over rounds, and the largest p99) against DeepEP low-latency's 77 / 114 µs.

  python3 bench/gpu/a2a_report.py --ours a2a_ours_1.jsonl a2a_ours_2.jsonl \\
      --torch a2a_torch_1.jsonl a2a_torch_2.jsonl [--md report.md]

Prints one JSON line a row ("kind": "a2a_goal") and writes the table to --md.
"""
import argparse
import json
import sys

from compare_report import json_lines, median  # the same line reading and median (no GPU)

DEEPEP_NORMAL_GBPS = {"dispatch": 153.0, "combine": 158.0}  # H800, EP8, 4096 tokens, hidden 7168, top-8
DEEPEP_LL_US = {"dispatch": 77.0, "combine": 114.0}  # H800, EP8, 128 tokens
TORCH_PEER_RATIO = 0.9


def lines(paths):
    for path in paths:
        yield from json_lines(path)


def per_member(records, key):
    """The median over rounds of each member's (slot's) figure."""
    by_slot = {}
    for r in records:
        by_slot.setdefault(r["slot"], []).append(r[key])
    return {slot: median(v) for slot, v in by_slot.items()}


def report(ours_paths, torch_paths, md_path):
    ours = list(lines(ours_paths))
    peer = list(lines(torch_paths))
    gpus = sorted({r["gpus"] for r in ours if "gpus" in r})
    if len(gpus) != 1:
        print("a2a_report: the lines hold %s GPU counts, want one" % (gpus or "no"), file=sys.stderr)
        return 1
    p = gpus[0]
    nvlink = [r["one_direction_gbps"] for r in ours if r.get("kind") == "nvlink"]
    rows = []
    for payload in ("bf16", "fp8"):
        mine = [r for r in ours if r.get("kind") == "a2a" and r["payload"] == payload]
        theirs = [r for r in peer if r.get("kind") == "a2a" and r["payload"] == payload]
        if not mine:
            continue
        for way in ("dispatch", "combine"):
            ours_gbps = min(per_member(mine, way + "_gbps").values())  # the slowest member
            torch_gbps = min(per_member(theirs, way + "_gbps").values()) if theirs else None
            ratio = ours_gbps / torch_gbps if torch_gbps else None
            rows.append({"kind": "a2a_goal", "gpus": p, "phase": "prefill", "payload": payload, "way": way,
                         "ours_gbps": round(ours_gbps, 1), "torch_gbps": torch_gbps and round(torch_gbps, 1),
                         "ours_over_torch": ratio and round(ratio, 3), "deepep_gbps": DEEPEP_NORMAL_GBPS[way],
                         "nvlink_gbps": median(nvlink) if nvlink else None,
                         "met": bool(ratio and ratio >= TORCH_PEER_RATIO and ours_gbps >= DEEPEP_NORMAL_GBPS[way])})
    for payload in ("bf16", "fp8"):
        mine = [r for r in ours if r.get("kind") == "decode" and r.get("payload") == payload]
        if not mine:
            continue
        for way in ("dispatch", "combine"):
            us = max(per_member(mine, way + "_us").values())
            p99 = max(r.get(way + "_p99_us", 0.0) for r in mine)
            rows.append({"kind": "a2a_goal", "gpus": p, "phase": "decode", "payload": payload, "way": way,
                         "ours_us": round(us, 1), "ours_p99_us": round(p99, 1), "deepep_ll_us": DEEPEP_LL_US[way],
                         "met": us <= DEEPEP_LL_US[way]})
    # torch's decode transfer under graph replay (BF16, no pack or combine): the slowest member.
    torch_graph = [r for r in peer if r.get("kind") == "decode" and r.get("impl", "").endswith("graph")]
    torch_decode = {way: max(per_member(torch_graph, way + "_us").values()) for way in ("dispatch", "combine")
                    if torch_graph}
    for row in rows:
        print(json.dumps(row))
    if md_path:
        with open(md_path, "w") as md:
            md.write("EP%d (%d GPUs), NVLink one direction per GPU in the same run: %s GB/s\n\n" % (
                p, p, "%.1f" % median(nvlink) if nvlink else "not measured"))
            md.write("| phase | rows | way | ours | torch | ours ÷ torch | DeepEP (H800) | goal met |\n"
                     "|---|---|---|---|---|---|---|---|\n")
            for r in rows:
                if r["phase"] == "prefill":
                    md.write("| prefill | %s | %s | %.1f GB/s | %s | %s | %.0f GB/s | %s |\n" % (
                        r["payload"], r["way"], r["ours_gbps"],
                        "%.1f GB/s" % r["torch_gbps"] if r["torch_gbps"] else "-",
                        "%.2f" % r["ours_over_torch"] if r["ours_over_torch"] else "-", r["deepep_gbps"],
                        "yes" if r["met"] else "no"))
                else:
                    torch_us = torch_decode.get(r["way"]) if r["payload"] == "bf16" else None
                    md.write("| decode 128 | %s | %s | %.1f µs (p99 %.1f) | %s | - | %.0f µs | %s |\n" % (
                        r["payload"], r["way"], r["ours_us"], r["ours_p99_us"],
                        "%.1f µs (graph, transfer only)" % torch_us if torch_us else "-", r["deepep_ll_us"],
                        "yes" if r["met"] else "no"))
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ours", nargs="+", required=True, help="a2a_bench's lines, one file a round")
    ap.add_argument("--torch", nargs="*", default=[], help="a2a_torch.py's lines, one file a round")
    ap.add_argument("--md", default="")
    a = ap.parse_args(argv)
    return report(a.ours, a.torch, a.md)


if __name__ == "__main__":
    sys.exit(main())
