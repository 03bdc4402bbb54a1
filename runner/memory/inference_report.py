"""What an inference job (task=evaluate, task=generate) prints before it starts, and its fit check against the
spec's hardware with the changes that fit; the estimate itself is runner/memory/inference_estimate.py."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional

from runner.config.hardware import GIB, Accelerator
from runner.errors import SpecError
from runner.memory.breakdown import Part, dtype_name, part_row, readable
from runner.memory.inference_estimate import (
    InferenceEstimate,
    InferenceLoad,
    activations_part,
    inference_estimate,
    kv_cache_bytes,
    model_parts,
    pipeline_load,
)
from runner.memory.model_shapes import facts_of

if TYPE_CHECKING:
    from runner.config.spec import RunSpec
    from runner.config.task import InferenceTaskConfig
    from runner.memory.model_shapes import ModelFacts


@dataclass(frozen=True)
class Options:
    """How the task spells the changes the fit check proposes."""

    batch: str = "task.batch_size"
    pipeline: Optional[str] = "task.pipeline_stages"  # None: the task has no pipeline
    device_map: str = "task.device_map=auto"
    max_memory: str = "task.max_memory"


def inference_report(
    spec: RunSpec,
    facts: ModelFacts,
    load: InferenceLoad,
    *,
    how: str = "replica",
    devices: Optional[int] = None,
    placement: Optional[dict[str, int]] = None,
    options: Options = Options(),
) -> str:
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


def check_inference_fit(
    spec: RunSpec,
    facts: ModelFacts,
    load: InferenceLoad,
    *,
    how: str = "replica",
    devices: Optional[int] = None,
    placement: Optional[dict[str, int]] = None,
    options: Options = Options(),
) -> None:
    """Refuses, in one line, an inference job whose device peak exceeds the device's memory, naming what fits."""
    devices = devices or spec.hardware.world_size
    result = inference_estimate(facts, load, devices=devices, how=how, placement=placement)
    available, needs = _available(spec), _needs(spec, result, devices)
    if available is None or needs <= available:
        return
    hardware = spec.hardware
    where = f" ({result.where})" if result.where else ""
    raise SpecError(
        f"the {load.task} job does not fit: an estimated {readable(needs)} per device{where} of the "
        f"{hardware.device_memory_gib:g} GiB of {hardware.device_name or 'each device'}; it fits with: "
        f"{_fixes(spec, facts, load, how, devices, placement, options)}; task.estimate_only=true shows "
        "the breakdown, task.fit_check=false runs anyway"
    )


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


def _fixes(
    spec: RunSpec,
    facts: ModelFacts,
    load: InferenceLoad,
    how: str,
    devices: int,
    placement: Optional[dict[str, int]],
    options: Options,
) -> str:
    """The changes that fit, each estimated again, cheapest first: a smaller batch, device_map=auto (or, already
    placed, a lower limit on the GPU), a pipeline of more stages."""
    available = _available(spec) or 0

    def needs(
        load: InferenceLoad, how: str = how, devices: int = devices, placement: Optional[dict[str, int]] = placement
    ) -> int:
        return _needs(spec, inference_estimate(facts, load, devices=devices, how=how, placement=placement), devices)

    found = []
    batch = next((b for b in _halvings(load.batch_size) if needs(replace(load, batch_size=b)) <= available), None)
    if batch is not None:
        found.append(f"{options.batch}={batch} ({readable(needs(replace(load, batch_size=batch)))})")
    room = available - _besides_weights(facts, load)
    weights = facts.parameters * load.weight_bytes_per_param + facts.buffer_bytes
    if room > 0 and not _shared(spec):
        if placement is None:
            found.append(
                f"{options.device_map} ({readable(max(weights - room, 0))} of the weights to CPU RAM and disk)"
            )
        else:
            found.append(
                f"{options.device_map} with {options.max_memory}.0={room / GIB:.1f} (room on the GPU for the "
                "KV cache and activations)"
            )
    if options.pipeline is not None and placement is None and how != "sharded":
        staged = pipeline_load(load)
        fewest = devices + 1 if how == "pipeline" else 2
        stages = next(
            (n for n in range(fewest, facts.layers + 1) if needs(staged, "pipeline", n, None) <= available), None
        )
        if stages is not None:
            found.append(
                f"{options.pipeline}={stages} ({readable(needs(staged, 'pipeline', stages, None))} on the "
                "largest stage)"
            )
    if found:
        return " | ".join(found)
    return (
        f"nothing tried fits ({options.batch}=1, {options.device_map} to spill weights to CPU RAM and disk"
        f"{', more pipeline stages' if options.pipeline else ''}): use larger devices or fewer tokens"
    )


