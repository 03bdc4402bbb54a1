"""The memory of an inference job (task=evaluate, task=generate), per device, before it starts: the weights, the KV
cache and the tensors of one forward, which keeps nothing for a backward.

Notation: P parameters, w the bytes of a weight as held (4 fp32, 2 bf16/fp16), c the bytes of an activation (the
compute dtype), r = max(w, c) the bytes of the residual stream (fp32 weights under bf16 autocast keep an fp32
stream), B rows per forward, s tokens per row, L layers, V the vocabulary, h hidden, I intermediate, q = heads x
head_dim, kv = kv_heads x head_dim.

    weights      replica    P.w + buffers: every device holds the whole model
                 pipeline   a stage's blocks (an even split), + the embeddings on the first stage, + the final norm
                            and LM head on the last (a tied LM head again); the largest stage is reported
                 sharded    FSDP2's shards, P_S.w, + the root unit (held gathered through forward) and 2 blocks (one
                            running, the next prefetched) gathered in the compute dtype
    KV cache     B.s.L.2.kv.c, generate only; a pipeline stage holds its own layers'
    activations  the larger of one layer's forward and the head's, + autocast's casts:
                 layer      B.s.(2r.h + max(attention, mlp)): the residual, the embeddings' output (the model's
                            forward holds it to the end) and the larger sub-block's tensors
                              attention  r.h + c(q + 2kv) + c(q + kv) + c.q: the normed input, q k v, the rotated
                                         q and k, the output; + 2c.q when k and v are repeated to every head (GQA
                                         with a mask); + heads.s.(4 + 2c) for eager attention's scores
                              mlp        r.h + 3c.I: the normed input, act(gate), up and their product
                            + the padding mask, B.s.s.(1 + c) (bool, and the additive copy torch makes for each
                            call; eager: c), and, while decoding, one layer's k and v copied as the cache grows
                 head       B.s.2r.h + the logits: evaluate's B.s.V.(c + 4 + 4) (the logits, their fp32 copy when
                            c < 4, the loss's fp32 log-softmax); generate's prefill B.s.V.c, or B.V.c with
                            logits_to_keep=1 (what transformers' generate() passes)
                 autocast   fp32 weights under a 16-bit compute dtype: the cast of every linear weight, c.P_linear,
                            which autocast keeps for leaf tensors that require grad, even under no_grad; with frozen
                            weights (requires_grad_(False)), the cast of the largest weight, made per call
    pipeline stages add the hidden states they receive and send, 2.B.s.h.c.

A device_map placement (accelerate's big-model inference) replaces the weights: the device holds its own entry,
and one offloaded block at a time while it runs; CPU RAM and disk are shown as rows, not counted on the device.
Generate's prefill is counted at its full length with the whole cache: a bound of both the prefill and the last
decoding step. Checked against the tensors a CPU forward of tiny_llama holds (tests/memory/test_inference_estimate.py):
the estimate is 0 to 30% above them. The report and the fit check: runner/memory/inference_report.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Optional

from runner.components.modeling import blocks
from runner.errors import SpecError
from runner.memory.breakdown import FP32, Part, dtype_name, sharded_elements

if TYPE_CHECKING:
    from runner.memory.model_shapes import LayerShape, ModelFacts

HOWS = ("replica", "pipeline", "sharded")
OFF_DEVICE = {"cpu": "CPU RAM", "disk": "disk"}


@dataclass
class InferenceLoad:
    batch_size: int  # rows per forward
    tokens: int  # tokens per row in one forward (evaluate: data.seq_len; generate: longest prompt + max_new_tokens)
    kv_cache: bool  # generate keeps a KV cache (the whole `tokens` length); evaluate does not
    weight_bytes_per_param: int  # 4 fp32, 2 bf16/fp16 (the dtype weights are held in)
    activation_bytes: int  # bytes per activation element (the compute dtype)
    prompt_tokens: Optional[int] = None  # generate: the prefill's length (the longest prompt); None: `tokens`
    # Logits per row (transformers' argument: generate() passes 1); 0: every position, and the loss's
    # log-softmax when there is no KV cache (evaluate).
    logits_to_keep: int = 0
    # The weights do not require grad (requires_grad_(False)): autocast then keeps no cast of every linear weight.
    frozen: bool = False

    @property
    def task(self) -> str:
        """generate keeps a KV cache or the logits of a position; evaluate takes the loss over every position."""
        return "generate" if self.kv_cache or self.logits_to_keep else "evaluate"

    @property
    def forward_tokens(self) -> int:
        """Tokens per row in the largest forward: evaluate's rows, generate's prefill."""
        return (self.prompt_tokens or self.tokens) if self.kv_cache else self.tokens


@dataclass
class InferenceEstimate:
    """Bytes on the device that needs the most (a pipeline's largest stage), and the weights placed elsewhere."""

    weights: Part
    kv_cache: Part
    activations: Part
    off_device: dict[str, int] = field(default_factory=dict)  # "CPU RAM" / "disk" -> bytes (device_map)
    where: str = ""  # which device or stage the parts are of

    @property
    def peak(self) -> int:
        return self.weights.bytes + self.kv_cache.bytes + self.activations.bytes


@dataclass(frozen=True)
class ModelParts:
    """Parameters by where a pipeline puts them."""

    embedding: int  # the input embeddings: the first stage
    block: int  # one transformer block
    head: int  # the rest, the final norm and LM head: the last stage (a tied LM head counted here again)
    rest: int  # parameters outside the blocks, tied ones once: FSDP's root unit


def model_parts(facts: ModelFacts) -> ModelParts:
    model = facts.model
    found = blocks(model)
    block = sum(p.numel() for p in found[0][1].parameters()) if found else 0
    embedding_module = model.get_input_embeddings()
    output = model.get_output_embeddings()
    embedding = embedding_module.weight.numel() if embedding_module is not None else 0
    tied = output is not None and output.weight is getattr(embedding_module, "weight", None)
    rest = facts.parameters - facts.layers * block
    return ModelParts(embedding, block, rest - embedding + (output.weight.numel() if tied else 0), rest)


def kv_cache_bytes(facts: ModelFacts, load: InferenceLoad, layers: Optional[int] = None) -> int:
    """B x tokens x layers x 2 (k and v) x kv_heads x head_dim x c; nothing for evaluate."""
    if not load.kv_cache:
        return 0
    layer = facts.layer
    count = facts.layers if layers is None else layers
    return load.batch_size * load.tokens * count * 2 * layer.kv_heads * layer.head_dim * load.activation_bytes


def stream_bytes(load: InferenceLoad) -> int:
    return max(load.weight_bytes_per_param, load.activation_bytes)


def layer_forward_bytes(layer: LayerShape, seq_len: int, load: InferenceLoad) -> int:
    """Bytes per token live at once in one layer's forward without autograd: the residual stream and the
    embeddings' output (the model's forward holds it to the end), and the larger of the attention's and the MLP's
    tensors (each sub-block's are freed before the next starts)."""
    h, c, r = layer.hidden, load.activation_bytes, stream_bytes(load)
    q, kv = layer.heads * layer.head_dim, layer.kv_heads * layer.head_dim
    # The normed input, q, k and v, the rotated q and k, and the output (o_proj's input).
    attention = r * h + c * (q + 2 * kv) + c * (q + kv) + c * q
    if kv < q:
        attention += 2 * c * q  # repeat_kv widens k and v to every head when sdpa cannot take GQA itself
    if layer.eager_attention:
        attention += layer.heads * seq_len * (FP32 + 2 * c)  # the scores, their fp32 softmax and its cast
    mlp = r * h + (3 * c if layer.gated_mlp else 2 * c) * layer.intermediate
    return 2 * r * h + max(attention, mlp)


def logits_bytes(facts: ModelFacts, load: InferenceLoad) -> int:
    """Evaluate: the logits, their fp32 copy and the fp32 log-softmax of the loss; generate: the prefill's logits
    (every position, or the last `logits_to_keep`)."""
    c, rows = load.activation_bytes, load.batch_size
    if load.task == "evaluate":
        return rows * load.tokens * facts.vocab * (c + (FP32 if c < FP32 else 0) + FP32)
    kept = load.logits_to_keep or load.forward_tokens
    return rows * min(kept, load.forward_tokens) * facts.vocab * c


def activations_part(
    facts: ModelFacts,
    load: InferenceLoad,
    *,
    with_layers: bool = True,
    with_head: bool = True,
    stage_buffers: bool = False,
) -> Part:
    """One forward's peak: the larger of one layer's tensors (with the padding mask, and while decoding a layer's
    k and v copied as the cache grows) and the head's (the final norm and the logits); autocast's casts on top.
    `stage_buffers`: a pipeline stage's hidden states received and sent, B x s x h each."""
    layer, s, c = facts.layer, load.forward_tokens, load.activation_bytes
    tokens = load.batch_size * s
    layer_peak = head_peak = cast = 0
    if with_layers:
        # A 4-d padding mask [B, 1, s, s]: eager's in the compute dtype; sdpa's bool, which torch turns into an
        # additive mask in the compute dtype for each call.
        mask = c if layer.eager_attention else 1 + c
        layer_peak = tokens * layer_forward_bytes(layer, s, load) + load.batch_size * s * s * mask
        layer_peak = max(layer_peak, kv_cache_bytes(facts, load, layers=1))
    if with_head:
        head_peak = tokens * 2 * stream_bytes(load) * layer.hidden + logits_bytes(facts, load)
    if c < load.weight_bytes_per_param:  # autocast
        cast = c * (facts.largest_parameter if load.frozen else facts.linear_parameters)
    buffers = 2 * tokens * layer.hidden * c if stage_buffers else 0
    shown = []
    if with_layers:
        shown.append(f"one layer's forward ({'eager attention, s x s scores' if layer.eager_attention else 'sdpa'})")
    if with_head:
        if load.task == "evaluate":
            shown.append("the logits and their fp32 log-softmax")
        else:
            kept = {0: "every position", 1: "the last position"}.get(
                load.logits_to_keep, f"the last {load.logits_to_keep}"
            )
            shown.append(f"the {'prefill' if load.kv_cache else 'step'}'s logits ({kept})")
    note = f"{load.batch_size} x {s} tokens: " + ("the larger of " if len(shown) > 1 else "") + " and ".join(shown)
    if buffers:
        note += "; the stage's input and output"
    if cast:
        note += "; autocast's cast of " + ("the largest weight" if load.frozen else "every linear weight")
    return Part(max(layer_peak, head_peak) + buffers + cast, note)


def stage_layers(layers: int, stages: int) -> list[int]:
    """An even split of the blocks, the first stages taking one more where it does not divide."""
    return [layers // stages + (1 if i < layers % stages else 0) for i in range(stages)]


def pipeline_load(load: InferenceLoad) -> InferenceLoad:
    """The runner's pipeline generation (runner/generation/pipelined.py) keeps no KV cache: each step runs the whole
    rows, prompt and new tokens, through the stages, and the last stage computes the logits of one position."""
    if not load.kv_cache:
        return load
    return replace(load, kv_cache=False, prompt_tokens=None, logits_to_keep=1)


def inference_estimate(
    facts: ModelFacts,
    load: InferenceLoad,
    *,
    devices: int = 1,
    how: str = "replica",
    placement: Optional[dict[str, int]] = None,
) -> InferenceEstimate:
    """Per device: the weights, the KV cache and one forward's activations (see the module's docstring). how:
    "replica" (each device the whole model), "pipeline" (`devices` stages at block boundaries: the largest is
    reported), "sharded" (FSDP over `devices`). placement: device -> bytes of weights a device_map puts there
    (GPU indices, "cpu", "disk"); it replaces the weights, whatever `how`."""
    if how not in HOWS:
        raise SpecError(f"unknown inference layout how={how!r}; choose one of {', '.join(HOWS)}")
    if placement is not None:
        return _placed(facts, load, placement)
    if how == "pipeline" and devices > 1:
        return max((_stage(facts, load, i, devices) for i in range(devices)), key=lambda e: e.peak)
    kv = Part(kv_cache_bytes(facts, load), _kv_note(facts, load, facts.layers))
    w = load.weight_bytes_per_param
    if how == "sharded" and devices > 1:
        return InferenceEstimate(
            _sharded_weights(facts, load, devices),
            kv,
            # FSDP's mixed-precision policy runs the whole forward in the gathered dtype.
            activations_part(facts, replace(load, weight_bytes_per_param=_gathered(load))),
        )
    return InferenceEstimate(
        Part(facts.parameters * w + facts.buffer_bytes, f"{dtype_name(w)}, whole"), kv, activations_part(facts, load)
    )


def _gathered(load: InferenceLoad) -> int:
    return min(load.weight_bytes_per_param, load.activation_bytes)


def _sharded_weights(facts: ModelFacts, load: InferenceLoad, devices: int) -> Part:
    """FSDP2's shards, and what forward gathers: the root unit (held from its first use to the end of forward) and
    a block with the next one prefetched."""
    w, parts = load.weight_bytes_per_param, model_parts(facts)
    held = sharded_elements(facts.parameter_shapes, devices) * w
    gathered = (parts.rest + 2 * parts.block) * _gathered(load)
    return Part(
        held + gathered + facts.buffer_bytes,
        f"{dtype_name(w)}, a 1/{devices} shard; gathered: the root unit and 2 blocks",
    )


def _stage(facts: ModelFacts, load: InferenceLoad, index: int, stages: int) -> InferenceEstimate:
    if stages > facts.layers:
        raise SpecError(f"a pipeline of {stages} stages needs at least as many layers; the model has {facts.layers}")
    parts, w = model_parts(facts), load.weight_bytes_per_param
    layers = stage_layers(facts.layers, stages)[index]
    first, last = index == 0, index == stages - 1
    params = layers * parts.block + (parts.embedding if first else 0) + (parts.head if last else 0)
    ends = " + the embeddings" if first else " + the final norm and LM head" if last else ""
    return InferenceEstimate(
        Part(params * w + facts.buffer_bytes, f"{dtype_name(w)}, {layers} of {facts.layers} blocks{ends}"),
        Part(kv_cache_bytes(facts, load, layers), _kv_note(facts, load, layers)),
        activations_part(facts, load, with_head=last, stage_buffers=True),
        where=f"stage {index + 1} of {stages}, the largest",
    )


def _placed(facts: ModelFacts, load: InferenceLoad, placement: dict[str, int]) -> InferenceEstimate:
    """device_map: the device holding the most weights. accelerate runs offloaded blocks on the main device, so
    the whole KV cache and the activations are counted there."""
    on = {str(key): size for key, size in placement.items() if str(key) not in OFF_DEVICE}
    if not on:  # no GPU: the CPU is the device
        on = {"cpu": placement.get("cpu", 0)}
    off = {
        OFF_DEVICE[str(key)]: size for key, size in placement.items() if str(key) in OFF_DEVICE and str(key) not in on
    }
    device, held = max(on.items(), key=lambda item: item[1])
    note = f"device_map: what it places on {device}"
    if any(off.values()):
        held += model_parts(facts).block * load.weight_bytes_per_param
        note += " + one offloaded block at a time"
    return InferenceEstimate(
        Part(held, note),
        Part(kv_cache_bytes(facts, load), _kv_note(facts, load, facts.layers)),
        activations_part(facts, load),
        off_device=off,
        where=f"device {device}",
    )


def _kv_note(facts: ModelFacts, load: InferenceLoad, layers: int) -> str:
    if not load.kv_cache:
        return "none" + (" (evaluate)" if load.task == "evaluate" else " (each step runs the whole rows)")
    layer = facts.layer
    return (
        f"{load.batch_size} x {load.tokens} tokens x {layers} layers x 2 x {layer.kv_heads} kv heads x "
        f"{layer.head_dim} x {load.activation_bytes} bytes"
    )
