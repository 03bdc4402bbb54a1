"""Memory estimate: what one run of the spec holds on each device and in each node's RAM, before it starts.

The model is built on the meta device (shapes, no weights: seconds even for 70B). Notation: P parameters (tied
ones once), N processes, S the size of an FSDP shard group, w the bytes of a parameter as the optimizer updates it
(4 for fp32; 2 under precision.param_dtype=bf16), c the bytes of the compute dtype (2 for bf16/fp16), k the
optimizer's states per parameter (AdamW 2, SGD with momentum 1, SGD without 0), V the vocabulary, t the tokens of
a micro batch (train.micro_batch_size x data.seq_len).

Weights, gradients and optimizer states, per device:

    single, ddp       weights P.w        gradients P.w        states k.P.w          (ddp: + P.w of gradient buckets)
    fsdp              weights P_S.w      gradients P_S.w      states k.P_S.w
                      P_S = sum over parameters of ceil(rows / S) x columns: FSDP2 shards dim 0, padded evenly;
                      S = N (FULL_SHARD, SHARD_GRAD_OP), 1 (NO_SHARD), the group (HYBRID_SHARD*: replicated across)
    deepspeed 0       fp32: as single;   bf16/fp16: weights 2P + 4P (fp32 master), gradients 2P, states 4k.P
    deepspeed 1, 2    weights m.P + 4.P/N (m = 2 in bf16/fp16, else 4), gradients m.P/N, states 4k.P/N
                      (+ the whole gradient of a parameter that straddles the partition's edge, at most 2)
    deepspeed 3       weights m.P/N + m.P_persist + 4.P/N, gradients m.P/N, states 4k.P/N
                      (P_persist: parameters of at most stage3_param_persistence_threshold elements stay whole)

The optim group has no 8-bit optimizer yet; one (bitsandbytes' or torchao's AdamW8bit) would hold 2 bytes of states
per parameter plus a scale per block instead of AdamW's 8.

Offload moves to CPU RAM: fsdp offload_params the sharded weights, gradients and states ((2 + k).P_S.w per
process); deepspeed offload_optimizer the fp32 master, its gradients and the states ((8 + 4k).P/N), offload_param
the ZeRO-3 weight partitions (m.P/N).

Activations, per device, after Korthikanti et al., 2022, "Reducing Activation Recomputation in Large Transformer
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
    dropout     2 h                  one-byte masks, where the model has hidden dropout

With c = r = l = 2, LayerNorm, a 4h GELU MLP and eager attention with dropout this is the paper's 34 h + 5 a s.
The whole model: t x (L x layer + final norm + (c + 4) V for the logits and their fp32 log-softmax). With
activation checkpointing (strategy=fsdp strategy.activation_checkpointing=true) each layer keeps only its input,
t x L x r x h, and one layer at a time is recomputed (the paper's "full recomputation", 2sbhL).

Transient buffers: the loss gradient, t x 8V at the start of backward; autocast's cached casts of the linear
weights (c per parameter) under single and ddp; FSDP's all-gathered units in the compute dtype (the root unit,
which FSDP2 keeps gathered from forward to backward, plus 2 + prefetch times the largest unit; SHARD_GRAD_OP keeps
every unit gathered until backward) and a reduce-scatter of a unit (compute + reduce dtype); DeepSpeed's reduce
bucket (reduce_bucket_size elements, twice with overlap_comm), ZeRO-3's live parameters (the largest module plus
stage3_prefetch_bucket_size, at most stage3_max_live_parameters), and the stage-0/1 full gradients before their
reduction; the optimizer step's temporaries (torch's foreach AdamW: one state's size; DeepSpeed: the partition's
fp32 gradients too).

The peak per device is the largest of the phases: weights + states + kept buffers, plus activations + transients at
the start of backward (+ gradients when accumulating), or gradients + transients at its end, or gradients + step
temporaries; and, for DeepSpeed, which moves the whole module onto each device before partitioning it, m.P while
loading. Each node's RAM holds what offload moves there, and while loading, the fp32 model each process builds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Optional

from runner.hardware import GIB, Accelerator
from runner.optim import AdamWConfig, OptimConfig, SGDConfig
from runner.precision import Dtype
from runner.spec import RunSpec, SpecError
from runner.strategy import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    OffloadDevice,
    ShardingStrategy,
    SingleStrategy,
    describe,
    shard_mesh_shape,
)
from runner.task import EstimateTask

if TYPE_CHECKING:
    from torch import nn

    from runner.model import ModelConfig

FP32 = 4
# DeepSpeed's defaults for the zero_optimization keys the estimate reads (deepspeed/runtime/zero/config.py).
DEEPSPEED_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_model_persistence_threshold": 2**63 - 1,
    "sub_group_size": 1_000_000_000,
}
# DeepSpeed ZeRO-0 all-reduces the gradients through flat copies of at most this many elements
# (engine.buffered_allreduce_fallback's elements_per_buffer).
DEEPSPEED_ALLREDUCE_BUCKET = 500_000_000


# ---------------------------------------------------------------------------------------------------------------
# The model, as the estimate sees it


@dataclass(frozen=True)
class LayerShape:
    """One transformer layer, as far as what it saves for backward goes."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    gated_mlp: bool = True  # SwiGLU: gate, up and down projections
    rms_norm: bool = True  # transformers' RMSNorm computes in fp32; LayerNorm in the stream's dtype
    attention_projections: int = 3  # separate q, k and v; 1 when fused
    mlp_projections: int = 2  # separate gate and up; 1 when fused or a plain MLP
    eager_attention: bool = False  # eager attention stores the s x s scores; sdpa and flash attention do not
    softmax_fp32: bool = True  # transformers' eager attention takes the softmax in fp32, then casts it
    attention_dropout: bool = False
    hidden_dropout: bool = False