def _halvings(batch: int) -> list[int]:
    return [batch >> i for i in range(1, batch.bit_length())]


def _besides_weights(facts: ModelFacts, load: InferenceLoad) -> int:
    """What device_map=auto's device holds besides its share of the weights: the KV cache, the activations, and one
    offloaded block brought in at a time."""
    block = model_parts(facts).block * load.weight_bytes_per_param
    return kv_cache_bytes(facts, load) + activations_part(facts, load).bytes + block


# ---- what the inference tasks call


def inference_answer(
    spec: RunSpec,
    task: InferenceTaskConfig,
    *,
    batch_size: int,
    tokens: int,
    kv_cache: bool,
    stages: int = 1,
    prompt_tokens: Optional[int] = None,
) -> Optional[str]:
    """An inference task's before_launch answer: the report when task.estimate_only (nothing starts); else None,
    once the fit check passed (task.fit_check)."""
    facts, load, layout = _planned(spec, task, batch_size, tokens, kv_cache, stages, prompt_tokens)
    if task.estimate_only:
        return inference_report(spec, facts, load, **layout)
    if task.fit_check:
        check_inference_fit(spec, facts, load, **layout)
    return None


def planned_report(
    spec: RunSpec,
    task: InferenceTaskConfig,
    *,
    batch_size: int,
    tokens: int,
    kv_cache: bool,
    stages: int = 1,
    prompt_tokens: Optional[int] = None,
) -> str:
    """The report an inference job prints as it starts (the same as task.estimate_only's)."""
    facts, load, layout = _planned(spec, task, batch_size, tokens, kv_cache, stages, prompt_tokens)
    return inference_report(spec, facts, load, **layout)


def _planned(
    spec: RunSpec,
    task: InferenceTaskConfig,
    batch_size: int,
    tokens: int,
    kv_cache: bool,
    stages: int,
    prompt_tokens: Optional[int],
) -> tuple[ModelFacts, InferenceLoad, dict[str, Any]]:
    """The model's facts, the load and the layout of the job. generate goes through transformers' generate() (a KV
    cache, the logits of the last position) or, with `stages` > 1, the runner's pipeline (see pipeline_load)."""
    from runner.config.task import DeviceMap

    facts = facts_of(spec.model)
    precision = spec.precision
    load = InferenceLoad(
        batch_size,
        tokens,
        kv_cache,
        precision.param_dtype.bytes,
        precision.compute_dtype.bytes,
        prompt_tokens=prompt_tokens,
        logits_to_keep=1 if kv_cache else 0,
        frozen=True,
    )
    how, devices = "replica", spec.hardware.world_size
    if stages > 1:
        how, devices, load = "pipeline", stages, pipeline_load(load)
    elif spec.strategy.shards_inference:
        how = "sharded"
    placement = None
    if task.device_map is DeviceMap.auto:
        placement = device_map_placement(spec, facts, task, load.weight_bytes_per_param)
    options = Options(
        batch="task.batch_size" if kv_cache else "train.micro_batch_size",
        pipeline="task.pipeline_stages" if kv_cache else None,
    )
    return facts, load, {"how": how, "devices": devices, "placement": placement, "options": options}


def device_map_placement(
    spec: RunSpec, facts: ModelFacts, task: InferenceTaskConfig, weight_bytes_per_param: int
) -> dict[str, int]:
    """Bytes of weights accelerate's device_map=auto puts on each GPU ("0", "1", ...), "cpu" and "disk", under
    the limits the task would give it (runner/generation/big_model.py), from the model on the meta device."""
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
