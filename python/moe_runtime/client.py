"""A client for one rank's ExpertLayerService (docs/api.md): one call per MoE layer step.

Example::

    from moe_runtime import RankClient
    with RankClient("unix:/run/moe/0.sock") as rank:
        result = rank.step(step_id=1, layer=3, hidden=h, topk_ids=ids, topk_weights=w)
        y = result.output          # [tokens, d], the kind and dtype of ``h``

Every rank of the group must be called for every step, with the same step id and layer
(docs/engine-integration.md); :class:`moe_runtime.group.RankGroup` does that for an engine
that drives all ranks from one process.

Thread-safety: a client may be used from several threads (gRPC channels are thread-safe); a step
ring (``use_ring``) serializes the steps that go through it.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence

import grpc

from moe_runtime import errors
from moe_runtime._proto import expert_layer_pb2 as pb
from moe_runtime._proto import expert_layer_pb2_grpc as pb_grpc
from moe_runtime.tensors import WireRows, admitted_bytes, from_wire, routing_arrays, to_wire

_MAX_MESSAGE = 1 << 30
# How long a step waits for a rank's channel to reconnect after a step failed UNAVAILABLE (the
# longest reconnect backoff the channel is given).
RECONNECT_GRACE_S = 1.0
STAGES = ("validate", "acquire", "plan", "agree", "dispatch", "experts", "return", "combine", "release")


@dataclass
class TlsFiles:
    """Mutual TLS to a rank's TCP port (moe-rankd --tls_*): this engine's certificate chain and
    key, and the CA the rank's certificate must chain to (PEM file paths)."""

    cert: str
    key: str
    ca: str

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str, what: str) -> bytes:
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError as e:
                raise ValueError(f"tls.{what}: {path}: {e.strerror}") from None

        return grpc.ssl_channel_credentials(root_certificates=read(self.ca, "ca"), private_key=read(self.key, "key"),
                                            certificate_chain=read(self.cert, "cert"))


@dataclass
class StepRecord:
    """What the rank reports about a step (``moe.v1.StepRecord``)."""

    placement_generation: int = 0
    layer: int = 0
    path: str = "eager"  # "eager" | "graph_replay"
    fallback_reason: str = ""
    routes_attempted: int = 0
    routes_accepted: int = 0
    routes_dropped: int = 0
    routes_remote: int = 0
    routes_inter_node: int = 0
    server_latency_us: float = 0.0
    compute_latency_us: float = 0.0
    canary: bool = False
    stages_us: Dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_proto(cls, r: "pb.StepRecord") -> "StepRecord":
        s = r.stages
        return cls(
            placement_generation=r.placement_generation,
            layer=r.layer,
            path="graph_replay" if r.path == pb.PATH_GRAPH_REPLAY else "eager",
            fallback_reason=r.fallback_reason,
            routes_attempted=r.routes_attempted,
            routes_accepted=r.routes_accepted,
            routes_dropped=r.routes_dropped,
            routes_remote=r.routes_remote,
            routes_inter_node=r.routes_inter_node,
            server_latency_us=r.server_latency_us,
            compute_latency_us=r.compute_latency_us,
            canary=r.canary,
            stages_us={name: getattr(s, f"{name}_us") for name in STAGES},
        )


@dataclass
class StepResult:
    output: Any  # [tokens, d]: the request's kind (numpy / torch) and dtype
    record: StepRecord
    client_latency_us: float = 0.0
    via: str = "grpc"  # "grpc" | "ring"


@dataclass
class StepInput:
    """One rank's share of a layer step (what :meth:`RankClient.step` takes, as one object)."""

    hidden: Any
    topk_ids: Any
    topk_weights: Any
    admitted: Any = None