@dataclass
class ModelFacts:
    model: Any  # the nn.Module, on the meta device
    parameters: int  # tied parameters once
    parameter_shapes: list[tuple[int, ...]]
    buffer_bytes: int
    linear_parameters: int  # in nn.Linear modules: what autocast casts to the compute dtype
    layers: int
    vocab: int
    layer: LayerShape
    largest_module: int  # the most parameters one module holds itself (DeepSpeed ZeRO-3 gathers per module)
    largest_parameter: int


_FACTS: dict[str, ModelFacts] = {}


def facts_of(model: ModelConfig) -> ModelFacts:
    """The facts of the model the run trains, built on the meta device; kept for the next call (validation and
    the fit check's re-estimates ask again)."""
    from runner.model import build_model, build_tokenizer

    key = repr(model)
    if key not in _FACTS:
        tokenizer = build_tokenizer(model) if model.architecture else None
        try:
            module = build_model(model, tokenizer, weights=False)
        except Exception as error:  # noqa: BLE001 - whatever transformers says of the config is the user's to fix
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            raise SpecError(f"cannot build the model's architecture: {lines[-1] if lines else repr(error)}") from None
        if len(_FACTS) >= 8:
            _FACTS.pop(next(iter(_FACTS)))
        _FACTS[key] = model_facts(module)
    return _FACTS[key]


def meta_model(model: ModelConfig) -> nn.Module:
    return facts_of(model).model


def model_facts(model: nn.Module) -> ModelFacts:
    from torch import nn

    config = model.config
    parameters = list(model.parameters())
    hidden, heads = config.hidden_size, config.num_attention_heads
    block = _first_block(model)
    linear_names = [name for name, module in block.named_modules() if isinstance(module, nn.Linear)]

    def named(*suffixes: str) -> int:
        return sum(any(name.endswith(suffix) for suffix in suffixes) for name in linear_names)

    def dropout(*keys: str) -> bool:
        return any((getattr(config, key, 0.0) or 0.0) > 0 for key in keys)

    layer = LayerShape(
        hidden=hidden,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or hidden // heads,
        intermediate=getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden,
        gated_mlp=named("gate_proj", "gate_up_proj", "w1", "w3") > 0,
        rms_norm=any("RMSNorm" in type(module).__name__ for module in block.modules()),
        attention_projections=3 if named("q_proj", "k_proj", "v_proj", "query", "key", "value") >= 3 else 1,
        mlp_projections=2 if named("gate_proj", "up_proj", "w1", "w3") >= 2 else 1,
        eager_attention=getattr(config, "_attn_implementation", "sdpa") == "eager",
        attention_dropout=dropout("attention_dropout", "attention_probs_dropout_prob", "attn_pdrop"),
        hidden_dropout=dropout("hidden_dropout_prob", "hidden_dropout", "resid_pdrop"),
    )
    linear = {id(p): p.numel() for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()}
    return ModelFacts(
        model=model,
        parameters=sum(p.numel() for p in parameters),
        parameter_shapes=[tuple(p.shape) for p in parameters],
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        linear_parameters=sum(linear.values()),
        layers=config.num_hidden_layers,
        vocab=config.vocab_size,
        layer=layer,
        largest_module=max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()),
        largest_parameter=max(p.numel() for p in parameters),
    )


def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The transformer blocks: instances of the classes the model names as not to be split."""
    block_classes = set(getattr(model, "_no_split_modules", None) or [])
    return [(name, m) for name, m in model.named_modules() if type(m).__name__ in block_classes]


def _first_block(model: nn.Module) -> nn.Module:
    return next((block for _, block in _blocks(model)), model)


def fp8_linears(model: nn.Module, spec: RunSpec) -> tuple[int, bool]:
    """Parameters of the linear layers precision.fp8 converts, and whether the transformer blocks' are among them."""
    from runner.precision import fp8_layer_names

    if spec.precision.fp8 is None:
        return 0, False
    names = fp8_layer_names(model, spec.precision.fp8)
    blocks = [name for name, _ in _blocks(model)]
    converted = sum(model.get_submodule(name).weight.numel() for name in names)
    return converted, any(name.startswith(block + ".") for name in names for block in blocks)


def fsdp_units(model: nn.Module, strategy: FSDPStrategy) -> tuple[int, int]:
    """(parameters left in the root unit, parameters of the largest other unit) under the strategy's wrap policy."""
    from runner.strategy import wrap_units

    units = wrap_units(model, strategy)
    in_units = {id(p): p.numel() for unit in units for p in unit.parameters()}
    total = sum(p.numel() for p in model.parameters())
    largest = max((sum(p.numel() for p in unit.parameters()) for unit in units), default=0)
    return total - sum(in_units.values()), largest


