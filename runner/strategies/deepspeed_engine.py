"""strategy=deepspeed's engine, which `deepspeed.initialize` makes with the config the spec implies
(runner/strategies/deepspeed_json.py): it wraps model and optimizer together and keeps the fp32 master weights; the
stepper that drives it, and the loading of its checkpoints. runner/strategies/deepspeed.py's
DeepSpeedStrategy.frozen and .stepper call it."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ContextManager, Optional

from runner.distributed import groups_wait_as_long_as_the_world
from runner.library_noise import deepspeed_setup
from runner.strategies.deepspeed_json import deepspeed_config
from runner.strategies.strategy_protocol import CheckpointLayout, StepOutcome, has_frozen_parameters, trained_state

if TYPE_CHECKING:
    import torch
    from torch import nn

    from runner.config.spec import RunSpec


def stepper(
    model: nn.Module, optimizer: torch.optim.Optimizer, spec: RunSpec, zero_stage: int, sp_size: int
) -> tuple[nn.Module, DeepSpeedStepper]:
    """DeepSpeed's engine of model and optimizer, its checkpoints loaded with tensors only unpickled, and its
    stepper."""
    engine = initialized(model, optimizer, spec, sp_size)
    engine.checkpoint_engine = WeightsOnlyLoading(engine.checkpoint_engine)
    return engine, DeepSpeedStepper(engine, zero_stage)


def initialized(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], spec: RunSpec, sp_size: int) -> Any:
    """DeepSpeed's engine of the model (and its optimizer). Under Ulysses (sp_size > 1), the engine reads
    DeepSpeed's sequence-parallel groups, made at placement."""
    import deepspeed

    from runner.parallel.ulysses import deepspeed_groups

    with deepspeed_setup():
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            config=deepspeed_config(spec),
            mpu=deepspeed_groups() if sp_size > 1 else None,
        )
    groups_wait_as_long_as_the_world(spec.hardware.accelerator.value)
    return engine


@dataclass
class DeepSpeedStepper:
    """DeepSpeed's engine steps after every backward and updates only at the accumulation boundary, which it
    counts itself (gradient_accumulation_steps in its config matches train.grad_accum_steps). Its checkpoint, fp16's
    loss scale included, is its own."""

    engine: Any
    zero_stage: int
    grad_norm: Optional[torch.Tensor] = None

    def micro_batch(self, last: bool) -> ContextManager:
        return contextlib.nullcontext()  # the engine reduces at the boundary it counts

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)  # the loss is already a share of the global batch
        if self.engine.is_gradient_accumulation_boundary() and not hasattr(self.engine.optimizer, "_global_grad_norm"):
            # ZeRO-0 in fp32 steps the torch optimizer itself and keeps no norm: the reduced gradients', before
            # the engine clips them
            import torch

            self.grad_norm = torch.nn.utils.get_total_norm(
                [p.grad for p in self.engine.module.parameters() if p.grad is not None]
            ).detach()
        self.engine.step()

    def step(self) -> StepOutcome:
        # Every fp16 optimizer of DeepSpeed has loss_scale; ZeRO-0's FP16_UnfusedOptimizer has no cur_scale.
        scale = self.engine.optimizer.loss_scale if self.engine.fp16_enabled() else None
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            norm = math.nan if self.grad_norm is None else self.grad_norm
        return StepOutcome(norm, self.engine.was_step_applied(), scale)

    # A frozen base (adapter=lora) is left out of what is written, read and exported.
    def save(self, directory: Path, rank: int) -> None:
        self.engine.save_checkpoint(
            str(directory / "deepspeed"), tag="engine", exclude_frozen_parameters=has_frozen_parameters(self.engine)
        )

    def load(self, directory: Path, rank: int, written: CheckpointLayout) -> None:
        self.engine.load_checkpoint(
            str(directory / "deepspeed"),
            tag="engine",
            load_lr_scheduler_states=False,
            load_module_strict=not has_frozen_parameters(self.engine),
        )

    def full_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        if self.zero_stage == 3:  # gathers the partitioned parameters
            frozen = has_frozen_parameters(self.engine)
            return self.engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=frozen) or {}
        return trained_state(self.engine, self.engine.module.state_dict())


class WeightsOnlyLoading:
    """DeepSpeed's checkpoint engine, except that loading unpickles nothing but tensors, containers and the few
    DeepSpeed types its checkpoints hold (DeepSpeed's own loader unpickles anything)."""

    def __init__(self, engine: Any):
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def load(self, path: str, map_location: Any = None) -> Any:
        import torch
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        # The non-tensor types in DeepSpeed's ZeRO 0-3 checkpoints (found with get_unsafe_globals_in_checkpoint):
        # fp16's dynamic loss scaling saves a DynamicLossScaler (fp16 DeepSpeed runs only on GPUs); others a LossScaler.
        with torch.serialization.safe_globals([DynamicLossScaler, LossScaler, ZeroStageEnum, fragment_address]):
            return torch.load(path, map_location=map_location, weights_only=True)
