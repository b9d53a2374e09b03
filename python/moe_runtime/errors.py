"""Typed errors of the data-plane API.

Every failure a rank reports, through gRPC or through a step ring, is raised as a subclass of
:class:`MoeError` chosen by its status code (docs/engine-integration.md lists what each means).
The rank's message names the offending field (``topk_ids[3][1]: expert 130 outside [0, 128)``).
"""
from __future__ import annotations

from typing import Optional

import grpc

# absl::StatusCode / grpc.StatusCode numbers (identical by design).
_OK = 0


class MoeError(Exception):
    """A step or call the rank did not complete. ``code`` is the gRPC status code name."""

    code: str = "UNKNOWN"
    #: Whether the same step, re-issued on every rank under a new step id, may succeed.
    retryable: bool = False

    def __init__(self, message: str, *, rank: Optional[int] = None):
        super().__init__(message if rank is None else f"rank {rank}: {message}")
        self.message = message
        self.rank = rank


class InvalidArgument(MoeError):
    """The request was malformed: a shape, a dtype, an id out of range, a NaN row."""

    code = "INVALID_ARGUMENT"


class FailedPrecondition(MoeError):
    """The rank cannot serve this request in its current state (e.g. ``expected_generation``)."""

    code = "FAILED_PRECONDITION"


class Aborted(MoeError):
    """The step was aborted before any payload moved (another rank rejected it, or the ranks
    disagreed on the step). Nothing was computed: re-issue it on every rank with a new step id."""

    code = "ABORTED"
    retryable = True


class Unavailable(MoeError):
    """The rank is draining, a peer rank failed, or the rank cannot be reached."""

    code = "UNAVAILABLE"
    retryable = True


class DeadlineExceeded(MoeError):
    """The call's deadline passed (a peer rank did not take part in the step in time)."""

    code = "DEADLINE_EXCEEDED"


class ResourceExhausted(MoeError):
    """A request or ring beyond the rank's limits (``--max_step_tokens``, ``--max_step_rings``)."""

    code = "RESOURCE_EXHAUSTED"


class PermissionDenied(MoeError):
    """The caller is not admitted (uid not allowed on the Unix socket, or a ring claimed by another uid)."""

    code = "PERMISSION_DENIED"


class Unauthenticated(MoeError):
    """No or a wrong bearer token on a TCP connection."""

    code = "UNAUTHENTICATED"


class NotFound(MoeError):
    code = "NOT_FOUND"


class AlreadyExists(MoeError):
    code = "ALREADY_EXISTS"


class OutOfRange(MoeError):
    code = "OUT_OF_RANGE"


class Internal(MoeError):
    code = "INTERNAL"


class DataLoss(MoeError):
    """A step's answer that is not this step's (e.g. a step ring's slot answering another step)."""

    code = "DATA_LOSS"


class Unknown(MoeError):
    code = "UNKNOWN"


_BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        FailedPrecondition,
        Aborted,
        Unavailable,
        DeadlineExceeded,
        ResourceExhausted,
        PermissionDenied,
        Unauthenticated,
        NotFound,
        AlreadyExists,
        OutOfRange,
        Internal,
        DataLoss,
        Unknown,
    )
}


def error_for(code_name: str, message: str, rank: Optional[int] = None) -> MoeError:
    """The typed error of a status code name (``"INVALID_ARGUMENT"``)."""
    return _BY_CODE.get(code_name, Unknown)(message, rank=rank)


def from_rpc_error(e: grpc.RpcError, rank: Optional[int] = None) -> MoeError:
    """The typed error of a failed gRPC call."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    return error_for(code.name, details or code.name, rank)


def from_status_code(code: int, message: str, rank: Optional[int] = None) -> MoeError:
    """The typed error of a numeric status code (a step ring's result)."""
    for c in grpc.StatusCode:
        if c.value[0] == code:
            return error_for(c.name, message, rank)
    return Unknown(f"status {code}: {message}", rank=rank)