def build_request(
    step_id: int,
    layer: int,
    hidden: Any,
    topk_ids: Any,
    topk_weights: Any,
    *,
    decode: bool = False,
    admitted: Any = None,
    expected_generation: int = 0,
) -> "tuple[pb.StepRequest, WireRows]":
    """The ``StepRequest`` of a step and the rows' wire form (ValueError / TypeError naming the field)."""
    if not 0 <= int(step_id) < 1 << 64:
        raise ValueError(f"step_id: {step_id} is not a 64-bit unsigned id")
    rows = to_wire(hidden)
    ids, w, k = routing_arrays(topk_ids, topk_weights, rows.rows)
    req = pb.StepRequest(
        step_id=int(step_id),
        layer=int(layer),
        phase=pb.PHASE_DECODE if decode else pb.PHASE_PREFILL,
        hidden=pb.Tensor(dtype=rows.dtype, rows=rows.rows, cols=rows.cols, data=rows.data),
        k=k,
        expected_generation=int(expected_generation),
    )
    req.topk_ids.extend(ids.reshape(-1).tolist())
    req.topk_weights.extend(w.reshape(-1).tolist())
    adm = admitted_bytes(admitted, ids.shape)
    if adm:
        req.admitted = adm
    return req, rows


def channel_options() -> "list[tuple[str, int]]":
    """The options of a channel to a rank (this client's and the asyncio one's)."""
    return [
        ("grpc.max_receive_message_length", _MAX_MESSAGE),
        ("grpc.max_send_message_length", _MAX_MESSAGE),
        # A rank that restarts (a replacement on the same address) is reached again within a second.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", int(RECONNECT_GRACE_S * 1000)),
    ]


