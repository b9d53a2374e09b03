"""``asyncio`` clients over ``grpc.aio``: :class:`AsyncRankClient` for one rank and
:class:`AsyncRankGroup` for every rank of the group (the same contract as moe_runtime.group)."""
from __future__ import annotations

import asyncio
import time
from typing import Any, List, Optional, Sequence

import grpc
from grpc import aio

from moe_runtime import errors
from moe_runtime._proto import expert_layer_pb2_grpc as pb_grpc
from moe_runtime.client import (RECONNECT_GRACE_S, StepInput, StepRecord, StepResult, TlsFiles, build_request,
                                channel_options)
from moe_runtime.group import GroupStepError, StepIds
from moe_runtime.tensors import check_step_arrays, from_wire


class AsyncRankClient:
    """One rank's data-plane API on an asyncio loop (create it inside the loop)."""

    def __init__(self, target: str, *, token: Optional[str] = None, timeout: float = 60.0, rank: Optional[int] = None,
                 tls: Optional[TlsFiles] = None):
        self.target, self.rank, self.timeout = target, rank, timeout
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        options = channel_options()
        if tls is not None:
            self._channel = aio.secure_channel(target, tls.credentials(), options=options)
        else:
            self._channel = aio.insecure_channel(target, options=options)
        self._stub = pb_grpc.ExpertLayerServiceStub(self._channel)
        self._health = self._channel.unary_unary(
            "/grpc.health.v1.Health/Check", request_serializer=None, response_deserializer=None)
        self._reconnect = False  # the last step failed UNAVAILABLE: wait for the channel first

    async def step(self, step_id: int, layer: int, hidden: Any, topk_ids: Any, topk_weights: Any, *,
                   decode: bool = False, admitted: Any = None, expected_generation: int = 0,
                   timeout: Optional[float] = None) -> StepResult:
        """As :meth:`moe_runtime.client.RankClient.step`."""
        req, rows = build_request(step_id, layer, hidden, topk_ids, topk_weights, decode=decode, admitted=admitted,
                                  expected_generation=expected_generation)
        await self._await_connection()
        start = time.perf_counter()
        try:
            resp = await self._stub.Execute(req, timeout=timeout or self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            self._reconnect = e.code() == grpc.StatusCode.UNAVAILABLE
            raise errors.from_rpc_error(e, self.rank) from None
        out = from_wire(rows, resp.output.data, resp.output.rows, resp.output.cols)
        return StepResult(out, StepRecord.from_proto(resp.record), (time.perf_counter() - start) * 1e6)

    async def _await_connection(self) -> None:
        """As the sync client: after a step failed UNAVAILABLE, the next one first waits (at most
        RECONNECT_GRACE_S) for the channel to reach the rank again, so that a replacement rank gets
        it instead of its peers waiting out their collective timeout."""
        if not self._reconnect:
            return
        self._reconnect = False
        try:
            await self._health(b"", timeout=RECONNECT_GRACE_S, wait_for_ready=True)
        except grpc.RpcError:
            pass  # any answer means connected; none within the grace: the step finds out

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncRankClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class AsyncRankGroup:
    """Every rank at once on an asyncio loop; all-ABORTED steps retried under a new step id."""

    def __init__(self, targets: Sequence[str], *, token: Optional[str] = None, timeout: float = 60.0,
                 max_retries: int = 8, step_ids: Optional[StepIds] = None, tls: Optional[TlsFiles] = None):
        self.clients = [AsyncRankClient(t, token=token, timeout=timeout, rank=r, tls=tls)
                        for r, t in enumerate(targets)]
        self.max_retries = max_retries
        self.step_ids = step_ids or StepIds()
        self.retried = 0
        self._step_lock = asyncio.Lock()

    async def step(self, layer: int, inputs: Sequence[StepInput], *, decode: bool = False,
                   step_id: Optional[int] = None, timeout: Optional[float] = None) -> List[StepResult]:
        if len(inputs) != len(self.clients):
            raise ValueError(f"inputs: {len(inputs)} entries for {len(self.clients)} ranks")
        for x in inputs:  # before any rank gets the step
            check_step_arrays(x.hidden, x.topk_ids, x.topk_weights, x.admitted)
        async with self._step_lock:  # one step at a time: every rank sees the steps in one order
            return await self._step(layer, inputs, decode, step_id, timeout)

    async def _step(self, layer: int, inputs: Sequence[StepInput], decode: bool, step_id: Optional[int],
                    timeout: Optional[float]) -> List[StepResult]:
        sid = self.step_ids.next() if step_id is None else step_id
        for attempt in range(self.max_retries + 1):
            outcomes = await asyncio.gather(
                *(c.step(sid, layer, x.hidden, x.topk_ids, x.topk_weights, decode=decode, admitted=x.admitted,
                         timeout=timeout) for c, x in zip(self.clients, inputs)),
                return_exceptions=True,
            )
            for o in outcomes:
                if isinstance(o, BaseException) and not isinstance(o, errors.MoeError):
                    raise o
            errs = [o if isinstance(o, errors.MoeError) else None for o in outcomes]
            if all(e is None for e in errs):
                return list(outcomes)  # type: ignore[arg-type]
            if all(isinstance(e, errors.Aborted) for e in errs) and attempt < self.max_retries:
                self.retried += 1
                await asyncio.sleep(min(1.0, 0.01 * (1 << attempt)))
                sid = self.step_ids.next()
                continue
            raise GroupStepError(sid, errs, [None if isinstance(o, BaseException) else o for o in outcomes])
        raise AssertionError("unreachable")

    async def close(self) -> None:
        for c in self.clients:
            await c.close()
