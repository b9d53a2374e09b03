#!/usr/bin/python3
"""bench/gpu/vllm_compare.py's search space for shapes vLLM has no tuned file for (sibling_configs):
from every tuned file of the GPU and dtype, the entry at the M nearest the token count, distinct;
files of other GPUs or dtypes, and metadata keys, never count. The module's GPU imports (torch,
triton) are stand-ins: only the file handling runs here."""
import json
import os
import sys
import tempfile
import types
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench", "gpu"))


def stand_ins():
    torch = types.ModuleType("torch")
    torch.Tensor = object
    triton = types.ModuleType("triton")
    triton.jit = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)
    triton.__version__ = "stand-in"
    language = types.ModuleType("triton.language")
    language.constexpr = object
    triton.language = language
    dense = types.ModuleType("dense_sustained")
    dense.block_scaled = lambda *a, **k: None
    reference = types.ModuleType("torch_reference")
    reference.median_us = lambda fn, reps: 0.0
    sys.modules.update({"torch": torch, "triton": triton, "triton.language": language, "dense_sustained": dense,
                        "torch_reference": reference})


stand_ins()
import vllm_compare  # noqa: E402


def cfg(bm, bn, bk=64, gm=1, warps=8, stages=3):
    return {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "GROUP_SIZE_M": gm, "num_warps": warps,
            "num_stages": stages}


class SiblingConfigsTest(unittest.TestCase):
    def setUp(self):
        self.root = tempfile.mkdtemp()
        self.folder = os.path.join(self.root, vllm_compare.FUSED, "configs")
        os.makedirs(self.folder)

    def write(self, name, entries):
        with open(os.path.join(self.folder, name), "w") as f:
            json.dump(entries, f)

    def test_nearest_entry_of_each_file_of_the_gpu_and_dtype(self):
        self.write("E=128,N=768,device_name=NVIDIA_H200.json",
                   {"triton_version": "3.4", "1024": cfg(128, 128), "4096": cfg(128, 256, gm=16)})
        self.write("E=8,N=14336,device_name=NVIDIA_H200.json", {"2048": cfg(64, 128), "8192": cfg(128, 256, gm=16)})
        # The same config as another file's: listed once.
        self.write("E=16,N=1024,device_name=NVIDIA_H200.json", {"3000": cfg(128, 128)})
        # Another GPU, another dtype: not this search's.
        self.write("E=32,N=2048,device_name=NVIDIA_H100_80GB_HBM3.json", {"4096": cfg(16, 64)})
        self.write("E=32,N=2048,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json",
                   {"4096": cfg(64, 64)})
        # At M = 4096: E=128's 4096, E=8's 2048 (nearer than 8192), E=16's 3000.
        got = vllm_compare.sibling_configs(self.root, "NVIDIA H200", 4096)
        self.assertEqual(sorted(json.dumps(c, sort_keys=True) for c in got),
                         sorted(json.dumps(c, sort_keys=True) for c in (cfg(128, 256, gm=16), cfg(64, 128),
                                                                        cfg(128, 128))))
        # At M = 1024: E=128's 1024, E=8's 2048, E=16's 3000 (the same as E=128's 1024).
        self.assertEqual(sorted(json.dumps(c, sort_keys=True) for c in
                                vllm_compare.sibling_configs(self.root, "NVIDIA H200", 1024)),
                         sorted(json.dumps(c, sort_keys=True) for c in (cfg(128, 128), cfg(64, 128))))
        # The FP8 files are their own space.
        self.assertEqual(vllm_compare.sibling_configs(self.root, "NVIDIA H200", 4096,
                                                      ",dtype=fp8_w8a8,block_shape=[128,128]"), [cfg(64, 64)])

    def test_ties_take_the_smaller_m(self):
        # 3000 is as near 2000 as 4000 is: the smaller M's entry, whatever the file's order.
        self.write("E=64,N=512,device_name=NVIDIA_H200.json", {"4000": cfg(128, 256), "2000": cfg(64, 128)})
        self.assertEqual(vllm_compare.sibling_configs(self.root, "NVIDIA H200", 3000), [cfg(64, 128)])

    def test_no_files_of_the_gpu(self):
        self.write("E=64,N=512,device_name=NVIDIA_B200.json", {"4096": cfg(128, 256)})
        self.assertEqual(vllm_compare.sibling_configs(self.root, "NVIDIA H200", 4096), [])


if __name__ == "__main__":
    unittest.main()
