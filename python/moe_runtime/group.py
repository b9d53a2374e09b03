"""Every rank of the group, one step at a time: for an engine that drives all ranks from one
process (a test harness, a single-process multi-GPU engine, the transformers adapter).

Each layer step is issued on every rank concurrently with the same step id and layer; each rank
gets its own rows (a rank may have none). A step that every rank answered ``ABORTED`` computed
nothing anywhere (the ranks aborted before payload moved: e.g. the ranks were switching
placement generation), so it is re-issued under a new step id, backing off 10 ms, 20 ms, ... up
to 1 s, at most ``max_retries`` times (docs/engine-integration.md).
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any, List, Optional, Sequence

from moe_runtime import errors
from moe_runtime.client import RankClient, StepInput, StepResult, TlsFiles
from moe_runtime.tensors import check_step_arrays


class StepIds:
    """Step ids unique in this process: a 64-bit start (the time, microseconds) plus a counter.
    Thread-safe."""

    def __init__(self, start: Optional[int] = None):
        self._next = start if start is not None else (time.time_ns() // 1000) << 8
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            v = self._next
            self._next = (self._next + 1) % (1 << 64)
            return v


class GroupStepError(errors.MoeError):
    """At least one rank failed a step that was not retried: ``errors`` holds each rank's error
    (None where the rank succeeded), ``results`` each rank's result (None where it failed)."""

    def __init__(self, step_id: int, per_rank: List[Optional[errors.MoeError]], results: List[Optional[StepResult]]):
        first = next(e for e in per_rank if e is not None)
        super().__init__(f"step {step_id}: " + "; ".join(str(e) for e in per_rank if e is not None))
        self.code = first.code
        self.errors = per_rank
        self.results = results
        self.step_id = step_id


class RankGroup:
    """Clients of ranks 0..P-1. ``targets``: each rank's address (``unix:/...`` or ``host:port``)."""

    def __init__(self, targets: Sequence[str], *, token: Optional[str] = None, timeout: float = 60.0,
                 max_retries: int = 8, step_ids: Optional[StepIds] = None, tls: Optional[TlsFiles] = None):
        self.clients = [RankClient(t, token=token, timeout=timeout, rank=r, tls=tls) for r, t in enumerate(targets)]
        self.max_retries = max_retries
        self.step_ids = step_ids or StepIds()
        self.retried = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(self.clients))
        self._step_lock = threading.Lock()

    @property
    def size(self) -> int:
        return len(self.clients)

    def use_rings(self, *, max_tokens: int, d: int, k: int, spin_us: int = 50,
                  devices: Optional[Sequence[Any]] = None) -> None:
        """Every rank's client sends the steps that fit through a step ring (ranks on this host).
        ``devices[r]``: rank r's ring keeps its rows on that GPU (its rank's), shared by CUDA IPC;
        then steps whose rows are torch BF16 CUDA tensors (on any GPU) never cross the host."""
        if devices is not None and len(devices) != self.size:
            raise ValueError(f"devices: {len(devices)} entries for {self.size} ranks")
        for r, c in enumerate(self.clients):
            c.use_ring(max_tokens=max_tokens, d=d, k=k, spin_us=spin_us,
                       device=None if devices is None else devices[r])

    @property
    def device_rings(self) -> bool:
        """Whether every rank's client has a ring with device rows (``use_rings(devices=...)``)."""
        return all(c._ring is not None and c._ring.device_rows for c in self.clients)

    def step(self, layer: int, inputs: Sequence[StepInput], *, decode: bool = False,
             step_id: Optional[int] = None, timeout: Optional[float] = None) -> List[StepResult]:
        """One layer step: ``inputs[r]`` on rank r. Returns each rank's result, in rank order;
        raises GroupStepError when a rank failed (after the retries of an all-ABORTED step).
        Every rank's share is checked (shapes, dtypes) before any rank gets the step, and steps
        from several threads take turns (each with its retries), so every rank sees them in one
        order."""
        if len(inputs) != self.size:
            raise ValueError(f"inputs: {len(inputs)} entries for {self.size} ranks")
        for x in inputs:  # before any rank gets the step
            check_step_arrays(x.hidden, x.topk_ids, x.topk_weights, x.admitted)
        with self._step_lock:  # one step at a time: every rank sees the group's steps in one order
            return self._step(layer, inputs, decode, step_id, timeout)

    def _step(self, layer: int, inputs: Sequence[StepInput], decode: bool, step_id: Optional[int],
              timeout: Optional[float]) -> List[StepResult]:
        sid = self.step_ids.next() if step_id is None else step_id
        for attempt in range(self.max_retries + 1):
            futures = [
                self._pool.submit(c.step_input, sid, layer, x, decode=decode, timeout=timeout)
                for c, x in zip(self.clients, inputs)
            ]
            results: List[Optional[StepResult]] = []
            errs: List[Optional[errors.MoeError]] = []
            for f in futures:
                try:
                    results.append(f.result())
                    errs.append(None)
                except errors.MoeError as e:
                    results.append(None)
                    errs.append(e)
            if all(e is None for e in errs):
                return results  # type: ignore[return-value]
            if all(isinstance(e, errors.Aborted) for e in errs) and attempt < self.max_retries:
                self.retried += 1
                time.sleep(min(1.0, 0.01 * (1 << attempt)))
                sid = self.step_ids.next()
                continue
            raise GroupStepError(sid, errs, results)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for c in self.clients:
            c.close()

    def __enter__(self) -> "RankGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
