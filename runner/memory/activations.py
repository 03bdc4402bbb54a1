"""Activations, per device, after Korthikanti et al., 2022, "Reducing Activation Recomputation in Large Transformer
Models" (section 4.1: a layer saves sbh(34 + 5as/h) bytes in 16-bit with dropout and materialised attention
scores), counted tensor by tensor for transformers' implementations. Per token and layer, with r the bytes of the
residual stream (4 when the weights are fp32 and autocast casts, 2 when the module itself runs in 16-bit), l the
bytes of a saved matmul input (c; 1 for fp8 linears), q = heads x head_dim and kv = key-value heads x head_dim:

    norms       2 (4 + r) h          RMSNorm: its fp32 input and normalised output (LayerNorm: 2 r h)
    qkv input   3 l h                one cast per projection under autocast or fp8; l h when the input is shared
    q, k, v     c (q + 2 kv)         rotated q and k, and v, saved by the attention kernel
    attention   c q                  sdpa / flash attention: the output; no s x s scores are stored
                + a s (4 + c)        eager attention only: fp32 softmax and its cast (+ a s (c + 1) with dropout)
    mlp input   2 l h                gate and up each cast (l h when shared)
    mlp         (3c + l) I           SwiGLU: gate, act(gate), up, and down's input (plain MLP: (c + l) I)
                                     MoE layers: each of the token's k experts' (runner/memory/expert_memory.py)
    dropout     2 h                  one-byte masks, where the model has hidden dropout

With c = r = l = 2, LayerNorm, a 4h GELU MLP and eager attention with dropout this is the paper's 34 h + 5 a s.
The whole model: t x (L x layer + final norm + (c + 4) V for the logits and their fp32 log-softmax). The chunked
loss (train.loss, runner/engine/loss.py) keeps no logits: its head's input, r h per token, and in backward one
chunk's recomputed logits and their gradients at a time. With activation checkpointing
(strategy.activation_checkpointing=true, under every strategy) each layer keeps only its
input, t x L x r x h, and one layer at a time is recomputed (the paper's "full recomputation", 2sbhL).

With LoRA adapters (runner/memory/parameters.py) each adapted linear adds, per token, lora_B's input (rank x c) and,
with adapter.dropout > 0, the dropout's output and mask (in x (c + 1)); the frozen base is stored in c, so the
stream is c and autocast makes no casts of it. The inputs of frozen linear layers that are not adapted are still
counted, though autograd does not keep them (no weight gradient needs them): an overcount where target_modules
is a subset.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

from runner.config.training import LossKind, loss_kind_in_effect
from runner.memory.breakdown import FP32, Part, micro_batch_tokens
from runner.memory.expert_memory import moe_mlp_bytes
from runner.memory.parameters import parameters_of
from runner.parallel.pipeline.layout import PipelineSchedule, balanced_bounds, stages_of

if TYPE_CHECKING:
    from runner.config.spec import RunSpec
    from runner.memory.model_shapes import ExpertFacts, LayerShape, ModelFacts


@dataclass(frozen=True)
class ActivationDtypes:
    compute: int  # c: bytes of the forward's matmul outputs
    stream: int  # r: bytes of the residual stream between layers
    casts: bool  # autocast: each projection saves its own cast of a shared input
    fp8: bool = False  # the blocks' linear layers save their inputs in fp8


def layer_activation_bytes(
    layer: LayerShape, seq_len: int, dtypes: ActivationDtypes, experts: Optional[ExpertFacts] = None
) -> int:
    """Bytes one layer saves for backward, per token (Korthikanti et al., 2022, section 4.1, adapted); `experts`:
    a MoE layer's, whose routed experts take the dense MLP's place."""
    h, i = layer.hidden, layer.intermediate
    q, kv = layer.heads * layer.head_dim, layer.kv_heads * layer.head_dim
    c, r = dtypes.compute, dtypes.stream
    saved_input = 1 if dtypes.fp8 else c  # what a linear layer keeps of its input
    separate = dtypes.casts or dtypes.fp8
    norms = 2 * ((FP32 + r) * h if layer.rms_norm else r * h)
    attention_inputs = (layer.attention_projections if separate else 1) * saved_input * h
    if layer.eager_attention:
        qkv = c * 3 * q  # repeat_kv widens k and v to every head before the matmuls save them
        softmax = (FP32 + c) if layer.softmax_fp32 else c
        scores = layer.heads * seq_len * (softmax + ((c + 1) if layer.attention_dropout else 0))
        attention = saved_input * q + scores  # o_proj's input; the attention output itself is not kept
    else:
        qkv = c * (q + 2 * kv)
        attention = c * q + (saved_input * q if dtypes.fp8 else 0)  # the kernel keeps its output, o_proj shares it
    mlp_inputs = (layer.mlp_projections if separate else 1) * saved_input * h
    mlp = (3 * c + saved_input) * i if layer.gated_mlp else (c + saved_input) * i
    if experts is not None:
        mlp = moe_mlp_bytes(experts, h, c, saved_input)
    dropout = 2 * h if layer.hidden_dropout else 0
    return norms + attention_inputs + qkv + attention + mlp_inputs + mlp + dropout


def activation_bytes(
    facts: ModelFacts,
    tokens: int,
    seq_len: int,
    dtypes: ActivationDtypes,
    checkpointing: bool,
    chunked_loss: bool = False,
    adapters: int = 0,
    tp: int = 1,
    layers: Optional[int] = None,
    head: bool = True,
) -> int:
    """`adapters`: bytes per token the LoRA adapters of all the layers save (runner/memory/parameters.py). `tp`:
    tensor-parallel ranks, which split every layer's activations (their heads and MLP columns, and along the
    sequence between the blocks: the paper's section 4.2.2) and gather the head's input and the logits whole.
    `layers`, `head`: a pipeline rank's decoder layers, and whether it holds the head (all of them, and it does)."""
    layer = facts.layer
    layers = facts.layers if layers is None else layers
    sizes = _layer_sizes(facts, seq_len, dtypes)
    per_layer = [(size + adapters // facts.layers) // tp for size in sizes]
    head_input = (FP32 + dtypes.stream) * layer.hidden // tp + dtypes.compute * layer.hidden  # final norm, lm_head
    if chunked_loss:  # the label positions' hidden states, which each chunk's head recomputes from
        logits = dtypes.stream * layer.hidden
    else:  # the logits, and the loss's fp32 log-softmax
        logits = (dtypes.compute + FP32) * facts.vocab
    if checkpointing:  # each layer keeps its input; one layer at a time is recomputed in backward
        blocks = layers * dtypes.stream * layer.hidden // tp + max(per_layer)
    else:  # a pipeline rank's layers as many of the model's average ones
        blocks = sum(per_layer) * layers // facts.layers
    return tokens * (blocks + (head_input + logits if head else 0))


def _layer_sizes(facts: ModelFacts, seq_len: int, dtypes: ActivationDtypes) -> list[int]:
    """Each layer's bytes per token: a MoE layer's experts in place of a dense layer's MLP."""
    experts = facts.experts
    moe = set(experts.moe_layers) if experts else set()
    dense = layer_activation_bytes(facts.layer, seq_len, dtypes)
    routed = layer_activation_bytes(facts.layer, seq_len, dtypes, experts) if experts else dense
    return [routed if index in moe else dense for index in range(facts.layers)]


def pipeline_activations_part(
    spec: RunSpec, facts: ModelFacts, dtypes: ActivationDtypes, schedule: PipelineSchedule
) -> Part:
    """Under pipeline parallelism, the activations of the pipeline rank that holds the most: its stages' layers
    for each microbatch in flight under the schedule (the first rank's, under 1F1B), and the last rank's head."""
    dims = spec.layout
    stages = dims.pp * dims.stages_per_rank
    bounds = balanced_bounds(facts.model, stages)
    one = activations_part(spec, facts, dtypes)
    tokens, microbatches = micro_batch_tokens(spec), spec.train.grad_accum_steps
    held = []
    for rank in range(dims.pp):
        mine = stages_of(rank, dims.pp, dims.stages_per_rank)
        layers = sum(bounds[stage][1] - bounds[stage][0] for stage in mine)
        per_microbatch = activation_bytes(
            facts,
            tokens,
            spec.data.seq_len,
            dtypes,
            spec.strategy.activation_checkpointing,
            chunked_loss(spec, facts),
            parameters_of(spec, facts).activation_bytes(dtypes.compute),
            dims.tp,
            layers=layers,
            head=stages - 1 in mine,
        )
        held.append((schedule.in_flight(microbatches, dims.pp, rank) * per_microbatch, rank, layers))
    most, rank, layers = max(held)
    note = one.note.replace(
        f"{facts.layers} layers", f"{layers} of {facts.layers} layers (pipeline rank {rank} of {dims.pp})", 1
    )
    return replace(
        one,
        bytes=int(most),
        note=f"{note}; {schedule.in_flight(microbatches, dims.pp, rank):g} of "
        f"{microbatches} microbatches in flight ({schedule.value})",
    )


def chunked_loss(spec: RunSpec, facts: ModelFacts) -> bool:
    return loss_kind_in_effect(spec.train.loss, facts.model_type, facts.vocab) is LossKind.chunked


def loss_gradient_bytes(spec: RunSpec, facts: ModelFacts) -> int:
    """At the start of backward: the fp32 gradients of the log-probabilities and of the logits; under the chunked
    loss, one chunk's recomputed logits (and their fp32 copy) with those gradients and the logits' own."""
    tokens = micro_batch_tokens(spec)
    if chunked_loss(spec, facts):
        compute = spec.precision.compute_dtype.bytes
        return min(spec.train.loss_chunk_tokens, tokens) * (2 * compute + 3 * FP32) * facts.vocab
    return tokens * 2 * FP32 * facts.vocab


def activations_part(spec: RunSpec, facts: ModelFacts, dtypes: ActivationDtypes) -> Part:
    """What a micro batch's forward keeps for backward, under the spec's activation checkpointing and loss. Packed
    rows are full rows of seq_len tokens; padded ones at most that (the longest row of the batch)."""
    checkpointing, chunked = spec.strategy.activation_checkpointing, chunked_loss(spec, facts)
    attention = "eager attention (s x s scores)" if facts.layer.eager_attention else "sdpa (no s x s scores)"
    rows = "packed rows" if spec.data.packing else "rows"
    parameters = parameters_of(spec, facts)
    adapters = parameters.activation_bytes(dtypes.compute)
    dims = spec.layout
    tp = dims.tp
    split = f", split {tp} ways (tensor and sequence parallel)" if tp > 1 else ""
    split += f", a 1/{dims.cp} slice of each sequence (context parallel)" if dims.cp > 1 else ""
    note = (
        f"{spec.train.micro_batch_size} {rows} x {spec.data.seq_len} tokens, {facts.layers} layers{split}, "
        f"{attention}, {'activation checkpointing' if checkpointing else 'no checkpointing'}; "
        f"{'the chunked loss (no logits kept)' if chunked else 'the logits'}"
        + (
            f"; the adapters' rank-{parameters.rank} intermediates"
            + (" and dropout copies" if parameters.dropout else "")
            if adapters
            else ""
        )
    )
    return Part(
        activation_bytes(
            facts, micro_batch_tokens(spec), spec.data.seq_len, dtypes, checkpointing, chunked, adapters, tp
        ),
        note,
    )
