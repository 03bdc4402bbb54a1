"""What a run trains and what it keeps frozen, as the estimate counts them (runner/config/adapter.py does it).

adapter=none: every parameter trains (P, in the param dtype w, with gradients and optimizer states); nothing is
frozen. adapter=lora or qlora, with r the rank and T = r x sum of (in + out) over the adapted linear layers:

    trained   lora_A (r, in) and lora_B (out, r) beside each adapted nn.Linear (out, in) of the transformer blocks,
              in w: T parameters, the only ones with gradients and optimizer states
    frozen    all P parameters of the model, in the compute dtype c (a frozen base needs no fp32 master copy);
              under qlora an adapted linear's weight in NF4 (NF4_BYTES_PER_WEIGHT, about 0.52 bytes) when it splits
              into whole scale blocks across the processes (nf4_fits), else in c

Each strategy counts gradients, optimizer states and the step's temporaries of the trained shapes as it counts a
full fine-tune's, and adds the frozen base under its own sharding (frozen_bytes). The adapters' own activations:
per adapted linear and token, lora_B's r-sized input, and with adapter.dropout > 0 the dropout's output and its
one-byte mask (lora_A's input; without dropout lora_A shares the base layer's input).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from runner.components.lora import nf4_fits, targets
from runner.components.modeling import blocks
from runner.config.adapter import NF4_BYTES_PER_WEIGHT
from runner.memory.breakdown import FP32, Part, sharded_elements
from runner.parallel.pipeline.layout import balanced_bounds, stage_parameters, stages_of
from runner.parallel.tensor import adapter_shapes, block_plan, split_shapes

if TYPE_CHECKING:
    from runner.config.spec import RunSpec
    from runner.memory.model_shapes import ModelFacts
    from runner.parallel.dims import ParallelDims

NF4 = "NF4"


@dataclass(frozen=True)
class Frozen:
    """Frozen parameters stored alike: their dtype's name, bytes per element and shapes."""

    dtype: str  # bf16, fp16, fp32, NF4
    bytes_per_element: float
    shapes: tuple[tuple[int, ...], ...]

    @property
    def elements(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)

    def bytes(self, shards: int = 1) -> int:
        """Rank 0's bytes of them, each split on dim 0 into `shards` (FSDP2's sharding; 1: whole)."""
        return math.ceil(sharded_elements(list(self.shapes), shards) * self.bytes_per_element)


@dataclass(frozen=True)
class Parameters:
    """The model's parameters under the spec's adapter: the trained shapes, the frozen base by stored dtype."""

    trained_shapes: tuple[tuple[int, ...], ...]
    trained_linear: int  # trained parameters in nn.Linear modules: what autocast casts to the compute dtype
    frozen: tuple[Frozen, ...] = ()  # empty: every parameter trains
    adapted: tuple[tuple[int, int], ...] = ()  # (out, in) of each adapted linear layer
    adapter: str = "none"  # the adapter's kind
    rank: int = 0
    dropout: bool = False
    target_names: tuple[str, ...] = ()
    # The bytes per element each frozen parameter is stored in, by name (its absence: the parameter trains), and
    # the adapter's elements beside each adapted linear, by the linear's module name: FSDP's units read them.
    stored: dict[str, float] = field(default_factory=dict)
    adapters: dict[str, int] = field(default_factory=dict)
    # Tensor-parallel ranks: the trained shapes are then each rank's parts.
    tp: int = 1

    @property
    def trained(self) -> int:
        return sum(math.prod(shape) for shape in self.trained_shapes)

    @property
    def largest_trained(self) -> int:
        return max((math.prod(shape) for shape in self.trained_shapes), default=0)

    @property
    def frozen_parameters(self) -> int:
        return sum(group.elements for group in self.frozen)

    def frozen_bytes(self, shards: int = 1) -> int:
        """Rank 0's bytes of the frozen base, split into `shards` as FSDP2 splits it (1: whole)."""
        return sum(group.bytes(shards) for group in self.frozen)

    @property
    def largest_nf4(self) -> int:
        """Elements of the largest NF4 weight: torchao dequantizes one at a time to the compute dtype."""
        return max(
            (math.prod(shape) for group in self.frozen if group.dtype == NF4 for shape in group.shapes), default=0
        )

    def activation_bytes(self, compute: int) -> int:
        """Bytes per token the adapters save for backward, over all the adapted layers: lora_B's input (rank
        elements), and with dropout lora_A's own input (the dropout's output) and the dropout's one-byte mask."""
        return sum(
            self.rank * compute + ((compute + 1) * columns if self.dropout else 0) for _, columns in self.adapted
        )

    def frozen_note(self) -> str:
        """`bf16 + NF4`: the dtypes the frozen base is stored in."""
        return " + ".join(group.dtype for group in self.frozen)

    def describe(self, param_dtype: str) -> str:
        """The report's line: how many parameters train, how many are frozen and in what."""
        if not self.frozen:
            if self.tp > 1:
                return (
                    f"all train ({param_dtype}; adapter=none: a full fine-tune), split {self.tp} ways: "
                    f"{self.trained:,} on each tensor-parallel rank"
                )
            return f"all {self.trained:,} train ({param_dtype}; adapter=none: a full fine-tune)"
        frozen = ", ".join(f"{group.elements:,} in {group.dtype}" for group in self.frozen)
        split = f", split {self.tp} ways: each tensor-parallel rank's parts" if self.tp > 1 else ""
        return (
            f"{self.trained:,} train ({self.adapter} adapters of rank {self.rank} on {len(self.adapted)} linear "
            f"layers: {', '.join(self.target_names)}; {param_dtype}); {self.frozen_parameters:,} frozen "
            f"({frozen}){split}"
        )


