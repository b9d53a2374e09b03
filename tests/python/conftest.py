"""A local CPU cluster of two moe-rankd processes (CPU kernels over UCX) for the Python client's
tests, started once per session from the binaries the Bazel test hands over (RANKD, MOECTL)."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from moe_runtime.tensors import bf16_to_float32

WORLD = 2
EXPERTS, D, D_FF, K = 8, 64, 32, 2


class Cluster:
    def __init__(self, work: Path, sockets: Path):
        self.work, self.sockets = work, sockets
        self.procs = []
        self.targets = [f"unix:{sockets}/{r}.sock" for r in range(WORLD)]
        self.checkpoint = work / "ckpt"
        self.weights = {}

    def start(self) -> None:
        moectl, rankd = os.environ["MOECTL"], os.environ["RANKD"]
        subprocess.run([moectl, "checkpoint", "synth", "--experts", str(EXPERTS), "--d", str(D), "--d_ff", str(D_FF),
                        "--seed", "3", "--layers", "2", "--version", "py-1", "--out", str(self.checkpoint)],
                       check=True, stdout=subprocess.DEVNULL)
        (self.work / "rv").mkdir()
        for r in range(WORLD):
            log = open(self.work / f"rank{r}.log", "w")
            self.procs.append(subprocess.Popen(
                [rankd, "--rank", str(r), "--world", str(WORLD), "--rendezvous_dir", str(self.work / "rv"),
                 "--checkpoint", str(self.checkpoint), "--engine_socket", f"{self.sockets}/{r}.sock",
                 "--port_file", str(self.work / f"{r}.port"), "--metrics_port_file", str(self.work / f"{r}.metrics"),
                 "--timeout_ms", "3000"], stdout=log, stderr=subprocess.STDOUT))
        deadline = time.time() + 60
        for r in range(WORLD):
            while not (self.work / f"{r}.port").exists() or not (self.work / f"{r}.port").read_text():
                if time.time() > deadline or self.procs[r].poll() is not None:
                    raise RuntimeError(f"rank {r} did not start:\n" + (self.work / f"rank{r}.log").read_text())
                time.sleep(0.05)
        self._load_weights()

    def _load_weights(self) -> None:
        raw = (self.checkpoint / "model.safetensors").read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8 : 8 + n])
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            a, b = meta["data_offsets"]
            assert meta["dtype"] == "BF16"
            bits = np.frombuffer(raw[8 + n + a : 8 + n + b], dtype=np.uint16).reshape(meta["shape"])
            self.weights[name] = bf16_to_float32(bits)

    def reference(self, layer: int, hidden: np.ndarray, ids: np.ndarray, w: np.ndarray, admitted=None) -> np.ndarray:
        """y_t = sum_j g_tj down(silu(gate h_t) * up h_t), FP32."""
        y = np.zeros((hidden.shape[0], D), dtype=np.float32)
        for t in range(hidden.shape[0]):
            for j in range(ids.shape[1]):
                if admitted is not None and not admitted[t, j]:
                    continue
                p = f"model.layers.{layer}.mlp.experts.{int(ids[t, j])}."
                g = self.weights[p + "gate_proj.weight"] @ hidden[t]
                u = self.weights[p + "up_proj.weight"] @ hidden[t]
                y[t] += w[t, j] * (self.weights[p + "down_proj.weight"] @ (g / (1 + np.exp(-g)) * u))
        return y

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture(scope="session")
def cluster():
    base = os.environ.get("TEST_TMPDIR", tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="pyclient-", dir=base))
    sockets = Path(tempfile.mkdtemp(prefix="moe-py-", dir="/tmp"))  # socket paths stay short
    c = Cluster(work, sockets)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def random_step(rng: np.random.Generator, tokens: int, *, hot: bool = False):
    """BF16 rows (uint16 bits), k distinct experts per token, normalized gates."""
    from moe_runtime.tensors import float32_to_bf16

    hidden = float32_to_bf16(rng.standard_normal((tokens, D)).astype(np.float32))
    ids = np.zeros((tokens, K), dtype=np.int32)
    for t in range(tokens):
        ids[t] = rng.choice(EXPERTS, size=K, replace=False)
    if hot and tokens:
        ids[:, 0] = 0
        ids[:, 1] = np.where(ids[:, 1] == 0, 1, ids[:, 1])
    w = rng.uniform(0.05, 1.0, (tokens, K)).astype(np.float32)
    w /= np.maximum(w.sum(axis=1, keepdims=True), 1e-6)
    return hidden, ids, w


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    den = float(np.linalg.norm(want))
    return float(np.linalg.norm(got - want)) / (den if den > 0 else 1.0)
