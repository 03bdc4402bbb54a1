"""The `precision` group: the dtype of the forward pass, of the weights the optimizer updates, and fp8 matmuls."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import List, Optional


class Dtype(str, Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"


class Float8Recipe(str, Enum):
    # One scale per tensor: the fastest; the one that allows float8 all-gather under FSDP.
    tensorwise = "tensorwise"
    # One scale per row: more accurate with outliers, somewhat slower.
    rowwise = "rowwise"


class Float8Backend(str, Enum):
    torchao = "torchao"
    transformer_engine = "transformer_engine"


@dataclass
class Float8Config:
    recipe: Float8Recipe = Float8Recipe.tensorwise
    backend: Float8Backend = Float8Backend.torchao
    # FSDP all-gathers the weights already cast to float8 (half bf16's traffic); tensorwise recipe only.
    all_gather: bool = False
    # Linear layers with fewer input or output features stay in compute_dtype: fp8 gains nothing on small matmuls,
    # and the fp8 kernels need both dimensions to be multiples of 16.
    min_features: int = 1024
    # Modules kept in compute_dtype whatever their size, by name or name suffix (the LM head's logits need the range).
    skip: List[str] = field(default_factory=lambda: ["lm_head"])
    # Run the fp8 matmuls in higher precision where the hardware has no fp8 (a CPU, a GPU below compute capability
    # 8.9): same numerics, no speed-up; for tests.
    emulate: bool = False


@dataclass
class PrecisionConfig:
    # The forward and the loss run in this dtype (autocast, or FSDP's mixed-precision policy).
    compute_dtype: Dtype = Dtype.fp32
    # The weights the optimizer updates and its states. fp32 unless asked otherwise (precision=pure_bf16): weights
    # cast to bf16 stay in bf16, and small updates are lost to rounding.
    param_dtype: Dtype = Dtype.fp32
    # The dtype FSDP reduces gradients in across ranks.
    reduce_dtype: Dtype = Dtype.fp32
    # fp16's dynamic loss scale: where it starts, and how many steps without an overflow before it doubles.
    initial_loss_scale: float = 2.0**16
    loss_scale_growth_interval: int = 2000
    # Linear layers' matmuls in float8, the rest in compute_dtype (precision=fp8).
    fp8: Optional[Float8Config] = None
