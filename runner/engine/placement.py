"""The model from its spec to what the loop trains, in one visible order (torchtitan's, as in its `parallelize_llama`
and `pipeline_llama`): build (with the summed loss in its forward) -> the adapters (LoRA; QLoRA's NF4 base) -> fp8
-> the weights' dtype -> the attention (per example, for packed rows on the CPU; the split's under context
parallelism) -> this rank's pipeline stages -> tensor parallelism -> activation checkpointing -> compile each block
-> wrap or shard (with rank 0's weights; each pipeline stage on its own) -> optimizer -> stepper -> the pipeline's
schedule.

Why this order: the adapters come first, so that everything after sees the frozen base as it is kept (in the
compute dtype, or NF4) and the adapters as parameters of the blocks they adapt. fp8 swaps the linear layers, so it
comes before anything that holds on to them (checkpointed blocks, FSDP's units, DeepSpeed's partitions). The
dtype is the weights' before sharding, so that shards, buckets and all-gathers take it. The pipeline cut comes
before anything that wraps the blocks: each rank keeps only its stages' layers, and everything after sees those
alone; FSDP then shards each stage as a root of its own, as the schedule calls it. Tensor parallelism splits
the blocks' layers before anything wraps them: checkpointing then recomputes the split layers with their
collectives, and FSDP shards the split parameters, as 2-D tensors, over the data-parallel dimensions of the same
mesh. Activation checkpointing wraps each block's forward inside the block, and the strategy's wrapping then sees
the checkpointed blocks. Context parallelism changes no module but the attention: FSDP shards over its ranks too
(ParallelDims' sharding mesh), DeepSpeed partitions over them, and each step splits the sequences around the
forward and backward (runner/parallel/sequence.py).
Compiling replaces each block's forward with its compiled version, in place: the strategy's hooks and the
checkpointing around it stay eager, and the blocks keep their class and parameter names, which FSDP's wrap policy
and every checkpoint read. FSDP shards unit by unit, the blocks first. Where rank 0 alone builds the weights
(cpu_ram_efficient_loading), it sets them aside whole before the split, and every rank lays the model out on the
meta device: the split and the shards take their shapes from it, and the wrap fills them with rank 0's values. The
optimizer takes the parameters as the strategy left them (FSDP's DTensor shards; the adapters only, when the base
is frozen), and DeepSpeed's engine takes model and optimizer together, in the stepper. An inference task (evaluate,
generate) takes the same path up to the wrap, without activation checkpointing, optimizer or stepper: no gradient
or optimizer state is ever allocated.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, ContextManager, Optional

from runner.compat import checkpoint_activations
from runner.components.fp8 import convert_to_fp8, summarize_names
from runner.components.lora import add_adapter
from runner.components.mixed_precision import PrecisionInEffect, autocast, cast_weights
from runner.components.modeling import blocks, build_model
from runner.components.optimizers import build_optimizer
from runner.config.hardware import Accelerator
from runner.config.precision import Dtype
from runner.config.training import LossKind
from runner.engine.attention import attend_causally_unmasked, attend_with, attend_within_examples, per_example_attention
from runner.engine.loss import summed_loss_from_hidden, with_summed_loss
from runner.engine.router import router_loss
from runner.parallel.experts import shard_experts
from runner.parallel.pipeline.layout import balanced_bounds, stages_of
from runner.parallel.tensor import parallelize_tensors
from runner.strategies.strategy_protocol import WholeWeights

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PreTrainedTokenizerBase

    from runner.config.spec import RunSpec
    from runner.distributed import Ranks
    from runner.parallel.pipeline.schedule import Pipeline
    from runner.parallel.sequence import SequenceSplit
    from runner.strategies.strategy_protocol import Stepper

log = logging.getLogger("runner")


@dataclass
class Placed:
    """The model as the loop calls it, its optimizer and stepper, and how its forward is cast."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    stepper: Stepper
    spec: RunSpec
    device: torch.device
    ranks: Ranks
    fp8_layers: list[str] = field(default_factory=list)
    # Under pipeline parallelism, the schedule of this rank's stages, which runs the steps and the evaluation.
    pipeline: Optional[Pipeline] = None
    sequence_split: Optional[SequenceSplit] = None

    def autocast(self) -> ContextManager:
        """The forward's context: the runner's autocast, unless the strategy casts the forward itself."""
        return autocast(self.spec.precision, self.device, compute_dtype=self.spec.strategy.forward_cast is None)

    def precision_in_effect(self) -> PrecisionInEffect:
        """The dtypes really in use (forward, weights, master weights, optimizer states), read from the tensors."""
        low = self.spec.precision.compute_dtype is not Dtype.fp32
        cast_by = (self.spec.strategy.forward_cast or "autocast") if low else ""
        return PrecisionInEffect.read(
            self.model,
            self.optimizer,
            self.spec.precision,
            cast_by,
            len(self.fp8_layers),
            gradient_reduce=self.ranks.world_size > 1,
        )


