#!/usr/bin/python3
"""bench/gpu/ncu_stalls.py: Nsight Compute's SASS page (CSV) summed by what the warps waited
for: try_wait branches, wgmma waits, CTA barriers, MMA issue; duplicated pages counted once,
distinct pages of one kernel summed; a page without the samples' column refused."""
import csv
import io
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "gpu"))
import ncu_stalls  # noqa: E402

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "stall_barrier", "stall_long_sb", "stall_wait", "stall_barrier (Not Issued)"]


def page(kernel, rows):
    out = [["Kernel Name", kernel], HEADER]
    for address, source, samples, barrier, long_sb in rows:
        wait = samples - barrier - long_sb
        out.append([address, source, str(samples), "0", str(barrier), str(long_sb), str(wait), "0"])
    return out


# A consumer's main loop: try_wait, address arithmetic, the retry branch (waiting for a full
# stage), MMAs, the wgmma wait; a ping-pong turn (BAR.SYNC, then the instruction that waits).
LOOP = [
    ("0x10", "      SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R16+URZ+0x34000], R21", 2, 0, 0),
    ("0x20", "      LOP3.LUT R20, R18, 0x3fff0, RZ, 0xc0, !PT", 3, 0, 0),
    ("0x30", "@!P0  BRA 0x100", 40, 0, 38),
    ("0x40", "      HGMMA.64x128x16.F32.BF16 R88, gdesc[UR12], R88", 10, 0, 0),
    ("0x50", "      WARPGROUP.DEPBAR.LE gsb0, 0x1", 25, 24, 0),
    ("0x60", "      ISETP.GE.AND P0, PT, R1, 0x1, PT", 1, 0, 0),
    ("0x70", "@!P0  BRA 0x200", 5, 0, 0),  # P0 now from ISETP: not a try_wait
    ("0x80", "      BAR.SYNC.DEFER_BLOCKING R153, 0x100", 1, 0, 0),
    ("0x90", "      IMAD.MOV.U32 R13, RZ, RZ, -0x1", 30, 29, 0),
]


class NcuStallsTest(unittest.TestCase):
    def write(self, pages):
        f = tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False, newline="")
        self.addCleanup(os.unlink, f.name)
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        for p in pages:
            w.writerows(p)
        f.close()
        return f.name

    def test_categories(self):
        path = self.write([page("KernelA", LOOP)])
        kernels = ncu_stalls.read_kernels(path)
        sums, per_instruction = ncu_stalls.summarize(kernels["KernelA"])
        self.assertEqual(sums["mbarrier wait"], 40)
        self.assertEqual(sums["mma wait"], 25)
        self.assertEqual(sums["mma issue"], 10)
        self.assertEqual(sums["named barrier"], 29)
        self.assertEqual(sums["other"], 2 + 3 + 1 + 5 + 1 + 1)
        self.assertEqual(sum(sums.values()), sum(r[2] for r in LOOP))
        top = max(per_instruction.items(), key=lambda kv: kv[1][0])
        self.assertIn("BRA 0x100", top[0][1])

    def test_reason_totals(self):
        path = self.write([page("KernelA", LOOP)])
        kernels = ncu_stalls.read_kernels(path)
        _, per_instruction = ncu_stalls.summarize(kernels["KernelA"])
        totals = dict(ncu_stalls.reason_totals(per_instruction))
        self.assertEqual(totals["stall_barrier"], 24 + 29)
        self.assertEqual(totals["stall_long_sb"], 38)
        self.assertEqual(totals["stall_wait"], sum(r[2] for r in LOOP) - 24 - 29 - 38)
        self.assertNotIn("stall_barrier (Not Issued)", totals)
        out = io.StringIO()
        ncu_stalls.report(path, 3, out)
        self.assertRegex(out.getvalue(), r"reason wait +%d" % totals["stall_wait"])

    def test_duplicate_page_once_and_launches_summed(self):
        other = [(a, s, 2 * n, 2 * b, 2 * l) for a, s, n, b, l in LOOP]
        path = self.write([page("KernelA", LOOP), page("KernelA", LOOP), page("KernelA", other),
                           page("KernelB", LOOP[:3])])
        kernels = ncu_stalls.read_kernels(path)
        self.assertEqual(list(kernels), ["KernelA", "KernelB"])
        self.assertEqual(len(kernels["KernelA"]), 2)  # the identical second page dropped
        sums, _ = ncu_stalls.summarize(kernels["KernelA"])
        self.assertEqual(sums["mbarrier wait"], 40 * 3)
        out = io.StringIO()
        ncu_stalls.report(path, 3, out)
        text = out.getvalue()
        self.assertIn("== KernelB", text)
        self.assertIn("mbarrier wait", text)
        self.assertIn("2 page(s)", text)

    def test_refuses_a_page_without_samples(self):
        bad = [["Kernel Name", "K"], ["Address", "Source", "Instructions Executed"], ["0x10", "NOP", "1"]]
        path = self.write([bad])
        with self.assertRaisesRegex(ValueError, "SourceCounters"):
            ncu_stalls.read_kernels(path)
        self.assertEqual(ncu_stalls.main([path]), 2)
        empty = self.write([[["something", "else"]]])
        self.assertEqual(ncu_stalls.main([empty]), 2)


if __name__ == "__main__":
    unittest.main()