# ---------------------------------------------------------------------------------------------------------------
# Activations


@dataclass(frozen=True)
class ActivationDtypes:
    compute: int  # c: bytes of the forward's matmul outputs
    stream: int  # r: bytes of the residual stream between layers
    casts: bool  # autocast: each projection saves its own cast of a shared input
    fp8: bool = False  # the blocks' linear layers save their inputs in fp8


def layer_activation_bytes(layer: LayerShape, seq_len: int, dtypes: ActivationDtypes) -> int:
    """Bytes one layer saves for backward, per token (Korthikanti et al., 2022, section 4.1, adapted)."""
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
    dropout = 2 * h if layer.hidden_dropout else 0
    return norms + attention_inputs + qkv + attention + mlp_inputs + mlp + dropout


def activation_bytes(facts: ModelFacts, tokens: int, seq_len: int, dtypes: ActivationDtypes,
                     checkpointing: bool) -> int:
    layer = facts.layer
    per_layer = layer_activation_bytes(layer, seq_len, dtypes)
    head_input = (FP32 + dtypes.stream) * layer.hidden + dtypes.compute * layer.hidden  # final norm, lm_head input
    logits = (dtypes.compute + FP32) * facts.vocab  # the logits, and the loss's fp32 log-softmax
    if checkpointing:  # each layer keeps its input; one layer at a time is recomputed in backward
        blocks = facts.layers * dtypes.stream * layer.hidden + per_layer
    else:
        blocks = facts.layers * per_layer
    return tokens * (blocks + head_input + logits)


def loss_gradient_bytes(facts: ModelFacts, tokens: int) -> int:
    """The fp32 gradients of the log-probabilities and of the logits, at the start of backward."""
    return tokens * 2 * FP32 * facts.vocab


# ---------------------------------------------------------------------------------------------------------------
# The estimate


@dataclass
class Part:
    bytes: int = 0
    note: str = ""


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

    def phases(self) -> dict[str, int]:
        kept = self.weights.bytes + self.optimizer_states.bytes + self.buffers.bytes
        accumulated = self.gradients.bytes if self.accumulating else 0
        phases = {
            "at the start of backward": kept + self.activations.bytes + self.backward_start.bytes + accumulated,
            "at the end of backward": kept + self.gradients.bytes + self.backward_end.bytes,
            "at the optimizer step": kept + self.gradients.bytes + self.step.bytes,
        }
        if self.loading.bytes:
            phases["while loading the model"] = self.loading.bytes
        return phases

    @property
    def peak(self) -> int:
        return max(self.phases().values())

    @property
    def peak_phase(self) -> str:
        phases = self.phases()
        return max(phases, key=phases.get)

    @property
    def host_peak(self) -> int:
        return max(self.host_offload.bytes, self.host_loading.bytes)


def estimate(spec: RunSpec, facts: ModelFacts) -> Estimate:
    """The run's memory per device and per node, from its spec and its model's shapes."""
    tokens = spec.train.micro_batch_size * spec.data.seq_len
    match spec.strategy:
        case DeepSpeedStrategy():
            result = _deepspeed(spec, facts, tokens)
        case FSDPStrategy():
            result = _fsdp(spec, facts, tokens)
        case SingleStrategy() | DDPStrategy():
            result = _replicated(spec, facts, tokens)
        case _:
            raise TypeError(f"unknown strategy {type(spec.strategy).__name__}")
    result.accumulating = spec.train.grad_accum_steps > 1
    return result


def _bytes(dtype: Dtype) -> int:
    return FP32 if dtype is Dtype.fp32 else 2


def _dtype_name(size: int) -> str:
    return {4: "fp32", 2: "16-bit", 1: "fp8"}[size]


def _share(shards: int) -> str:
    return f", a 1/{shards} shard" if shards > 1 else ""


def _processes(count: int) -> str:
    return f"{count} process{'es' if count != 1 else ''}"


def _states(optim: OptimConfig) -> tuple[int, str]:
    """States per parameter, and their name."""
    match optim:
        case AdamWConfig():
            return 2, "AdamW's 2 states"
        case SGDConfig() if optim.momentum > 0:
            return 1, "SGD's momentum"
        case SGDConfig():
            return 0, "none (SGD without momentum)"
    raise TypeError(f"unknown optimizer {type(optim).__name__}")


def _step_copies(optim: OptimConfig) -> int:
    """Parameter-sized temporaries of torch's foreach optimizer step."""
    if isinstance(optim, SGDConfig):
        return int(optim.weight_decay > 0 or optim.nesterov)
    return 1  # AdamW: the square root of the second moment


def _activations(spec: RunSpec, facts: ModelFacts, tokens: int, dtypes: ActivationDtypes,
                 checkpointing: bool) -> Part:
    attention = "eager attention (s x s scores)" if facts.layer.eager_attention else "sdpa (no s x s scores)"
    note = (f"{spec.train.micro_batch_size} x {spec.data.seq_len} tokens, {facts.layers} layers, {attention}, "
            f"{'activation checkpointing' if checkpointing else 'no checkpointing'}; the logits")
    return Part(activation_bytes(facts, tokens, spec.data.seq_len, dtypes, checkpointing), note)


