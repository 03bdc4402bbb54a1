"""strategy=deepspeed: `deepspeed.initialize` with a config made from the spec (ZeRO stage, offload, accumulation,
clipping, precision); its engine wraps model and optimizer together and keeps the fp32 master weights."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, ContextManager, Optional

from runner.config.float8 import Float8Backend
from runner.config.hardware import Accelerator
from runner.config.precision import Dtype
from runner.config.strategy import StrategyConfig
from runner.errors import require
from runner.memory.activations import ActivationDtypes, activations_part, loss_gradient_bytes
from runner.memory.facts import facts_of, fp8_linears
from runner.memory.parameters import host_loading, parameters_of
from runner.memory.terms import FP32, Change, Estimate, Part, dtype_name, processes, share, strategy_change
from runner.parallel.dims import ParallelDims
from runner.quiet import deepspeed_setup
from runner.strategies.deepspeed_json import config_with_file, read_into_spec
from runner.strategies.fsdp import switch_to_fsdp
from runner.strategies.protocol import (
    CheckpointLayout,
    PipelineStages,
    StepOutcome,
    WholeWeights,
    has_frozen_parameters,
    trained_state,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

    from runner.config.hardware import HardwareConfig
    from runner.config.spec import RunSpec
    from runner.memory.facts import ModelFacts
    from runner.memory.parameters import Parameters
    from runner.parallel.sequence import SequenceSplit

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
    # Sequence-parallel ranks (Ulysses, DeepSpeed's ALST): each sequence split into this many slices, each rank
    # attending over whole sequences for its share of the heads.
    sp_size: int = 1

    name: ClassVar[str] = "deepspeed"
    distributed: ClassVar[bool] = True
    forward_cast: ClassVar[Optional[str]] = "DeepSpeed engine"
    float8_all_gather: ClassVar[bool] = False
    shards_inference: ClassVar[bool] = False
    checkpoint_layout: ClassVar[CheckpointLayout] = CheckpointLayout.ENGINE

    def check(self, spec: RunSpec) -> None:
        precision, machine = spec.precision, spec.hardware
        require(not spec.adapter.quantized,
                "adapter=qlora runs under strategy=single, ddp and fsdp: DeepSpeed flattens and partitions the "
                "module's tensors, which cannot hold torchao's NF4 base (use strategy=fsdp, or adapter=lora)")
        require(not spec.train.compile,
                "train.compile=true runs under strategy=single, ddp and fsdp; DeepSpeed's ZeRO hooks swap the "
                "parameters a compiled block would trace (use strategy=fsdp, or train.compile=false)")
        require(precision.param_dtype is Dtype.fp32,
                "strategy=deepspeed keeps fp32 master weights itself; precision.param_dtype=bf16 applies to "
                "single, ddp and fsdp (use precision=bf16)")
        if precision.compute_dtype is Dtype.fp16:
            require(machine.accelerator is Accelerator.cuda,
                    "strategy=deepspeed with precision=fp16 needs a GPU (DeepSpeed's CPU accelerator has no fp16); "
                    "use precision=bf16, or precision=fp16 with strategy=single, ddp or fsdp")
        if precision.fp8:
            require(precision.fp8.backend is not Float8Backend.transformer_engine,
                    "precision.fp8.backend=transformer_engine works with strategy=single, ddp or fsdp; "
                    "use precision.fp8.backend=torchao with strategy=deepspeed")
        import importlib.util

        require(importlib.util.find_spec("deepspeed") is not None,
                "strategy=deepspeed needs the deepspeed package: pip install deepspeed "
                "(or '.[deepspeed]' from the runner's checkout)")
        require(self.zero_stage in (0, 1, 2, 3), f"strategy.zero_stage={self.zero_stage} must be 0, 1, 2 or 3")
        require(self.offload_param is OffloadDevice.none or self.zero_stage == 3,
                f"strategy.offload_param={self.offload_param.value} needs strategy.zero_stage=3")
        require(self.offload_optimizer is OffloadDevice.none or self.zero_stage >= 1,
                f"strategy.offload_optimizer={self.offload_optimizer.value} needs strategy.zero_stage >= 1")
        nvme = OffloadDevice.nvme in (self.offload_optimizer, self.offload_param)
        require(not nvme or (self.nvme_path and Path(self.nvme_path).is_dir()),
                f"NVMe offload needs strategy.nvme_path=<an existing directory on the NVMe drive>, not {self.nvme_path}")
        if self.sp_size != 1:
            self._check_sequence_parallel(spec)
        if self.config_file:
            deepspeed_config(spec)  # the file's contradictions with the spec, before launch

    def _check_sequence_parallel(self, spec: RunSpec) -> None:
        """What Ulysses cannot split, refused before launch: it trades sequence slices for whole heads."""
        sp, world = f"strategy.sp_size={self.sp_size}", spec.hardware.world_size
        require(self.sp_size >= 1 and world % self.sp_size == 0,
                f"{sp} does not divide the {world} processes (hardware.nnodes x hardware.nproc_per_node)")
        layer = facts_of(spec.model).layer
        require(layer.heads % self.sp_size == 0 and (layer.kv_heads % self.sp_size == 0
                                                     or self.sp_size % layer.kv_heads == 0),
                f"{sp} does not divide the model's {layer.heads} attention heads, or its {layer.kv_heads} key-value "
                "heads (nor they it): each rank attends with an equal share of the heads; pick a divisor of both")
        reduce_scatter = deepspeed_config(spec)["zero_optimization"].get("reduce_scatter", True)
        require(self.zero_stage != 3 or reduce_scatter,
                f"{sp} with ZeRO-3 and zero_optimization.reduce_scatter=false (strategy.config_file): DeepSpeed then "
                "divides some gradient buckets by the data-parallel ranks and others by every rank; remove the key")

    def resolved(self, spec: RunSpec) -> RunSpec:
        """What the config file decides where the spec does not (runner/strategies/deepspeed_json.py)."""
        return read_into_spec(spec) if self.config_file else spec

    def describe(self, hardware: HardwareConfig) -> str:
        described = f"deepspeed ZeRO-{self.zero_stage}, {processes(hardware.world_size)}"
        if self.sp_size > 1:
            described += f", {self.dims(hardware).describe()}, Ulysses sequence parallel"
        return described

    def dims(self, hardware: HardwareConfig) -> ParallelDims:
        return ParallelDims(dp_shard=hardware.world_size // self.sp_size, cp=self.sp_size)

    def sequence_split(self, dims: ParallelDims, device_type: str) -> Optional[SequenceSplit]:
        from runner.parallel.ulysses import UlyssesSplit, sequence_parallel_group

        if dims.cp == 1:
            return None
        return UlyssesSplit(sequence_parallel_group(dims.cp), whole_gradients=self.zero_stage == 3)

    def loads_weights(self, rank: int) -> bool:
        return True

    def wrap(self, model: nn.Module, spec: RunSpec, device: torch.device, dims: ParallelDims,
             whole: Optional[WholeWeights] = None) -> nn.Module:
        """Nothing yet: DeepSpeed's engine takes model and optimizer together (`stepper`), moves the module to the
        device and broadcasts rank 0's weights."""
        return model

    def frozen(self, model: nn.Module, spec: RunSpec, device: torch.device, dims: ParallelDims,
               whole: Optional[WholeWeights] = None) -> nn.Module:
        """ZeRO-3: an engine of its own, without optimizer, which partitions the weights as the trained model's are
        and gathers them layer by layer in the forward (as TRL places its reference); otherwise a replica."""
        if self.zero_stage < 3:
            return model.to(device)
        return self._engine(model, None, spec)

    def frozen_shards(self, hardware: HardwareConfig) -> int:
        return hardware.world_size if self.zero_stage == 3 else 1

    def stepper(self, model: nn.Module, optimizer: torch.optim.Optimizer, spec: RunSpec, device: torch.device,
                stages: Optional[PipelineStages] = None) -> tuple[nn.Module, DeepSpeedStepper]:
        engine = self._engine(model, optimizer, spec)
        engine.checkpoint_engine = WeightsOnlyLoading(engine.checkpoint_engine)
        return engine, DeepSpeedStepper(engine, self.zero_stage)

    def _engine(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer], spec: RunSpec) -> Any:
        """DeepSpeed's engine of the model (and its optimizer). Under Ulysses, the engine reads DeepSpeed's
        sequence-parallel groups, made at placement."""
        import deepspeed

        from runner.parallel.ulysses import deepspeed_groups

        with deepspeed_setup():
            engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(spec),
                                                   mpu=deepspeed_groups() if self.sp_size > 1 else None)
        return engine

    def estimate_memory(self, spec: RunSpec, facts: ModelFacts) -> Estimate:
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
        if self.zero_stage == 0:
            return _stage0(spec, facts, parameters, m, common)
        zero = {**ZERO_DEFAULTS, **deepspeed_config(spec).get("zero_optimization", {})}
        if self.zero_stage in (1, 2):
            result, partition = _stages_1_2(spec, facts, parameters, m, zero, common)
        else:
            result, partition = _stage3(spec, facts, parameters, m, zero, common)
        if self.offload_optimizer is not OffloadDevice.none:
            _offload_optimizer(result, spec, partition)
        return result

    def memory_changes(self, spec: RunSpec) -> list[Change]:
        changes = [switch_to_fsdp()]
        for stage in range(self.zero_stage + 1, 4):
            changes.append(strategy_change(f"strategy.zero_stage={stage}", 0.5 + 0.25 * stage, zero_stage=stage))
        if self.offload_optimizer is OffloadDevice.none and self.zero_stage >= 1:
            changes.append(strategy_change("strategy.offload_optimizer=cpu", 3.0, offload_optimizer=OffloadDevice.cpu))
        if self.offload_param is OffloadDevice.none and self.zero_stage == 3:
            changes.append(strategy_change("strategy.offload_param=cpu", 3.0, offload_param=OffloadDevice.cpu))
        if self.sp_size == 1:
            # Ulysses slices each sequence's activations, which no ZeRO stage partitions; the checks keep the sizes
            # that divide the processes and the heads.
            changes += [strategy_change(f"strategy.sp_size={sp}", 1.0 + 0.5 * math.log2(sp), sp_size=sp)
                        for sp in (2, 4, 8)]
        return changes


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
        weights=Part(m * P + master + frozen + facts.buffer_bytes,
                     f"{_adapters(parameters)}{module}, whole" + (" + fp32 master weights" if master else "")
                     + frozen_note),
        gradients=Part(m * P, f"{module}, whole"),
        optimizer_states=Part(k * FP32 * P, f"{states}, fp32, whole"),
        backward_start=Part(loss_gradient_bytes(spec, facts), "the loss gradient"),
        backward_end=Part(min(P, ALLREDUCE_BUCKET) * m, "the all-reduce's flat gradient bucket"),
        step=Part((2 if master else 1) * FP32 * P, "the step's temporaries" + (", fp32 gradients" if master else "")),
        **common,
    )


