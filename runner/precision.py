"""The `precision` group: the dtype of the forward pass and of the weights the optimizer updates."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, ContextManager, Optional

if TYPE_CHECKING:
    import torch


class ComputeDtype(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"


@dataclass
class PrecisionConfig:
    # Weights, gradients and optimizer states stay fp32; the forward and the loss run under autocast in this dtype.
    compute_dtype: ComputeDtype = ComputeDtype.fp32


def fsdp_mixed_precision(precision: PrecisionConfig) -> Optional[object]:
    """FSDP2's policy: parameters all-gathered and computed in the low dtype, gradients reduced in fp32."""
    if precision.compute_dtype is ComputeDtype.fp32:
        return None
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def autocast(precision: PrecisionConfig, device: torch.device) -> ContextManager:
    import torch

    if precision.compute_dtype is ComputeDtype.fp32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)
