"""Same-machine comparison with the pinned Python EPLB solver (deepseek-ai/EPLB @ d52c72d).

Runs the pinned solver (loaded from a file path: its source is not part of this repository) and
`moectl eplb solve` on the same seeded loads, checks that phy2log / log2phy / logcnt agree
exactly, and times the Python solve at the DeepSeek-V3 shape (58 x 256 -> 288, 8 groups,
4 nodes, 32 GPUs). The C++ time comes from bench/eplb_bench in the same run.

Usage: eplb_compare.py PATH/TO/eplb.py PATH/TO/moectl [--cases N]
"""
import argparse
import importlib.util
import json
import random
import subprocess
import tempfile
import time

import torch

from nearest_rank import median  # noqa: E402  (0x0DA's nearest rank; this script's folder)


def load_solver(path):
    spec = importlib.util.spec_from_file_location("pinned_eplb", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.rebalance_experts


def force_stable_sort():
    """The issue's tie rule: equal weights keep index order in the descending sort. torch.sort
    is not stable by default (multi-row CPU sorts can reorder equal keys), so the reference run
    patches Tensor.sort to stable=True; the unpatched run is reported beside it."""
    original = torch.Tensor.sort

    def stable_sort(self, dim=-1, descending=False, stable=True):
        return original(self, dim=dim, descending=descending, stable=True)

    torch.Tensor.sort = stable_sort
    return original


def random_case(rng, big=False):
    if big:
        return 58, 256, 288, 8, 4, 32
    nodes = rng.choice([1, 2, 4])
    gpus = nodes * rng.choice([1, 2, 4])
    groups = nodes * rng.choice([1, 2, 4]) + (1 if rng.random() < 0.2 else 0)
    experts = groups * rng.choice([2, 4, 8]) * nodes
    replicas = gpus * (-(-experts // gpus) + rng.choice([0, 1, 2]))
    layers = rng.choice([1, 2, 3])
    return layers, experts, replicas, groups, nodes, gpus


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("solver")
    ap.add_argument("moectl")
    ap.add_argument("--cases", type=int, default=40)
    args = ap.parse_args()
    rebalance = load_solver(args.solver)
    results = {}
    for mode in ("torch default sort", "stable sort"):
        original = force_stable_sort() if mode == "stable sort" else None
        rng = random.Random(7)
        exact = same_counts = 0
        mismatches = []
        for case in range(args.cases + 1):
            big = case == args.cases
            layers, experts, replicas, groups, nodes, gpus = random_case(rng, big)
            weight = [[round(rng.uniform(1, 1000), 3) for _ in range(experts)] for _ in range(layers)]
            doc = {"weight": weight, "num_replicas": replicas, "num_groups": groups, "num_nodes": nodes,
                   "num_gpus": gpus}
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump(doc, f)
            ours = json.loads(subprocess.run([args.moectl, "eplb", "solve", "--input", f.name], capture_output=True,
                                             text=True, check=True).stdout)
            p2l, l2p, cnt = rebalance(torch.tensor(weight, dtype=torch.float32), replicas, groups, nodes, gpus)
            ref = {"phy2log": p2l.tolist(), "log2phy": l2p.tolist(), "logcnt": cnt.tolist()}
            if ours == ref:
                exact += 1
            else:
                mismatches.append((layers, experts, replicas, groups, nodes, gpus))
            # Replica ranks of one expert's copies are interchangeable under tied weights; the
            # placement itself is phy2log and logcnt.
            same_counts += ours["phy2log"] == ref["phy2log"] and ours["logcnt"] == ref["logcnt"]
            if big and mode == "torch default sort":
                w = torch.tensor(weight, dtype=torch.float32)
                times = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    rebalance(w, replicas, groups, nodes, gpus)
                    times.append(time.perf_counter() - t0)
                print(json.dumps({"kind": "eplb_python", "shape": "58x256->288 g8 n4 gpus32",
                                  "median_s": round(median(times), 4), "torch": torch.__version__}))
        if original is not None:
            torch.Tensor.sort = original
        print(json.dumps({"kind": "eplb_conformance", "reference": mode, "cases": args.cases + 1,
                          "exact_matches": exact, "phy2log_and_logcnt_matches": same_counts,
                          "mismatches": mismatches[:5]}))


if __name__ == "__main__":
    main()