def _stages_1_2(spec: RunSpec, facts: ModelFacts, parameters: Parameters, m: int, zero: dict,
                common: dict) -> tuple[Estimate, int]:
    P, N, module, stage = parameters.trained, spec.hardware.world_size, dtype_name(m), spec.strategy.zero_stage
    k, states = spec.optim.states()
    partition = math.ceil(P / N)
    # A parameter that straddles a partition's edge keeps its whole gradient on both ranks.
    straddling = min(N - 1, 2) * parameters.largest_trained
    reduce_bucket = int(zero["reduce_bucket_size"])
    overlap = zero.get("overlap_comm", False)
    frozen, frozen_note = _frozen(parameters, m)
    return Estimate(
        weights=Part(m * P + FP32 * partition + frozen + facts.buffer_bytes,
                     f"{_adapters(parameters)}{module}, whole, + fp32 master weights{share(N)}{frozen_note}"),
        gradients=Part(m * (partition + straddling), f"{module}{share(N)} (+ whole gradients at its edges)"),
        optimizer_states=Part(k * FP32 * partition, f"{states}, fp32{share(N)}"),
        buffers=Part(reduce_bucket * m * (2 if overlap else 1),
                     f"the reduce bucket of {reduce_bucket:.0e} elements" + (", twice (overlap_comm)" if overlap else "")),
        backward_start=Part(loss_gradient_bytes(spec, facts), "the loss gradient"),
        # ZeRO-1 reduces once, after backward: the whole gradients exist until then.
        backward_end=Part(m * P, "ZeRO-1's whole gradients before their reduction") if stage == 1 else Part(0, ""),
        step=Part(2 * FP32 * partition, "fp32 gradients of the partition, the step's temporaries"),
        **common,
    ), partition


