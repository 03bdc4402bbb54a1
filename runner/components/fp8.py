"""The float8 conversion that precision=fp8 asks for (runner/config/float8.py): which linear layers go to fp8,
and their conversion by torchao or Transformer Engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.config.float8 import Float8Backend, Float8Config
from runner.errors import SpecError

if TYPE_CHECKING:
    from torch import nn


def fp8_layer_names(model: nn.Module, fp8: Float8Config) -> list[str]:
    """The linear layers whose matmuls go to fp8: large enough, multiples of 16, and not skipped by name; an
    error when there is none."""
    from torch import nn

    def skipped(name: str) -> bool:
        return any(name == s or name.endswith(f".{s}") for s in fp8.skip)

    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and not skipped(name)
        and min(module.in_features, module.out_features) >= fp8.min_features
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    ]
    if not names:  # an fp8 run without a single fp8 matmul would be a bf16 run under another name
        raise SpecError(
            f"precision=fp8 finds no linear layer to convert: none has both dimensions >= "
            f"precision.fp8.min_features={fp8.min_features} and multiples of 16, outside "
            f"precision.fp8.skip; lower precision.fp8.min_features or use precision=bf16"
        )
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
        replacement = te.Linear(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            params_dtype=linear.weight.dtype,
            device=linear.weight.device,
        )
        with torch.no_grad():
            replacement.weight.copy_(linear.weight)
            if linear.bias is not None:
                replacement.bias.copy_(linear.bias)
        setattr(parent, child, replacement)
