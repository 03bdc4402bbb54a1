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
decoding step. Checked against the tensors a CPU forward of tiny_llama holds (tests/test_inference_estimate.py):
the estimate is 0 to 30% above them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Optional

from runner.config.hardware import GIB, Accelerator
from runner.errors import SpecError
from runner.config.model import blocks
from runner.memory.facts import facts_of
from runner.memory.terms import FP32, Part, dtype_name, part_row, readable, sharded_elements

if TYPE_CHECKING:
    from runner.config.spec import RunSpec
    from runner.config.task import InferenceTaskConfig
    from runner.memory.facts import LayerShape, ModelFacts

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


def activations_part(facts: ModelFacts, load: InferenceLoad, *, with_layers: bool = True, with_head: bool = True,
                     stage_buffers: bool = False) -> Part:
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
            kept = {0: "every position", 1: "the last position"}.get(load.logits_to_keep,
                                                                     f"the last {load.logits_to_keep}")
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


def inference_estimate(facts: ModelFacts, load: InferenceLoad, *, devices: int = 1, how: str = "replica",
                       placement: Optional[dict[str, int]] = None) -> InferenceEstimate:
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
        return InferenceEstimate(_sharded_weights(facts, load, devices), kv,
                                 # FSDP's mixed-precision policy runs the whole forward in the gathered dtype.
                                 activations_part(facts, replace(load, weight_bytes_per_param=_gathered(load))))
    return InferenceEstimate(Part(facts.parameters * w + facts.buffer_bytes, f"{dtype_name(w)}, whole"), kv,
                             activations_part(facts, load))


def _gathered(load: InferenceLoad) -> int:
    return min(load.weight_bytes_per_param, load.activation_bytes)


def _sharded_weights(facts: ModelFacts, load: InferenceLoad, devices: int) -> Part:
    """FSDP2's shards, and what forward gathers: the root unit (held from its first use to the end of forward) and
    a block with the next one prefetched."""
    w, parts = load.weight_bytes_per_param, model_parts(facts)
    held = sharded_elements(facts.parameter_shapes, devices) * w
    gathered = (parts.rest + 2 * parts.block) * _gathered(load)
    return Part(held + gathered + facts.buffer_bytes,
                f"{dtype_name(w)}, a 1/{devices} shard; gathered: the root unit and 2 blocks")


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
        where=f"stage {index + 1} of {stages}, the largest")


def _placed(facts: ModelFacts, load: InferenceLoad, placement: dict[str, int]) -> InferenceEstimate:
    """device_map: the device holding the most weights. accelerate runs offloaded blocks on the main device, so
    the whole KV cache and the activations are counted there."""
    on = {str(key): size for key, size in placement.items() if str(key) not in OFF_DEVICE}
    if not on:  # no GPU: the CPU is the device
        on = {"cpu": placement.get("cpu", 0)}
    off = {OFF_DEVICE[str(key)]: size for key, size in placement.items() if str(key) in OFF_DEVICE and
           str(key) not in on}
    device, held = max(on.items(), key=lambda item: item[1])
    note = f"device_map: what it places on {device}"
    if any(off.values()):
        held += model_parts(facts).block * load.weight_bytes_per_param
        note += " + one offloaded block at a time"
    return InferenceEstimate(Part(held, note), Part(kv_cache_bytes(facts, load), _kv_note(facts, load, facts.layers)),
                             activations_part(facts, load), off_device=off, where=f"device {device}")


def _kv_note(facts: ModelFacts, load: InferenceLoad, layers: int) -> str:
    if not load.kv_cache:
        return "none" + (" (evaluate)" if load.task == "evaluate" else " (each step runs the whole rows)")
    layer = facts.layer
    return (f"{load.batch_size} x {load.tokens} tokens x {layers} layers x 2 x {layer.kv_heads} kv heads x "
            f"{layer.head_dim} x {load.activation_bytes} bytes")


# ---- the report and the fit check, against the spec's hardware


@dataclass(frozen=True)
class Options:
    """How the task spells the changes the fit check proposes."""

    batch: str = "task.batch_size"
    pipeline: Optional[str] = "task.pipeline_stages"  # None: the task has no pipeline
    device_map: str = "task.device_map=auto"
    max_memory: str = "task.max_memory"