_PARAMETERS: dict[tuple, tuple[ModelFacts, Parameters]] = {}


def _heaviest_pipeline_rank(facts: ModelFacts, dims: ParallelDims) -> Parameters:
    """The parameters of the pipeline rank that holds the most: its stages' layers, and the embeddings or the head
    (a tensor-parallel rank's parts of them). Their linear part is the model's in proportion."""
    split = facts.parameter_shapes if dims.tp == 1 else split_shapes(facts.model, dims.tp)
    bounds = balanced_bounds(facts.model, dims.pp * dims.stages_per_rank)
    stages = stage_parameters(facts.model, bounds, split)
    ranks = [
        [shape for stage in stages_of(rank, dims.pp, dims.stages_per_rank) for shape in stages[stage]]
        for rank in range(dims.pp)
    ]

    def elements(shapes: list[tuple[int, ...]]) -> int:
        return sum(math.prod(shape) for shape in shapes)

    shapes = max(ranks, key=elements)
    share = elements(shapes) / max(1, elements(split))
    return Parameters(
        trained_shapes=tuple(shapes), trained_linear=int(facts.linear_parameters * share) // dims.tp, tp=dims.tp
    )


def parameters_of(spec: RunSpec, facts: ModelFacts) -> Parameters:
    """What the spec's run trains of its model and what it keeps frozen; kept for the next call (the fit check's
    re-estimates ask again)."""
    adapter = spec.adapter
    if not adapter.active:  # under tensor parallelism, each rank's parts (no adapter composes with pipelines)
        dims = spec.layout
        if dims.pp > 1:
            return _heaviest_pipeline_rank(facts, dims)
        shapes = facts.parameter_shapes if dims.tp == 1 else split_shapes(facts.model, dims.tp)
        return Parameters(trained_shapes=tuple(shapes), trained_linear=facts.linear_parameters // dims.tp, tp=dims.tp)
    tp = spec.layout.tp
    key = (id(facts), repr(adapter), spec.precision.compute_dtype, spec.hardware.world_size, tp)
    if key not in _PARAMETERS:
        if len(_PARAMETERS) >= 16:
            _PARAMETERS.pop(next(iter(_PARAMETERS)))
        _PARAMETERS[key] = facts, _adapted(spec, facts, tp)  # the facts kept alive: their id stays theirs
    return _PARAMETERS[key][1]


def _adapted(spec: RunSpec, facts: ModelFacts, tp: int) -> Parameters:
    """Under tensor parallelism (`tp` ranks), each rank's parts: of the base as the plan splits it, and of each
    adapter the matrix on the split side (B beside a layer split by columns, A by rows), the other whole."""
    from torch import nn

    adapter, model = spec.adapter, facts.model
    names = targets(adapter, model)
    plan = block_plan(model, tp) if tp > 1 else {}
    adapted: dict[str, tuple[int, int]] = {}  # module name -> (out, in)
    parts: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {}  # module name -> this rank's A and B
    for block_name, block in blocks(model):
        for name, module in block.named_modules():
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in names:
                rows, columns = module.out_features, module.in_features
                adapted[f"{block_name}.{name}"] = (rows, columns)
                parts[f"{block_name}.{name}"] = adapter_shapes(rows, columns, adapter.rank, plan.get(name), tp)
    in_nf4 = {
        f"{name}.weight"
        for name, shape in adapted.items()
        if adapter.quantized and nf4_fits(shape, spec.hardware.world_size)
    }
    compute = spec.precision.compute_dtype
    stored: dict[str, float] = {}
    groups: dict[str, list[tuple[int, ...]]] = {compute.value: [], NF4: []}
    named = list(model.named_parameters())  # tied parameters once
    shapes = split_shapes(model, tp) if tp > 1 else [tuple(parameter.shape) for _, parameter in named]
    for (name, _), shape in zip(named, shapes):
        nf4 = name in in_nf4
        stored[name] = NF4_BYTES_PER_WEIGHT if nf4 else compute.bytes
        groups[NF4 if nf4 else compute.value].append(shape)
    sizes = {compute.value: compute.bytes, NF4: NF4_BYTES_PER_WEIGHT}
    trained = [shape for pair in parts.values() for shape in pair]
    return Parameters(
        trained_shapes=tuple(trained),
        trained_linear=sum(math.prod(shape) for shape in trained),
        frozen=tuple(Frozen(dtype, sizes[dtype], tuple(shapes)) for dtype, shapes in groups.items() if shapes),
        adapted=tuple(adapted.values()),
        adapter=adapter.kind.value,
        rank=adapter.rank,
        dropout=adapter.dropout > 0,
        target_names=tuple(names),
        stored=stored,
        adapters={name: sum(math.prod(shape) for shape in pair) for name, pair in parts.items()},
        tp=tp,
    )


def host_loading(spec: RunSpec, facts: ModelFacts, loaders: int) -> Part:
    """The node's CPU RAM while `loaders` processes build the model. A full fine-tune builds the fp32 model in each.
    An adapter run loads a pretrained base in the compute dtype straight from the memory-mapped safetensors (the
    page cache, shared and reclaimable: a bf16 checkpoint adds no memory of the process's own), then holds the NF4
    copies of qlora's adapted weights and the adapters; a random-init base is built in the compute dtype."""
    parameters = parameters_of(spec, facts)
    who = "each process builds" if loaders > 1 else "one process builds"
    if not parameters.frozen:
        return Part(loaders * FP32 * facts.parameters, f"{who} the fp32 model")
    adapters = parameters.trained * spec.precision.param_dtype.bytes
    nf4 = sum(group.bytes() for group in parameters.frozen if group.dtype == NF4)
    compute = spec.precision.compute_dtype
    if spec.model.pretrained:
        what = "the adapters" + (" and the NF4 base" if nf4 else "")
        return Part(
            loaders * (nf4 + adapters), f"{who} {what}; the {compute.value} base is memory-mapped (the page cache)"
        )
    return Part(
        loaders * (compute.bytes * facts.parameters + adapters),
        f"{who} the {compute.value} base (random init) and the adapters",
    )


def weights_note(parameters: Parameters, trained_dtype: str, where: str) -> str:
    """The weights' note: `16-bit, whole` for a full fine-tune; `frozen bf16 + NF4 base, fp32 adapters, whole`."""
    if not parameters.frozen:
        return f"{trained_dtype}{where}"
    return f"frozen {parameters.frozen_note()} base, {trained_dtype} adapters{where}"


def adapter_transients(parameters: Parameters, compute: int) -> tuple[int, str]:
    """qlora: torchao dequantizes each NF4 weight to the compute dtype for its matmul, one at a time."""
    largest = parameters.largest_nf4
    return largest * compute, (", a dequantized NF4 weight" if largest else "")