class RankClient:
    """One rank's data-plane API.

    ``target``: ``"unix:/path/to/engine.sock"`` (the rank's ``--engine_socket``; callers are admitted
    by uid) or ``"host:port"`` (then ``token`` is the rank's ``--engine_token_file`` bearer token).
    ``timeout``: the default deadline of a call, seconds. ``rank``: a label for errors.
    """

    def __init__(
        self,
        target: str,
        *,
        token: Optional[str] = None,
        timeout: float = 60.0,
        rank: Optional[int] = None,
        channel: Optional[grpc.Channel] = None,
        tls: Optional["TlsFiles"] = None,
    ):
        self.target = target
        self.rank = rank
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        options = channel_options()
        if channel is not None:
            self._channel = channel
        elif tls is not None:
            self._channel = grpc.secure_channel(target, tls.credentials(), options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._stub = pb_grpc.ExpertLayerServiceStub(self._channel)
        # gRPC health (every rank serves it on its socket), called raw: no stubs needed.
        self._health = self._channel.unary_unary(
            "/grpc.health.v1.Health/Check", request_serializer=None, response_deserializer=None)
        self._reconnect = False  # the last step failed UNAVAILABLE: wait for the channel first
        self._ring = None
        self._ring_lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        with self._ring_lock:  # not while a step is in the ring
            if self._ring is not None:
                self._ring.close()
                self._ring = None
        self._channel.close()

    def __enter__(self) -> "RankClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Blocks until the channel is connected (Unavailable after ``timeout`` seconds)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError as e:
            raise errors.Unavailable(f"{self.target}: not reachable within {timeout}s", rank=self.rank) from e

    # -- steps -------------------------------------------------------------------------------
    def step(
        self,
        step_id: int,
        layer: int,
        hidden: Any,
        topk_ids: Any,
        topk_weights: Any,
        *,
        decode: bool = False,
        admitted: Any = None,
        expected_generation: int = 0,
        timeout: Optional[float] = None,
    ) -> StepResult:
        """Runs one layer step on this rank: ``hidden`` ``[T, d]``, ``topk_ids`` / ``topk_weights``
        ``[T, k]`` from the router, optional ``admitted`` ``[T, k]`` (0: a route the router
        dropped). Returns the gate-weighted expert output ``[T, d]``. Raises a
        :class:`moe_runtime.errors.MoeError` subclass for what the rank refused."""
        with self._ring_lock:
            ring = self._ring
            if ring is not None and ring.fits(hidden, topk_ids):
                self._drain_ring(ring, timeout or self.timeout)
                if not ring.closed:
                    return ring.step(
                        step_id, layer, hidden, topk_ids, topk_weights, decode=decode, admitted=admitted,
                        expected_generation=expected_generation, timeout=timeout or self.timeout, rank=self.rank,
                    )
            if ring is not None and ring.closed:
                # The rank closed the ring (its teardown, or an overrun): steps go through gRPC.
                self._ring = None
                ring.close()
        req, rows = build_request(
            step_id, layer, hidden, topk_ids, topk_weights, decode=decode, admitted=admitted,
            expected_generation=expected_generation,
        )
        self._await_connection()
        start = time.perf_counter()
        try:
            resp = self._stub.Execute(req, timeout=timeout or self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            self._reconnect = e.code() == grpc.StatusCode.UNAVAILABLE
            raise errors.from_rpc_error(e, self.rank) from None
        return self._result(resp, rows, start)

    def _drain_ring(self, ring: Any, timeout: float) -> None:
        """An earlier ring step whose wait timed out (its caller got DeadlineExceeded) is still
        outstanding: its answer is taken and dropped first, so that this step's wait returns this
        step's answer. Its own error, if any, was its caller's to see; still none within
        ``timeout``: DeadlineExceeded, and this step is not sent."""
        while ring.outstanding and not ring.closed:
            try:
                ring.wait(timeout, self.rank)
            except errors.DeadlineExceeded:
                raise errors.DeadlineExceeded(
                    f"step ring: an earlier step whose wait timed out is still unanswered after {timeout}s; "
                    "this step was not sent", rank=self.rank) from None
            except errors.MoeError:
                pass  # that step's own error (a closed ring ends the loop: nothing more is answered)

    def _await_connection(self) -> None:
        """After a step failed UNAVAILABLE (the rank may have restarted: a replacement on the same
        address), the channel is reconnected before the next step goes out, for at most
        RECONNECT_GRACE_S: a step that failed at once here would never reach the rank, and its
        peers, which got the step, would wait out their collective timeout for it. A rank that
        stays unreachable fails the step as before."""
        if not self._reconnect:
            return
        self._reconnect = False
        try:
            self._health(b"", timeout=RECONNECT_GRACE_S, wait_for_ready=True)
        except grpc.RpcError:
            pass  # any answer means connected; none within the grace: the step finds out

    def step_input(self, step_id: int, layer: int, x: StepInput, **kw: Any) -> StepResult:
        return self.step(step_id, layer, x.hidden, x.topk_ids, x.topk_weights, admitted=x.admitted, **kw)

    def _result(self, resp: "pb.StepResponse", rows: WireRows, start: float) -> StepResult:
        out = from_wire(rows, resp.output.data, resp.output.rows, resp.output.cols)
        return StepResult(out, StepRecord.from_proto(resp.record), (time.perf_counter() - start) * 1e6)

    def stream(self, timeout: Optional[float] = None) -> "StepStream":
        """A bidirectional stream of steps (``ExpertLayerService.Step``): one connection's steps
        in order, without a call setup per step."""
        return StepStream(self, timeout or self.timeout)

    # -- shared memory -----------------------------------------------------------------------
    def open_ring(self, *, max_tokens: int, d: int, k: int, slots: int = 2, spin_us: int = 50,
                  device: Any = None, done_events: bool = True) -> "Any":
        """A step ring on this rank (the client must be on the rank's host, on its Unix socket):
        steps written into shared memory, a futex doorbell, no gRPC call per step. ``device`` (a
        torch CUDA device): the rows stay in that GPU's memory, shared with the rank by CUDA IPC;
        ``done_events``: outputs ready in the current stream's order (``StepRing.open``)."""
        from moe_runtime.ring import StepRing

        return StepRing.open(self, max_tokens=max_tokens, d=d, k=k, slots=slots, spin_us=spin_us, device=device,
                             done_events=done_events)

    def use_ring(self, *, max_tokens: int, d: int, k: int, spin_us: int = 50, device: Any = None,
                 done_events: bool = True) -> None:
        """From now on :meth:`step` sends steps that fit through a ring of its own (one at a time);
        larger ones and other dtypes keep going through gRPC. ``device``, ``done_events``: as
        :meth:`open_ring` (then only torch BF16 tensors on that GPU fit the ring)."""
        ring = self.open_ring(max_tokens=max_tokens, d=d, k=k, slots=1, spin_us=spin_us, device=device,
                              done_events=done_events)
        with self._ring_lock:  # not while a step is in the old ring
            old, self._ring = self._ring, ring
            if old is not None:
                old.close()

    @property
    def using_ring(self) -> bool:
        return self._ring is not None

    def register_region(self, name: str, nbytes: int) -> None:
        """Registers a POSIX shared-memory region (``/moe-...``) the rank maps for rows by reference."""
        self._call(self._stub.RegisterRegion, pb.RegisterRegionRequest(name=name, bytes=nbytes))

    def unregister_region(self, name: str) -> None:
        self._call(self._stub.UnregisterRegion, pb.UnregisterRegionRequest(name=name))

    def _call(self, method: Any, request: Any, timeout: Optional[float] = None) -> Any:
        try:
            return method(request, timeout=timeout or self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, self.rank) from None


class StepStream:
    """Steps over one ``Step`` stream, answered in order. Close it (or use ``with``) when done.

    ``timeout`` bounds each step, not the stream: a step not answered within it ends the stream
    (``DeadlineExceeded``; later steps are ``Unavailable``: open another). Steps from several
    threads take turns, each waiting for its own answer."""

    def __init__(self, client: RankClient, timeout: Optional[float]):
        self._client = client
        self._timeout = timeout
        self._requests: List[Any] = []
        self._cond = threading.Condition()
        self._closed = False
        self._turn = threading.Lock()  # one step in flight: responses are matched to requests by order
        self._expired: Optional[int] = None  # the step id whose answer did not come in time
        self._waiting: Optional[int] = None  # the step id awaiting its answer (under _cond)
        # No deadline on the call itself: it would end a stream kept open longer than one step's timeout.
        self._responses: Any = client._stub.Step(self._request_iter(), metadata=client._metadata)

    def _request_iter(self) -> Iterator[Any]:
        while True:
            with self._cond:
                while not self._requests and not self._closed:
                    self._cond.wait()
                if not self._requests and self._closed:
                    return
                req = self._requests.pop(0)
            yield req

    def _expire(self, step_id: int) -> None:
        with self._cond:
            if self._waiting != step_id:
                return  # answered meanwhile
            self._expired = step_id
        self._responses.cancel()

    def step(self, step_id: int, layer: int, hidden: Any, topk_ids: Any, topk_weights: Any, **kw: Any) -> StepResult:
        req, rows = build_request(step_id, layer, hidden, topk_ids, topk_weights, **kw)
        rank = self._client.rank
        with self._turn:
            if self._expired is not None:
                raise errors.Unavailable(f"step stream ended: step {self._expired} was not answered within "
                                         f"{self._timeout} s; open another stream", rank=rank)
            start = time.perf_counter()
            with self._cond:
                if self._closed:
                    raise errors.FailedPrecondition("step stream: closed", rank=rank)
                self._requests.append(req)
                self._waiting = step_id
                self._cond.notify()
            timer = None
            if self._timeout:
                timer = threading.Timer(self._timeout, self._expire, args=(step_id,))
                timer.daemon = True
                timer.start()
            try:
                resp = next(self._responses)
                with self._cond:
                    self._waiting = None
                    expired = self._expired == step_id
                if expired:  # the timer fired as the answer came: the stream is cancelled all the same
                    raise errors.DeadlineExceeded(f"step {step_id}: answered after {self._timeout} s; the step "
                                                  f"stream is ended", rank=rank)
            except grpc.RpcError as e:
                if self._expired == step_id:
                    raise errors.DeadlineExceeded(f"step {step_id}: not answered within {self._timeout} s; the step "
                                                  f"stream is ended", rank=rank) from None
                raise errors.from_rpc_error(e, rank) from None
            except StopIteration:
                raise errors.Unavailable("step stream ended", rank=rank) from None
            finally:
                if timer is not None:
                    timer.cancel()
                with self._cond:
                    self._waiting = None
            return self._client._result(resp, rows, start)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def __enter__(self) -> "StepStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def connect_all(targets: Sequence[str], **kw: Any) -> List[RankClient]:
    """One client per rank, in rank order."""
    return [RankClient(t, rank=r, **kw) for r, t in enumerate(targets)]
