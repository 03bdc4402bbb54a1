"""strategy=single: one process on one device, no wrapping."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, ContextManager, Optional

from runner.components.mixed_precision import grad_scaler
from runner.config.strategy import StrategyConfig
from runner.errors import require
from runner.memory.breakdown import processes
from runner.memory.replicated import whole_copies
from runner.parallel.dims import ParallelDims
from runner.strategies.fsdp import switch_to_fsdp
from runner.strategies.strategy_protocol import CheckpointLayout, PipelineStages, WholeWeights
from runner.strategies.torch_stepper import TorchStepper, no_sync_needed

if TYPE_CHECKING:
    import torch
    from torch import nn

    from runner.config.hardware import HardwareConfig
    from runner.config.spec import RunSpec
    from runner.memory.breakdown import Change, Estimate
    from runner.memory.model_shapes import ModelFacts
    from runner.parallel.sequence import SequenceSplit


@dataclass
class SingleStrategy(StrategyConfig):
    """One process on one device, no wrapping."""

    name: ClassVar[str] = "single"
    distributed: ClassVar[bool] = False
    forward_cast: ClassVar[Optional[str]] = None
    float8_all_gather: ClassVar[bool] = False
    shards_inference: ClassVar[bool] = False
    checkpoint_layout: ClassVar[CheckpointLayout] = CheckpointLayout.FULL

    def resolved(self, spec: RunSpec) -> RunSpec:
        return spec  # no files of its own

    def check(self, spec: RunSpec) -> None:
        machine = spec.hardware
        require(
            machine.world_size == 1,
            f"strategy=single runs one process but the hardware gives {machine.world_size} (hardware.nnodes="
            f"{machine.nnodes} x hardware.nproc_per_node={machine.nproc_per_node}); choose strategy=ddp or "
            "strategy=fsdp, or set hardware.nproc_per_node=1",
        )

    def describe(self, spec: RunSpec) -> str:
        return f"single, {processes(spec.hardware.world_size)}"

    def dims(self, hardware: HardwareConfig) -> ParallelDims:
        return ParallelDims()

    def sequence_split(self, dims: ParallelDims, device_type: str) -> Optional[SequenceSplit]:
        return None

    def loads_weights(self, rank: int) -> bool:
        return True

    def frozen(
        self,
        model: nn.Module,
        spec: RunSpec,
        device: torch.device,
        dims: ParallelDims,
        whole: Optional[WholeWeights] = None,
    ) -> nn.Module:
        return model.to(device)  # no gradients to reduce: a replica as it is

    def frozen_shards(self, spec: RunSpec) -> int:
        return 1

    def wrap(
        self,
        model: nn.Module,
        spec: RunSpec,
        device: torch.device,
        dims: ParallelDims,
        whole: Optional[WholeWeights] = None,
    ) -> nn.Module:
        return model.to(device)

    def stepper(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        spec: RunSpec,
        device: torch.device,
        stages: Optional[PipelineStages] = None,
    ) -> tuple[nn.Module, TorchStepper]:
        scaler = grad_scaler(spec.precision, device, sharded=False)
        return model, TorchStepper(
            model, optimizer, spec.train.max_grad_norm, self.checkpoint_layout, scaler, self.gradient_sync(model)
        )

    def gradient_sync(self, model: nn.Module) -> Callable[[bool], ContextManager]:
        """What holds back the gradients' reduction on the micro batches before a step's last: nothing to reduce."""
        return no_sync_needed

    def estimate_memory(self, spec: RunSpec, facts: ModelFacts) -> Estimate:
        return whole_copies(spec, facts)

    def memory_changes(self, spec: RunSpec) -> list[Change]:
        return [switch_to_fsdp()]