def place(spec: RunSpec, ranks: Ranks, device: torch.device, tokenizer: PreTrainedTokenizerBase) -> Placed:
    dims = spec.layout
    on_layout = placed_model(spec, ranks, device, tokenizer, training=True)
    model = on_layout.model
    optimizer = build_optimizer(model, spec.optim)
    pipeline = None
    if on_layout.stages:
        from runner.parallel.pipeline.schedule import build_pipeline

        pipeline = build_pipeline(
            on_layout.stages, on_layout.stage_ids, spec, dims, ranks.rank, device, tokenizer.pad_token_id
        )
    model, stepper = spec.strategy.stepper(model, optimizer, spec, device, stages=pipeline)
    return Placed(
        model, optimizer, stepper, spec, device, ranks, on_layout.fp8_layers, pipeline, on_layout.sequence_split
    )


@dataclass
class ModelOnLayout:
    model: nn.Module  # the whole model, or this rank's part of it: its pipeline stages' layers
    fp8_layers: list[str]
    # Under pipeline parallelism, this rank's stages (each sharded by the strategy as a root) and their indices.
    stages: list[nn.Module] = field(default_factory=list)
    stage_ids: list[int] = field(default_factory=list)
    # Under context parallelism, how each micro batch's sequences are split over the group.
    sequence_split: Optional[SequenceSplit] = None


def placed_model(
    spec: RunSpec,
    ranks: Ranks,
    device: torch.device,
    tokenizer: PreTrainedTokenizerBase,
    training: bool,
    weights: Optional[dict[str, torch.Tensor]] = None,
    frozen: bool = False,
) -> ModelOnLayout:
    """The model wrapped or sharded by its strategy on the spec's layout, and its fp8 layers. `weights`: a whole
    state dict to load (a checkpoint's model). For inference (not `training`), no activation checkpointing, and a
    whole replica on this rank's device unless the strategy shards inference too; `frozen` (task=dpo's reference),
    sharded as the strategy shards what it trains. In training under pipeline parallelism, this rank's stages."""
    strategy, dims = spec.strategy, spec.layout
    sharded = training or frozen or strategy.shards_inference
    model, loss_kind, fp8_layers = built_model(spec, ranks, tokenizer, training, weights)
    # A frozen reference runs the trained model's slices of the rows with it.
    sequence_split = attention_of(model, spec, device, training, frozen)
    whole = None
    if sharded and not all(strategy.loads_weights(rank) for rank in range(ranks.world_size)):
        # Rank 0 sets its weights aside whole, and every rank lays the model out on the meta device: the split and
        # the shards take their shapes from it, and the wrap fills them with rank 0's values.
        whole = set_aside(model, ranks.rank)
        model = model.to("meta")
        model.tie_weights()  # moving to meta unties the LM head from the embeddings; the other ranks have them tied
    on_layout = ModelOnLayout(model, fp8_layers, sequence_split=sequence_split)
    if training and dims.pp > 1:
        from runner.parallel.pipeline.stages import cut_into_stages

        on_layout.stage_ids = stages_of(dims.pp_rank(ranks.rank), dims.pp, dims.stages_per_rank)
        bounds = balanced_bounds(model, dims.pp * len(on_layout.stage_ids))
        loss = partial(summed_loss_from_hidden, loss_kind, spec.train.loss_chunk_tokens)
        tp_mesh = dims.mesh(device.type)["tp"] if dims.tp > 1 else None
        on_layout.stages = cut_into_stages(model, on_layout.stage_ids, bounds, spec.data.packing, loss, tp_mesh)
    if sharded and dims.tp > 1:
        parallelize_tensors(model, dims.mesh(device.type)["tp"])
    if sharded and dims.ep > 1:
        log.info(
            "experts of %d MoE layers split over ep %d",
            shard_experts(model, dims.experts_view(device.type)["ep"]),
            dims.ep,
        )
    if training and strategy.activation_checkpointing:
        checkpoint_activations(model)
    if training and spec.train.compile:
        compile_blocks(model)
    if frozen:
        on_layout.model = strategy.frozen(model, spec, device, dims, whole)
    elif on_layout.stages:
        on_layout.stages = [strategy.wrap(stage, spec, device, dims) for stage in on_layout.stages]
    elif sharded:
        on_layout.model = strategy.wrap(model, spec, device, dims, whole)
    else:
        on_layout.model = model.to(device)
    return on_layout


