"""Step rings from Python (docs/api.md "Step rings"; layout: server/step_ring_layout.h).

A co-located engine opens a ring through gRPC, claims the rank's sealed memfd on the ring socket
(``SCM_RIGHTS``; the ticket from the gRPC answer and the same uid), maps it, and from then on a
step is: rows and routing written into the slot, a descriptor, a counter bump and a futex wake
when the rank sleeps; the answer is read from the same slot. No gRPC call per step.

The counters are plain aligned 32-bit stores and loads, which x86-64 keeps in program order
(TSO); the ring is refused on other machines.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import platform
import socket
import struct
import time
from typing import Any, Optional

import numpy as np

from moe_runtime import cuda_ipc, errors
from moe_runtime._proto import expert_layer_pb2 as pb
from moe_runtime.client import STAGES, RankClient, StepRecord, StepResult
from moe_runtime.tensors import WireRows, admitted_bytes, from_host_rows, host_rows, routing_arrays

MAGIC = 0x31474E4952454F4D  # "MOERING1"
LAYOUT_VERSION = 1
PAGE = 4096
ALIGN = 256
FLAG_ADMITTED = 1
FLAG_DEVICE_ROUTING = 2  # descriptor.flags: topk_ids / topk_weights in the device slot
HEADER_DEVICE_ROWS = 1  # header.flags (offset 88)
# Header: counters each on their own 64-byte line.
OFF_SUBMITTED, OFF_RANK_SLEEPING, OFF_COMPLETED, OFF_ENGINE_SLEEPING, OFF_CLOSED = 128, 192, 256, 320, 384
RESULT_OFFSET = 64
_HEADER = struct.Struct("<QIIQqqqQQQQQ")  # magic .. admitted_offset
_DESCRIPTOR = struct.Struct("<IIiiQqqq")  # seq, flags, phase, k, step_id, layer, tokens, expected_generation
_RESULT_HEAD = struct.Struct("<Ii")  # seq, code; message[512] follows
_PATH_GRAPH_REPLAY = pb.PATH_GRAPH_REPLAY
_RESULT_REST = struct.Struct("<qqii64s5qdd9d")  # at +520

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


def _align(v: int, a: int) -> int:
    return (v + a - 1) // a * a


def geometry(max_tokens: int, d: int, k: int, slots: int, device_rows: bool = False) -> dict:
    """Slot offsets and sizes, as ring::ComputeGeometry computes them (``device_rows``: the rows
    live in the engine's GPU memory, not in the slots)."""
    rows, routes = (0 if device_rows else max_tokens * d * 2), max_tokens * k
    at = PAGE
    g = {"hidden": at}
    at = _align(at + rows, ALIGN)
    g["output"] = at
    at = _align(at + rows, ALIGN)
    g["ids"] = at
    at = _align(at + routes * 4, ALIGN)
    g["weights"] = at
    at = _align(at + routes * 4, ALIGN)
    g["admitted"] = at
    at = _align(at + routes, PAGE)
    g["slot_bytes"] = at
    g["total_bytes"] = at * slots + PAGE
    return g


def device_geometry(max_tokens: int, d: int, k: int, slots: int) -> dict:
    """A device-rows ring's device slot, as ring::ComputeDeviceGeometry computes it: byte offsets
    of hidden, output, ids and weights inside a slot, the slot's size and all slots' size."""
    rows, routes = max_tokens * d * 2, max_tokens * k
    g = {"hidden": 0, "output": _align(rows, ALIGN)}
    g["ids"] = _align(g["output"] + rows, ALIGN)
    g["weights"] = _align(g["ids"] + routes * 4, ALIGN)
    g["slot_bytes"] = _align(g["weights"] + routes * 4, ALIGN)
    g["total_bytes"] = g["slot_bytes"] * slots
    return g


# Device rows of rings the rank did not confirm closing (StepRing.close).
_UNRELEASED_DEVICE_ROWS: list = []


class _Futex:
    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.syscall.restype = ctypes.c_long

    def wake(self, addr: int) -> None:
        self._libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, 1, None, None, 0)

    def wait(self, addr: int, seen: int, timeout_s: float) -> None:
        class Timespec(ctypes.Structure):
            _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

        ts = Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
        self._libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_uint32(seen), ctypes.byref(ts), None, 0)


