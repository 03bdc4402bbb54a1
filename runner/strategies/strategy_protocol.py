"""What the runner asks of a strategy. Each option of the `strategy` group is one file here (single, ddp, fsdp,
deepspeed) whose schema, the dataclass conf/strategy/<name>.yaml fills, implements `Strategy`; the rest of the
runner asks it and never looks at which one it is. Where a strategy's placement and memory terms are long, its
methods call them in modules of their own beside it (fsdp_placement.py, fsdp_memory.py, deepspeed_engine.py,
deepspeed_memory.py). Adding a strategy is a new file, its conf file and its entry in runner/strategies/__init__.py.

A prepared job steps through the strategy's `Stepper`: backward, the optimizer step and what a checkpoint holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, ContextManager, Optional, Protocol, Union

if TYPE_CHECKING:
    import torch
    from torch import nn

    from runner.config.hardware import HardwareConfig
    from runner.config.spec import RunSpec
    from runner.memory.breakdown import Change, Estimate
    from runner.memory.model_shapes import ModelFacts
    from runner.parallel.dims import ParallelDims
    from runner.parallel.sequence import SequenceSplit


class CheckpointLayout(str, Enum):
    """How a checkpoint's model and optimizer state are written (runner/engine/checkpoint.py)."""

    # The whole model and optimizer, gathered on rank 0.
    FULL = "full"
    # Each rank's own shards, which torch.distributed.checkpoint reshards on load.
    SHARDED = "sharded"
    # The engine's own checkpoint (DeepSpeed's): the same number of processes and strategy.
    ENGINE = "engine"

    @property
    def portable(self) -> bool:
        """Whether it resumes on any number of processes and any layout, under any strategy whose stepper reads it
        (all but an engine of its own)."""
        return self is not CheckpointLayout.ENGINE

    def reads(self, written: CheckpointLayout) -> bool:
        """Whether a stepper that writes this layout can resume from a checkpoint written in another: torch's
        state dicts load a FULL or SHARDED checkpoint into any sharding; an engine reads its own only."""
        return written is self or (written.portable and self is not CheckpointLayout.ENGINE)


@dataclass
class WholeWeights:
    """Rank 0's whole state dict and buffers, kept aside while the model is laid out on the meta device."""

    state: dict[str, Any]
    buffers: dict[str, Any]


@dataclass
class StepOutcome:
    grad_norm: Union[float, torch.Tensor]  # before clipping; a tensor stays on the device until the loop reads it
    # False when fp16's loss scale overflowed and the update was skipped (the schedule then waits too).
    applied: bool = True
    loss_scale: Optional[float] = None


class Stepper(Protocol):
    """Backward on each micro batch, then one optimizer step, and the state a checkpoint keeps of them."""

    def micro_batch(self, last: bool) -> ContextManager:
        """Around a micro batch's forward and backward: gradients are synchronised across ranks on the last one."""
        ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> StepOutcome:
        """Clips, updates and clears the gradients; the norm is the one before clipping."""
        ...

    def save(self, directory: Path, rank: int) -> None:
        """Model, optimizer and the stepper's own state (fp16's loss scale) into a checkpoint directory, in the
        strategy's layout; every rank calls it."""
        ...

    def load(self, directory: Path, rank: int, written: CheckpointLayout) -> None:
        """From a checkpoint written in `written` layout (this strategy's, or FULL)."""
        ...

    def full_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        """The whole model's trained weights on rank 0 (all of them, or the adapters of a frozen base), for the
        export; None where the model's own are whole (one process). Every rank calls it."""
        ...


