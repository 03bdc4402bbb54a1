"""The parts of an estimate, its phases and its peak, and the helpers each strategy's terms are written with."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable

from runner.config.hardware import GIB

if TYPE_CHECKING:
    from runner.config.spec import RunSpec
    from runner.memory.model_shapes import ModelFacts

FP32 = 4


@dataclass
class Part:
    bytes: int = 0
    note: str = ""


class Phase(Enum):
    """The moments of a step (and of the start) whose sum of live memory the peak is the largest of."""

    BACKWARD_START = "at the start of backward"
    BACKWARD_END = "at the end of backward"
    OPTIMIZER_STEP = "at the optimizer step"
    LOADING = "while loading the model"
    SAMPLING = "while sampling completions"


@dataclass
class Estimate:
    """Bytes per device (rank 0, which holds the largest shards) and per node's CPU RAM, with what each holds."""

    weights: Part
    gradients: Part
    optimizer_states: Part
    activations: Part
    buffers: Part = field(default_factory=Part)  # kept throughout: communication buckets
    backward_start: Part = field(default_factory=Part)  # transient, at the start of backward
    backward_end: Part = field(default_factory=Part)  # transient, at the end of backward
    step: Part = field(default_factory=Part)  # transient, during the optimizer step
    loading: Part = field(default_factory=Part)  # on the device while the model is placed, before training
    host_offload: Part = field(default_factory=Part)  # the node's CPU RAM: what offload moves there
    host_loading: Part = field(default_factory=Part)  # the node's CPU RAM while its processes build the model
    accumulating: bool = False  # gradients live through forward and backward (train.grad_accum_steps > 1)
    reference: Part = field(default_factory=Part)  # kept throughout: task=dpo's and task=grpo's reference model
    sampling: Part = field(default_factory=Part)  # transient, as task=grpo samples: the KV cache and the logits
    experts: Part = field(default_factory=Part)  # a MoE model's routed experts' share of the parts above, not added

    def phases(self) -> dict[Phase, int]:
        kept = self.weights.bytes + self.optimizer_states.bytes + self.buffers.bytes + self.reference.bytes
        accumulated = self.gradients.bytes if self.accumulating else 0
        phases = {
            Phase.BACKWARD_START: kept + self.activations.bytes + self.backward_start.bytes + accumulated,
            Phase.BACKWARD_END: kept + self.gradients.bytes + self.backward_end.bytes,
            Phase.OPTIMIZER_STEP: kept + self.gradients.bytes + self.step.bytes,
        }
        if self.loading.bytes:
            phases[Phase.LOADING] = self.loading.bytes
        if self.sampling.bytes:
            phases[Phase.SAMPLING] = kept + self.sampling.bytes
        return phases

    @property
    def peak(self) -> int:
        return max(self.phases().values())

    @property
    def peak_phase(self) -> Phase:
        phases = self.phases()
        return max(phases, key=phases.get)

    @property
    def host_peak(self) -> int:
        return max(self.host_offload.bytes, self.host_loading.bytes)


def estimate(spec: RunSpec, facts: ModelFacts) -> Estimate:
    """The run's memory per device and per node, from its spec and its model's shapes: the strategy's terms, and
    the task's (task=dpo: two rows a pair, a reference model)."""
    result = spec.strategy.estimate_memory(spec, facts)
    result.accumulating = spec.train.grad_accum_steps > 1
    return spec.task.memory_terms(spec, facts, result)


@dataclass(frozen=True)
class Change:
    """A change to the spec that saves memory, as the overrides a user would type."""

    overrides: tuple[str, ...]
    cost: float  # roughly what it costs in throughput: the cheapest changes that fit are proposed first
    apply: Callable[[RunSpec], RunSpec]


def strategy_change(override: str, cost: float, **keys: Any) -> Change:
    """A change of the strategy's own keys."""
    return Change((override,), cost, lambda spec: replace(spec, strategy=replace(spec.strategy, **keys)))


def micro_batch_tokens(spec: RunSpec) -> int:
    """The tokens of a micro batch that one rank runs: under context parallelism, its slice of every sequence."""
    return spec.train.micro_batch_size * spec.data.seq_len // spec.layout.cp


def dtype_name(size: int) -> str:
    return {4: "fp32", 2: "16-bit", 1: "fp8"}[size]


def share(shards: int, tp: int = 1) -> str:
    """How much of a tensor a process holds: a 1/shards shard (FSDP's, ZeRO's) of its 1/tp tensor-parallel part."""
    part = f"its 1/{tp} tensor-parallel part" if tp > 1 else ""
    if shards > 1:
        return f", a 1/{shards} shard" + (f" of {part}" if part else "")
    return f", {part}" if part else ""


def reference_model(spec: Any, parameters: int, buffer_bytes: int) -> Part:
    """The reference model of task=dpo and task=grpo: the policy with its adapters off (no copy), or a frozen copy of
    the weights in their dtype, sharded as the strategy shards what it trains (FSDP, ZeRO-3)."""
    if spec.adapter.active:
        return Part(0, "the policy with its adapters off: no copy")
    shards, size = spec.strategy.frozen_shards(spec), spec.precision.param_dtype.bytes
    return Part(
        math.ceil(parameters / shards) * size + buffer_bytes,
        f"a frozen copy of the model, {dtype_name(size)}{share(shards)}",
    )


def processes(count: int) -> str:
    return f"{count} process{'es' if count != 1 else ''}"


def gib(size: int) -> str:
    return f"{size / GIB:.2f}"


def readable(size: int) -> str:
    """GiB, or MiB below one GiB."""
    return f"{size / GIB:.2f} GiB" if size >= GIB or size == 0 else f"{size / 2**20:.2f} MiB"


def sharded_elements(shapes: list[tuple[int, ...]], shards: int) -> int:
    """Elements of rank 0's FSDP2 shards: each parameter split on dim 0, padded to equal shards."""
    return sum(math.ceil(shape[0] / shards) * math.prod(shape[1:]) if shape else 1 for shape in shapes)


def part_row(label: str, part: Part, width: int) -> str:
    """A report's line for one part: its label, its size and what it is."""
    return f"  {label:<{width}} {readable(part.bytes):>12}  {part.note}".rstrip()
