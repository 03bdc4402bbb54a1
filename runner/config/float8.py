"""The `precision.fp8` section: linear layers' matmuls in float8 (torchao, or TransformerEngine on CUDA), the
rest in the precision's compute dtype.

The schema and its checks; runner/components/fp8.py builds what it names.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, List

from runner.config.fields import setting
from runner.config.hardware import Accelerator, HardwareConfig
from runner.errors import require

if TYPE_CHECKING:
    pass


class Float8Recipe(str, Enum):
    # One scale per tensor: the fastest; the one that allows float8 all-gather under FSDP.
    tensorwise = "tensorwise"
    # One scale per row: more accurate with outliers, somewhat slower.
    rowwise = "rowwise"


class Float8Backend(str, Enum):
    torchao = "torchao"
    transformer_engine = "transformer_engine"


class Float8Format(str, Enum):
    # E4M3 in forward, E5M2 (more range) for the gradients: Transformer Engine's default.
    hybrid = "hybrid"
    e4m3 = "e4m3"


class AmaxAlgorithm(str, Enum):
    max = "max"
    most_recent = "most_recent"


@dataclass
class Float8Config:
    recipe: Float8Recipe = setting(
        Float8Recipe.tensorwise,
        "torchao's scaling: tensorwise (one scale per tensor, the fastest) or rowwise (one per row, closer to bf16).",
    )
    backend: Float8Backend = setting(
        Float8Backend.torchao,
        "Whose fp8 kernels: torchao (Float8Linear, any strategy) or transformer_engine (its te.Linear and delayed "
        "scaling).",
    )
    all_gather: bool = setting(
        False,
        "FSDP all-gathers the weights already cast to float8 (half bf16's traffic); tensorwise recipe only.",
    )
    min_features: int = setting(
        1024,
        "Linear layers with fewer input or output features stay in compute_dtype: fp8 gains nothing on small matmuls, "
        "and the fp8 kernels need both dimensions to be multiples of 16.",
    )
    skip: List[str] = setting(
        ["lm_head"],
        "Modules kept in compute_dtype whatever their size, by name or name suffix (the LM head's logits need the "
        "range).",
    )
    emulate: bool = setting(
        False,
        "Run the fp8 matmuls in higher precision where the hardware has no fp8 (a CPU, a GPU below compute capability "
        "8.9): same numerics, no speed-up; for tests.",
    )
    format: Float8Format = setting(
        Float8Format.hybrid,
        "transformer_engine: hybrid (e4m3 forward, e5m2 gradients) or e4m3 for both.",
    )
    amax_history_len: int = setting(
        1024,
        "transformer_engine's delayed scaling: how many past steps' amax each scale comes from (torchao scales from "
        "each tensor's current amax).",
    )
    amax_compute_algo: AmaxAlgorithm = setting(
        AmaxAlgorithm.max,
        "transformer_engine's delayed scaling: the scale from the history's max, or its most recent amax.",
    )
    margin: int = setting(0, "transformer_engine's delayed scaling: scales stay 2^margin below the format's maximum.")


def check(fp8: Float8Config, machine: HardwareConfig, float8_all_gather: bool) -> None:
    """`float8_all_gather`: whether the strategy's all-gathers can carry float8 weights (FSDP's)."""
    require(
        fp8.min_features >= 16,
        f"precision.fp8.min_features={fp8.min_features} must be >= 16 (fp8 kernels "
        "need dimensions that are multiples of 16)",
    )
    if fp8.all_gather:
        require(float8_all_gather, "precision.fp8.all_gather=true is FSDP's float8 all-gather; it needs strategy=fsdp")
        require(
            fp8.recipe is Float8Recipe.tensorwise,
            f"precision.fp8.all_gather=true needs precision.fp8.recipe=tensorwise, not {fp8.recipe.value}",
        )
    delayed = [key for key in DELAYED_SCALING if getattr(fp8, key) != getattr(Float8Config(), key)]
    if fp8.backend is not Float8Backend.transformer_engine:
        require(
            not delayed,
            f"{', '.join(f'precision.fp8.{key}' for key in delayed)} set Transformer Engine's "
            "delayed scaling; torchao scales each tensor from its current amax: use "
            "precision.fp8.backend=transformer_engine, or leave them",
        )
    require(
        fp8.amax_history_len >= 1 and fp8.margin >= 0,
        "precision.fp8.amax_history_len must be >= 1 and precision.fp8.margin >= 0",
    )
    if fp8.backend is Float8Backend.transformer_engine:
        require(
            importlib.util.find_spec("transformer_engine") is not None,
            "precision.fp8.backend=transformer_engine needs TransformerEngine: pip install "
            "'transformer-engine[pytorch]' (on a CUDA machine), or use precision.fp8.backend=torchao",
        )
        require(
            machine.accelerator is Accelerator.cuda and not fp8.emulate,
            "precision.fp8.backend=transformer_engine runs on CUDA GPUs only and cannot emulate; "
            "use precision.fp8.backend=torchao",
        )
    else:
        require(
            importlib.util.find_spec("torchao") is not None,
            "precision=fp8 needs torchao: pip install torchao (or '.[fp8]' from the runner's checkout)",
        )
    if fp8.emulate:
        return
    capability = machine.compute_capability or 0.0
    if machine.accelerator is Accelerator.cuda:
        has = f"{machine.device_name} (compute capability {capability or 'unknown: set hardware.compute_capability'})"
    else:
        has = "a CPU"
    require(
        machine.accelerator is Accelerator.cuda and capability >= 8.9,
        f"precision=fp8 needs a GPU with fp8 tensor cores (CUDA compute capability 8.9+: H100, H200, L40S, "
        f"RTX 4090) and this run has {has}; set precision.fp8.emulate=true to emulate fp8 (same numerics, "
        "no speed-up)",
    )


DELAYED_SCALING = ("format", "amax_history_len", "amax_compute_algo", "margin")


def delayed_scaling(fp8: Float8Config) -> dict[str, Any]:
    """The arguments of Transformer Engine's DelayedScaling recipe (its Format by name)."""
    return {
        "fp8_format": fp8.format.value.upper(),
        "amax_history_len": fp8.amax_history_len,
        "amax_compute_algo": fp8.amax_compute_algo.value,
        "margin": fp8.margin,
    }