class StepRing:
    """One engine's ring on one rank. Steps are submitted and waited for in order; ``slots``
    steps may be outstanding. Not thread-safe: one thread drives a ring."""

    def __init__(self) -> None:
        raise TypeError("use RankClient.open_ring")

    @classmethod
    def open(cls, client: RankClient, *, max_tokens: int, d: int, k: int, slots: int = 2, spin_us: int = 50,
             device: Any = None, done_events: bool = True) -> "StepRing":
        """``device`` (a torch device, e.g. ``"cuda:0"``): the rows stay on that GPU. The ring
        allocates its device slots there (rows, output and routing of every slot,
        :func:`device_geometry`) and hands the rank a CUDA IPC handle for them and for an
        interprocess event it records at each submit; steps then take and return torch CUDA
        tensors, routing given as CUDA tensors stays on the GPU too, and the engine never waits
        for its GPU to submit. The rank must run CUDA kernels on the same host.

        ``done_events`` (device rows): the rank answers a step once its GPU work is enqueued, and
        :meth:`wait` makes the device's current stream wait on the rank's event for that slot,
        so the output is ready in stream order, as a torch operation's would be (the engine
        never waits for the rank's GPU work on the host). A rank without them answers once the
        output is written. False: always the latter."""
        if platform.machine() not in ("x86_64", "AMD64"):
            raise errors.FailedPrecondition(f"step rings from Python need x86-64 (this is {platform.machine()})")
        req = pb.OpenStepRingRequest(slots=slots, max_tokens=max_tokens, d=d, k=k)
        rows_buf = None
        if device is not None:
            import torch

            dg = device_geometry(max_tokens, d, k, slots)
            rows_buf = torch.empty(dg["total_bytes"], dtype=torch.uint8, device=device)
            with torch.cuda.device(rows_buf.device):
                exp = cuda_ipc.export(rows_buf.data_ptr())
                ready = torch.cuda.Event(interprocess=True)
                ready.record()  # the handle of an event never recorded would name no device
            req.device_rows.ipc_handle = exp.handle
            req.device_rows.offset = exp.offset
            req.device_rows.ready_event = bytes(ready.ipc_handle())
            req.device_rows.done_events = bool(done_events)
        resp = client._call(client._stub.OpenStepRing, req, timeout=10)
        done = []
        if resp.done_events:
            import torch

            if rows_buf is None or not done_events or len(resp.done_events) != slots:
                raise errors.FailedPrecondition(
                    f"OpenStepRing: the rank sent {len(resp.done_events)} done events for {slots} slots")
            done = [torch.cuda.Event.from_ipc_handle(rows_buf.device, bytes(h)) for h in resp.done_events]
        g = geometry(max_tokens, d, k, slots, device_rows=rows_buf is not None)
        if resp.device_rows != (rows_buf is not None):
            raise errors.FailedPrecondition("OpenStepRing: the rank did not take the ring's device rows")
        if resp.layout_version != LAYOUT_VERSION or resp.bytes != g["total_bytes"]:
            raise errors.FailedPrecondition(
                f"OpenStepRing: the rank's ring layout {resp.layout_version} of {resp.bytes} bytes is not this "
                f"client's {LAYOUT_VERSION} of {g['total_bytes']}"
            )
        self = object.__new__(cls)
        self._client = client
        self.id = resp.ring_id
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(resp.socket_path)
            self._conn.sendall(struct.pack("<Q", resp.ring_id) + resp.ticket)
            msg, fds, _, _ = socket.recv_fds(self._conn, 1, 1)
        except OSError as e:
            self._conn.close()
            raise errors.Unavailable(f"ring socket {resp.socket_path}: {e}", rank=client.rank) from None
        if msg != b"K" or not fds:
            for fd in fds:
                os.close(fd)
            self._conn.close()
            raise errors.PermissionDenied("ring socket: the rank refused the claim (ticket or uid)", rank=client.rank)
        memfd = fds[0]
        try:
            if os.fstat(memfd).st_size != g["total_bytes"]:
                raise errors.FailedPrecondition("step ring: the memfd's size is not the ring's")
            self._mm = mmap.mmap(memfd, g["total_bytes"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except errors.MoeError:
            self._conn.close()  # hanging up releases the claimed ring on the rank (one of --max_step_rings)
            raise
        except OSError as e:
            self._conn.close()
            raise errors.Unavailable(f"step ring: cannot map the ring's memory: {e}", rank=client.rank) from None
        finally:
            os.close(memfd)
        head = _HEADER.unpack_from(self._mm, 0)
        (flags,) = struct.unpack_from("<I", self._mm, 88)
        self._rows = rows_buf  # the device slots (uint8) on the GPU, or None
        self._done = done  # the rank's event per slot (done_events), or []
        if rows_buf is not None:
            import torch

            self._device_index = rows_buf.device.index
            # The device's current stream as a raw pointer: one call, no stream object per step.
            self._raw_stream = torch._C._cuda_getCurrentRawStream
        self._dev_hidden, self._dev_output, self._dev_ids, self._dev_weights = [], [], [], []
        self._out_cache = [(-1, None)] * slots  # per slot: (rows, its output view)
        if rows_buf is not None:
            import torch

            self._ready = ready
            for s in range(slots):
                at = s * dg["slot_bytes"]
                part = lambda name, n, dt: rows_buf[at + dg[name]: at + dg[name] + n].view(dt)  # noqa: E731
                self._dev_hidden.append(part("hidden", max_tokens * d * 2, torch.bfloat16).view(max_tokens, d))
                self._dev_output.append(part("output", max_tokens * d * 2, torch.bfloat16).view(max_tokens, d))
                self._dev_ids.append(part("ids", max_tokens * k * 4, torch.int32))
                self._dev_weights.append(part("weights", max_tokens * k * 4, torch.float32))
        if head[0] != MAGIC or head[3] != g["slot_bytes"] or head[7] != g["hidden"] or \
                bool(flags & HEADER_DEVICE_ROWS) != (rows_buf is not None):
            self.close()
            raise errors.FailedPrecondition("step ring: the header does not match the layout this client expects")
        self.slots, self.max_tokens, self.d, self.k = slots, max_tokens, d, k
        self.spin_s = spin_us * 1e-6
        self._g = g
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        self._submitted = ctypes.c_uint32.from_buffer(self._mm, OFF_SUBMITTED)
        self._rank_sleeping = ctypes.c_uint32.from_buffer(self._mm, OFF_RANK_SLEEPING)
        self._completed = ctypes.c_uint32.from_buffer(self._mm, OFF_COMPLETED)
        self._engine_sleeping = ctypes.c_uint32.from_buffer(self._mm, OFF_ENGINE_SLEEPING)
        self._closed_word = ctypes.c_uint32.from_buffer(self._mm, OFF_CLOSED)
        self._futex = _Futex()
        # Per-slot flat views of the payload, made once (np.frombuffer per step costs microseconds).
        rows_n, routes_n = (0 if rows_buf is not None else max_tokens * d), max_tokens * k
        view = lambda s, part, dt, n: np.frombuffer(self._mm, dtype=dt, count=n,  # noqa: E731
                                                    offset=PAGE + s * g["slot_bytes"] + g[part])
        self._hidden_views = [view(s, "hidden", np.uint16, rows_n) for s in range(slots)]
        self._output_views = [view(s, "output", np.uint16, rows_n) for s in range(slots)]
        self._ids_views = [view(s, "ids", np.int32, routes_n) for s in range(slots)]
        self._weights_views = [view(s, "weights", np.float32, routes_n) for s in range(slots)]
        self._admitted_views = [view(s, "admitted", np.uint8, routes_n) for s in range(slots)]
        self._n_submitted = self._n_waited = 0
        self._pending: list = []  # (rows meta, submit time) per outstanding step
        return self

    # -- the slot of step n ------------------------------------------------------------------
    def _slot(self, seq: int) -> int:
        return PAGE + (seq % self.slots) * self._g["slot_bytes"]


    @property
    def device(self) -> Any:
        """The GPU of a ring with device rows (None otherwise)."""
        return None if self._rows is None else self._rows.device

    @property
    def device_rows(self) -> bool:
        """Whether this ring's rows stay in GPU memory (``open(device=...)``)."""
        return self._rows is not None

    @property
    def outstanding(self) -> int:
        """Steps submitted whose answer no wait() has taken yet (a wait that raised
        DeadlineExceeded leaves its step outstanding: its answer is the next wait's)."""
        return self._n_submitted - self._n_waited

    @property
    def closed(self) -> bool:
        """Whether the rank closed the ring (its teardown, or a step overrunning the slots): no
        outstanding step will be answered, and no step can be submitted."""
        return getattr(self, "_closed_word", None) is None or bool(self._closed_word.value)

    def fits(self, hidden: Any, topk_ids: Any) -> bool:
        """Whether a step can go through this ring: BF16 rows of this d, at most max_tokens rows
        and k routes (other dtypes would need a lossy cast; they go through gRPC). A ring with
        device rows takes torch BF16 CUDA tensors only (on any GPU: rows on another one are
        copied GPU to GPU)."""
        try:
            shape, k = tuple(hidden.shape), topk_ids.shape[1]
        except Exception:
            return False
        dtype = str(getattr(hidden, "dtype", ""))
        if self._rows is not None and not getattr(hidden, "is_cuda", False):
            return False
        bf16 = dtype in ("uint16", "torch.bfloat16")
        return bf16 and len(shape) == 2 and shape[0] <= self.max_tokens and shape[1] == self.d and 1 <= k <= self.k

    def next_slot(self, tokens: int, k: Optional[int] = None) -> "dict[str, np.ndarray]":
        """Views of the next step's slot, for an engine that builds its rows and routing in place
        (no copy at submit): ``hidden`` ``[tokens, d]`` uint16 (BF16 bits; a torch BF16 CUDA
        tensor on a ring with device rows), ``topk_ids``
        ``[tokens, k]`` int32, ``topk_weights`` ``[tokens, k]`` float32, ``admitted`` ``[tokens, k]``
        uint8. Fill them, then :meth:`submit_in_place`. The views stay valid until that slot is
        submitted again."""
        k = self.k if k is None else k
        if not 0 <= tokens <= self.max_tokens or not 1 <= k <= self.k:
            raise ValueError(f"tokens, k: {tokens} x {k} do not fit the ring's {self.max_tokens} x {self.k} slots")
        if self._n_submitted - self._n_waited >= self.slots:
            raise errors.FailedPrecondition(f"step ring: {self.slots} steps outstanding; wait for one first")
        s = (self._n_submitted & 0xFFFFFFFF) % self.slots
        if self._rows is not None:
            hidden = self._dev_hidden[s][:tokens]
        else:
            hidden = self._hidden_views[s][: tokens * self.d].reshape(tokens, self.d)
        views = {
            "hidden": hidden,
            "topk_ids": self._ids_views[s][: tokens * k].reshape(tokens, k),
            "topk_weights": self._weights_views[s][: tokens * k].reshape(tokens, k),
            "admitted": self._admitted_views[s][: tokens * k].reshape(tokens, k),
        }
        if self._rows is not None:
            views["device_topk_ids"] = self._dev_ids[s][: tokens * k].view(tokens, k)
            views["device_topk_weights"] = self._dev_weights[s][: tokens * k].view(tokens, k)
        return views

    def submit_in_place(self, step_id: int, layer: int, tokens: int, k: Optional[int] = None, *,
                        decode: bool = False, admitted: bool = False, expected_generation: int = 0,
                        device_routing: bool = False) -> None:
        """Submits the step whose rows and routing were written into :meth:`next_slot`'s views
        (``admitted``: the admitted table was filled too; ``device_routing``: the routing is in
        the ``device_topk_ids`` / ``device_topk_weights`` views, on a ring with device rows).
        :meth:`wait` returns its output as a uint16 (BF16 bits) array, or as a torch BF16 CUDA
        tensor on a ring with device rows."""
        if device_routing and self._rows is None:
            raise ValueError("device_routing: this ring has no device rows")
        k = self.k if k is None else k
        if not 0 <= tokens <= self.max_tokens or not 1 <= k <= self.k:
            raise ValueError(f"tokens, k: {tokens} x {k} do not fit the ring's {self.max_tokens} x {self.k} slots")
        if self._n_submitted - self._n_waited >= self.slots:
            raise errors.FailedPrecondition(f"step ring: {self.slots} steps outstanding; wait for one first")
        if self._closed_word.value:
            raise errors.Unavailable("step ring: the rank closed the ring", rank=self._client.rank)
        if self._rows is not None:
            import torch

            rows = WireRows(pb.DTYPE_BF16, tokens, self.d, b"", "torch", np.dtype(np.uint16), torch.bfloat16,
                            self.device)
        else:
            rows = WireRows(pb.DTYPE_BF16, tokens, self.d, b"", "numpy", np.dtype(np.uint16))
        self._rows_ready()
        flags = (FLAG_ADMITTED if admitted else 0) | (FLAG_DEVICE_ROUTING if device_routing else 0)
        self._publish(flags, decode, k, step_id, layer, tokens, expected_generation, rows)

    def _rows_ready(self) -> None:
        """Device rows: the rank's work on the step waits (on the GPU) for this event, recorded
        after what the current stream has enqueued: the rows' (and routing's) writes."""
        if self._rows is not None:
            self._stream_call(cuda_ipc.record_event, self._ready.cuda_event, stream_first=False)

    def _stream_call(self, f: Any, event: int, *, stream_first: bool) -> None:
        """f(stream, event) or f(event, stream) on the ring device's current stream, as one
        driver call. The raw pointer of a default stream (0) names the current context's, so the
        ring's device is made current first when another one is."""
        import torch

        if torch._C._cuda_getDevice() != self._device_index:
            with torch.cuda.device(self._device_index):
                self._stream_call(f, event, stream_first=stream_first)
            return
        stream = self._raw_stream(self._device_index)
        if stream_first:
            f(stream, event)
        else:
            f(event, stream)

    def _publish(self, flags: int, decode: bool, k: int, step_id: int, layer: int, tokens: int,
                 expected_generation: int, rows: WireRows) -> None:
        """Writes the next slot's descriptor, bumps `submitted` (after the slot: x86-64 keeps store
        order) and wakes the rank when it sleeps."""
        seq = self._n_submitted & 0xFFFFFFFF
        _DESCRIPTOR.pack_into(self._mm, self._slot(seq), seq, flags, pb.PHASE_DECODE if decode else pb.PHASE_PREFILL,
                              k, int(step_id), int(layer), tokens, int(expected_generation))
        self._pending.append((rows, time.perf_counter()))
        self._n_submitted += 1
        self._submitted.value = self._n_submitted & 0xFFFFFFFF
        if self._rank_sleeping.value:
            self._futex.wake(self._base + OFF_SUBMITTED)

    def submit(self, step_id: int, layer: int, hidden: Any, topk_ids: Any, topk_weights: Any, *,
               decode: bool = False, admitted: Any = None, expected_generation: int = 0) -> None:
        if self._n_submitted - self._n_waited >= self.slots:
            raise errors.FailedPrecondition(f"step ring: {self.slots} steps outstanding; wait for one first")
        if self._closed_word.value:
            raise errors.Unavailable("step ring: the rank closed the ring", rank=self._client.rank)
        if self._rows is not None:
            self._submit_device(step_id, layer, hidden, topk_ids, topk_weights, decode, admitted, expected_generation)
            return
        rows, arr = host_rows(hidden)
        if rows.dtype != pb.DTYPE_BF16 or rows.cols != self.d or rows.rows > self.max_tokens:
            raise ValueError(f"hidden: [{rows.rows}, {rows.cols}] of dtype {rows.np_dtype} does not fit the ring's "
                             f"BF16 [{self.max_tokens}, {self.d}] slots")
        ids, w, k = routing_arrays(topk_ids, topk_weights, rows.rows)
        if k > self.k:
            raise ValueError(f"topk_ids: k = {k} exceeds the ring's {self.k}")
        s = (self._n_submitted & 0xFFFFFFFF) % self.slots
        t = rows.rows
        self._hidden_views[s][: t * self.d] = arr.reshape(-1)  # the one copy of the rows
        flags = self._write_routing(s, t, k, ids, w, admitted)
        self._publish(flags, decode, k, step_id, layer, t, expected_generation, rows)

    def _write_routing(self, s: int, t: int, k: int, ids: np.ndarray, w: np.ndarray, admitted: Any) -> int:
        """Slot s's routing tables; returns the descriptor's flags."""
        self._ids_views[s][: t * k] = ids.reshape(-1)
        self._weights_views[s][: t * k] = w.reshape(-1)
        return self._write_admitted(s, t, k, admitted)

    def _write_admitted(self, s: int, t: int, k: int, admitted: Any) -> int:
        """Slot s's admitted table, when given; returns the descriptor's FLAG_ADMITTED or 0."""
        adm = admitted_bytes(admitted, (t, k))
        if not adm:
            return 0
        self._admitted_views[s][: t * k] = np.frombuffer(adm, np.uint8)
        return FLAG_ADMITTED

    def _submit_device(self, step_id: int, layer: int, hidden: Any, topk_ids: Any, topk_weights: Any, decode: bool,
                       admitted: Any, expected_generation: int) -> None:
        import torch

        if not isinstance(hidden, torch.Tensor) or not hidden.is_cuda or \
                hidden.dtype != torch.bfloat16 or hidden.dim() != 2 or hidden.shape[1] != self.d or \
                hidden.shape[0] > self.max_tokens:
            raise ValueError(f"hidden: a ring with device rows takes BF16 [<= {self.max_tokens}, {self.d}] CUDA "
                             f"tensors, got {getattr(hidden, 'dtype', type(hidden))} "
                             f"{tuple(getattr(hidden, 'shape', ()))} on {getattr(hidden, 'device', 'the host')}")
        with torch.cuda.device(self.device):
            # The copies into the device slot run on this GPU's current stream (torch orders a
            # copy from another GPU after that GPU's current stream), where the event is recorded.
            self._submit_device_here(step_id, layer, hidden, topk_ids, topk_weights, decode, admitted,
                                     expected_generation)

    def _submit_device_here(self, step_id: int, layer: int, hidden: Any, topk_ids: Any, topk_weights: Any,
                            decode: bool, admitted: Any, expected_generation: int) -> None:
        import torch

        t = hidden.shape[0]
        s = (self._n_submitted & 0xFFFFFFFF) % self.slots
        on_gpu = lambda x: isinstance(x, torch.Tensor) and x.is_cuda  # noqa: E731
        if on_gpu(topk_ids) and on_gpu(topk_weights):
            # Routing stays on the GPU: into the device slot, on the engine's stream.
            if topk_ids.dim() != 2 or topk_ids.shape[0] != t:
                raise ValueError(f"topk_ids: expected [{t}, k], got shape {tuple(topk_ids.shape)}")
            if tuple(topk_weights.shape) != tuple(topk_ids.shape):
                raise ValueError(f"topk_weights: shape {tuple(topk_weights.shape)} differs from topk_ids "
                                 f"{tuple(topk_ids.shape)}")
            if topk_ids.is_floating_point() or topk_ids.is_complex() or topk_ids.dtype == torch.bool:
                raise TypeError(f"topk_ids: integer dtype expected, got {topk_ids.dtype}")
            k = topk_ids.shape[1]
            if not 1 <= k <= self.k:
                raise ValueError(f"topk_ids: k = {k} outside [1, {self.k}] (the ring's k)")
            ids = topk_ids
            if ids.dtype != torch.int32:
                # Ids beyond int32 become -2^31, which the rank refuses as outside [0, experts)
                # (narrowing them would wrap them into range); no wait for the GPU.
                fits = (ids >= -(2**31)) & (ids <= 2**31 - 1)
                ids = torch.where(fits, ids, torch.full_like(ids, -(2**31))).to(torch.int32)
            self._dev_ids[s][: t * k].view(t, k).copy_(ids)
            self._dev_weights[s][: t * k].view(t, k).copy_(topk_weights)
            flags = FLAG_DEVICE_ROUTING | self._write_admitted(s, t, k, admitted)
        else:
            ids, w, k = routing_arrays(topk_ids, topk_weights, t)
            if k > self.k:
                raise ValueError(f"topk_ids: k = {k} exceeds the ring's {self.k}")
            flags = self._write_routing(s, t, k, ids, w, admitted)
        self._dev_hidden[s][:t].copy_(hidden)
        # The output goes back to the rows' own GPU (wait()).
        rows = WireRows(pb.DTYPE_BF16, t, self.d, b"", "torch", np.dtype(np.uint16), torch.bfloat16, hidden.device)
        self._rows_ready()
        self._publish(flags, decode, k, step_id, layer, t, expected_generation, rows)

    def wait(self, timeout: float = 60.0, rank: Optional[int] = None, *, copy: bool = True) -> StepResult:
        """The oldest outstanding step's answer (its error raised as a MoeError). ``copy=False``:
        the output is a view of the step's slot instead of a copy (a uint16 array of BF16 bits,
        or the torch BF16 CUDA tensor of a ring with device rows), valid until that slot is
        submitted again (``slots`` submits later): an engine that reads it before its next
        submit saves a copy of every output (on a device ring, a launch inside the wait)."""
        if self._n_submitted == self._n_waited:
            raise errors.FailedPrecondition("step ring: no step outstanding")
        want = (self._n_waited + 1) & 0xFFFFFFFF
        done = lambda: ((self._completed.value - want) & 0xFFFFFFFF) < 0x80000000  # noqa: E731
        start = time.perf_counter()
        spin_until, until = start + self.spin_s, start + timeout
        while not done():
            now = time.perf_counter()
            if now < spin_until:
                continue
            if self._closed_word.value and not done():
                raise errors.Unavailable("step ring: the rank closed the ring", rank=rank)
            if now >= until:
                raise errors.DeadlineExceeded("step ring: the step did not complete within the deadline", rank=rank)
            self._engine_sleeping.value = 1
            seen = self._completed.value
            if ((seen - want) & 0xFFFFFFFF) >= 0x80000000:
                self._futex.wait(self._base + OFF_COMPLETED, seen, min(until - now, 0.1))
            self._engine_sleeping.value = 0
        self._completed_at = time.perf_counter()  # when the answer was seen (benchmarks read it)
        seq = self._n_waited & 0xFFFFFFFF
        rows, submitted_at = self._pending.pop(0)
        res = self._slot(seq) + RESULT_OFFSET
        answered, code = _RESULT_HEAD.unpack_from(self._mm, res)
        self._n_waited += 1
        if answered != seq:
            # Another step's answer in this step's slot: never hand it out as this step's.
            raise errors.from_status_code(
                15, f"step ring: slot answers step {answered} where step {seq} was awaited", rank)
        if code != 0:
            message = bytes(self._mm[res + 8 : res + 520]).split(b"\0", 1)[0].decode(errors="replace")
            raise errors.from_status_code(code, message, rank)
        v = _RESULT_REST.unpack_from(self._mm, res + 520)
        # gen, layer, path, canary, fallback, 5 route counts, server / compute us, the stages;
        # StepRecord's fields in order (positional: a step's record is on the engine's path).
        fallback = v[4]
        record = StepRecord(v[0], v[1], "graph_replay" if v[2] == _PATH_GRAPH_REPLAY else "eager",
                            "" if fallback[:1] == b"\0" else fallback.split(b"\0", 1)[0].decode(errors="replace"),
                            v[5], v[6], v[7], v[8], v[9], v[10], v[11], bool(v[3]), dict(zip(STAGES, v[12:])))
        s = seq % self.slots
        if self._rows is not None:
            if self._done:
                # The rank answered once its work was enqueued: the device's current stream (where
                # the output is read and the slot written next) waits for that work on the GPU.
                self._stream_call(cuda_ipc.stream_wait_event, self._done[s].cuda_event, stream_first=True)
            # The rank wrote them on the GPU; a copy the slot's next step cannot touch (the copy is
            # on the current stream, where the next submit records the ready event after it).
            cached = self._out_cache[s]  # the slot's last view: a slice costs microseconds
            if cached[0] != rows.rows:
                cached = self._out_cache[s] = (rows.rows, self._dev_output[s][: rows.rows])
            output = cached[1]
            if copy:
                output = output.clone() if rows.device in (None, output.device) else output.to(rows.device)
        elif copy:
            output = from_host_rows(rows, self._output_views[s][: rows.rows * rows.cols].reshape(rows.rows, rows.cols))
        else:
            output = self._output_views[s][: rows.rows * rows.cols].reshape(rows.rows, rows.cols)
        return StepResult(output, record, (time.perf_counter() - submitted_at) * 1e6, via="ring")

    def step(self, step_id: int, layer: int, hidden: Any, topk_ids: Any, topk_weights: Any, *,
             decode: bool = False, admitted: Any = None, expected_generation: int = 0,
             timeout: float = 60.0, rank: Optional[int] = None) -> StepResult:
        """One step end to end: submit, then wait. Refused (FailedPrecondition) while an earlier
        step is outstanding, whose answer the wait would return instead of this step's."""
        if self.outstanding:
            raise errors.FailedPrecondition(
                f"step ring: {self.outstanding} step(s) outstanding (a submit without its wait, or a wait that "
                "timed out); wait() for them before step()", rank=rank)
        self.submit(step_id, layer, hidden, topk_ids, topk_weights, decode=decode, admitted=admitted,
                    expected_generation=expected_generation)
        return self.wait(timeout, rank)

    def close(self) -> None:
        """Closes the ring (``CloseStepRing``) and the claim connection."""
        if getattr(self, "_conn", None) is None:
            return
        closed = False
        try:
            self._client._call(self._client._stub.CloseStepRing, pb.CloseStepRingRequest(ring_id=self.id), timeout=5)
            closed = True  # answered once the rank's ring thread ended and the ring was released
        except errors.MoeError:
            pass  # hanging up below tears the ring down as well
        for name in ("_submitted", "_rank_sleeping", "_completed", "_engine_sleeping", "_closed_word", "_hidden_views",
                     "_output_views", "_ids_views", "_weights_views", "_admitted_views"):
            if hasattr(self, name):
                delattr(self, name)  # ctypes views must go before the mapping can close
        self._base = 0
        if self._rows is not None and not closed:
            # The rank may still be in a step that writes into these rows: never hand their memory
            # back to the allocator (a small leak instead of memory written behind our back).
            _UNRELEASED_DEVICE_ROWS.append(self._rows)
        self._rows = None
        self._dev_hidden, self._dev_output, self._dev_ids, self._dev_weights = [], [], [], []
        self._out_cache = []
        try:
            self._mm.close()
        except (BufferError, AttributeError):
            pass
        self._conn.close()
        self._conn = None

    def __enter__(self) -> "StepRing":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