def _stage3(spec: RunSpec, facts: ModelFacts, parameters: Parameters, m: int, zero: dict,
            common: dict) -> tuple[Estimate, int]:
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
        weights=Part(m * (partitioned + persistent) + FP32 * partition + facts.buffer_bytes,
                     f"{module}{share(N)}{frozen} (+ {persistent:,} small parameters whole), + fp32 master weights"
                     f"{share(N)}"),
        gradients=Part(m * partition, f"{module}{share(N)}"),
        optimizer_states=Part(k * FP32 * partition, f"{states}, fp32{share(N)}"),
        buffers=Part(reduce_bucket * m, f"the reduce bucket of {reduce_bucket:.0e} elements"),
        backward_start=Part(live * m + loss_gradient_bytes(spec, facts),
                            "gathered parameters (the largest module + the prefetch bucket); the loss gradient"),
        backward_end=Part(live * m, "gathered parameters"),
        # The optimizer steps the partition in sub-groups of sub_group_size elements.
        step=Part(2 * FP32 * min(partition, int(zero["sub_group_size"])),
                  "fp32 gradients of a sub-group, the step's temporaries"),
        **common,
    )
    if strategy.offload_param is not OffloadDevice.none:
        result.weights = Part(m * persistent + FP32 * partition + facts.buffer_bytes,
                              f"{persistent:,} small parameters whole, + fp32 master weights{share(N)}; "
                              f"the weight partitions on {strategy.offload_param.value} (offload_param)")
        if strategy.offload_param is OffloadDevice.cpu:
            result.host_offload = Part((spec.hardware.nproc_per_node or 1) * m * partitioned,
                                       f"offload_param: {module} weight partitions")
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


