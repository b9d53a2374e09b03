"""Side-by-side medians of kernel_ab.sh's runs: one row a cell, one column a build (median over
rounds of each run's median), for the layer's cells, the breakdown's route and experts stages and the
FP8 lines."""
import collections
import json
import statistics
import sys


def main(path):
    rows = collections.OrderedDict()
    builds = []
    for line in open(path):
        r = json.loads(line)
        if r["build"] not in builds:
            builds.append(r["build"])
        kind = r.get("kind")
        if kind == "cell":
            keys = [(f"{r['path']} layer", r["us"])]
        elif kind == "breakdown":
            keys = [(f"{r['path']} route", r["route_rows_us"]), (f"{r['path']} experts", r["experts_us"])]
        elif kind == "fp8":
            keys = [("bf16 experts (fp8 pair)", r["bf16_experts_us"]), ("fp8 experts", r["fp8_experts_us"])]
        else:
            continue
        for what, us in keys:
            rows.setdefault((r["shape"], r["T"], what), collections.defaultdict(list))[r["build"]].append(us)
    print("shape | T | what | " + " | ".join(builds) + " | last ÷ first")
    for (shape, t, what), by in rows.items():
        meds = [statistics.median(by[b]) if by[b] else float("nan") for b in builds]
        spread = ["/".join(f"{v:.1f}" for v in by[b]) for b in builds]  # in round order
        ratio = meds[-1] / meds[0] if meds[0] else float("nan")
        print(f"{shape} | {t} | {what} | " + " | ".join(spread) + f" | {ratio:.3f}")


if __name__ == "__main__":
    main(sys.argv[1])
