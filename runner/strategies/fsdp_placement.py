"""strategy=fsdp's placement: the units its wrap policy picks, `fully_shard` on each of them and on the root over the
mesh's data-parallel dimensions with the mixed-precision policy, rank 0's weights in every shard, and the stepper.
runner/strategies/fsdp.py's FSDPStrategy.wrap and .stepper call it."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ContextManager, Optional

from runner.components.mixed_precision import grad_scaler
from runner.config.precision import Dtype, PrecisionConfig
from runner.distributed import local
from runner.parallel.experts import experts_modules
from runner.strategies.fsdp_settings import AutoWrapPolicy, FSDPSettings
from runner.strategies.strategy_protocol import CheckpointLayout, PipelineStages, WholeWeights
from runner.strategies.torch_stepper import TorchStepper

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from runner.config.spec import RunSpec
    from runner.parallel.dims import ParallelDims


def wrap(
    strategy: FSDPSettings,
    model: nn.Module,
    spec: RunSpec,
    device: torch.device,
    dims: ParallelDims,
    whole: Optional[WholeWeights] = None,
) -> nn.Module:
    """`fully_shard` on each unit, then on the root, over the mesh's data-parallel dimensions; rank 0's weights
    in every shard."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    if strategy.async_tp:  # read when the blocks compile, at their first forward
        import torch._inductor.config

        torch._inductor.config._micro_pipeline_tp = True
    if whole is None and strategy.sync_module_states:
        _broadcast_from_rank0(model, dims, device.type)
    mesh = dims.sharding_mesh(device.type)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if strategy.offload_params else OffloadPolicy()
    options = {
        "mesh": mesh,
        "reshard_after_forward": strategy.sharding_strategy.reshards_after_forward,
        "mp_policy": mixed_precision_policy(spec.precision),
        "offload_policy": offload,
    }
    units = wrap_units(model, strategy)
    if dims.ep > 1:  # each rank's experts first, over the ranks that hold the same ones
        for experts in experts_modules(model):
            fully_shard(experts, **{**options, "mesh": dims.experts_mesh(device.type)})
    for unit in units:
        fully_shard(unit, **options)
    fully_shard(model, **options)
    set_prefetch(units, strategy)
    if whole is not None:  # the model was laid out on the meta device; rank 0's weights go into its shards
        _load_whole(model, whole, "cpu" if strategy.offload_params else device)
    return model


def stepper(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    spec: RunSpec,
    device: torch.device,
    layout: CheckpointLayout,
    stages: Optional[PipelineStages] = None,
) -> tuple[nn.Module, TorchStepper]:
    """The torch stepper of the sharded model, which syncs the gradients on a step's last micro batch only and
    writes checkpoints in `layout`."""

    def sync(last: bool) -> ContextManager:
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    scaler = grad_scaler(spec.precision, device, sharded=True)
    return model, TorchStepper(model, optimizer, spec.train.max_grad_norm, layout, scaler, sync, stages)


def mixed_precision_policy(precision: PrecisionConfig) -> MixedPrecisionPolicy:
    """Parameters all-gathered and computed in compute_dtype (the fp32 shards stay the master weights), gradients
    reduced in reduce_dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    low = precision.compute_dtype is not Dtype.fp32 and precision.param_dtype is Dtype.fp32
    return MixedPrecisionPolicy(
        param_dtype=precision.compute_dtype.torch if low else None, reduce_dtype=precision.reduce_dtype.torch
    )


def _broadcast_from_rank0(model: nn.Module, dims: ParallelDims, device_type: str) -> None:
    """Rank 0's trained parameters and buffers, over the data-parallel dimensions: each rank gets those of the rank
    with its tensor-parallel part (and its experts, which only the ranks at its place in the other expert-parallel
    groups share). A frozen base is left alone: every rank builds the same one, and QLoRA's NF4 tensors cannot be
    broadcast."""
    import torch
    import torch.distributed as dist

    mesh = dims.mesh(device_type)
    with torch.no_grad():
        for tensor in [*(p for p in model.parameters() if p.requires_grad), *model.buffers()]:
            if "ep" in (getattr(getattr(tensor, "device_mesh", None), "mesh_dim_names", None) or ()):
                groups = [
                    dims.experts_view(device_type).get_group(name) for name in ("dp_shard_mod_ep", "dp_replicate")
                ]
            else:
                groups = [mesh.get_group(name) for name in ("cp", "dp_shard", "dp_replicate")]
            for group in groups:
                dist.broadcast(local(tensor), group=group, group_src=0)


def _load_whole(model: nn.Module, whole: WholeWeights, device: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=device)
    set_model_state_dict(model, whole.state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in whole.buffers:
                buffer.copy_(whole.buffers[name])
            dist.broadcast(buffer, src=0)


def wrap_units(model: nn.Module, strategy: FSDPSettings) -> list[nn.Module]:
    """The submodules that become their own FSDP units, in forward order.

    A module holding a tied parameter (input embeddings shared with the LM head) stays with the root, which
    holds both ends of the tie.
    """
    match strategy.auto_wrap_policy:
        case AutoWrapPolicy.NO_WRAP:
            return []
        case AutoWrapPolicy.TRANSFORMER_BASED_WRAP:
            names = set(strategy.transformer_layer_cls or getattr(model, "_no_split_modules", None) or [])
            units = [m for m in model.modules() if type(m).__name__ in names]
        case AutoWrapPolicy.SIZE_BASED_WRAP:
            units = []
            _collect_by_size(model, strategy.min_num_params, units)
    tied = _tied_parameters(model)
    return [u for u in units if u is not model and not any(id(p) in tied for p in u.parameters())]


def _tied_parameters(model: nn.Module) -> set[int]:
    names: dict[int, int] = {}
    for _, parameter in model.named_parameters(remove_duplicate=False):
        names[id(parameter)] = names.get(id(parameter), 0) + 1
    return {key for key, count in names.items() if count > 1}


def _collect_by_size(module: nn.Module, min_num_params: int, units: list[nn.Module]) -> int:
    """Post-order: a module whose parameters not yet in a unit reach min_num_params becomes a unit (containers
    without a forward of their own, such as ModuleList, pass their count up instead)."""
    from torch import nn

    remaining = sum(_collect_by_size(child, min_num_params, units) for child in module.children())
    remaining += sum(p.numel() for p in module.parameters(recurse=False))
    if remaining >= min_num_params and not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        units.append(module)
        return 0
    return remaining


def set_prefetch(units: list[nn.Module], strategy: FSDPSettings) -> None:
    if strategy.forward_prefetch:
        for i, unit in enumerate(units):
            unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + strategy.forward_prefetch])
    if strategy.backward_prefetch != 1:
        for i, unit in enumerate(units):
            unit.set_modules_to_backward_prefetch(units[max(0, i - strategy.backward_prefetch) : i][::-1])