def deepspeed_config(spec: RunSpec) -> dict[str, Any]:
    """The DeepSpeed config the spec implies, with the user's config file's other keys added."""
    strategy, train, precision = spec.strategy, spec.train, spec.precision
    zero: dict[str, Any] = {"stage": strategy.zero_stage}
    for key in ("offload_optimizer", "offload_param"):
        device = getattr(strategy, key)
        if device is not OffloadDevice.none:
            zero[key] = {"device": device.value, **({"nvme_path": strategy.nvme_path} if device.value == "nvme" else {})}
    generated = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.grad_accum_steps,
        "train_batch_size": train.micro_batch_size * train.grad_accum_steps * strategy.dims(spec.hardware).dp_size,
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
        # What DeepSpeed reduces the gradients in instead, under sequence parallelism.
        **({"seq_parallel_communication_data_type": precision.reduce_dtype.value}
           if strategy.sp_size > 1 else {}),
        # The runner's own torch optimizer also steps offloaded states (DeepSpeed would insist on its CPU Adam), and
        # ZeRO partitions any torch optimizer's states (DeepSpeed lists Adam's variants as tested, not SGD).
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
    }
    if not strategy.config_file:
        return generated
    return config_with_file(spec, generated, lambda: facts_of(spec.model).layer.hidden)


@dataclass
class DeepSpeedStepper:
    """DeepSpeed's engine steps after every backward and updates only at the accumulation boundary, which it
    counts itself (gradient_accumulation_steps in its config matches train.grad_accum_steps). Its checkpoint, fp16's
    loss scale included, is its own."""

    engine: Any
    zero_stage: int
    grad_norm: Optional[torch.Tensor] = None

    def micro_batch(self, last: bool) -> ContextManager:
        return contextlib.nullcontext()  # the engine reduces at the boundary it counts

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)  # the loss is already a share of the global batch
        if self.engine.is_gradient_accumulation_boundary() and not hasattr(self.engine.optimizer, "_global_grad_norm"):
            # ZeRO-0 in fp32 steps the torch optimizer itself and keeps no norm: the reduced gradients', before
            # the engine clips them
            import torch

            self.grad_norm = torch.nn.utils.get_total_norm(
                [p.grad for p in self.engine.module.parameters() if p.grad is not None]).detach()
        self.engine.step()

    def step(self) -> StepOutcome:
        # Every fp16 optimizer of DeepSpeed has loss_scale; ZeRO-0's FP16_UnfusedOptimizer has no cur_scale.
        scale = self.engine.optimizer.loss_scale if self.engine.fp16_enabled() else None
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            norm = math.nan if self.grad_norm is None else self.grad_norm
        return StepOutcome(norm, self.engine.was_step_applied(), scale)

    # A frozen base (adapter=lora) is left out of what is written, read and exported.
    def save(self, directory: Path, rank: int) -> None:
        self.engine.save_checkpoint(str(directory / "deepspeed"), tag="engine",
                                    exclude_frozen_parameters=has_frozen_parameters(self.engine))

    def load(self, directory: Path, rank: int, written: CheckpointLayout) -> None:
        self.engine.load_checkpoint(str(directory / "deepspeed"), tag="engine", load_lr_scheduler_states=False,
                                    load_module_strict=not has_frozen_parameters(self.engine))

    def full_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        if self.zero_stage == 3:  # gathers the partitioned parameters
            frozen = has_frozen_parameters(self.engine)
            return self.engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=frozen) or {}
        return trained_state(self.engine, self.engine.module.state_dict())


class WeightsOnlyLoading:
    """DeepSpeed's checkpoint engine, except that loading unpickles nothing but tensors, containers and the few
    DeepSpeed types its checkpoints hold (DeepSpeed's own loader unpickles anything)."""

    def __init__(self, engine: Any):
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def load(self, path: str, map_location: Any = None) -> Any:
        import torch
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        # The non-tensor types in DeepSpeed's ZeRO 0-3 checkpoints (found with get_unsafe_globals_in_checkpoint):
        # fp16's dynamic loss scaling saves a DynamicLossScaler (fp16 DeepSpeed runs only on GPUs); others a LossScaler.
        with torch.serialization.safe_globals([DynamicLossScaler, LossScaler, ZeroStageEnum, fragment_address]):
            return torch.load(path, map_location=map_location, weights_only=True)
