"""The `precision` group: the dtype of the forward pass, of the weights the optimizer updates, and fp8 matmuls."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, List, Optional

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.amp import GradScaler
    from torch.distributed.fsdp import MixedPrecisionPolicy

log = logging.getLogger("runner")


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
    # The dtype gradients are reduced in across data-parallel ranks.
    reduce_dtype: Dtype = Dtype.fp32
    # fp16's dynamic loss scale: where it starts, and how many steps without an overflow before it doubles.
    initial_loss_scale: float = 2.0**16
    loss_scale_growth_interval: int = 2000
    # Linear layers' matmuls in float8, the rest in compute_dtype (precision=fp8).
    fp8: Optional[Float8Config] = None


def torch_dtype(dtype: Dtype) -> torch.dtype:
    import torch

    return {Dtype.fp32: torch.float32, Dtype.fp16: torch.float16, Dtype.bf16: torch.bfloat16}[dtype]


def cast_weights(model: nn.Module, precision: PrecisionConfig) -> nn.Module:
    """The model in param_dtype: fp32 unless the spec explicitly asks for pure bf16."""
    if precision.param_dtype is Dtype.fp32:
        return model
    log.warning("precision.param_dtype=bf16: weights, gradients and optimizer states are bf16 and stay bf16; "
                "updates smaller than 1/256 of a weight are rounded away")
    return model.to(torch_dtype(precision.param_dtype))


def fp8_layer_names(model: nn.Module, fp8: Float8Config) -> list[str]:
    """The linear layers whose matmuls go to fp8: large enough, multiples of 16, and not skipped by name; an
    error when there is none."""
    from torch import nn

    from runner.spec import SpecError

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


def autocast(precision: PrecisionConfig, device: torch.device, compute_dtype: bool = True) -> ContextManager:
    """The forward's context: autocast to compute_dtype (FSDP casts through its policy instead), and
    TransformerEngine's fp8 autocast when that backend is in use."""
    import torch

    contexts = contextlib.ExitStack()
    if compute_dtype and precision.compute_dtype is not Dtype.fp32:
        contexts.enter_context(torch.autocast(device.type, dtype=torch_dtype(precision.compute_dtype)))
    if precision.fp8 and precision.fp8.backend is Float8Backend.transformer_engine:
        import transformer_engine.pytorch as te

        contexts.enter_context(te.fp8_autocast(enabled=True))
    return contexts


def fsdp_mixed_precision(precision: PrecisionConfig) -> MixedPrecisionPolicy:
    """FSDP2's policy: parameters all-gathered and computed in compute_dtype (fp32 shards stay the master
    weights), gradients reduced in reduce_dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    low = precision.compute_dtype is not Dtype.fp32 and precision.param_dtype is Dtype.fp32
    return MixedPrecisionPolicy(
        param_dtype=torch_dtype(precision.compute_dtype) if low else None,
        reduce_dtype=torch_dtype(precision.reduce_dtype),
    )


def ddp_reduce_hook(precision: PrecisionConfig) -> Optional[Callable]:
    """DDP all-reduces gradients in their own dtype; a reduce_dtype below it goes through torch's compression hook."""
    if precision.reduce_dtype is precision.param_dtype or precision.reduce_dtype is Dtype.fp32:
        return None
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {Dtype.bf16: default_hooks.bf16_compress_hook, Dtype.fp16: default_hooks.fp16_compress_hook}[
        precision.reduce_dtype]


def grad_scaler(precision: PrecisionConfig, device: torch.device, sharded: bool) -> Optional[GradScaler]:
    """fp16's dynamic loss scale; the sharded scaler agrees across ranks on whether any shard overflowed."""
    if precision.compute_dtype is not Dtype.fp16:
        return None
    import torch

    options = {"init_scale": precision.initial_loss_scale, "growth_interval": precision.loss_scale_growth_interval}
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type, **options)
    return torch.amp.GradScaler(device.type, **options)


def in_effect(model: nn.Module, optimizer: torch.optim.Optimizer, precision: PrecisionConfig, cast_by: str,
              fp8_layers: int, gradient_reduce: bool) -> dict[str, Any]:
    """The precision really in use, read from the tensors. The optimizer's own parameters are the master weights:
    DeepSpeed keeps fp32 copies there while its model holds low-precision ones (ZeRO-3 lends them to the
    optimizer only during its step; its state stays keyed by them)."""
    from torch import nn

    def dtypes(tensors: Iterable[torch.Tensor]) -> str:
        names = {str(t.dtype).removeprefix("torch.") for t in tensors}
        return ", ".join(sorted(DTYPE_NAMES.get(name, name) for name in names)) or "none yet"

    master = [*(p for group in optimizer.param_groups for p in group["params"]), *optimizer.state]
    states = [v for state in optimizer.state.values() for v in state.values() if getattr(v, "ndim", 0)]
    linear_layers = sum(isinstance(module, nn.Linear) for module in model.modules())
    effect = {
        "forward": f"{precision.compute_dtype.value} ({cast_by})" if cast_by else precision.compute_dtype.value,
        "model_weights": dtypes(model.parameters()),
        "master_weights": dtypes(master),
        # Before the first step there are no states yet; torch optimizers create them like their parameters.
        "optimizer_states": dtypes(states or master),
        "gradient_reduce": precision.reduce_dtype.value if gradient_reduce else "none (one data-parallel rank)",
        "loss_scale": f"dynamic from {precision.initial_loss_scale:g}"
        if precision.compute_dtype is Dtype.fp16 else "none",
        f"{precision.compute_dtype.value}_linear_layers": linear_layers - fp8_layers,
    }
    if precision.fp8:
        fp8 = precision.fp8
        effect["fp8_linear_layers"] = fp8_layers
        effect["fp8"] = (f"{fp8.backend.value} {fp8.recipe.value}{', emulated' if fp8.emulate else ''}"
                         f"{', float8 all-gather' if fp8.all_gather else ''}")
    return effect


def describe(effect: dict[str, Any]) -> str:
    """The log line of `in_effect`."""
    compute = effect["forward"].split()[0]
    linear = f"{effect[f'{compute}_linear_layers']} {compute}"
    if "fp8" in effect:
        linear = f"{effect['fp8_linear_layers']} fp8 ({effect['fp8']}), {linear}"
    return (f"forward {effect['forward']} | weights {effect['model_weights']}, master weights "
            f"{effect['master_weights']}, optimizer states {effect['optimizer_states']} | gradient reduce "
            f"{effect['gradient_reduce']} | loss scale {effect['loss_scale']} | linear layers: {linear}")


DTYPE_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