def _replicated(spec: RunSpec, facts: ModelFacts, tokens: int) -> Estimate:
    """single and ddp: a whole copy of everything on each device."""
    precision, P = spec.precision, facts.parameters
    w, c = _bytes(precision.param_dtype), _bytes(precision.compute_dtype)
    k, states = _states(spec.optim)
    autocast = c < w
    fp8_parameters, fp8_blocks = fp8_linears(facts.model, spec)
    # Autocast keeps one cast of each linear weight from its first use until backward has used it.
    copies = (c * (facts.linear_parameters - fp8_parameters) if autocast else 0) + fp8_parameters
    dtypes = ActivationDtypes(compute=c, stream=w, casts=autocast, fp8=fp8_blocks)
    result = Estimate(
        weights=Part(P * w + facts.buffer_bytes, f"{_dtype_name(w)}, whole"),
        gradients=Part(P * w, f"{_dtype_name(w)}, whole"),
        optimizer_states=Part(k * P * w, f"{states}, {_dtype_name(w)}"),
        activations=_activations(spec, facts, tokens, dtypes, checkpointing=False),
        backward_start=Part(copies + loss_gradient_bytes(facts, tokens),
                            "the loss gradient" + (", autocast's casts of the linear weights" if copies else "")),
        step=Part(_step_copies(spec.optim) * P * w, "the optimizer's foreach temporaries"),
        host_loading=Part((spec.hardware.nproc_per_node or 1) * FP32 * P, "each process builds the fp32 model"),
    )
    if isinstance(spec.strategy, DDPStrategy):
        result.buffers = Part(P * w, "DDP's gradient buckets (a flat copy of the gradients)")
    return result


def sharded_elements(shapes: list[tuple[int, ...]], shards: int) -> int:
    """Elements of rank 0's FSDP2 shards: each parameter split on dim 0, padded to equal shards."""
    return sum(math.ceil(shape[0] / shards) * math.prod(shape[1:]) if shape else 1 for shape in shapes)


def _fsdp(spec: RunSpec, facts: ModelFacts, tokens: int) -> Estimate:
    strategy, precision, P = spec.strategy, spec.precision, facts.parameters
    _, shards = shard_mesh_shape(strategy, spec.hardware)
    w = _bytes(precision.param_dtype)
    gathered = min(w, _bytes(precision.compute_dtype))  # FSDP's mixed-precision policy gathers in compute dtype
    reduce = _bytes(precision.reduce_dtype)
    k, states = _states(spec.optim)
    local = sharded_elements(facts.parameter_shapes, shards)
    root, largest = fsdp_units(facts.model, strategy)
    _, fp8_blocks = fp8_linears(facts.model, spec)
    dtypes = ActivationDtypes(compute=gathered, stream=gathered, casts=False, fp8=fp8_blocks)
    if strategy.sharding_strategy in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.HYBRID_SHARD_ZERO2):
        all_gathered = gathered * (P + largest)
        gather_note = f"{_dtype_name(gathered)} all-gathers: every unit stays gathered from forward to backward"
    else:
        # The root unit stays gathered from forward to backward; each other unit is gathered, copied out of the
        # all-gather buffer, and the next ones prefetched.
        prefetch = max(strategy.forward_prefetch, strategy.backward_prefetch)
        all_gathered = gathered * (root + (2 + prefetch) * largest)
        gather_note = f"{_dtype_name(gathered)} all-gathers: the root unit and {2 + prefetch} x the largest unit"
    share = _share(shards)
    nproc = spec.hardware.nproc_per_node or 1
    loaders = 1 if strategy.cpu_ram_efficient_loading else nproc
    result = Estimate(
        weights=Part(local * w + facts.buffer_bytes, f"{_dtype_name(w)}{share} ({strategy.sharding_strategy.value})"),
        gradients=Part(local * w, f"{_dtype_name(w)}{share}"),
        optimizer_states=Part(k * local * w, f"{states}, {_dtype_name(w)}{share}"),
        activations=_activations(spec, facts, tokens, dtypes, strategy.activation_checkpointing),
        backward_start=Part(all_gathered + loss_gradient_bytes(facts, tokens) + largest * (gathered + reduce),
                            f"{gather_note}; the loss gradient; a unit's reduce-scatter"),
        # The root unit's gradients are reduced last, its parameters still gathered.
        backward_end=Part(root * gathered + root * (gathered + reduce) + largest * gathered,
                          "the root unit's reduce-scatter"),
        step=Part(_step_copies(spec.optim) * local * w, "the optimizer's foreach temporaries"),
        host_loading=Part(loaders * FP32 * P, "each process builds the fp32 model" if loaders > 1
                          else "one process builds the fp32 model"),
    )
    if strategy.offload_params:
        result.host_offload = Part(nproc * (2 + k) * local * w,
                                   f"offload_params: each process's weights, gradients and {states}{share}")
        result.weights = Part(facts.buffer_bytes, "in CPU RAM (offload_params); buffers only")
        result.gradients = Part(0, "in CPU RAM (offload_params)")
        result.optimizer_states = Part(0, "in CPU RAM (offload_params); the step runs on the CPU")
        result.step = Part(0, "on the CPU")
    return result


