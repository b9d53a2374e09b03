#!/usr/bin/python3
"""bench/gpu/kernel_ab.py: the A/B table of kernel_ab.sh's runs: one column a build in the order
they first appear, each run's figure in round order, the median ratio of the last build to the
first; sustained windows with their mean SM clock from the sampler's file (the first 500 ms of a
window left out), without it plain."""
import io
import json
import os
import sys
import tempfile
import unittest
from contextlib import redirect_stdout

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "gpu"))
import kernel_ab  # noqa: E402

SHAPE = "E8-k2-d4096-f14336"


def lines(build, rnd, layer_us, fp8_us, sus_us, start_ms):
    base = {"shape": SHAPE, "T": 8192, "build": build, "round": rnd}
    return [
        dict(base, kind="ceiling", dense_bf16_tflops=700.0),
        dict(base, kind="cell", path="prefill", us=layer_us),
        dict(base, kind="breakdown", path="prefill", route_rows_us=15.0, experts_us=layer_us - 20.0),
        dict(base, kind="fp8", bf16_experts_us=8800.0, fp8_experts_us=fp8_us),
        dict(base, kind="sustained", what="fp8_experts_from_rows", start_unix_ms=start_ms, end_unix_ms=start_ms + 2000,
             calls=340, median_us=sus_us),
    ]


class KernelAbTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.log = os.path.join(self.dir, "kernel_ab.jsonl")
        runs = [("old", 1, 9000.0, 5800.0, 5801.8, 1000), ("new", 1, 8900.0, 5700.0, 5922.5, 4000),
                ("new", 2, 8950.0, 5750.0, 5912.0, 7000), ("old", 2, 9100.0, 5900.0, 5810.3, 10000)]
        with open(self.log, "w") as f:
            for run in runs:
                for rec in lines(*run):
                    f.write(json.dumps(rec) + "\n")
        # Samples: 1400 MHz inside each window's first 500 ms (left out), then the window's clock.
        self.samples = os.path.join(self.dir, "samples.csv")
        with open(self.samples, "w") as f:
            for start, mhz in ((1000, 1458), (4000, 1469), (7000, 1463), (10000, 1464)):
                for ms in range(start, start + 2001, 50):
                    f.write(f"{ms}, {1400 if ms < start + 500 else mhz}, 690.5\n")
            f.write("12050, 14")  # the sampler's last line, cut short

    def table(self, *args):
        out = io.StringIO()
        with redirect_stdout(out):
            kernel_ab.main(*args)
        return {tuple(line.split(" | ")[:3]): line.split(" | ")[3:] for line in out.getvalue().splitlines()[1:]}

    def test_builds_in_order_rounds_in_order_and_the_ratio_of_medians(self):  # nearest-rank medians (0x0DA)
        t = self.table(self.log)
        self.assertEqual(t[(SHAPE, "8192", "prefill layer")], ["9000.0/9100.0", "8900.0/8950.0", "0.989"])
        self.assertEqual(t[(SHAPE, "8192", "prefill route")], ["15.0/15.0", "15.0/15.0", "1.000"])
        self.assertEqual(t[(SHAPE, "8192", "fp8 experts")], ["5800.0/5900.0", "5700.0/5750.0", "0.983"])
        self.assertNotIn((SHAPE, "8192", "ceiling"), t)

    def test_sustained_windows_carry_their_clock(self):
        t = self.table(self.log, self.samples)
        self.assertEqual(t[(SHAPE, "8192", "sustained fp8_experts_from_rows")],
                         ["5801.8@1458/5810.3@1464", "5922.5@1469/5912.0@1463", "1.019"])
        plain = self.table(self.log)
        self.assertEqual(plain[(SHAPE, "8192", "sustained fp8_experts_from_rows")],
                         ["5801.8/5810.3", "5922.5/5912.0", "1.019"])

    def test_a_window_without_samples_is_plain(self):
        with open(self.samples, "w") as f:
            f.write("1, 1500, 600\n")
        t = self.table(self.log, self.samples)
        self.assertEqual(t[(SHAPE, "8192", "sustained fp8_experts_from_rows")][0], "5801.8/5810.3")


if __name__ == "__main__":
    unittest.main()