def built_model(
    spec: RunSpec,
    ranks: Ranks,
    tokenizer: PreTrainedTokenizerBase,
    training: bool,
    weights: Optional[dict[str, torch.Tensor]],
) -> tuple[nn.Module, LossKind, list[str]]:
    """The model as its precision and adapter have it, before any layout: fp32 master weights built on the CPU (on
    the meta device on the ranks that receive rank 0's), the loss it computes, and its fp8 layers."""
    import torch

    torch.manual_seed(spec.seed)
    builds_weights = spec.strategy.loads_weights(ranks.rank)
    # A frozen base is built in the dtype it is kept in; trained weights in fp32. Inference reads what an adapter
    # run saved merged, and adds no adapter.
    adapted = training and spec.adapter.active
    base_dtype = spec.precision.compute_dtype.torch if adapted else None
    model = build_model(spec.model, tokenizer, weights=builds_weights, dtype=base_dtype)
    if weights is not None and builds_weights:
        model.load_state_dict(weights)
    router = router_loss(model.config, spec.model) if training else None
    loss_kind = with_summed_loss(model, spec.train.loss, spec.train.loss_chunk_tokens, router)
    if adapted:
        log.info(
            "adapter %s", add_adapter(model, spec.adapter, spec.precision.param_dtype.torch, spec.hardware.world_size)
        )
    fp8_layers = convert_to_fp8(model, spec.precision.fp8) if spec.precision.fp8 else []
    if fp8_layers:
        log.info("fp8: %d linear layers converted: %s", len(fp8_layers), summarize_names(fp8_layers))
    if not adapted:  # the adapters are in param_dtype already, the frozen base in its own
        model = cast_weights(model, spec.precision)
    return model, loss_kind, fp8_layers


def attention_of(
    model: nn.Module, spec: RunSpec, device: torch.device, training: bool, frozen: bool
) -> Optional[SequenceSplit]:
    """The attention the model runs on its rows (within packed examples, or causally without a mask), and under
    context parallelism how its group splits every sequence."""
    dims = spec.layout
    if training and spec.data.packing and device.type == "cpu":
        attend_within_examples(model)
    elif (training or frozen) and not spec.data.packing:
        attend_causally_unmasked(model)
    sequence_split = spec.strategy.sequence_split(dims, device.type) if (training or frozen) and dims.cp > 1 else None
    if sequence_split:
        within_examples = per_example_attention if spec.data.packing else None
        attend_with(model, sequence_split.name, sequence_split.attention(model, within_examples))
    return sequence_split


def set_aside(model: nn.Module, rank: int) -> WholeWeights:
    """Rank 0's state dict, and its buffers: those outside the state dict (rotary frequencies) would come back
    empty from the meta device."""
    if rank != 0:
        return WholeWeights({}, {})
    return WholeWeights(model.state_dict(), {name: buffer.clone() for name, buffer in model.named_buffers()})


def frozen_base(spec: RunSpec, tokenizer: PreTrainedTokenizerBase) -> nn.Module:
    """The base of an adapter run as it was built before training (it never changed): on the CPU, in its dtype."""
    import torch

    torch.manual_seed(spec.seed)
    return build_model(spec.model, tokenizer, dtype=spec.precision.compute_dtype.torch)


def device_of(spec: RunSpec, ranks: Ranks) -> torch.device:
    """This rank's device: its local GPU, or the CPU."""
    import torch

    cuda = spec.hardware.accelerator is Accelerator.cuda
    return torch.device("cuda", ranks.local_rank) if cuda else torch.device("cpu")


def compile_blocks(model: nn.Module) -> None:
    """torch.compile each transformer block's forward (each block compiles once, whatever the depth: the blocks
    share their code and recompile only on new shapes)."""
    import torch

    for _, block in blocks(model):
        block.forward = torch.compile(block.forward)