def _deepspeed(spec: RunSpec, facts: ModelFacts, tokens: int) -> Estimate:
    from runner.strategy import deepspeed_config

    strategy, P, N = spec.strategy, facts.parameters, spec.hardware.world_size
    zero = {**DEEPSPEED_DEFAULTS, **deepspeed_config(spec).get("zero_optimization", {})}
    stage = strategy.zero_stage
    m = 2 if spec.precision.compute_dtype is not Dtype.fp32 else FP32  # DeepSpeed casts the module itself
    module = _dtype_name(m)
    k, states = _states(spec.optim)
    _, fp8_blocks = fp8_linears(facts.model, spec)
    dtypes = ActivationDtypes(compute=m, stream=m, casts=False, fp8=fp8_blocks)
    nproc = spec.hardware.nproc_per_node or 1
    common = dict(
        activations=_activations(spec, facts, tokens, dtypes, checkpointing=False),
        loading=Part(m * P + facts.buffer_bytes, "deepspeed.initialize moves the whole module onto each device"),
        host_loading=Part(nproc * FP32 * P, "each process builds the fp32 model"),
    )
    loss_gradient = loss_gradient_bytes(facts, tokens)

    if stage == 0:
        master = FP32 * P if m < FP32 else 0  # 16-bit: DeepSpeed's FP16_Optimizer keeps whole fp32 weights
        return Estimate(
            weights=Part(m * P + master + facts.buffer_bytes,
                         f"{module}, whole" + (" + fp32 master weights" if master else "")),
            gradients=Part(m * P, f"{module}, whole"),
            optimizer_states=Part(k * FP32 * P, f"{states}, fp32, whole"),
            backward_start=Part(loss_gradient, "the loss gradient"),
            backward_end=Part(min(P, DEEPSPEED_ALLREDUCE_BUCKET) * m, "the all-reduce's flat gradient bucket"),
            step=Part((2 if master else 1) * FP32 * P,
                      "the step's temporaries" + (", fp32 gradients" if master else "")),
            **common,
        )

    share = _share(N)
    reduce_bucket = int(zero["reduce_bucket_size"])
    overlap = zero.get("overlap_comm", stage == 3)
    if stage in (1, 2):
        partition = math.ceil(P / N)
        # A parameter that straddles a partition's edge keeps its whole gradient on both ranks.
        straddling = min(N - 1, 2) * facts.largest_parameter
        result = Estimate(
            weights=Part(m * P + FP32 * partition + facts.buffer_bytes,
                         f"{module}, whole, + fp32 master weights{share}"),
            gradients=Part(m * (partition + straddling), f"{module}{share} (+ whole gradients at its edges)"),
            optimizer_states=Part(k * FP32 * partition, f"{states}, fp32{share}"),
            buffers=Part(reduce_bucket * m * (2 if overlap else 1),
                         f"the reduce bucket of {reduce_bucket:.0e} elements" + (", twice (overlap_comm)" if overlap
                                                                                  else "")),
            backward_start=Part(loss_gradient, "the loss gradient"),
            # ZeRO-1 reduces once, after backward: the whole gradients exist until then.
            backward_end=Part(m * P if stage == 1 else 0, "ZeRO-1's whole gradients before their reduction"
                              if stage == 1 else ""),
            step=Part(2 * FP32 * partition, "fp32 gradients of the partition, the step's temporaries"),
            **common,
        )
        persistent = 0
    else:
        partition = sum(math.ceil(math.prod(shape) / N) for shape in facts.parameter_shapes)
        persistent = _persistent_parameters(facts, zero)
        live = min(int(zero["stage3_max_live_parameters"]),
                   facts.largest_module + int(zero["stage3_prefetch_bucket_size"]))
        result = Estimate(
            weights=Part(m * (partition + persistent) + FP32 * partition + facts.buffer_bytes,
                         f"{module}{share} (+ {persistent:,} small parameters whole), + fp32 master weights{share}"),
            gradients=Part(m * partition, f"{module}{share}"),
            optimizer_states=Part(k * FP32 * partition, f"{states}, fp32{share}"),
            buffers=Part(reduce_bucket * m, f"the reduce bucket of {reduce_bucket:.0e} elements"),
            backward_start=Part(live * m + loss_gradient,
                                "gathered parameters (the largest module + the prefetch bucket); the loss gradient"),
            backward_end=Part(live * m, "gathered parameters"),
            # The optimizer steps the partition in sub-groups of sub_group_size elements.
            step=Part(2 * FP32 * min(partition, int(zero["sub_group_size"])),
                      "fp32 gradients of a sub-group, the step's temporaries"),
            **common,
        )
        if strategy.offload_param is not OffloadDevice.none:
            result.weights = Part(m * persistent + FP32 * partition + facts.buffer_bytes,
                                  f"{persistent:,} small parameters whole, + fp32 master weights{share}; "
                                  f"the weight partitions on {strategy.offload_param.value} (offload_param)")
            if strategy.offload_param is OffloadDevice.cpu:
                result.host_offload = Part(nproc * m * partition, f"offload_param: {module} weight partitions")
    if strategy.offload_optimizer is not OffloadDevice.none:
        device = strategy.offload_optimizer.value
        note = result.weights.note.replace(f", + fp32 master weights{share}", f"; fp32 master on {device}")
        result.weights = Part(result.weights.bytes - FP32 * partition, note)
        result.gradients = Part(0, f"reduced into {device} buffers (offload_optimizer)")
        result.optimizer_states = Part(0, f"on {device} (offload_optimizer); the step runs on the CPU")
        result.step = Part(0, "on the CPU")
        if strategy.offload_optimizer is OffloadDevice.cpu:
            moved = nproc * (2 * FP32 + k * FP32) * partition
            note = f"offload_optimizer: fp32 master weights, their gradients and {states}{share}"
            if result.host_offload.bytes:
                note += f"; {result.host_offload.note}"
            result.host_offload = Part(result.host_offload.bytes + moved, note)
    return result


