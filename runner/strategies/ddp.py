"""strategy=ddp: torch DistributedDataParallel, a whole replica per process, gradients all-reduced in buckets."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, ContextManager, Optional

from runner.config.fields import setting
from runner.config.hardware import Accelerator
from runner.config.precision import Dtype, PrecisionConfig
from runner.errors import require
from runner.memory.breakdown import Part, processes
from runner.memory.replicated import whole_copies
from runner.parallel.dims import ParallelDims
from runner.strategies.single import SingleStrategy
from runner.strategies.strategy_protocol import WholeWeights

if TYPE_CHECKING:
    import torch
    from torch import nn

    from runner.config.hardware import HardwareConfig
    from runner.config.spec import RunSpec
    from runner.memory.breakdown import Estimate
    from runner.memory.model_shapes import ModelFacts


@dataclass
class DDPStrategy(SingleStrategy):
    """single's replica on each process, wrapped in DistributedDataParallel: what differs from single is here."""

    find_unused_parameters: bool = setting(
        False,
        "Let DDP look for parameters that get no gradient in a step (slower; only for models that need it).",
    )
    bucket_cap_mb: int = setting(25, "Gradients are all-reduced in buckets of this many MiB, overlapping backward.")

    name: ClassVar[str] = "ddp"
    distributed: ClassVar[bool] = True

    def check(self, spec: RunSpec) -> None:
        require(self.bucket_cap_mb > 0, f"strategy.bucket_cap_mb={self.bucket_cap_mb} must be > 0")
        precision = spec.precision
        if precision.reduce_dtype not in (Dtype.fp32, precision.param_dtype):
            require(
                spec.hardware.accelerator is Accelerator.cuda,
                f"precision.reduce_dtype={precision.reduce_dtype.value} under strategy=ddp uses torch's gradient "
                "compression hook, which needs NCCL (a GPU); leave precision.reduce_dtype=fp32 on a CPU",
            )

    def describe(self, spec: RunSpec) -> str:
        return f"ddp, {processes(spec.hardware.world_size)}"

    def dims(self, hardware: HardwareConfig) -> ParallelDims:
        return ParallelDims(dp_replicate=hardware.world_size)

    def wrap(
        self,
        model: nn.Module,
        spec: RunSpec,
        device: torch.device,
        dims: ParallelDims,
        whole: Optional[WholeWeights] = None,
    ) -> nn.Module:
        """DDP's constructor broadcasts rank 0's parameters and buffers to the other ranks; a frozen base (which
        every rank builds the same, and QLoRA's NF4 tensors cannot be broadcast) is left alone."""
        from torch.nn.parallel import DistributedDataParallel

        frozen = [name for name, parameter in model.named_parameters() if not parameter.requires_grad]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, frozen)
        ddp = DistributedDataParallel(
            model.to(device),
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=self.find_unused_parameters,
            bucket_cap_mb=self.bucket_cap_mb,
        )
        if hook := reduce_hook(spec.precision):
            ddp.register_comm_hook(None, hook)
        return ddp

    def gradient_sync(self, model: nn.Module) -> Callable[[bool], ContextManager]:
        def sync(last: bool) -> ContextManager:
            return contextlib.nullcontext() if last else model.no_sync()

        return sync

    def estimate_memory(self, spec: RunSpec, facts: ModelFacts) -> Estimate:
        """As single, plus P.w of gradient buckets."""
        result = whole_copies(spec, facts)
        result.buffers = Part(result.gradients.bytes, "DDP's gradient buckets (a flat copy of the gradients)")
        return result


def reduce_hook(precision: PrecisionConfig) -> Optional[Callable]:
    """DDP all-reduces gradients in their own dtype; a reduce_dtype below it goes through torch's compression hook."""
    if precision.reduce_dtype is precision.param_dtype or precision.reduce_dtype is Dtype.fp32:
        return None
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {Dtype.bf16: default_hooks.bf16_compress_hook, Dtype.fp16: default_hooks.fp16_compress_hook}[
        precision.reduce_dtype
    ]
