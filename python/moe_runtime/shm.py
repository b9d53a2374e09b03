"""Rows by reference: a POSIX shared-memory region registered with a rank
(``RegisterRegion``), whose bytes a step names instead of carrying them in the request
(``StepRequest.hidden_region`` / ``output_region``). For engines on the rank's host that keep
gRPC per step; a step ring (RankClient.open_ring) also drops the gRPC call.

The rank reads a step's rows out of the region once, when the step starts, and writes the
output rows into it before it answers.
"""
from __future__ import annotations

import itertools
import math
import mmap
import os
import time
from multiprocessing import resource_tracker
from typing import Any, Optional

import numpy as np

from moe_runtime import errors
from moe_runtime._proto import expert_layer_pb2 as pb
from moe_runtime.client import RankClient, StepRecord, StepResult, build_request

_counter = itertools.count()
_SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory (the rank's shm_open)


class SharedRegion:
    """``nbytes`` of shared memory named ``/moe-py-<pid>-<n>`` (the rank's ``--shm_prefix`` is
    ``/moe-`` by default), registered with ``client``'s rank. Close it when done.

    Arrays from :meth:`array` (and a step's ``StepResult.output``) are views of the mapping and
    keep it mapped: :meth:`close` unregisters and unlinks the region at once, and the memory is
    unmapped when the last view is freed (never under a live view)."""

    def __init__(self, client: RankClient, nbytes: int, *, prefix: str = "moe-py"):
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise errors.InvalidArgument(f"nbytes: must be a positive int, not {nbytes!r}")
        self.client = client
        self.name = f"/{prefix}-{os.getpid()}-{next(_counter)}"
        self.nbytes = nbytes
        self._mm: Optional[mmap.mmap] = None
        path = _SHM_DIR + self.name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._mm = mmap.mmap(fd, nbytes)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        # The resource tracker (multiprocessing's, as SharedMemory uses it) unlinks the object if
        # this process dies without close(), even by SIGKILL; the rank then drops the region when
        # it needs room (server/shared_regions.h).
        resource_tracker.register(self.name, "shared_memory")
        try:
            client.register_region(self.name, nbytes)
        except errors.MoeError:
            self._unmap()
            os.unlink(path)
            resource_tracker.unregister(self.name, "shared_memory")
            raise

    @property
    def closed(self) -> bool:
        return self._mm is None

    def _require_open(self) -> None:
        if self._mm is None:
            raise errors.FailedPrecondition(f"region {self.name}: closed")

    def array(self, offset: int, shape: "tuple[int, ...]", dtype: Any = np.uint16) -> np.ndarray:
        """A numpy view of the region's bytes [offset, offset + size)."""
        self._require_open()
        dt = np.dtype(dtype)
        count = math.prod(int(n) for n in shape)
        if any(int(n) < 0 for n in shape) or offset < 0 or offset + count * dt.itemsize > self.nbytes:
            raise errors.InvalidArgument(f"offset: {offset} + {count} x {dt.itemsize} bytes is outside region "
                                         f"{self.name} of {self.nbytes} bytes")
        # frombuffer holds the mapping (a buffer export), so it outlives close() while the view lives.
        return np.frombuffer(self._mm, dtype=dt, count=count, offset=offset).reshape(shape)

    def step(self, step_id: int, layer: int, *, hidden_offset: int, tokens: int, d: int, topk_ids: Any,
             topk_weights: Any, output_offset: int, decode: bool = False, admitted: Any = None,
             expected_generation: int = 0, timeout: Optional[float] = None) -> StepResult:
        """A step whose BF16 rows ``[tokens, d]`` are at ``hidden_offset`` and whose output rows the
        rank writes at ``output_offset``; ``StepResult.output`` is a view of them."""
        self._require_open()
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
        """Unregisters and unlinks the region; idempotent. Views handed out stay valid."""
        if self._mm is None:
            return
        path = _SHM_DIR + self.name
        try:
            self.client.unregister_region(self.name)
        except errors.MoeError:
            pass
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        resource_tracker.unregister(self.name, "shared_memory")
        self._unmap()

    def _unmap(self) -> None:
        mm, self._mm = self._mm, None
        try:
            mm.close()
        except BufferError:
            pass  # views of it are alive: it is unmapped when the last of them is freed

    def __enter__(self) -> "SharedRegion":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