def _persistent_parameters(facts: ModelFacts, zero: dict) -> int:
    """ZeRO-3 keeps parameters of at most stage3_param_persistence_threshold elements whole on every rank, up to
    stage3_model_persistence_threshold elements in all (DeepSpeed's mark_persistent_parameters)."""
    threshold, budget = int(zero["stage3_param_persistence_threshold"]), int(zero["stage3_model_persistence_threshold"])
    kept = 0
    for numel in (math.prod(shape) for shape in facts.parameter_shapes):
        if numel <= threshold and numel + kept <= budget:
            kept += numel
    return kept


# ---------------------------------------------------------------------------------------------------------------
# Fit


@dataclass
class Fit:
    device: Optional[float]  # GiB each device has (None: unknown)
    host: Optional[float]  # GiB of CPU RAM per node (None: unknown)
    device_needs: int  # bytes per device; on a CPU, of the node's processes together
    host_needs: int  # bytes of CPU RAM per node besides the devices'
    shared: bool  # the devices are this machine's CPU: its processes share one RAM

    @property
    def device_fits(self) -> bool:
        return self.device is None or self.device_needs <= self.device * GIB

    @property
    def host_fits(self) -> bool:
        return self.host is None or self.host_needs <= self.host * GIB

    @property
    def fits(self) -> bool:
        return self.device_fits and self.host_fits


def fit(spec: RunSpec, result: Estimate) -> Fit:
    hardware = spec.hardware
    if hardware.accelerator is Accelerator.cpu:
        needs = (hardware.nproc_per_node or 1) * result.peak + result.host_offload.bytes
        return Fit(hardware.device_memory_gib, None, max(needs, result.host_loading.bytes), 0, shared=True)
    return Fit(hardware.device_memory_gib, hardware.host_memory_gib, result.peak, result.host_peak, shared=False)


@dataclass(frozen=True)
class Change:
    """A change to the spec that saves memory, as the overrides a user would type."""

    overrides: tuple[str, ...]
    cost: float  # roughly what it costs in throughput: the cheapest changes that fit are proposed first
    apply: Callable[[RunSpec], RunSpec]


def _strategy_change(override: str, cost: float, **keys: Any) -> Change:
    return Change((override,), cost, lambda spec: replace(spec, strategy=replace(spec.strategy, **keys)))


def _changes(spec: RunSpec) -> list[Change]:
    """The changes that apply to this spec."""
    strategy, train = spec.strategy, spec.train
    changes = []
    if isinstance(strategy, FSDPStrategy):
        if strategy.sharding_strategy is not ShardingStrategy.FULL_SHARD and spec.hardware.world_size > 1:
            changes.append(_strategy_change("strategy.sharding_strategy=FULL_SHARD", 1.0,
                                            sharding_strategy=ShardingStrategy.FULL_SHARD, hybrid_shard_size=None))
        if not strategy.activation_checkpointing:
            changes.append(_strategy_change("strategy.activation_checkpointing=true", 2.0,
                                            activation_checkpointing=True))
        if not strategy.offload_params:
            changes.append(_strategy_change("strategy.offload_params=true", 3.0, offload_params=True))
        if not strategy.cpu_ram_efficient_loading:
            changes.append(_strategy_change("strategy.cpu_ram_efficient_loading=true", 0.5,
                                            cpu_ram_efficient_loading=True, sync_module_states=True))
    else:
        changes.append(Change(("strategy=fsdp",), 1.5, lambda s: replace(s, strategy=FSDPStrategy())))
    if isinstance(strategy, DeepSpeedStrategy):
        for stage in range(strategy.zero_stage + 1, 4):
            changes.append(_strategy_change(f"strategy.zero_stage={stage}", 0.5 + 0.25 * stage, zero_stage=stage))
        if strategy.offload_optimizer is OffloadDevice.none and strategy.zero_stage >= 1:
            changes.append(_strategy_change("strategy.offload_optimizer=cpu", 3.0,
                                            offload_optimizer=OffloadDevice.cpu))
        if strategy.offload_param is OffloadDevice.none and strategy.zero_stage == 3:
            changes.append(_strategy_change("strategy.offload_param=cpu", 3.0, offload_param=OffloadDevice.cpu))
    bf16_capable = spec.hardware.accelerator is not Accelerator.cuda or (spec.hardware.compute_capability or 0) >= 8.0
    precision = spec.precision
    if precision.compute_dtype is Dtype.fp32 and bf16_capable:
        changes.append(Change(("precision=bf16",), 0.5,
                              lambda s: replace(s, precision=replace(s.precision, compute_dtype=Dtype.bf16))))
    if (precision.param_dtype is Dtype.fp32 and precision.fp8 is None and bf16_capable
            and not isinstance(strategy, DeepSpeedStrategy)):
        # Half the bytes of weights, gradients and states, at a cost in quality: small updates are lost.
        changes.append(Change(("precision=pure_bf16",), 4.0, lambda s: replace(s, precision=replace(
            s.precision, compute_dtype=Dtype.bf16, param_dtype=Dtype.bf16, reduce_dtype=Dtype.bf16))))
    # A smaller micro batch with more accumulation steps: the same global batch.
    micro = train.micro_batch_size // 2
    while micro >= 1:
        steps = train.grad_accum_steps * train.micro_batch_size // micro
        if micro * steps == train.micro_batch_size * train.grad_accum_steps:
            changes.append(Change(
                (f"train.micro_batch_size={micro}", f"train.grad_accum_steps={steps}"),
                1.0 + 0.1 * math.log2(train.micro_batch_size / micro),
                lambda s, micro=micro, steps=steps: replace(
                    s, train=replace(s.train, micro_batch_size=micro, grad_accum_steps=steps))))
        micro //= 2
    return changes


