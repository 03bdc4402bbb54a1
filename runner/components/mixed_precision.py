"""Mixed precision as the `precision` group asks (runner/config/precision.py): weights cast only on explicit
request, the forward's autocast, fp16's grad scaler, and the dtypes a prepared job holds, read back from it."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ContextManager, Iterable, Optional

from runner.config.float8 import Float8Backend, delayed_scaling
from runner.config.precision import DTYPE_NAMES, Dtype, PrecisionConfig

log = logging.getLogger("runner")

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.amp import GradScaler


def cast_weights(model: nn.Module, precision: PrecisionConfig) -> nn.Module:
    """The model in param_dtype: fp32 unless the spec explicitly asks for pure bf16."""
    if precision.param_dtype is Dtype.fp32:
        return model
    log.warning(
        "precision.param_dtype=bf16: weights, gradients and optimizer states are bf16 and stay bf16; "
        "updates smaller than 1/256 of a weight are rounded away"
    )
    return model.to(precision.param_dtype.torch)


def autocast(precision: PrecisionConfig, device: torch.device, compute_dtype: bool = True) -> ContextManager:
    """The forward's context: autocast to compute_dtype (unless the strategy casts itself), and TransformerEngine's
    fp8 autocast when that backend is in use."""
    import torch

    contexts = contextlib.ExitStack()
    if compute_dtype and precision.compute_dtype is not Dtype.fp32:
        contexts.enter_context(torch.autocast(device.type, dtype=precision.compute_dtype.torch))
    if precision.fp8 and precision.fp8.backend is Float8Backend.transformer_engine:
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe

        scaling = delayed_scaling(precision.fp8)
        scaling["fp8_format"] = getattr(recipe.Format, scaling["fp8_format"])
        contexts.enter_context(te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling(**scaling)))
    return contexts


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


@dataclass(frozen=True)
class PrecisionInEffect:
    """The precision really in use, read from the tensors of a prepared job."""

    forward: str
    model_weights: str
    master_weights: str
    optimizer_states: str
    gradient_reduce: str
    loss_scale: str
    compute: Dtype
    compute_linear_layers: int  # linear layers whose matmuls run in the compute dtype
    fp8_linear_layers: Optional[int] = None
    fp8: Optional[str] = None

    @classmethod
    def read(
        cls,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        precision: PrecisionConfig,
        cast_by: str,
        fp8_layers: int,
        gradient_reduce: bool,
    ) -> PrecisionInEffect:
        """The optimizer's own parameters are the master weights: DeepSpeed keeps fp32 copies there while its
        model holds low-precision ones (ZeRO-3 lends them to the optimizer only during its step; its state stays
        keyed by them)."""
        from torch import nn

        master = [*(p for group in optimizer.param_groups for p in group["params"]), *optimizer.state]
        states = [v for state in optimizer.state.values() for v in state.values() if getattr(v, "ndim", 0)]
        fp8 = precision.fp8
        compute = precision.compute_dtype
        return cls(
            forward=f"{compute.value} ({cast_by})" if cast_by else compute.value,
            model_weights=_dtypes(model.parameters()),
            master_weights=_dtypes(master),
            # Before the first step there are no states yet; torch optimizers create them like their parameters.
            optimizer_states=_dtypes(states or master),
            gradient_reduce=precision.reduce_dtype.value if gradient_reduce else "none (one data-parallel rank)",
            loss_scale=f"dynamic from {precision.initial_loss_scale:g}" if compute is Dtype.fp16 else "none",
            compute=compute,
            compute_linear_layers=sum(isinstance(m, nn.Linear) for m in model.modules()) - fp8_layers,
            fp8_linear_layers=fp8_layers if fp8 else None,
            fp8=(
                f"{fp8.backend.value} {fp8.recipe.value}{', emulated' if fp8.emulate else ''}"
                f"{', float8 all-gather' if fp8.all_gather else ''}"
            )
            if fp8
            else None,
        )

    def as_dict(self) -> dict[str, Any]:
        """What summary.json and the trackers record: the linear layers counted under their dtype's name."""
        plain = {key: value for key, value in asdict(self).items() if value is not None}
        plain.pop("compute")
        plain[f"{self.compute.value}_linear_layers"] = plain.pop("compute_linear_layers")
        if self.fp8 is not None:
            plain["fp8_linear_layers"], plain["fp8"] = plain.pop("fp8_linear_layers"), plain.pop("fp8")
        return plain

    def line(self) -> str:
        linear = f"{self.compute_linear_layers} {self.compute.value}"
        if self.fp8 is not None:
            linear = f"{self.fp8_linear_layers} fp8 ({self.fp8}), {linear}"
        return (
            f"forward {self.forward} | weights {self.model_weights}, master weights {self.master_weights}, "
            f"optimizer states {self.optimizer_states} | gradient reduce {self.gradient_reduce} | loss scale "
            f"{self.loss_scale} | linear layers: {linear}"
        )


def _dtypes(tensors: Iterable[torch.Tensor]) -> str:
    names = {str(t.dtype).removeprefix("torch.") for t in tensors}
    return ", ".join(sorted(DTYPE_NAMES.get(name, name) for name in names)) or "none yet"
