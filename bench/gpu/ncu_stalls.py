#!/usr/bin/env python3
"""Where a kernel's warps wait, from Nsight Compute's SASS page: the stall samples of every
instruction summed by what the warp was waiting for.

Input: the CSV that

    ncu --import R.ncu-rep --page source --print-source sass --csv > sass.csv

writes for a report collected with `--section SourceCounters` (bench/gpu/profile_kernels.sh).
A sample is charged to the instruction a warp would issue next, so a wait shows on an
instruction after the one that waits (the compiler schedules others in between). The
categories:

    mbarrier wait   samples on a branch whose predicate the last SYNCS.PHASECHK (try_wait)
                    wrote: a TMA stage not full yet for a consumer, not released yet for the
                    producer
    mma wait        samples on WARPGROUP.DEPBAR (wgmma.wait_group: a warpgroup waiting for its
                    own MMAs)
    named barrier   samples stalled for a CTA barrier anywhere else (BAR.SYNC: ping-pong turns,
                    __syncthreads)
    mma issue       samples on HGMMA / QGMMA / WARPGROUP.ARRIVE
    other           everything else (address arithmetic, epilogue, loads of scales)

Each kernel's share of each category is printed, then its samples by Nsight Compute's own stall
reasons (the largest first: what "other" is made of), then its top instructions with their two
largest stall reasons. Pages of one kernel name are summed (several launches profiled); a page
identical to an earlier one of the same kernel is counted once (ncu 2025.3 prints each kernel's
source page twice).

Usage: ncu_stalls.py sass.csv [--top N]
"""
import argparse
import csv
import sys
from collections import OrderedDict

CATEGORIES = ("mbarrier wait", "named barrier", "mma wait", "mma issue", "other")
SAMPLES = "Warp Stall Sampling (All Samples)"


def opcode_and_operands(source):
    words = [w for w in source.replace(",", " ").split() if not w.startswith("@")]
    guard = next((w for w in source.split() if w.startswith("@")), "")
    return (words[0] if words else ""), words[1:], guard.lstrip("@!")


def categorize(body):
    """Samples by category over one page, in address order."""
    sums = {c: 0.0 for c in CATEGORIES}
    writer = {}  # predicate register -> opcode of its last writer
    for _, source, samples, stalls in body:
        op, operands, guard = opcode_and_operands(source)
        if op.startswith("WARPGROUP.DEPBAR"):
            sums["mma wait"] += samples
        elif op.startswith(("HGMMA", "QGMMA", "WARPGROUP.ARRIVE")):
            sums["mma issue"] += samples
        elif op == "BRA" and guard and writer.get(guard, "").startswith("SYNCS.PHASECHK"):
            sums["mbarrier wait"] += samples
        else:
            barrier = stalls.get("stall_barrier", 0.0)
            sums["named barrier"] += barrier
            sums["other"] += samples - barrier
        if operands and len(operands[0]) == 2 and operands[0][0] == "P" and operands[0][1].isdigit():
            writer[operands[0]] = op
    return sums


def read_kernels(path):
    """{kernel name: [page, ...]} in file order, a page being
    [(address, source, samples, {stall reason: samples}), ...]."""
    kernels = OrderedDict()
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    i = 0
    while i < len(rows):
        row = rows[i]
        if not row or row[0] != "Kernel Name":
            i += 1
            continue
        name = row[1] if len(row) > 1 else "?"
        if i + 1 >= len(rows):
            raise ValueError(f"{path}: kernel {name!r} has no header row")
        header = rows[i + 1]
        if SAMPLES not in header or "Source" not in header:
            raise ValueError(f"{path}: no '{SAMPLES}' column: collect with --section SourceCounters")
        col_samples, col_source = header.index(SAMPLES), header.index("Source")
        reasons = [(j, c) for j, c in enumerate(header) if c.startswith("stall_") and "Not Issued" not in c]
        body = []
        i += 2
        while i < len(rows) and rows[i] and rows[i][0] != "Kernel Name":
            r = rows[i]
            samples = float(r[col_samples] or 0)
            stalls = {c: float(r[j] or 0) for j, c in reasons if j < len(r)}
            body.append((r[0], r[col_source], samples, stalls))
            i += 1
        pages = kernels.setdefault(name, [])
        if body not in pages:
            pages.append(body)
    return kernels


def reason_totals(per_instruction):
    """Samples by ncu's stall reason over all of a kernel's instructions, largest first."""
    totals = {}
    for _, reasons in per_instruction.values():
        for reason, value in reasons.items():
            totals[reason] = totals.get(reason, 0.0) + value
    return sorted(((r, v) for r, v in totals.items() if v > 0), key=lambda kv: -kv[1])


def summarize(launches):
    """Categories' sample sums and the per-instruction totals, over a kernel's pages."""
    by_category = {c: 0.0 for c in CATEGORIES}
    per_instruction = OrderedDict()
    for body in launches:
        for c, v in categorize(body).items():
            by_category[c] += v
        for index, (_, source, samples, stalls) in enumerate(body):
            key = (index, source)
            total, reasons = per_instruction.get(key, (0.0, {}))
            for reason, value in stalls.items():
                reasons[reason] = reasons.get(reason, 0.0) + value
            per_instruction[key] = (total + samples, reasons)
    return by_category, per_instruction


def report(path, top, out=sys.stdout):
    kernels = read_kernels(path)
    if not kernels:
        raise ValueError(f"{path}: no 'Kernel Name' rows: not an ncu --page source --csv export")
    for name, launches in kernels.items():
        by_category, per_instruction = summarize(launches)
        total = sum(by_category.values())
        print(f"== {name}", file=out)
        print(f"   {total:.0f} samples over {len(launches)} page(s)", file=out)
        for c in CATEGORIES:
            share = 100.0 * by_category[c] / total if total > 0 else 0.0
            print(f"   {c:14s} {by_category[c]:10.0f}  {share:5.1f}%", file=out)
        reasons = reason_totals(per_instruction)
        reason_sum = sum(v for _, v in reasons)
        for reason, value in reasons[:top]:
            share = 100.0 * value / reason_sum if reason_sum > 0 else 0.0
            print(f"   reason {reason[len('stall_'):]:20s} {value:10.0f}  {share:5.1f}%", file=out)
        ranked = sorted(per_instruction.items(), key=lambda kv: -kv[1][0])[:top]
        for (index, source), (samples, reasons) in ranked:
            if samples <= 0:
                break
            main = sorted(reasons.items(), key=lambda kv: -kv[1])[:2]
            why = ", ".join(f"{r[len('stall_'):]} {v:.0f}" for r, v in main if v > 0)
            print(f"   {samples:8.0f}  #{index:<5d} {source.strip()[:60]:60s} {why}", file=out)
    return kernels


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=10, help="instructions listed a kernel")
    args = parser.parse_args(argv)
    try:
        report(args.csv, args.top)
    except (OSError, ValueError) as e:
        print(f"ncu_stalls.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