def cheapest_fits(spec: RunSpec, facts: ModelFacts, limit: int = 3, depth: int = 3) -> list[tuple[Change, Fit]]:
    """Up to `limit` sets of up to `depth` changes, cheapest first, each checked by estimating the changed spec."""
    found: list[tuple[Change, Fit]] = []
    frontier = [Change((), 0.0, lambda s: s)]
    for _ in range(depth):
        grown: list[Change] = []
        for base in frontier:
            keys = {override.split("=")[0] for override in base.overrides}
            for change in _changes(base.apply(spec)):
                if keys & {override.split("=")[0] for override in change.overrides}:
                    continue
                combined = Change(base.overrides + change.overrides, base.cost + change.cost,
                                  lambda s, base=base, change=change: change.apply(base.apply(s)))
                if any(set(c.overrides) <= set(combined.overrides) for c, _ in found):
                    continue  # fewer of these changes fit already
                if any(set(g.overrides) == set(combined.overrides) for g in grown):
                    continue
                changed = combined.apply(spec)
                verdict = fit(changed, estimate(changed, facts))
                if verdict.fits:
                    found.append((combined, verdict))
                else:
                    grown.append(combined)
        frontier = sorted(grown, key=lambda c: c.cost)[:40]
    found.sort(key=lambda item: (item[0].cost, item[1].device_needs))
    return found[:limit]


def _proposals(fixes: list[tuple[Change, Fit]]) -> str:
    return " | ".join(f"{' '.join(change.overrides)} ({readable(verdict.device_needs)}"
                      + (f", {readable(verdict.host_needs)} of CPU RAM" if verdict.host_needs and verdict.host
                         else "") + ")" for change, verdict in fixes)


def check_fit(spec: RunSpec) -> None:
    """Refuses, in one line, a run that cannot fit its hardware, naming the cheapest changes that would."""
    facts = facts_of(spec.model)
    verdict = fit(spec, estimate(spec, facts))
    if verdict.fits:
        return
    hardware = spec.hardware
    if not verdict.device_fits and verdict.shared:
        problem = (f"an estimated {readable(verdict.device_needs)} for {_processes(hardware.nproc_per_node or 1)} "
                   f"of this machine's RAM ({verdict.device:g} GiB)")
    elif not verdict.device_fits:
        problem = (f"an estimated {readable(verdict.device_needs)} per device of the {verdict.device:g} GiB of "
                   f"{hardware.device_name or 'each device'}")
    else:
        problem = f"an estimated {readable(verdict.host_needs)} of CPU RAM of the {verdict.host:g} GiB of each node"
    fixes = cheapest_fits(spec, facts)
    advice = (f"it fits with: {_proposals(fixes)}" if fixes else
              "no change tried fits (sharding, checkpointing, offload, a micro batch of 1): use more or larger devices")
    raise SpecError(f"the run does not fit: {problem}; {advice}; `run task=estimate` with the same overrides shows "
                    "the breakdown, task.fit_check=false launches anyway")


def check_causal_lm(spec: RunSpec) -> None:
    """The runner trains causal language models; an encoder such as BERT sees the tokens it should predict."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = meta_model(spec.model).config
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or not getattr(config, "is_decoder", True):
        raise SpecError(f"{config.model_type} is not a causal language model (an encoder: its attention sees the "
                        "tokens it predicts), and the runner trains causal LMs only; choose a decoder such as "
                        "model=tiny_llama or model=llama3_8b, or use task=estimate for its memory")


def gib(size: int) -> str:
    return f"{size / GIB:.2f}"


def readable(size: int) -> str:
    """GiB, or MiB below one GiB."""
    return f"{size / GIB:.2f} GiB" if size >= GIB or size == 0 else f"{size / 2**20:.2f} MiB"


# ---------------------------------------------------------------------------------------------------------------
# accelerate's view


def _base_model(model: nn.Module) -> nn.Module:
    """What accelerate's create_empty_model builds: AutoModel, with no LM head, in fp32, without weights."""
    import torch
    from transformers import AutoModel

    with torch.device("meta"):
        return AutoModel.from_config(model.config, dtype=torch.float32)


