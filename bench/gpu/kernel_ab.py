"""Side-by-side medians of kernel_ab.sh's runs: one row a cell, one column a build (median over
rounds of each run's median), for the layer's cells, the breakdown's route and experts stages, the
FP8 lines and (SUSTAIN_MS) the experts run back to back at the power limit. With the clock
sampler's file as a second argument each sustained figure carries the mean SM clock of its window
(its first 500 ms left out, while the clock settles), as "us@MHz"."""
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_report import clock_samples, mean_clock, median  # noqa: E402

SETTLE_MS = 500  # as sustained.sh


def rows_of(path, samples=None):
    """-> (builds in order of appearance, {(shape, T, what): {build: [(us, MHz or None), ...]}})."""
    rows = collections.OrderedDict()
    builds = []
    for line in open(path):
        r = json.loads(line)
        if r["build"] not in builds:
            builds.append(r["build"])
        kind = r.get("kind")
        mhz = None
        if kind == "cell":
            keys = [(f"{r['path']} layer", r["us"])]
        elif kind == "breakdown":
            keys = [(f"{r['path']} route", r["route_rows_us"]), (f"{r['path']} experts", r["experts_us"])]
        elif kind == "fp8":
            keys = [("bf16 experts (fp8 pair)", r["bf16_experts_us"]), ("fp8 experts", r["fp8_experts_us"])]
        elif kind == "sustained":
            keys = [(f"sustained {r['what']}", r["median_us"])]
            if samples is not None:
                mhz = mean_clock(samples, [(r["start_unix_ms"] + SETTLE_MS, r["end_unix_ms"])])
        else:
            continue
        for what, us in keys:
            rows.setdefault((r["shape"], r["T"], what), collections.defaultdict(list))[r["build"]].append((us, mhz))
    return builds, rows


def main(path, samples_path=None):
    builds, rows = rows_of(path, clock_samples(samples_path) if samples_path else None)
    print("shape | T | what | " + " | ".join(builds) + " | last ÷ first")
    for (shape, t, what), by in rows.items():
        meds = [median([us for us, _ in by[b]]) if by[b] else float("nan") for b in builds]
        spread = ["/".join(f"{us:.1f}" + (f"@{mhz:.0f}" if mhz is not None else "") for us, mhz in by[b])
                  for b in builds]  # in round order
        ratio = meds[-1] / meds[0] if meds[0] else float("nan")
        print(f"{shape} | {t} | {what} | " + " | ".join(spread) + f" | {ratio:.3f}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
