"""Rows by reference: a POSIX shared-memory region registered with a rank
(``RegisterRegion``), whose bytes a step names instead of carrying them in the request
(``StepRequest.hidden_region`` / ``output_region``). For engines on the rank's host that keep
gRPC per step; a step ring (RankClient.open_ring) also drops the gRPC call.

The rank reads a step's rows out of the region once, when the step starts, and writes the
output rows into it before it answers.
"""
from __future__ import annotations

import itertools
import os
import time
from multiprocessing import shared_memory
from typing import Any, Optional

import numpy as np

from moe_runtime import errors
from moe_runtime._proto import expert_layer_pb2 as pb
from moe_runtime.client import RankClient, StepRecord, StepResult, build_request

_counter = itertools.count()


class SharedRegion:
    """``nbytes`` of shared memory named ``/moe-py-<pid>-<n>`` (the rank's ``--shm_prefix`` is
    ``/moe-`` by default), registered with ``client``'s rank. Close it when done."""

    def __init__(self, client: RankClient, nbytes: int, *, prefix: str = "moe-py"):
        self.client = client
        self._shm = shared_memory.SharedMemory(name=f"{prefix}-{os.getpid()}-{next(_counter)}", create=True, size=nbytes)
        self.name = "/" + self._shm.name
        self.nbytes = nbytes
        try:
            client.register_region(self.name, nbytes)
        except errors.MoeError:
            self._shm.close()
            self._shm.unlink()
            raise

    def array(self, offset: int, shape: "tuple[int, ...]", dtype: Any = np.uint16) -> np.ndarray:
        """A numpy view of the region's bytes [offset, offset + size)."""
        return np.ndarray(shape, dtype=dtype, buffer=self._shm.buf, offset=offset)

    def step(self, step_id: int, layer: int, *, hidden_offset: int, tokens: int, d: int, topk_ids: Any,
             topk_weights: Any, output_offset: int, decode: bool = False, admitted: Any = None,
             expected_generation: int = 0, timeout: Optional[float] = None) -> StepResult:
        """A step whose BF16 rows ``[tokens, d]`` are at ``hidden_offset`` and whose output rows the
        rank writes at ``output_offset``; ``StepResult.output`` is a view of them."""
        placeholder = np.zeros((tokens, d), dtype=np.uint16)
        req, _ = build_request(step_id, layer, placeholder, topk_ids, topk_weights, decode=decode, admitted=admitted,
                               expected_generation=expected_generation)
        nbytes = tokens * d * 2
        req.hidden.data = b""
        req.hidden_region.CopyFrom(pb.SharedRegionRef(region=self.name, offset=hidden_offset, bytes=nbytes))
        req.output_region.CopyFrom(pb.SharedRegionRef(region=self.name, offset=output_offset, bytes=nbytes))
        start = time.perf_counter()
        resp = self.client._call(self.client._stub.Execute, req, timeout)
        return StepResult(self.array(output_offset, (tokens, d)), StepRecord.from_proto(resp.record),
                          (time.perf_counter() - start) * 1e6)

    def close(self) -> None:
        try:
            self.client.unregister_region(self.name)
        except errors.MoeError:
            pass
        self._shm.close()
        self._shm.unlink()

    def __enter__(self) -> "SharedRegion":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
