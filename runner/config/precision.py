"""The `precision` group: the dtype of the forward pass, of the weights the optimizer updates, and fp8 matmuls
(runner/config/float8.py).

The schema and its checks; runner/components/mixed_precision.py builds what it names.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Optional

from runner.config import float8
from runner.config.fields import setting
from runner.config.float8 import Float8Config
from runner.config.hardware import Accelerator, HardwareConfig
from runner.errors import require

if TYPE_CHECKING:
    import torch

log = logging.getLogger("runner")


class Dtype(str, Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"

    @property
    def bytes(self) -> int:
        return 4 if self is Dtype.fp32 else 2

    @property
    def torch(self) -> torch.dtype:
        import torch

        return {Dtype.fp32: torch.float32, Dtype.fp16: torch.float16, Dtype.bf16: torch.bfloat16}[self]


@dataclass
class PrecisionConfig:
    compute_dtype: Dtype = setting(
        Dtype.fp32,
        "The forward and the loss run in this dtype (autocast, or FSDP's mixed-precision policy).",
    )
    param_dtype: Dtype = setting(
        Dtype.fp32,
        "The weights the optimizer updates and its states. fp32 unless asked otherwise (precision=pure_bf16): weights "
        "cast to bf16 stay in bf16, and small updates are lost to rounding.",
    )
    reduce_dtype: Dtype = setting(Dtype.fp32, "The dtype gradients are reduced in across data-parallel ranks.")
    initial_loss_scale: float = setting(
        2.0**16,
        "fp16's dynamic loss scale: where it starts (it halves on an overflow).",
    )
    loss_scale_growth_interval: int = setting(
        2000,
        "fp16's dynamic loss scale: the steps without an overflow after which it doubles.",
    )
    fp8: Optional[Float8Config] = setting(
        None,
        "Linear layers' matmuls in float8, the rest in compute_dtype (precision=fp8).",
    )


def check(precision: PrecisionConfig, machine: HardwareConfig, float8_all_gather: bool) -> None:
    """The rules of the precision group on this hardware; a strategy checks its own (runner/strategies/)."""
    require(
        precision.param_dtype in (Dtype.fp32, Dtype.bf16),
        f"precision.param_dtype={precision.param_dtype.value} is not supported: fp16 weights need fp32 master "
        "copies; use precision=fp16 (fp32 weights, fp16 forward)",
    )
    if precision.param_dtype is Dtype.bf16:
        require(
            precision.compute_dtype is Dtype.bf16 and precision.reduce_dtype is Dtype.bf16,
            "precision.param_dtype=bf16 needs precision.compute_dtype=bf16 and precision.reduce_dtype=bf16 "
            "(bf16 weights have bf16 gradients); choose precision=pure_bf16",
        )
    scale = precision.initial_loss_scale
    require(
        scale >= 1 and float(scale).is_integer() and (int(scale) & (int(scale) - 1)) == 0,
        f"precision.initial_loss_scale={scale:g} must be a power of two (65536 is usual)",
    )
    require(
        precision.loss_scale_growth_interval > 0,
        f"precision.loss_scale_growth_interval={precision.loss_scale_growth_interval} must be a positive integer",
    )
    capability = machine.compute_capability
    if precision.compute_dtype is Dtype.bf16 and machine.accelerator is Accelerator.cuda and capability:
        require(
            capability >= 8.0,
            f"precision.compute_dtype=bf16 needs a GPU of compute capability 8.0+ (A100, RTX 30xx or newer), "
            f"and {machine.device_name} has {capability}; use precision=fp16",
        )
    if precision.fp8 is None:
        return
    require(
        precision.compute_dtype in (Dtype.bf16, Dtype.fp32),
        f"precision.fp8 runs its other operations in bf16 or fp32, not "
        f"precision.compute_dtype={precision.compute_dtype.value}",
    )
    require(
        precision.param_dtype is Dtype.fp32, "precision.fp8 keeps fp32 master weights; set precision.param_dtype=fp32"
    )
    float8.check(precision.fp8, machine, float8_all_gather)


DTYPE_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
