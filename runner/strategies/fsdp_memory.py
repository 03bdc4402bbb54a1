"""strategy=fsdp's terms of the memory estimate (runner/memory/), and the changes of its keys that save memory, for
the fit check's advice. runner/strategies/fsdp.py's FSDPStrategy.estimate_memory and .memory_changes call them."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

from runner.errors import SpecError
from runner.memory.activations import ActivationDtypes, activations_part, loss_gradient_bytes, pipeline_activations_part
from runner.memory.breakdown import (
    Change,
    Estimate,
    Part,
    dtype_name,
    estimate,
    sharded_elements,
    share,
    strategy_change,
)
from runner.memory.expert_memory import dispatch_bytes, experts_part
from runner.memory.model_shapes import facts_of, fp8_linears, meta_model
from runner.memory.parameters import adapter_transients, host_loading, parameters_of, weights_note
from runner.parallel.tensor import block_plan
from runner.strategies.fsdp_placement import wrap_units
from runner.strategies.fsdp_settings import FSDPSettings, ShardingStrategy

if TYPE_CHECKING:
    from torch import nn

    from runner.config.spec import RunSpec
    from runner.memory.model_shapes import ExpertFacts, ModelFacts
    from runner.memory.parameters import Parameters


def estimate_memory(strategy: FSDPSettings, spec: RunSpec, facts: ModelFacts) -> Estimate:
    """weights P_S.w, gradients P_S.w, states k.P_S.w, with P_S = sum over parameters of ceil(rows / S) x
    columns (FSDP2 shards dim 0, padded evenly) and S the shard group: N (FULL_SHARD, SHARD_GRAD_OP), 1
    (NO_SHARD), the group (HYBRID_SHARD*). offload_params moves (2 + k).P_S.w per process to CPU RAM.
    With an adapter P is the adapters' parameters, and the frozen base is sharded alike in its stored dtypes
    (NF4 included: torchao's NF4 shards and all-gathers as NF4)."""
    precision, parameters = spec.precision, parameters_of(spec, facts)
    dims = spec.layout
    shards = dims.dp_shard * dims.cp  # FSDP shards over the context-parallel ranks too
    w = precision.param_dtype.bytes
    gathered = min(w, precision.compute_dtype.bytes)  # FSDP's mixed-precision policy gathers in compute dtype
    reduce = precision.reduce_dtype.bytes
    k, states = spec.optim.states()
    held = _held(facts, parameters, shards, dims.ep)
    frozen = parameters.frozen_bytes(shards)
    (root, root_trained), (largest, largest_trained), whole = unit_sizes(
        facts.model, strategy, parameters, gathered, strategy.tp_size, facts.experts, dims.ep
    )
    _, fp8_blocks = fp8_linears(facts.model, precision)
    dtypes = ActivationDtypes(compute=gathered, stream=gathered, casts=False, fp8=fp8_blocks)
    if not strategy.sharding_strategy.reshards_after_forward:
        all_gathered = whole + largest
        gather_note = f"{dtype_name(gathered)} all-gathers: every unit stays gathered from forward to backward"
    else:
        # The root unit stays gathered from forward to backward; each other unit is gathered, copied out of the
        # all-gather buffer, and the next ones prefetched.
        prefetch = max(strategy.forward_prefetch, strategy.backward_prefetch)
        all_gathered = root + (2 + prefetch) * largest
        gather_note = f"{dtype_name(gathered)} all-gathers: the root unit and {2 + prefetch} x the largest unit"
    if parameters.frozen:
        gather_note = gather_note.replace(dtype_name(gathered), parameters.frozen_note() + " base", 1)
    dequantized, dequantized_note = adapter_transients(parameters, precision.compute_dtype.bytes)
    part_of = share(shards, strategy.tp_size) + (" of a pipeline rank's stages" if strategy.pp_size > 1 else "")
    nproc = spec.hardware.nproc_per_node or 1
    a2a, a2a_note = _dispatched(spec, facts, gathered)
    result = Estimate(
        weights=Part(
            held * w + frozen + facts.buffer_bytes,
            weights_note(parameters, dtype_name(w), f"{part_of} ({strategy.sharding_strategy.value})"),
        ),
        gradients=Part(held * w, f"{dtype_name(w)}{part_of}"),
        optimizer_states=Part(k * held * w, f"{states}, {dtype_name(w)}{part_of}"),
        activations=(
            pipeline_activations_part(spec, facts, dtypes, strategy.pipeline_schedule)
            if strategy.pp_size > 1
            else activations_part(spec, facts, dtypes)
        ),
        backward_start=Part(
            all_gathered + loss_gradient_bytes(spec, facts) + largest_trained * (gathered + reduce) + dequantized + a2a,
            f"{gather_note}; the loss gradient; a unit's reduce-scatter{dequantized_note}{a2a_note}",
        ),
        # The root unit's gradients are reduced last, its parameters still gathered.
        backward_end=Part(root + root_trained * (gathered + reduce) + largest, "the root unit's reduce-scatter"),
        step=Part(spec.optim.step_copies() * held * w, "the optimizer's foreach temporaries"),
        host_loading=host_loading(spec, facts, 1 if strategy.cpu_ram_efficient_loading else nproc),
    )
    if strategy.offload_params:
        _offloaded(result, nproc * ((2 + k) * held * w + frozen), states, part_of, frozen, facts.buffer_bytes)
    result.experts = experts_part(spec, facts, result, _gathered_experts(facts, strategy, gathered, dims.ep))
    return result


def _dispatched(spec: RunSpec, facts: ModelFacts, gathered: int) -> tuple[int, str]:
    """Expert parallelism's all-to-all buffers of a MoE layer, and their note; none without it."""
    if spec.layout.ep == 1:
        return 0, ""
    tokens = spec.train.micro_batch_size * spec.data.seq_len
    return (
        dispatch_bytes(facts.experts, tokens, facts.layer.hidden, gathered),
        "; a MoE layer's all-to-all buffers (expert parallelism)",
    )


def _held(facts: ModelFacts, parameters: Parameters, shards: int, ep: int) -> int:
    """Elements of rank 0's shards of the trained parameters; under expert parallelism each MoE layer's routed
    experts are first split ep ways (dim 0, the experts), then sharded over the shards' other dp_shard / ep."""
    if ep == 1 or parameters.frozen:
        return sharded_elements(list(parameters.trained_shapes), shards)
    others, local = [], []
    for (name, _), shape in zip(facts.model.named_parameters(), parameters.trained_shapes):
        if name in facts.experts.names:
            local.append((shape[0] // ep, *shape[1:]))
        else:
            others.append(shape)
    return sharded_elements(others, shards) + sharded_elements(local, shards // ep)


def _gathered_experts(facts: ModelFacts, strategy: FSDPSettings, gathered: int, ep: int) -> int:
    """The routed experts' all-gathered bytes at the start of backward: those of the units gathered then
    (the whole model's under SHARD_GRAD_OP), each unit's being a MoE layer's local 1/ep of them."""
    experts = facts.experts
    if experts is None:
        return 0
    layer = experts.routed * experts.per_expert * gathered // ep
    if not strategy.sharding_strategy.reshards_after_forward:
        return layer * len(experts.moe_layers)
    return (2 + max(strategy.forward_prefetch, strategy.backward_prefetch)) * layer


def _offloaded(result: Estimate, moved: int, states: str, part_of: str, frozen: int, buffer_bytes: int) -> None:
    """offload_params: the weights, gradients and optimizer states leave the device for each node's CPU RAM."""
    frozen_note = f", and the frozen base{part_of}" if frozen else ""
    result.host_offload = Part(
        moved, f"offload_params: each process's weights, gradients and {states}{part_of}" + frozen_note
    )
    result.weights = Part(buffer_bytes, "in CPU RAM (offload_params); buffers only")
    result.gradients = Part(0, "in CPU RAM (offload_params)")
    result.optimizer_states = Part(0, "in CPU RAM (offload_params); the step runs on the CPU")
    result.step = Part(0, "on the CPU")


def memory_changes(strategy: FSDPSettings, spec: RunSpec) -> list[Change]:
    changes = []
    if strategy.sharding_strategy is not ShardingStrategy.FULL_SHARD and spec.hardware.world_size > 1:
        changes.append(
            strategy_change(
                "strategy.sharding_strategy=FULL_SHARD",
                1.0,
                sharding_strategy=ShardingStrategy.FULL_SHARD,
                hybrid_shard_size=None,
            )
        )
    if not strategy.offload_params:
        changes.append(strategy_change("strategy.offload_params=true", 3.0, offload_params=True))
    if not strategy.cpu_ram_efficient_loading and not spec.adapter.quantized:  # qlora: each process quantizes
        changes.append(
            strategy_change(
                "strategy.cpu_ram_efficient_loading=true", 0.5, cpu_ram_efficient_loading=True, sync_module_states=True
            )
        )
    return changes + _tensor_parallel_changes(strategy, spec) + _expert_parallel_changes(strategy, spec)


def _expert_parallel_changes(strategy: FSDPSettings, spec: RunSpec) -> list[Change]:
    """Splitting a MoE model's experts over 2, 4, 8 ... of the shards, where that divides the experts and the
    shards and lowers the peak: each rank gathers its experts only, at the cost of an all-to-all each MoE layer."""
    facts = facts_of(spec.model)
    if strategy.ep_size > 1 or facts.experts is None or max(strategy.tp_size, strategy.pp_size, strategy.cp_size) > 1:
        return []
    peak, shards, changes = estimate(spec, facts).peak, spec.layout.dp_shard, []
    ep = 2
    while ep <= min(shards, facts.experts.routed):
        if shards % ep == 0 and facts.experts.routed % ep == 0:
            change = strategy_change(f"strategy.ep_size={ep}", 1.0 + 0.25 * math.log2(ep), ep_size=ep)
            if estimate(change.apply(spec), facts).peak < peak:
                changes.append(change)
        ep *= 2
    return changes


def _tensor_parallel_changes(strategy: FSDPSettings, spec: RunSpec) -> list[Change]:
    """Splitting each block over 2, 4 or 8 of a node's processes, where the model's heads allow: it divides the
    activations too, which no sharding does. Its collectives at every layer cost more the more ranks share them.
    (Pipeline stages are no such change: with FSDP over the other ranks, each rank holds the same share of
    weights, gradients and states, and under 1F1B the first stage keeps as many layers' activations in flight.)"""
    if strategy.tp_size > 1:
        return []
    model, nproc = meta_model(spec.model), spec.hardware.nproc_per_node or 1
    changes = []
    for tp in (2, 4, 8):
        try:
            if nproc % tp == 0 and block_plan(model, tp):
                changes.append(strategy_change(f"strategy.tp_size={tp}", 1.0 + 0.5 * math.log2(tp), tp_size=tp))
        except SpecError:
            pass
    return changes


def unit_sizes(
    model: nn.Module,
    strategy: FSDPSettings,
    parameters: Parameters,
    gathered: int,
    tp: int = 1,
    experts: Optional[ExpertFacts] = None,
    ep: int = 1,
) -> tuple[tuple[int, int], tuple[int, int], int]:
    """(all-gathered bytes, trained parameters) of the root unit and of the largest other unit under the strategy's
    wrap policy, and the whole model's all-gathered bytes. Trained parameters gather in `gathered` bytes, as do the
    adapters beside an adapted linear (each rank's parts already); frozen ones in the dtype they are stored in (NF4
    as NF4). Under tensor parallelism FSDP gathers a rank's parts: a tp-th of each unit (its norms, whole on every
    rank, are a rounding error). Under expert parallelism (`ep` ranks) a block's routed experts (`experts`) are a
    unit of their own, each rank gathering its 1/ep of them."""
    routed_names = experts.names if experts else frozenset()

    def size(module: nn.Module, prefix: str, routed: bool = False) -> tuple[int, int]:
        gathered_bytes, trained = 0.0, 0
        for name, parameter in module.named_parameters(prefix=prefix):
            if routed and name not in routed_names:
                continue
            stored = parameters.stored.get(name)
            gathered_bytes += parameter.numel() * (gathered if stored is None else stored)
            trained += parameter.numel() if stored is None else 0
        adapters = 0 if routed else sum(parameters.adapters.get(n, 0) for n, _ in module.named_modules(prefix=prefix))
        return math.ceil(gathered_bytes / tp) + adapters * gathered, trained // tp + adapters

    names = {id(module): name for name, module in model.named_modules()}
    wrapped = [(unit, names[id(unit)]) for unit in wrap_units(model, strategy)]
    units = [size(unit, name) for unit, name in wrapped]
    whole = size(model, "")
    root = (whole[0] - sum(unit[0] for unit in units), whole[1] - sum(unit[1] for unit in units))
    if ep > 1:  # each block without its experts, and its rank's part of them
        routed = [size(unit, name, routed=True) for unit, name in wrapped]
        units = [(u[0] - r[0], u[1] - r[1]) for u, r in zip(units, routed)] + [(r[0] // ep, r[1] // ep) for r in routed]
    return root, max(units, default=(0, 0)), whole[0]
