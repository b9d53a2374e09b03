"""moe-runtime's Python engine client: call the ranks' ExpertLayerService once per MoE layer step.

* :class:`RankClient` — one rank (gRPC unary, streams, step rings when co-located);
* :class:`RankGroup` — every rank of the group at once, all-ABORTED steps retried;
* :mod:`moe_runtime.aio` — the same on ``grpc.aio``;
* :mod:`moe_runtime.errors` — typed errors by status code;
* :mod:`moe_runtime.hf` — swaps a transformers MoE block's experts for calls to the ranks.

docs/engine-integration.md is the contract (step ids, layers, retries, co-location, errors).
"""
from moe_runtime.client import RankClient, StepInput, StepRecord, StepResult, StepStream, TlsFiles, build_request
from moe_runtime.errors import MoeError
from moe_runtime.group import GroupStepError, RankGroup, StepIds
from moe_runtime.tensors import bf16_to_float32, float32_to_bf16

__version__ = "0.1.0"

__all__ = [
    "RankClient",
    "RankGroup",
    "StepIds",
    "StepInput",
    "StepRecord",
    "StepResult",
    "StepStream",
    "TlsFiles",
    "GroupStepError",
    "MoeError",
    "build_request",
    "bf16_to_float32",
    "float32_to_bf16",
]
