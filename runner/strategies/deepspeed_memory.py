"""strategy=deepspeed's terms of the memory estimate (runner/memory/), ZeRO stage by stage, from DeepSpeed's own
defaults and the config the spec implies (runner/strategies/deepspeed_json.py). runner/strategies/deepspeed.py's
DeepSpeedStrategy.estimate_memory calls it."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from runner.config.precision import Dtype
from runner.memory.activations import ActivationDtypes, activations_part, loss_gradient_bytes
from runner.memory.breakdown import FP32, Estimate, Part, dtype_name, share
from runner.memory.expert_memory import experts_part
from runner.memory.model_shapes import fp8_linears
from runner.memory.parameters import host_loading, parameters_of
from runner.strategies.deepspeed_json import OffloadDevice, deepspeed_config

if TYPE_CHECKING:
    from runner.config.spec import RunSpec
    from runner.memory.model_shapes import ModelFacts
    from runner.memory.parameters import Parameters

# DeepSpeed's defaults for the zero_optimization keys the estimate reads (deepspeed/runtime/zero/config.py).
ZERO_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_model_persistence_threshold": 2**63 - 1,
    "sub_group_size": 1_000_000_000,
}
# ZeRO-0 all-reduces the gradients through flat copies of at most this many elements
# (engine.buffered_allreduce_fallback's elements_per_buffer).
ALLREDUCE_BUCKET = 500_000_000


def estimate_memory(spec: RunSpec, facts: ModelFacts, zero_stage: int, offload_optimizer: OffloadDevice) -> Estimate:
    """ZeRO-0: as single in fp32; in bf16/fp16 weights 2P + 4P (fp32 master), gradients 2P, states 4k.P.
    ZeRO-1, 2: weights m.P + 4.P/N (m = 2 in bf16/fp16, else 4), gradients m.P/N (+ the whole gradient of a
    parameter that straddles the partition's edge, at most 2), states 4k.P/N.
    ZeRO-3: weights m.P/N + m.P_persist + 4.P/N, gradients m.P/N, states 4k.P/N (P_persist: parameters of at
    most stage3_param_persistence_threshold elements stay whole).
    offload_optimizer moves the fp32 master, its gradients and the states ((8 + 4k).P/N) to CPU RAM;
    offload_param the ZeRO-3 weight partitions (m.P/N).
    With an adapter P is the adapters' parameters; the frozen base F, cast to m with the module, adds m.F to
    the weights (whole under ZeRO-0, 1, 2; m.F/N under ZeRO-3, which partitions every parameter)."""
    parameters = parameters_of(spec, facts)
    m = 2 if spec.precision.compute_dtype is not Dtype.fp32 else FP32  # DeepSpeed casts the module itself
    _, fp8_blocks = fp8_linears(facts.model, spec.precision)
    dtypes = ActivationDtypes(compute=m, stream=m, casts=False, fp8=fp8_blocks)
    module = parameters.trained + parameters.frozen_parameters
    common = dict(
        activations=activations_part(spec, facts, dtypes),
        loading=Part(m * module + facts.buffer_bytes, "deepspeed.initialize moves the whole module onto each device"),
        host_loading=host_loading(spec, facts, spec.hardware.nproc_per_node or 1),
    )
    if zero_stage == 0:
        result = _stage0(spec, facts, parameters, m, common)
        result.experts = experts_part(spec, facts, result)
        return result
    zero = {**ZERO_DEFAULTS, **deepspeed_config(spec).get("zero_optimization", {})}
    if zero_stage in (1, 2):
        result, partition = _stages_1_2(spec, facts, parameters, m, zero, common)
    else:
        result, partition = _stage3(spec, facts, parameters, m, zero, common)
    if offload_optimizer is not OffloadDevice.none:
        _offload_optimizer(result, spec, partition)
    result.experts = experts_part(spec, facts, result)
    return result


def _frozen(parameters: Parameters, m: int) -> tuple[int, str]:
    """The frozen base in DeepSpeed's module dtype, whole (ZeRO-0, 1, 2), and its note."""
    if not parameters.frozen:
        return 0, ""
    return m * parameters.frozen_parameters, f" + the frozen base, {dtype_name(m)}, whole"


def _adapters(parameters: Parameters) -> str:
    return "adapters " if parameters.frozen else ""


def _stage0(spec: RunSpec, facts: ModelFacts, parameters: Parameters, m: int, common: dict) -> Estimate:
    P, module = parameters.trained, dtype_name(m)
    k, states = spec.optim.states()
    master = FP32 * P if m < FP32 else 0  # 16-bit: DeepSpeed's FP16_Optimizer keeps whole fp32 weights
    frozen, frozen_note = _frozen(parameters, m)
    return Estimate(
        weights=Part(
            m * P + master + frozen + facts.buffer_bytes,
            f"{_adapters(parameters)}{module}, whole" + (" + fp32 master weights" if master else "") + frozen_note,
        ),
        gradients=Part(m * P, f"{module}, whole"),
        optimizer_states=Part(k * FP32 * P, f"{states}, fp32, whole"),
        backward_start=Part(loss_gradient_bytes(spec, facts), "the loss gradient"),
        backward_end=Part(min(P, ALLREDUCE_BUCKET) * m, "the all-reduce's flat gradient bucket"),
        step=Part((2 if master else 1) * FP32 * P, "the step's temporaries" + (", fp32 gradients" if master else "")),
        **common,
    )


def _stages_1_2(
    spec: RunSpec, facts: ModelFacts, parameters: Parameters, m: int, zero: dict, common: dict
) -> tuple[Estimate, int]:
    P, N, module, stage = parameters.trained, spec.hardware.world_size, dtype_name(m), spec.strategy.zero_stage
    k, states = spec.optim.states()
    partition = math.ceil(P / N)
    # A parameter that straddles a partition's edge keeps its whole gradient on both ranks.
    straddling = min(N - 1, 2) * parameters.largest_trained
    reduce_bucket = int(zero["reduce_bucket_size"])
    overlap = zero.get("overlap_comm", False)
    frozen, frozen_note = _frozen(parameters, m)
    return Estimate(
        weights=Part(
            m * P + FP32 * partition + frozen + facts.buffer_bytes,
            f"{_adapters(parameters)}{module}, whole, + fp32 master weights{share(N)}{frozen_note}",
        ),
        gradients=Part(m * (partition + straddling), f"{module}{share(N)} (+ whole gradients at its edges)"),
        optimizer_states=Part(k * FP32 * partition, f"{states}, fp32{share(N)}"),
        buffers=Part(
            reduce_bucket * m * (2 if overlap else 1),
            f"the reduce bucket of {reduce_bucket:.0e} elements" + (", twice (overlap_comm)" if overlap else ""),
        ),
        backward_start=Part(loss_gradient_bytes(spec, facts), "the loss gradient"),
        # ZeRO-1 reduces once, after backward: the whole gradients exist until then.
        backward_end=Part(m * P, "ZeRO-1's whole gradients before their reduction") if stage == 1 else Part(0, ""),
        step=Part(2 * FP32 * partition, "fp32 gradients of the partition, the step's temporaries"),
        **common,
    ), partition


def _stage3(
    spec: RunSpec, facts: ModelFacts, parameters: Parameters, m: int, zero: dict, common: dict
) -> tuple[Estimate, int]:
    strategy, N, module = spec.strategy, spec.hardware.world_size, dtype_name(m)
    k, states = spec.optim.states()
    # Every parameter of the module is partitioned and gathered alike; the frozen ones have no master or states.
    shapes = [*parameters.trained_shapes, *(shape for group in parameters.frozen for shape in group.shapes)]
    partitioned = sum(math.ceil(math.prod(shape) / N) for shape in shapes)
    partition = sum(math.ceil(math.prod(shape) / N) for shape in parameters.trained_shapes)
    persistent = _persistent_parameters(shapes, zero)
    live = min(int(zero["stage3_max_live_parameters"]), facts.largest_module + int(zero["stage3_prefetch_bucket_size"]))
    reduce_bucket = int(zero["reduce_bucket_size"])
    frozen = ", the frozen base included" if parameters.frozen else ""
    result = Estimate(
        weights=Part(
            m * (partitioned + persistent) + FP32 * partition + facts.buffer_bytes,
            f"{module}{share(N)}{frozen} (+ {persistent:,} small parameters whole), + fp32 master weights{share(N)}",
        ),
        gradients=Part(m * partition, f"{module}{share(N)}"),
        optimizer_states=Part(k * FP32 * partition, f"{states}, fp32{share(N)}"),
        buffers=Part(reduce_bucket * m, f"the reduce bucket of {reduce_bucket:.0e} elements"),
        backward_start=Part(
            live * m + loss_gradient_bytes(spec, facts),
            "gathered parameters (the largest module + the prefetch bucket); the loss gradient",
        ),
        backward_end=Part(live * m, "gathered parameters"),
        # The optimizer steps the partition in sub-groups of sub_group_size elements.
        step=Part(
            2 * FP32 * min(partition, int(zero["sub_group_size"])),
            "fp32 gradients of a sub-group, the step's temporaries",
        ),
        **common,
    )
    if strategy.offload_param is not OffloadDevice.none:
        result.weights = Part(
            m * persistent + FP32 * partition + facts.buffer_bytes,
            f"{persistent:,} small parameters whole, + fp32 master weights{share(N)}; "
            f"the weight partitions on {strategy.offload_param.value} (offload_param)",
        )
        if strategy.offload_param is OffloadDevice.cpu:
            result.host_offload = Part(
                (spec.hardware.nproc_per_node or 1) * m * partitioned, f"offload_param: {module} weight partitions"
            )
    return result, partition


def _offload_optimizer(result: Estimate, spec: RunSpec, partition: int) -> None:
    """The fp32 master weights, their gradients and the states leave the device for offload_optimizer's."""
    device, N = spec.strategy.offload_optimizer, spec.hardware.world_size
    k, states = spec.optim.states()
    note = result.weights.note.replace(f", + fp32 master weights{share(N)}", f"; fp32 master on {device.value}")
    result.weights = Part(result.weights.bytes - FP32 * partition, note)
    result.gradients = Part(0, f"reduced into {device.value} buffers (offload_optimizer)")
    result.optimizer_states = Part(0, f"on {device.value} (offload_optimizer); the step runs on the CPU")
    result.step = Part(0, "on the CPU")
    if device is OffloadDevice.cpu:
        moved = (spec.hardware.nproc_per_node or 1) * (2 * FP32 + k * FP32) * partition
        note = f"offload_optimizer: fp32 master weights, their gradients and {states}{share(N)}"
        if result.host_offload.bytes:
            note += f"; {result.host_offload.note}"
        result.host_offload = Part(result.host_offload.bytes + moved, note)


def _persistent_parameters(shapes: list[tuple[int, ...]], zero: dict) -> int:
    """ZeRO-3 keeps parameters of at most stage3_param_persistence_threshold elements whole on every rank, up to
    stage3_model_persistence_threshold elements in all (DeepSpeed's mark_persistent_parameters)."""
    threshold, budget = int(zero["stage3_param_persistence_threshold"]), int(zero["stage3_model_persistence_threshold"])
    kept = 0
    for numel in (math.prod(shape) for shape in shapes):
        if numel <= threshold and numel + kept <= budget:
            kept += numel
    return kept
