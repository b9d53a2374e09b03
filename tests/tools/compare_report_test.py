#!/usr/bin/python3
"""bench/gpu/compare_report.py: the comparison's figures from rounds of lines (issue 19's table
and plot are decided there): medians over rounds, the project's faster path, the table's rows,
and a refusal when vLLM's lines are missing."""
import io
import json
import os
import sys
import tempfile
import unittest
from contextlib import redirect_stdout

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "gpu"))
import compare_report  # noqa: E402

SHAPE = "E128-k8-d2048-f768"


def ours(path, cells):
    with open(path, "w") as f:
        f.write('{"kind": "ceiling", "impl": "moe-runtime", "dense_bf16_tflops": 760.0}\n')
        for t, p, us in cells:
            f.write(json.dumps({"kind": "cell", "impl": "moe-runtime", "path": p, "shape": SHAPE, "T": t, "us": us,
                                "weight_read_us": 17.8 if t == 1 else 284.1}) + "\n")


def peer(path, cells):
    with open(path, "w") as f:
        f.write('{"kind": "peer", "impl": "vllm-triton"}\n')
        for t, us in cells:
            f.write(json.dumps({"kind": "cell", "impl": "vllm-triton", "shape": SHAPE, "T": t, "us": us,
                                "config_source": "tuned E=128,N=768,device_name=NVIDIA_H200.json"}) + "\n")


class CompareReportTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()

    def path(self, name):
        return os.path.join(self.dir, name)

    def run_report(self, ours_files, peer_files):
        out = io.StringIO()
        md = self.path("table.md")
        with redirect_stdout(out):
            rc = compare_report.main(["--ours"] + ours_files + ["--peer"] + peer_files + ["--md", md])
        lines = [json.loads(x) for x in out.getvalue().splitlines() if x.startswith("{")]
        text = ""
        if rc == 0:
            with open(md) as f:
                text = f.read()
        return rc, {r["T"]: r for r in lines}, text

    def test_medians_over_rounds_and_the_faster_path(self):
        # T = 8192: decode graph 1250 / 1290 (median 1270), prefill 1300 / 1280 (1290): the graph.
        # T = 1: only the decode graph and the padded runner (which the table's ratio may take).
        ours(self.path("o1"), [(8192, "prefill", 1300.0), (8192, "decode-graph", 1250.0), (1, "decode-graph", 29.0),
                               (1, "decode-padded-graph", 20.0)])
        ours(self.path("o2"), [(8192, "prefill", 1280.0), (8192, "decode-graph", 1290.0), (1, "decode-graph", 31.0),
                               (1, "decode-padded-graph", 22.0)])
        ours(self.path("o3"), [(8192, "prefill", 1500.0), (8192, "decode-graph", 1260.0), (1, "decode-graph", 30.0),
                               (1, "decode-padded-graph", 21.0)])
        peer(self.path("p1"), [(8192, 1480.0), (1, 34.0)])
        peer(self.path("p2"), [(8192, 1500.0), (1, 36.0)])
        peer(self.path("p3"), [(8192, 1490.0), (1, 35.0)])
        rc, rows, md = self.run_report([self.path("o1"), self.path("o2"), self.path("o3")],
                                       [self.path("p1"), self.path("p2"), self.path("p3")])
        self.assertEqual(rc, 0)
        big = rows[8192]
        self.assertEqual(big["project_path"], "decode-graph")
        self.assertEqual(big["project_us"], 1260.0)  # the median of 1250, 1290, 1260
        self.assertEqual(big["vllm_us"], 1490.0)
        self.assertEqual(big["project_rounds_us"], [1250.0, 1290.0, 1260.0])
        self.assertEqual(big["vllm_rounds_us"], [1480.0, 1500.0, 1490.0])
        self.assertEqual(big["rounds"], 3)
        self.assertAlmostEqual(big["project_over_vllm"], round(1260.0 / 1490.0, 3))
        self.assertEqual(big["weight_read_us"], 284.1)
        self.assertEqual(rows[1]["project_us"], 30.0)
        self.assertIn("| %s | 8192 | 1260.0 | decode-graph | - | 1490.0 | 0.85 |" % SHAPE, md)
        # The table's ratio takes the padded runner where it is faster (21 / 35), the compare
        # line the project's chosen path (30 / 35).
        self.assertIn("| %s | 1 | 30.0 | decode-graph | 21.0 | 35.0 | 0.60 |" % SHAPE, md)
        self.assertAlmostEqual(rows[1]["project_over_vllm"], round(30.0 / 35.0, 3))

    def test_two_rounds_take_the_mean(self):
        ours(self.path("o1"), [(8192, "prefill", 1300.0)])
        ours(self.path("o2"), [(8192, "prefill", 1310.0)])
        peer(self.path("p1"), [(8192, 1480.0)])
        peer(self.path("p2"), [(8192, 1500.0)])
        rc, rows, _ = self.run_report([self.path("o1"), self.path("o2")], [self.path("p1"), self.path("p2")])
        self.assertEqual(rc, 0)
        self.assertEqual(rows[8192]["project_path"], "prefill")
        self.assertEqual(rows[8192]["project_us"], 1305.0)
        self.assertEqual(rows[8192]["vllm_us"], 1490.0)

    def test_no_vllm_lines_is_refused(self):
        ours(self.path("o1"), [(8192, "prefill", 1300.0)])
        with open(self.path("empty"), "w") as f:
            f.write('{"kind": "peer", "impl": "vllm-triton"}\n')
        rc, rows, _ = self.run_report([self.path("o1")], [self.path("empty")])
        self.assertEqual(rc, 1)
        self.assertEqual(rows, {})


if __name__ == "__main__":
    unittest.main()