def accelerate_sizes(model: nn.Module) -> dict[str, tuple[int, int, int, int]]:
    """accelerate `estimate-memory`'s training table (commands/estimate.py, estimate_training_usage), per dtype:
    model, gradients, backward pass, optimizer step, from b = the bytes of the base model's parameters and
    buffers in fp32 (utils/modeling.py, compute_module_sizes). float32: b, b, 2b, 4b; float16: b, b + b//2, 2b, 2b."""
    base = _base_model(model)
    size = sum(t.numel() * t.element_size() for t in [*base.parameters(), *base.buffers()])
    return {"float32": (size, size, 2 * size, 4 * size), "float16": (size, size + size // 2, 2 * size, 2 * size)}


def accelerate_bytes(size: float) -> str:
    """accelerate's convert_bytes: its MB and GB are MiB and GiB."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"


def format_accelerate_view(model: nn.Module) -> str:
    base = _base_model(model)
    rows = [["dtype", "Model", "Gradients", "Backward pass", "Optimizer step"]]
    rows += [[dtype, *map(accelerate_bytes, sizes)] for dtype, sizes in accelerate_sizes(model).items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join([
        f"accelerate estimate-memory's view ({type(base).__name__}, no LM head: "
        f"{sum(p.numel() for p in base.parameters()):,} parameters, with its buffers; Adam, batch size 1, no "
        "activations, one device; MB and GB are MiB and GiB):",
        *("  " + "   ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows),
    ])


# ---------------------------------------------------------------------------------------------------------------
# The report


def report(spec: RunSpec) -> str:
    """What `run task=estimate` prints."""
    facts = facts_of(spec.model)
    result = estimate(spec, facts)
    verdict = fit(spec, result)
    hardware, precision = spec.hardware, spec.precision
    dtypes = f"{precision.compute_dtype.value} compute, {precision.param_dtype.value} weights"
    if precision.fp8 is not None:
        dtypes += ", fp8 linear layers"
    memory = f"{hardware.device_memory_gib:g} GiB" if hardware.device_memory_gib else "memory not declared"
    nproc = hardware.nproc_per_node or 1

    def row(label: str, part: Part) -> str:
        return f"  {label:<22} {readable(part.bytes):>12}  {part.note}".rstrip()

    lines = [
        f"memory estimate: {type(facts.model).__name__} ({facts.parameters:,} parameters), "
        f"{describe(spec.strategy, hardware)}, {dtypes}, {type(spec.optim).__name__.removesuffix('Config')}, "
        f"micro batch {spec.train.micro_batch_size} x {spec.data.seq_len} tokens",
        f"per device ({hardware.device_name or hardware.accelerator.value}, {memory}), rank 0:",
        row("weights", result.weights),
        row("gradients", result.gradients),
        row("optimizer states", result.optimizer_states),
        row("activations", result.activations),
        "  transient buffers",
        *([row("  kept throughout", result.buffers)] if result.buffers.bytes else []),
        row("  start of backward", result.backward_start),
        row("  end of backward", result.backward_end),
        row("  optimizer step", result.step),
        *([row("model loading", result.loading)] if result.loading.bytes else []),
        row("peak", Part(result.peak, f"{result.peak_phase}: {_peak_formula(result)}")),
    ]
    if verdict.shared:
        lines.append(f"  fits: {_verdict(verdict.device_fits, verdict.device)} ({readable(verdict.device_needs)} "
                     f"for {_processes(nproc)} in this machine's RAM of {memory})")
    else:
        host = f"{hardware.host_memory_gib:g} GiB" if hardware.host_memory_gib else "RAM not declared"
        lines += [
            f"  fits: {_verdict(verdict.device_fits, verdict.device)}",
            f"CPU RAM per node ({_processes(nproc)}, {host}):",
            row("offloaded", result.host_offload if result.host_offload.bytes else Part(0, "nothing")),
            row("model loading", result.host_loading),
            f"  fits: {_verdict(verdict.host_fits, verdict.host)}",
        ]
    if not verdict.fits:
        lines.append(f"cheapest changes that fit: {_proposals(cheapest_fits(spec, facts)) or 'none found'}")
    if isinstance(spec.task, EstimateTask) and spec.task.accelerate_view:
        lines += ["", format_accelerate_view(facts.model)]
    return "\n".join(lines)


def _peak_formula(result: Estimate) -> str:
    phase = result.peak_phase
    if phase == "while loading the model":
        return "the whole module on the device"
    kept = "weights + optimizer states" + (" + buffers kept throughout" if result.buffers.bytes else "")
    if phase == "at the start of backward":
        return kept + " + activations + its transients" + (" + gradients" if result.accumulating else "")
    if phase == "at the end of backward":
        return kept + " + gradients + its transients"
    return kept + " + gradients + the step's temporaries"


def _verdict(fits: bool, available: Optional[float]) -> str:
    if available is None:
        return "unknown (the hardware declares no memory)"
    return "yes" if fits else "NO"
