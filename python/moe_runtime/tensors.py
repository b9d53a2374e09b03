"""Tensors on the wire: numpy arrays and torch tensors in, the same kind out, no lossy casts.

Hidden rows are ``[tokens, d]``. Accepted:

* a torch tensor of ``torch.bfloat16``, ``torch.float16`` or ``torch.float32`` (any device;
  copied to the host), sent in its own dtype;
* a numpy array of ``float32`` or ``float16``, sent in its own dtype;
* a numpy array of ``uint16`` holding BF16 bit patterns (numpy has no bfloat16), sent as BF16.

Outputs come back in the request's dtype and kind: a torch tensor of the input's dtype (on the
input's device), or a numpy array of the input's dtype. BF16 is never converted on the client;
FP16/FP32 rows are converted to BF16 by the rank (the experts run in BF16) and the output is
converted back there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np

from moe_runtime._proto import expert_layer_pb2 as pb

try:  # torch is optional
    import torch  # type: ignore

    _TORCH = True
except Exception:  # pragma: no cover - exercised where torch is absent
    torch = None  # type: ignore
    _TORCH = False


def _is_torch(x: Any) -> bool:
    return _TORCH and isinstance(x, torch.Tensor)


@dataclass
class WireRows:
    """Rows as the rank reads them, and what the answer converts back to."""

    dtype: int  # pb.DType
    rows: int
    cols: int
    data: bytes
    kind: str  # "numpy" | "torch"
    np_dtype: Any
    torch_dtype: Any = None
    device: Any = None


_NP_WIRE = {np.dtype(np.uint16): pb.DTYPE_BF16, np.dtype(np.float16): pb.DTYPE_FP16, np.dtype(np.float32): pb.DTYPE_FP32}


def to_wire(hidden: Any, field: str = "hidden") -> WireRows:
    """``hidden`` as wire bytes; TypeError / ValueError naming ``field`` when it cannot be sent."""
    rows, arr = host_rows(hidden, field)
    rows.data = arr.tobytes()
    return rows


def host_rows(hidden: Any, field: str = "hidden") -> Tuple[WireRows, np.ndarray]:
    """``hidden`` as a C-contiguous host array in its wire dtype (uint16 BF16 bits, float16 or
    float32; no copy when it already is one) and the rows' description (``data`` left empty):
    what a step ring copies into its slot."""
    if _is_torch(hidden):
        if hidden.dim() != 2:
            raise ValueError(f"{field}: expected [tokens, d], got shape {tuple(hidden.shape)}")
        t = hidden.detach()
        if t.dtype == torch.bfloat16:
            arr = t.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)
            wire = pb.DTYPE_BF16
        elif t.dtype == torch.float16:
            arr = t.contiguous().cpu().numpy()
            wire = pb.DTYPE_FP16
        elif t.dtype == torch.float32:
            arr = t.contiguous().cpu().numpy()
            wire = pb.DTYPE_FP32
        else:
            raise TypeError(f"{field}: torch dtype {t.dtype} (bfloat16, float16 or float32)")
        return WireRows(wire, arr.shape[0], arr.shape[1], b"", "torch", arr.dtype, t.dtype, t.device), arr
    arr = np.asarray(hidden)
    if arr.ndim != 2:
        raise ValueError(f"{field}: expected [tokens, d], got shape {arr.shape}")
    wire = _NP_WIRE.get(arr.dtype)
    if wire is None:
        raise TypeError(f"{field}: numpy dtype {arr.dtype} (uint16 BF16 bits, float16 or float32)")
    arr = np.ascontiguousarray(arr)
    return WireRows(wire, arr.shape[0], arr.shape[1], b"", "numpy", arr.dtype), arr


def from_wire(like: WireRows, data: bytes, rows: int, cols: int) -> Any:
    """The answer's rows in the kind and dtype of the request's."""
    return from_host_rows(like, np.frombuffer(data, dtype=like.np_dtype).reshape(rows, cols))


def from_host_rows(like: WireRows, arr: np.ndarray) -> Any:
    """The answer's rows (``arr``, in the wire dtype; copied, never kept) in the kind and dtype of
    the request's."""
    if like.kind == "torch":
        if like.torch_dtype == torch.bfloat16:
            out = torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
        else:
            out = torch.from_numpy(arr.copy())
        return out.to(like.device) if like.device is not None and str(like.device) != "cpu" else out
    return arr.copy()


