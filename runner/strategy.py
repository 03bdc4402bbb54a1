"""The `strategy` group: how the model is placed and wrapped across processes and devices.

single: one process. ddp: torch DistributedDataParallel. deepspeed: `deepspeed.initialize` with a config made
from the spec (ZeRO stage, offload, accumulation, clipping, precision). fsdp: torch FSDP2 (`fully_shard`) in the vocabulary of
FSDP1 and accelerate, mapped onto a device mesh:

    sharding_strategy    mesh (replicate x shard)        reshard after forward
    FULL_SHARD           1 x world                       yes   (ZeRO-3)
    SHARD_GRAD_OP        1 x world                       no    (ZeRO-2)
    NO_SHARD             world x 1                       -     (replicated, gradients all-reduced)
    HYBRID_SHARD         world/group x group             yes   (shard within a group, replicate across)
    HYBRID_SHARD_ZERO2   world/group x group             no

where `group` is `hybrid_shard_size`: by default the processes of one node, or on a single node half of them
(two replicas), since sharding across the whole of one node is FULL_SHARD.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, ContextManager, List, Optional, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from runner.hardware import HardwareConfig
    from runner.precision import PrecisionConfig
    from runner.spec import RunSpec


@dataclass
class StrategyConfig:
    """What every strategy option shares; each option's schema adds its own keys."""


@dataclass
class SingleStrategy(StrategyConfig):
    """One process on one device, no wrapping."""


@dataclass
class DDPStrategy(StrategyConfig):
    # Let DDP look for parameters that get no gradient in a step (slower; only for models that need it).
    find_unused_parameters: bool = False
    bucket_cap_mb: int = 25


class ShardingStrategy(str, Enum):
    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"
    HYBRID_SHARD_ZERO2 = "HYBRID_SHARD_ZERO2"


class AutoWrapPolicy(str, Enum):
    TRANSFORMER_BASED_WRAP = "TRANSFORMER_BASED_WRAP"
    SIZE_BASED_WRAP = "SIZE_BASED_WRAP"
    NO_WRAP = "NO_WRAP"


class StateDictType(str, Enum):
    FULL = "FULL"
    SHARDED = "SHARDED"


@dataclass
class FSDPStrategy(StrategyConfig):
    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    # HYBRID_SHARD*: ranks in one shard group; unset: a node's processes (on one node: half of them).
    hybrid_shard_size: Optional[int] = None
    auto_wrap_policy: AutoWrapPolicy = AutoWrapPolicy.TRANSFORMER_BASED_WRAP
    # TRANSFORMER_BASED_WRAP: class names of the blocks to shard as units; empty means the model's _no_split_modules.
    transformer_layer_cls: List[str] = field(default_factory=list)
    # SIZE_BASED_WRAP: a module becomes a unit once it holds this many parameters not already in a unit.
    min_num_params: int = 100_000_000
    # Keep the sharded parameters, gradients and optimizer states in CPU RAM; the optimizer steps on the CPU.
    offload_params: bool = False
    # Only rank 0 loads (or initialises) the weights; the others start on the meta device and receive them.
    cpu_ram_efficient_loading: bool = False
    sync_module_states: bool = True
    activation_checkpointing: bool = False
    # Checkpoints: FULL gathers the whole model and optimizer state on rank 0 (and resumes on any number of
    # processes); SHARDED has each rank write its own shards (faster, and resumes on the same number only).
    state_dict_type: StateDictType = StateDictType.FULL
    # How many following blocks' all-gathers to issue early in forward, and preceding ones in backward.
    forward_prefetch: int = 0
    backward_prefetch: int = 1

    @property
    def hybrid(self) -> bool:
        return self.sharding_strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)