def inference_report(spec: RunSpec, facts: ModelFacts, load: InferenceLoad, *, how: str = "replica",
                     devices: Optional[int] = None, placement: Optional[dict[str, int]] = None,
                     options: Options = Options()) -> str:
    """What an inference task prints before it starts: the parts per device, the total, and whether it fits.
    `devices`: the stages or shards of `how`; unset, the hardware's processes."""
    devices = devices or spec.hardware.world_size
    result = inference_estimate(facts, load, devices=devices, how=how, placement=placement)
    hardware = spec.hardware
    memory = f"{hardware.device_memory_gib:g} GiB" if hardware.device_memory_gib else "memory not declared"

    def row(label: str, part: Part) -> str:
        return part_row(label, part, 12)

    lines = [
        f"inference memory estimate: {type(facts.model).__name__} ({facts.parameters:,} parameters), {load.task}, "
        f"{_layout(how, devices, placement)}, {dtype_name(load.weight_bytes_per_param)} weights, "
        f"{dtype_name(load.activation_bytes)} activations, batch {load.batch_size} x {load.tokens} tokens",
        f"per device ({hardware.device_name or hardware.accelerator.value}, {memory})"
        + (f", {result.where}:" if result.where else ":"),
        row("weights", result.weights),
        row("KV cache", result.kv_cache),
        row("activations", result.activations),
        row("total", Part(result.peak, "weights + KV cache + activations")),
        *(row(f"in {name}", Part(size, "device_map: not on the device")) for name, size in result.off_device.items()),
    ]
    needs, available = _needs(spec, result, devices), _available(spec)
    if available is None:
        lines.append("  fits: unknown (the hardware declares no memory)")
    else:
        shared = f" for {devices} processes sharing its RAM" if _shared(spec) and devices > 1 else ""
        lines.append(f"  fits: {'yes' if needs <= available else 'NO'} ({readable(needs)} of {memory}{shared})")
        if needs > available:
            lines.append(f"  it fits with: {_fixes(spec, facts, load, how, devices, placement, options)}")
    return "\n".join(lines)


def check_inference_fit(spec: RunSpec, facts: ModelFacts, load: InferenceLoad, *, how: str = "replica",
                        devices: Optional[int] = None, placement: Optional[dict[str, int]] = None,
                        options: Options = Options()) -> None:
    """Refuses, in one line, an inference job whose device peak exceeds the device's memory, naming what fits."""
    devices = devices or spec.hardware.world_size
    result = inference_estimate(facts, load, devices=devices, how=how, placement=placement)
    available, needs = _available(spec), _needs(spec, result, devices)
    if available is None or needs <= available:
        return
    hardware = spec.hardware
    where = f" ({result.where})" if result.where else ""
    raise SpecError(f"the {load.task} job does not fit: an estimated {readable(needs)} per device{where} of the "
                    f"{hardware.device_memory_gib:g} GiB of {hardware.device_name or 'each device'}; it fits with: "
                    f"{_fixes(spec, facts, load, how, devices, placement, options)}; task.estimate_only=true shows "
                    "the breakdown, task.fit_check=false runs anyway")


def pipeline_load(load: InferenceLoad) -> InferenceLoad:
    """The runner's pipeline generation (runner/engine/pipeline.py) keeps no KV cache: each step runs the whole
    rows, prompt and new tokens, through the stages, and the last stage computes the logits of one position."""
    if not load.kv_cache:
        return load
    return replace(load, kv_cache=False, prompt_tokens=None, logits_to_keep=1)


def _layout(how: str, devices: int, placement: Optional[dict[str, int]]) -> str:
    if placement is not None:
        return "device_map placement"
    if how == "pipeline" and devices > 1:
        return f"a pipeline of {devices} stages"
    if how == "sharded" and devices > 1:
        return f"sharded over {devices} devices (FSDP)"
    return f"a whole replica on each of {devices} devices" if devices > 1 else "one device"


def _shared(spec: RunSpec) -> bool:
    """On a CPU the processes share the machine's RAM."""
    return spec.hardware.accelerator is Accelerator.cpu


def _needs(spec: RunSpec, result: InferenceEstimate, devices: int) -> int:
    return result.peak * devices if _shared(spec) else result.peak


def _available(spec: RunSpec) -> Optional[int]:
    memory = spec.hardware.device_memory_gib
    return None if memory is None else int(memory * GIB)


def _fixes(spec: RunSpec, facts: ModelFacts, load: InferenceLoad, how: str, devices: int,
           placement: Optional[dict[str, int]], options: Options) -> str:
    """The changes that fit, each estimated again, cheapest first: a smaller batch, device_map=auto (or, already
    placed, a lower limit on the GPU), a pipeline of more stages."""
    available = _available(spec) or 0

    def needs(load: InferenceLoad, how: str = how, devices: int = devices,
              placement: Optional[dict[str, int]] = placement) -> int:
        return _needs(spec, inference_estimate(facts, load, devices=devices, how=how, placement=placement), devices)

    found = []
    batch = next((b for b in _halvings(load.batch_size) if needs(replace(load, batch_size=b)) <= available), None)
    if batch is not None:
        found.append(f"{options.batch}={batch} ({readable(needs(replace(load, batch_size=batch)))})")
    room = available - _besides_weights(facts, load)
    weights = facts.parameters * load.weight_bytes_per_param + facts.buffer_bytes
    if room > 0 and not _shared(spec):
        if placement is None:
            found.append(f"{options.device_map} ({readable(max(weights - room, 0))} of the weights to CPU RAM and "
                         "disk)")
        else:
            found.append(f"{options.device_map} with {options.max_memory}.0={room / GIB:.1f} (room on the GPU for the "
                         "KV cache and activations)")
    if options.pipeline is not None and placement is None and how != "sharded":
        staged = pipeline_load(load)
        fewest = devices + 1 if how == "pipeline" else 2
        stages = next((n for n in range(fewest, facts.layers + 1)
                       if needs(staged, "pipeline", n, None) <= available), None)
        if stages is not None:
            found.append(f"{options.pipeline}={stages} ({readable(needs(staged, 'pipeline', stages, None))} on the "
                         "largest stage)")
    if found:
        return " | ".join(found)
    return (f"nothing tried fits ({options.batch}=1, {options.device_map} to spill weights to CPU RAM and disk"
            f"{', more pipeline stages' if options.pipeline else ''}): use larger devices or fewer tokens")


