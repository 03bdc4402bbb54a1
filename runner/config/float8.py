"""The `precision.fp8` section: linear layers' matmuls in float8 (torchao, or TransformerEngine on CUDA), the
rest in the precision's compute dtype."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, List

from runner.config.hardware import Accelerator, HardwareConfig
from runner.errors import SpecError, require

if TYPE_CHECKING:
    from torch import nn


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
    # Transformer Engine's delayed scaling (DelayedScaling): formats, the amax history each scale comes from, and a
    # margin of 2^margin below the format's maximum. torchao scales from each tensor's current amax instead.
    format: Float8Format = Float8Format.hybrid
    amax_history_len: int = 1024
    amax_compute_algo: AmaxAlgorithm = AmaxAlgorithm.max
    margin: int = 0


def check(fp8: Float8Config, machine: HardwareConfig, float8_all_gather: bool) -> None:
    """`float8_all_gather`: whether the strategy's all-gathers can carry float8 weights (FSDP's)."""
    require(fp8.min_features >= 16, f"precision.fp8.min_features={fp8.min_features} must be >= 16 (fp8 kernels "
            "need dimensions that are multiples of 16)")
    if fp8.all_gather:
        require(float8_all_gather, "precision.fp8.all_gather=true is FSDP's float8 all-gather; it needs strategy=fsdp")
        require(fp8.recipe is Float8Recipe.tensorwise,
                f"precision.fp8.all_gather=true needs precision.fp8.recipe=tensorwise, not {fp8.recipe.value}")
    delayed = [key for key in DELAYED_SCALING if getattr(fp8, key) != getattr(Float8Config(), key)]
    if fp8.backend is not Float8Backend.transformer_engine:
        require(not delayed, f"{', '.join(f'precision.fp8.{key}' for key in delayed)} set Transformer Engine's "
                             "delayed scaling; torchao scales each tensor from its current amax: use "
                             "precision.fp8.backend=transformer_engine, or leave them")
    require(fp8.amax_history_len >= 1 and fp8.margin >= 0,
            "precision.fp8.amax_history_len must be >= 1 and precision.fp8.margin >= 0")
    if fp8.backend is Float8Backend.transformer_engine:
        require(importlib.util.find_spec("transformer_engine") is not None,
                "precision.fp8.backend=transformer_engine needs TransformerEngine: pip install "
                "'transformer-engine[pytorch]' (on a CUDA machine), or use precision.fp8.backend=torchao")
        require(machine.accelerator is Accelerator.cuda and not fp8.emulate,
                "precision.fp8.backend=transformer_engine runs on CUDA GPUs only and cannot emulate; "
                "use precision.fp8.backend=torchao")
    else:
        require(importlib.util.find_spec("torchao") is not None,
                "precision=fp8 needs torchao: pip install torchao (or '.[fp8]' from the runner's checkout)")
    if fp8.emulate:
        return
    capability = machine.compute_capability or 0.0
    if machine.accelerator is Accelerator.cuda:
        has = f"{machine.device_name} (compute capability {capability or 'unknown: set hardware.compute_capability'})"
    else:
        has = "a CPU"
    require(machine.accelerator is Accelerator.cuda and capability >= 8.9,
            f"precision=fp8 needs a GPU with fp8 tensor cores (CUDA compute capability 8.9+: H100, H200, L40S, "
            f"RTX 4090) and this run has {has}; set precision.fp8.emulate=true to emulate fp8 (same numerics, "
            "no speed-up)")


DELAYED_SCALING = ("format", "amax_history_len", "amax_compute_algo", "margin")


def delayed_scaling(fp8: Float8Config) -> dict[str, Any]:
    """The arguments of Transformer Engine's DelayedScaling recipe (its Format by name)."""
    return {"fp8_format": fp8.format.value.upper(), "amax_history_len": fp8.amax_history_len,
            "amax_compute_algo": fp8.amax_compute_algo.value, "margin": fp8.margin}


def fp8_layer_names(model: nn.Module, fp8: Float8Config) -> list[str]:
    """The linear layers whose matmuls go to fp8: large enough, multiples of 16, and not skipped by name; an
    error when there is none."""
    from torch import nn

    def skipped(name: str) -> bool:
        return any(name == s or name.endswith(f".{s}") for s in fp8.skip)

    names = [
        name for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and not skipped(name)
        and min(module.in_features, module.out_features) >= fp8.min_features
        and module.in_features % 16 == 0 and module.out_features % 16 == 0
    ]
    if not names:  # an fp8 run without a single fp8 matmul would be a bf16 run under another name
        raise SpecError(f"precision=fp8 finds no linear layer to convert: none has both dimensions >= "
                        f"precision.fp8.min_features={fp8.min_features} and multiples of 16, outside "
                        f"precision.fp8.skip; lower precision.fp8.min_features or use precision=bf16")
    return names


def convert_to_fp8(model: nn.Module, fp8: Float8Config) -> list[str]:
    """Swaps the eligible linear layers for fp8 training ones in place (before any strategy wraps the model);
    returns their names."""
    names = fp8_layer_names(model, fp8)
    if fp8.backend is Float8Backend.transformer_engine:
        _convert_to_transformer_engine(model, names)
        return names
    from dataclasses import replace

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    # The weight gradient's matmul runs over the micro batch's tokens, which _scaled_mm needs in multiples of 16;
    # padded instruction batches rarely are, so torchao pads that dimension when it is not.
    config = replace(
        Float8LinearConfig.from_recipe_name(fp8.recipe.value),
        emulate=fp8.emulate,
        enable_fsdp_float8_all_gather=fp8.all_gather,
        pad_inner_dim=True,
    )
    chosen = set(names)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, name: name in chosen)
    return names


def summarize_names(names: list[str]) -> str:
    """Module names with the layer indices folded: `model.layers.*.mlp.up_proj (x32), ...`."""
    import re

    counts: dict[str, int] = {}
    for name in names:
        pattern = re.sub(r"\.\d+\.", ".*.", name)
        counts[pattern] = counts.get(pattern, 0) + 1
    return ", ".join(f"{pattern} (x{count})" if count > 1 else pattern for pattern, count in counts.items())


def _convert_to_transformer_engine(model: nn.Module, names: list[str]) -> None:
    import torch
    import transformer_engine.pytorch as te

    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child)
        replacement = te.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                params_dtype=linear.weight.dtype, device=linear.weight.device)
        with torch.no_grad():
            replacement.weight.copy_(linear.weight)
            if linear.bias is not None:
                replacement.bias.copy_(linear.bias)
        setattr(parent, child, replacement)