class OffloadDevice(str, Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


@dataclass
class DeepSpeedStrategy(StrategyConfig):
    zero_stage: int = 2
    # Optimizer states (stages 1-3) and parameters (stage 3) can live in CPU RAM or on an NVMe drive.
    offload_optimizer: OffloadDevice = OffloadDevice.none
    offload_param: OffloadDevice = OffloadDevice.none
    nvme_path: Optional[str] = None
    # A DeepSpeed JSON whose keys are added to the generated config; one the spec also sets must agree with it.
    config_file: Optional[str] = None


def data_parallel_size(strategy: StrategyConfig, world_size: int) -> int:
    """How many ranks split each global batch: all of them, for every multi-process strategy here."""
    return 1 if isinstance(strategy, SingleStrategy) else world_size


def shard_mesh_shape(strategy: FSDPStrategy, hardware: HardwareConfig) -> tuple[int, int]:
    """(replicate, shard) sizes of the FSDP device mesh."""
    world = hardware.world_size
    if strategy.sharding_strategy is ShardingStrategy.NO_SHARD:
        return world, 1
    if strategy.hybrid:
        group = hybrid_group_size(strategy, hardware)
        return world // group, group
    return 1, world


def describe(strategy: StrategyConfig, hardware: HardwareConfig) -> str:
    processes = f"{hardware.world_size} process{'es' if hardware.world_size > 1 else ''}"
    match strategy:
        case SingleStrategy():
            return f"single, {processes}"
        case DDPStrategy():
            return f"ddp, {processes}"
        case DeepSpeedStrategy():
            return f"deepspeed ZeRO-{strategy.zero_stage}, {processes}"
        case FSDPStrategy():
            replicate, shard = shard_mesh_shape(strategy, hardware)
            return (f"fsdp {strategy.sharding_strategy.value}, {processes}, mesh {replicate} x {shard} "
                    f"(replicate x shard), {strategy.auto_wrap_policy.value}")
    raise TypeError(f"unknown strategy {type(strategy).__name__}")


def hybrid_group_size(strategy: FSDPStrategy, hardware: HardwareConfig) -> int:
    if strategy.hybrid_shard_size:
        return strategy.hybrid_shard_size
    return hardware.nproc_per_node if hardware.nnodes > 1 else max(1, hardware.world_size // 2)


def loads_weights(strategy: StrategyConfig, rank: int) -> bool:
    """Whether this rank builds the model with real weights (else on the meta device, to be filled by rank 0)."""
    return rank == 0 or not (isinstance(strategy, FSDPStrategy) and strategy.cpu_ram_efficient_loading)


def apply_strategy(
    model: nn.Module, strategy: StrategyConfig, hardware: HardwareConfig, device: torch.device,
    precision: PrecisionConfig,
) -> nn.Module:
    from runner.precision import ddp_reduce_hook, fsdp_mixed_precision

    match strategy:
        case SingleStrategy():
            return model.to(device)
        case DDPStrategy():
            from torch.nn.parallel import DistributedDataParallel

            ddp = DistributedDataParallel(
                model.to(device),
                device_ids=[device.index] if device.type == "cuda" else None,
                find_unused_parameters=strategy.find_unused_parameters,
                bucket_cap_mb=strategy.bucket_cap_mb,
            )
            if hook := ddp_reduce_hook(precision):
                ddp.register_comm_hook(None, hook)
            return ddp
        case FSDPStrategy():
            return apply_fsdp(model, strategy, hardware, device, fsdp_mixed_precision(precision))
    raise TypeError(f"unknown strategy {type(strategy).__name__}")


def apply_fsdp(
    model: nn.Module, strategy: FSDPStrategy, hardware: HardwareConfig, device: torch.device,
    mixed_precision: MixedPrecisionPolicy,
) -> nn.Module:
    """Activation checkpointing, then `fully_shard` on each unit and the root, then the weights into the shards."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    if strategy.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    replicate, shard = shard_mesh_shape(strategy, hardware)
    mesh = init_device_mesh(device.type, (replicate, shard), mesh_dim_names=("replicate", "shard"))
    reshard = strategy.sharding_strategy not in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.HYBRID_SHARD_ZERO2)
    options = {
        "mesh": mesh,
        "reshard_after_forward": reshard,
        "mp_policy": mixed_precision,
        "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda") if strategy.offload_params else OffloadPolicy(),
    }
    if strategy.cpu_ram_efficient_loading:
        # Only rank 0 holds weights: keep them aside, shard an empty copy everywhere, then broadcast into the shards.
        full_state = model.state_dict() if dist.get_rank() == 0 else {}
        # Buffers outside the state dict (rotary frequencies) would come back empty from the meta device.
        buffers = {name: b.clone() for name, b in model.named_buffers()} if dist.get_rank() == 0 else {}
        model = model.to("meta")
        model.tie_weights()  # moving to meta unties the LM head from the embeddings; the other ranks have them tied
    elif strategy.sync_module_states:
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor, src=0)

    units = wrap_units(model, strategy)
    for unit in units:
        fully_shard(unit, **options)
    fully_shard(model, **options)
    set_prefetch(units, strategy)

    if strategy.cpu_ram_efficient_loading:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        buffers_device = "cpu" if strategy.offload_params else device
        model.to_empty(device=buffers_device)
        set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name in buffers:
                    buffer.copy_(buffers[name])
                dist.broadcast(buffer, src=0)
    return model


def wrap_units(model: nn.Module, strategy: FSDPStrategy) -> list[nn.Module]:
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


def set_prefetch(units: list[nn.Module], strategy: FSDPStrategy) -> None:
    if strategy.forward_prefetch:
        for i, unit in enumerate(units):
            unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + strategy.forward_prefetch])
    if strategy.backward_prefetch != 1:
        for i, unit in enumerate(units):
            unit.set_modules_to_backward_prefetch(units[max(0, i - strategy.backward_prefetch) : i][::-1])


def deepspeed_config(spec: RunSpec) -> dict[str, Any]:
    """The DeepSpeed config the spec implies, with the user's config file's other keys added."""
    import json
    import math

    from runner.precision import Dtype

    strategy, train, precision = spec.strategy, spec.train, spec.precision
    zero: dict[str, Any] = {"stage": strategy.zero_stage}
    for key in ("offload_optimizer", "offload_param"):
        device = getattr(strategy, key)
        if device is not OffloadDevice.none:
            zero[key] = {"device": device.value, **({"nvme_path": strategy.nvme_path} if device.value == "nvme" else {})}
    generated = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.grad_accum_steps,
        "train_batch_size": train.micro_batch_size * train.grad_accum_steps * spec.hardware.world_size,
        "gradient_clipping": train.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": precision.compute_dtype is Dtype.bf16},
        "fp16": {
            "enabled": precision.compute_dtype is Dtype.fp16,
            "loss_scale": 0,  # dynamic
            "initial_scale_power": int(math.log2(precision.initial_loss_scale)),
            "loss_scale_window": precision.loss_scale_growth_interval,
        },
        "communication_data_type": precision.reduce_dtype.value,
        # The runner's own torch optimizer also steps offloaded states (DeepSpeed would insist on its CPU Adam).
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
    }
    if not strategy.config_file:
        return generated
    user = json.loads(open(strategy.config_file).read())
    return _merge_agreeing(user, generated, strategy.config_file)


def _merge_agreeing(user: dict, generated: dict, source: str, path: str = "") -> dict:
    from runner.spec import SpecError

    merged = dict(generated)
    for key, value in user.items():
        if isinstance(value, dict) and isinstance(generated.get(key), dict):
            merged[key] = _merge_agreeing(value, generated[key], source, f"{path}{key}.")
        elif key in generated and generated[key] != value:
            raise SpecError(f"{source} sets {path}{key}={value!r} but the spec gives {generated[key]!r}; "
                            "change one of them")
        else:
            merged[key] = value
    return merged


def deepspeed_engine(model: nn.Module, optimizer: torch.optim.Optimizer, spec: RunSpec) -> nn.Module:
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(spec))
    engine.checkpoint_engine = WeightsOnlyLoading(engine.checkpoint_engine)
    return engine


class WeightsOnlyLoading:
    """DeepSpeed's checkpoint engine, except that loading unpickles nothing but tensors, containers and the few
    DeepSpeed types its checkpoints hold (DeepSpeed's own loader unpickles anything)."""

    def __init__(self, engine: Any):
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def load(self, path: str, map_location: Any = None) -> Any:
        import torch

        with torch.serialization.safe_globals(deepspeed_checkpoint_types()):
            return torch.load(path, map_location=map_location, weights_only=True)


def deepspeed_checkpoint_types() -> list:
    """The non-tensor types in DeepSpeed's ZeRO 0-3 checkpoints (found with get_unsafe_globals_in_checkpoint)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    # fp16's dynamic loss scaling saves a DynamicLossScaler (fp16 DeepSpeed runs only on GPUs); others a LossScaler.
    return [DynamicLossScaler, LossScaler, ZeroStageEnum, fragment_address]


@dataclass
class StepOutcome:
    grad_norm: float
    # False when fp16's loss scale overflowed and the update was skipped (the schedule then waits too).
    applied: bool = True
    loss_scale: Optional[float] = None


class Stepper(Protocol):
    """Backward on each micro batch, then one optimizer step; how depends on the strategy."""

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> StepOutcome:
        """Clips, updates and clears the gradients; the norm is the one before clipping."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs beyond model and optimizer (fp16's loss scale)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TorchStepper:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    max_grad_norm: float
    scaler: Optional[torch.amp.GradScaler] = None

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self) -> StepOutcome:
        import torch

        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP: the shards' partial norms, combined
            norm = norm.full_tensor()
        if self.max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, norm)
        if self.scaler:
            # The scaler skips the update when a gradient overflowed, and then lowers the scale.
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            outcome = StepOutcome(float(norm), self.scaler.get_scale() >= scale, self.scaler.get_scale())
        else:
            self.optimizer.step()
            outcome = StepOutcome(float(norm))
        self.optimizer.zero_grad(set_to_none=True)
        return outcome

    def state_dict(self) -> dict[str, Any]:
        return {"loss_scaler": self.scaler.state_dict()} if self.scaler else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler and "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])


@dataclass
class DeepSpeedStepper:
    """DeepSpeed's engine steps after every backward and updates only at the accumulation boundary, which it
    counts itself (gradient_accumulation_steps in its config matches train.grad_accum_steps). Its fp16 loss
    scale lives in its own checkpoint."""

    engine: Any

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)  # the loss is already a share of the global batch
        self.engine.step()

    def step(self) -> StepOutcome:
        # Every fp16 optimizer of DeepSpeed has loss_scale; ZeRO-0's FP16_UnfusedOptimizer has no cur_scale.
        scale = self.engine.optimizer.loss_scale if self.engine.fp16_enabled() else None
        return StepOutcome(float(self.engine.get_global_grad_norm() or 0.0), self.engine.was_step_applied(), scale)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def gradient_sync(model: nn.Module, strategy: StrategyConfig, enabled: bool) -> ContextManager:
    """Within gradient accumulation, only the last micro batch synchronises gradients across ranks."""
    match strategy:
        case DDPStrategy() if not enabled:
            return model.no_sync()
        case FSDPStrategy():
            model.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


def unwrapped(model: nn.Module) -> nn.Module:
    """The transformers model inside a strategy's wrapper (FSDP2 wraps in place)."""
    return getattr(model, "module", model)


def parameter_count(model: nn.Module) -> int:
    """The whole model's parameters, however they are sharded: an FSDP2 DTensor's numel is its global size, and a
    parameter that DeepSpeed ZeRO-3 partitioned keeps its size in ds_numel (its own data is empty)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def full_state_dict(model: nn.Module, strategy: StrategyConfig) -> dict[str, torch.Tensor]:
    """The whole model's weights on rank 0 (maybe empty elsewhere); every rank must call it."""
    if isinstance(strategy, DeepSpeedStrategy):
        if strategy.zero_stage == 3:  # gathers the partitioned parameters
            return model._zero3_consolidated_16bit_state_dict() or {}
        return model.module.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from runner.checkpoint import cpu_copy

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name: cpu_copy(tensor) for name, tensor in state.items()}