def routing_arrays(topk_ids: Any, topk_weights: Any, tokens: int) -> Tuple[np.ndarray, np.ndarray, int]:
    """``topk_ids`` as int32 and ``topk_weights`` as float32 ``[tokens, k]`` (ValueError naming the field)."""
    ids = topk_ids.detach().cpu().numpy() if _is_torch(topk_ids) else np.asarray(topk_ids)
    w = topk_weights.detach().float().cpu().numpy() if _is_torch(topk_weights) else np.asarray(topk_weights)
    if ids.ndim != 2 or ids.shape[0] != tokens:
        raise ValueError(f"topk_ids: expected [{tokens}, k], got shape {ids.shape}")
    if w.shape != ids.shape:
        raise ValueError(f"topk_weights: shape {w.shape} differs from topk_ids {ids.shape}")
    if ids.dtype.kind not in "iu":
        raise TypeError(f"topk_ids: integer dtype expected, got {ids.dtype}")
    # Values only need a range check when the dtype is wider than int32.
    if ids.dtype != _INT32 and ids.size and (ids.min() < _INT32_MIN or ids.max() > _INT32_MAX):
        raise ValueError("topk_ids: ids beyond int32")
    return np.ascontiguousarray(ids, dtype=np.int32), np.ascontiguousarray(w, dtype=np.float32), ids.shape[1]


_INT32 = np.dtype(np.int32)
_INT32_MIN, _INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)


def check_step_arrays(hidden: Any, topk_ids: Any, topk_weights: Any, admitted: Any = None) -> None:
    """What a step's send refuses in its arrays' shapes and dtypes (TypeError / ValueError naming
    the field, as ``build_request`` and a ring's submit raise them), checked without converting or
    copying the arrays: ``RankGroup`` checks every rank's share before it sends the step to any,
    so that a bad share never leaves the other ranks waiting for a rank that never got it."""
    if _is_torch(hidden):
        shape = tuple(hidden.shape)
        if len(shape) != 2:
            raise ValueError(f"hidden: expected [tokens, d], got shape {shape}")
        if hidden.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"hidden: torch dtype {hidden.dtype} (bfloat16, float16 or float32)")
    else:
        arr = np.asarray(hidden)
        shape = arr.shape
        if arr.ndim != 2:
            raise ValueError(f"hidden: expected [tokens, d], got shape {shape}")
        if arr.dtype not in _NP_WIRE:
            raise TypeError(f"hidden: numpy dtype {arr.dtype} (uint16 BF16 bits, float16 or float32)")
    tokens = shape[0]
    if _is_torch(topk_ids):
        ids_shape = tuple(topk_ids.shape)
        integer = not (topk_ids.is_floating_point() or topk_ids.is_complex() or topk_ids.dtype == torch.bool)
        ids_dtype = topk_ids.dtype
    else:
        ids = np.asarray(topk_ids)
        ids_shape, integer, ids_dtype = ids.shape, ids.dtype.kind in "iu", ids.dtype
    w_shape = tuple(topk_weights.shape) if _is_torch(topk_weights) else np.shape(topk_weights)
    if len(ids_shape) != 2 or ids_shape[0] != tokens:
        raise ValueError(f"topk_ids: expected [{tokens}, k], got shape {ids_shape}")
    if tuple(w_shape) != tuple(ids_shape):
        raise ValueError(f"topk_weights: shape {tuple(w_shape)} differs from topk_ids {tuple(ids_shape)}")
    if not integer:
        raise TypeError(f"topk_ids: integer dtype expected, got {ids_dtype}")
    if admitted is not None:
        a_shape = tuple(admitted.shape) if _is_torch(admitted) else np.shape(admitted)
        if tuple(a_shape) != tuple(ids_shape):
            raise ValueError(f"admitted: shape {tuple(a_shape)} differs from topk_ids {tuple(ids_shape)}")


def admitted_bytes(admitted: Optional[Any], shape: Tuple[int, int]) -> bytes:
    if admitted is None:
        return b""
    a = admitted.detach().cpu().numpy() if _is_torch(admitted) else np.asarray(admitted)
    if a.shape != shape:
        raise ValueError(f"admitted: shape {a.shape} differs from topk_ids {shape}")
    return np.ascontiguousarray(a != 0, dtype=np.uint8).tobytes()


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """BF16 bit patterns (uint16) as float32, exactly."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 rounded to the nearest BF16 (ties to even), as uint16 bit patterns. Lossy by design:
    for callers that want BF16 on the wire from float32 data."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out