class PipelineStages(Protocol):
    """The pipeline stages a model's parameters are spread over, beyond the strategy's own shards
    (runner/parallel/pipeline/schedule.py): what a stepper asks to take the gradients' norm and to write or export whole
    state."""

    def grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The norm of the whole model's gradients, from this rank's (each parameter's shards combined)."""
        ...

    def whole_model_names(self) -> dict[str, str]:
        """This rank's parameters that the whole model's state names otherwise, by their names here (the last
        stage's end of tied embeddings, which the whole model knows by the first stage's name)."""
        ...

    def keeps_whole(self) -> bool:
        """Whether this rank keeps its stage's whole state to pass to rank 0 (one rank of each stage does)."""
        ...

    def to_rank0(self, value: Any) -> Optional[list[Any]]:
        """Each stage's `value` (that of the rank that keeps its whole state), on rank 0; None elsewhere."""
        ...


class Strategy(Protocol):
    """A strategy option's schema. Its fields are the option's keys; `activation_checkpointing` is every one's."""

    name: ClassVar[str]  # the option: strategy=<name>
    # Runs in a process group, its ranks splitting each global batch; single alone does not.
    distributed: ClassVar[bool]
    # What casts the forward to precision.compute_dtype when it is not the runner's autocast (for the log).
    forward_cast: ClassVar[Optional[str]]
    # Whether its all-gathers can carry float8 weights (precision.fp8.all_gather).
    float8_all_gather: ClassVar[bool]
    # Whether an inference task (evaluate) shards the model across the ranks as training does; otherwise every
    # rank holds a whole replica, with no gradient buckets or engine.
    shards_inference: ClassVar[bool]
    activation_checkpointing: bool

    @property
    def checkpoint_layout(self) -> CheckpointLayout: ...

    def resolved(self, spec: RunSpec) -> RunSpec:
        """The spec with what the strategy's own files decide where the spec does not (DeepSpeed's config file);
        validation asks it before any check."""
        ...

    def check(self, spec: RunSpec) -> None:
        """Raises SpecError for a spec the strategy cannot run: its keys, the hardware, the precision."""
        ...

    def describe(self, spec: RunSpec) -> str:
        """Its line in the log and the estimate: `fsdp FULL_SHARD, 8 processes, mesh 1 x 8 ...`."""
        ...

    def dims(self, hardware: HardwareConfig) -> ParallelDims:
        """How its processes divide the work: the named dimensions of the job's device mesh."""
        ...

    def sequence_split(self, dims: ParallelDims, device_type: str) -> Optional[SequenceSplit]:
        """How the ranks of a context-parallel group (dims.cp > 1) split every sequence: FSDP's ring, DeepSpeed's
        Ulysses; None where it has none."""
        ...

    def loads_weights(self, rank: int) -> bool:
        """Whether this rank builds the model with its weights, or on the meta device to receive rank 0's."""
        ...

    def wrap(
        self,
        model: nn.Module,
        spec: RunSpec,
        device: torch.device,
        dims: ParallelDims,
        whole: Optional[WholeWeights] = None,
    ) -> nn.Module:
        """The model on its device(s), wrapped or sharded over the data-parallel dimensions of `dims`' mesh, with
        rank 0's weights on every rank. `whole`: where only rank 0 loads weights (`loads_weights`), the model is on
        the meta device and these are rank 0's (empty elsewhere)."""
        ...

    def frozen(
        self,
        model: nn.Module,
        spec: RunSpec,
        device: torch.device,
        dims: ParallelDims,
        whole: Optional[WholeWeights] = None,
    ) -> nn.Module:
        """A model that only runs forward beside the trained one (task=dpo's reference), sharded as the trained
        one's weights are: whole, or in the same shards (FSDP's units, ZeRO-3's partitions)."""
        ...

    def frozen_shards(self, spec: RunSpec) -> int:
        """How many shards `frozen` splits a model's weights into (1: whole on every rank)."""
        ...

    def stepper(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        spec: RunSpec,
        device: torch.device,
        stages: Optional[PipelineStages] = None,
    ) -> tuple[nn.Module, Stepper]:
        """The model as the loop calls it, and its stepper; `stages`: the pipeline stages the model is spread over,
        where it is (this rank's `model` then holds its own stages' parameters)."""
        ...

    def estimate_memory(self, spec: RunSpec, facts: ModelFacts) -> Estimate:
        """Its terms of the memory estimate (runner/memory/)."""
        ...

    def memory_changes(self, spec: RunSpec) -> list[Change]:
        """Changes of its own keys (or to another strategy) that save memory, for the fit check's advice."""
        ...


def unwrapped(model: nn.Module) -> nn.Module:
    """The transformers model inside a strategy's wrapper (DDP's and DeepSpeed's `module`; FSDP2 wraps in place)."""
    return getattr(model, "module", model)


def has_frozen_parameters(model: nn.Module) -> bool:
    """Whether part of the model is frozen (adapter=lora, qlora): checkpoints and exports then hold the rest."""
    return any(not parameter.requires_grad for parameter in model.parameters())


def trained_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of a state dict that belong to trained parameters (all of it when nothing is frozen)."""
    if not has_frozen_parameters(model):
        return state
    names = {name for name, parameter in unwrapped(model).named_parameters() if parameter.requires_grad}
    return {name: value for name, value in state.items() if name in names}


def parameter_count(model: nn.Module) -> int:
    """The whole model's parameters, however they are sharded: an FSDP2 DTensor's numel is its global size, and a
    parameter that DeepSpeed ZeRO-3 partitioned keeps its size in ds_numel (its own data is empty)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def model_class_name(model: nn.Module) -> str:
    """fully_shard swaps the model's class for an FSDP<Name> subclass; the name users know is the original."""
    return type(unwrapped(model)).__name__.removeprefix("FSDP")