def _halvings(batch: int) -> list[int]:
    return [batch >> i for i in range(1, batch.bit_length())]


def _besides_weights(facts: ModelFacts, load: InferenceLoad) -> int:
    """What device_map=auto's device holds besides its share of the weights: the KV cache, the activations, and one
    offloaded block brought in at a time."""
    block = model_parts(facts).block * load.weight_bytes_per_param
    return kv_cache_bytes(facts, load) + activations_part(facts, load).bytes + block


# ---- what the inference tasks call


def inference_answer(spec: RunSpec, task: InferenceTaskConfig, *, batch_size: int, tokens: int, kv_cache: bool,
                     stages: int = 1, prompt_tokens: Optional[int] = None) -> Optional[str]:
    """An inference task's before_launch answer: the report when task.estimate_only (nothing starts); else None,
    once the fit check passed (task.fit_check)."""
    facts, load, layout = _planned(spec, task, batch_size, tokens, kv_cache, stages, prompt_tokens)
    if task.estimate_only:
        return inference_report(spec, facts, load, **layout)
    if task.fit_check:
        check_inference_fit(spec, facts, load, **layout)
    return None


def planned_report(spec: RunSpec, task: InferenceTaskConfig, *, batch_size: int, tokens: int, kv_cache: bool,
                   stages: int = 1, prompt_tokens: Optional[int] = None) -> str:
    """The report an inference job prints as it starts (the same as task.estimate_only's)."""
    facts, load, layout = _planned(spec, task, batch_size, tokens, kv_cache, stages, prompt_tokens)
    return inference_report(spec, facts, load, **layout)


def _planned(spec: RunSpec, task: InferenceTaskConfig, batch_size: int, tokens: int, kv_cache: bool, stages: int,
             prompt_tokens: Optional[int]) -> tuple[ModelFacts, InferenceLoad, dict[str, Any]]:
    """The model's facts, the load and the layout of the job. generate goes through transformers' generate() (a KV
    cache, the logits of the last position) or, with `stages` > 1, the runner's pipeline (see pipeline_load)."""
    from runner.config.task import DeviceMap

    facts = facts_of(spec.model)
    precision = spec.precision
    load = InferenceLoad(batch_size, tokens, kv_cache, precision.param_dtype.bytes, precision.compute_dtype.bytes,
                         prompt_tokens=prompt_tokens, logits_to_keep=1 if kv_cache else 0, frozen=True)
    how, devices = "replica", spec.hardware.world_size
    if stages > 1:
        how, devices, load = "pipeline", stages, pipeline_load(load)
    elif spec.strategy.shards_inference:
        how = "sharded"
    placement = None
    if task.device_map is DeviceMap.auto:
        placement = device_map_placement(spec, facts, task, load.weight_bytes_per_param)
    options = Options(batch="task.batch_size" if kv_cache else "train.micro_batch_size",
                      pipeline="task.pipeline_stages" if kv_cache else None)
    return facts, load, {"how": how, "devices": devices, "placement": placement, "options": options}


def device_map_placement(spec: RunSpec, facts: ModelFacts, task: InferenceTaskConfig,
                         weight_bytes_per_param: int) -> dict[str, int]:
    """Bytes of weights accelerate's device_map=auto puts on each GPU ("0", "1", ...), "cpu" and "disk", under
    the limits the task would give it (runner/engine/big_model.py), from the model on the meta device."""
    from runner.memory.device_map import automatic_device_map, device_of, memory_limits

    hardware = spec.hardware
    gpus = (hardware.nproc_per_node or 0) if hardware.accelerator is Accelerator.cuda else 0
    limits = memory_limits(hardware.device_memory_gib, gpus, hardware.host_memory_gib, task.max_memory)
    device_map = automatic_device_map(facts.model, limits, spec.precision.param_dtype.torch)
    placed: dict[str, int] = {}
    for name, parameter in facts.model.named_parameters():
        device = str(device_of(name, device_map))
        placed[device] = placed.get(device, 0) + parameter.numel() * weight_bytes_per_param
    return placed
