#!/usr/bin/python3
"""bench/gpu/a2a_report.py: issue 23's EP figures against their goals, from rounds of
a2a_bench and a2a_torch.py lines: medians over rounds, the slowest member, the ratios and the
verdicts, and a refusal of lines from more than one GPU count."""
import io
import json
import os
import sys
import tempfile
import unittest
from contextlib import redirect_stdout

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "gpu"))
import a2a_report  # noqa: E402


def write(path, records):
    with open(path, "w") as f:
        f.write("# a comment line\n")
        for r in records:
            f.write(json.dumps(r) + "\n")


def prefill(impl, payload, slot, dispatch, combine, gpus=8):
    return {"kind": "a2a", "impl": impl, "payload": payload, "gpus": gpus, "slot": slot,
            "dispatch_gbps": dispatch, "combine_gbps": combine}


def decode(slot, dispatch, combine, p99=(0.0, 0.0), payload="bf16", impl="moe-runtime nccl graph"):
    return {"kind": "decode", "impl": impl, "payload": payload, "gpus": 8, "slot": slot, "dispatch_us": dispatch,
            "combine_us": combine, "dispatch_p99_us": p99[0], "combine_p99_us": p99[1]}


class A2aReportTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()

    def run_report(self, ours, peer):
        paths = []
        for i, records in enumerate(ours + peer):
            paths.append(os.path.join(self.dir, "f%d" % i))
            write(paths[-1], records)
        md = os.path.join(self.dir, "a2a.md")
        out = io.StringIO()
        with redirect_stdout(out):
            rc = a2a_report.main(["--ours"] + paths[:len(ours)] + ["--torch"] + paths[len(ours):] + ["--md", md])
        rows = [json.loads(x) for x in out.getvalue().splitlines() if x.startswith("{")]
        text = ""
        if rc == 0:
            with open(md) as f:
                text = f.read()
        return rc, {(r["phase"], r["payload"], r["way"]): r for r in rows}, text

    def test_goals_from_the_slowest_member_over_rounds(self):
        # Slot 1 is the slower member: its median over the three rounds (180, 150, 170 -> 170) is
        # the dispatch figure; torch's slowest is 185 -> 170 / 185 = 0.919 >= 0.9 and >= 153.
        ours = [[prefill("ours", "bf16", 0, 200.0, 150.0), prefill("ours", "bf16", 1, 180.0, 160.0),
                 decode(0, 70.0, 100.0, (75.0, 120.0)), decode(1, 72.0, 110.0, (80.0, 118.0)),
                 {"kind": "nvlink", "gpus": 8, "one_direction_gbps": 390.0}],
                [prefill("ours", "bf16", 0, 210.0, 155.0), prefill("ours", "bf16", 1, 150.0, 161.0),
                 decode(0, 71.0, 101.0), decode(1, 78.0, 112.0)],
                [prefill("ours", "bf16", 0, 205.0, 152.0), prefill("ours", "bf16", 1, 170.0, 159.0),
                 decode(0, 69.0, 99.0), decode(1, 76.0, 116.0)]]
        peer = [[prefill("torch", "bf16", 0, 190.0, 170.0), prefill("torch", "bf16", 1, 185.0, 175.0),
                 decode(0, 50.0, 60.0, impl="torch all_to_all_single graph"),
                 decode(1, 55.0, 65.0, impl="torch all_to_all_single graph")]]
        rc, rows, md = self.run_report(ours, peer)
        self.assertEqual(rc, 0)
        d = rows[("prefill", "bf16", "dispatch")]
        self.assertEqual(d["ours_gbps"], 170.0)
        self.assertEqual(d["torch_gbps"], 185.0)
        self.assertAlmostEqual(d["ours_over_torch"], round(170.0 / 185.0, 3))
        self.assertTrue(d["met"])
        c = rows[("prefill", "bf16", "combine")]
        self.assertEqual(c["ours_gbps"], 152.0)  # slot 0's median of 150, 155, 152
        self.assertFalse(c["met"])  # 152 / 170 = 0.89 < 0.9, and under DeepEP's 158
        dd = rows[("decode", "bf16", "dispatch")]
        self.assertEqual(dd["ours_us"], 76.0)  # slot 1's median of 72, 78, 76
        self.assertEqual(dd["ours_p99_us"], 80.0)
        self.assertTrue(dd["met"])  # <= 77
        dc = rows[("decode", "bf16", "combine")]
        self.assertEqual(dc["ours_us"], 112.0)
        self.assertTrue(dc["met"])  # <= 114
        self.assertIn("NVLink one direction per GPU in the same run: 390.0 GB/s", md)
        self.assertIn("| prefill | bf16 | dispatch | 170.0 GB/s | 185.0 GB/s | 0.92 | 153 GB/s | yes |", md)
        self.assertIn("| decode 128 | bf16 | combine | 112.0 µs (p99 120.0) | 65.0 µs (graph, transfer only) |", md)

    def test_a_slow_decode_misses_the_goal(self):
        rc, rows, _ = self.run_report([[decode(0, 90.0, 100.0), decode(1, 70.0, 130.0)]], [[]])
        self.assertEqual(rc, 0)
        self.assertFalse(rows[("decode", "bf16", "dispatch")]["met"])
        self.assertFalse(rows[("decode", "bf16", "combine")]["met"])

    def test_mixed_gpu_counts_are_refused(self):
        rc, rows, _ = self.run_report([[prefill("ours", "bf16", 0, 1.0, 1.0, gpus=4)],
                                       [prefill("ours", "bf16", 0, 1.0, 1.0, gpus=8)]], [[]])
        self.assertEqual(rc, 1)
        self.assertEqual(rows, {})


if __name__ == "__main__":
    unittest.main()
