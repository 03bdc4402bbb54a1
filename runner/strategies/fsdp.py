"""strategy=fsdp: torch FSDP2 (`fully_shard`) in the vocabulary of FSDP1 and accelerate, mapped onto the data-parallel
dimensions of the job's device mesh (runner/parallel/dims.py), dp the processes that are not tensor-parallel ranks
of one another (world / tp_size):

    sharding_strategy    dp_replicate x dp_shard     reshard after forward
    FULL_SHARD           1 x dp                      yes   (ZeRO-3)
    SHARD_GRAD_OP        1 x dp                      no    (ZeRO-2)
    NO_SHARD             dp x 1                      -     (replicated, gradients all-reduced)
    HYBRID_SHARD         dp/group x group            yes   (shard within a group, replicate across)
    HYBRID_SHARD_ZERO2   dp/group x group            no

where `group` is `hybrid_shard_size`: by default the data-parallel ranks of one node, as in torch's FSDP and
accelerate (shard within a node, replicate across nodes); on a single node that is FULL_SHARD unless a smaller group
is given. `tp_size` > 1 splits every block over that many consecutive ranks first (runner/parallel/tensor.py), and
FSDP then shards the split parameters: FSDP x TP, or HYBRID_SHARD x TP. `pp_size` > 1 cuts the layers into that
many pipeline stages (runner/parallel/pipeline/layout.py), each run by world / pp_size ranks that FSDP shards it over,
and `pp_schedule` orders the micro batches through them.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, ContextManager, List, Optional

from runner.components.mixed_precision import grad_scaler
from runner.config.hardware import Accelerator
from runner.config.precision import Dtype, PrecisionConfig
from runner.config.strategy import StrategyConfig
from runner.distributed import local
from runner.errors import SpecError, require
from runner.memory.activations import ActivationDtypes, activations_part, loss_gradient_bytes, pipeline_activations_part
from runner.memory.facts import fp8_linears, meta_model
from runner.memory.parameters import adapter_transients, host_loading, parameters_of, weights_note
from runner.memory.terms import Change, Estimate, Part, dtype_name, processes, sharded_elements, share, strategy_change
from runner.parallel.dims import ParallelDims
from runner.parallel.pipeline.layout import PipelineSchedule
from runner.parallel.tensor import block_plan
from runner.strategies.protocol import CheckpointLayout, PipelineStages, WholeWeights
from runner.strategies.torch_stepper import TorchStepper

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from runner.config.hardware import HardwareConfig
    from runner.config.spec import RunSpec
    from runner.memory.facts import ModelFacts
    from runner.memory.parameters import Parameters
    from runner.parallel.sequence import SequenceSplit


class ShardingStrategy(str, Enum):
    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"
    HYBRID_SHARD_ZERO2 = "HYBRID_SHARD_ZERO2"

    @property
    def reshards_after_forward(self) -> bool:
        """ZeRO-3's way: free the gathered parameters after forward and gather them again for backward."""
        return self not in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.HYBRID_SHARD_ZERO2)

    @property
    def hybrid(self) -> bool:
        return self in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)


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
    # HYBRID_SHARD*: ranks in one shard group; unset: a node's processes.
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
    # Checkpoints: FULL gathers the whole model and optimizer state on rank 0; SHARDED has each rank write its own
    # shards (faster, no whole copy in any process). Both resume on any layout.
    state_dict_type: StateDictType = StateDictType.FULL
    # How many following blocks' all-gathers to issue early in forward, and preceding ones in backward.
    forward_prefetch: int = 0
    backward_prefetch: int = 1
    # Tensor-parallel ranks: each block's heads and MLP columns split across this many consecutive processes.
    tp_size: int = 1
    # Async tensor parallelism: the compiled blocks overlap each split layer's all-gather and reduce-scatter with its
    # matmul (torch's micro-pipelined TP, as torchtitan's async TP; CUDA, train.compile=true).
    async_tp: bool = False
    # Pipeline stages: the decoder layers cut into this many slices, each held by world / pp_size processes.
    pp_size: int = 1
    # The order of a step's micro batches (train.grad_accum_steps) through the stages: GPipe, 1F1B, Interleaved1F1B
    # (a string: an enum's member could not be named 1F1B).
    pp_schedule: str = PipelineSchedule.ONE_F_ONE_B.value
    # Context-parallel ranks: each sequence split into this many slices, the attention run as a ring among them
    # (torch's context parallelism; CUDA only).
    cp_size: int = 1

    name: ClassVar[str] = "fsdp"
    distributed: ClassVar[bool] = True
    forward_cast: ClassVar[Optional[str]] = "FSDP mixed-precision policy"
    float8_all_gather: ClassVar[bool] = True
    shards_inference: ClassVar[bool] = True

    @property
    def pipeline_schedule(self) -> PipelineSchedule:
        return PipelineSchedule(self.pp_schedule)

    @property
    def checkpoint_layout(self) -> CheckpointLayout:
        return CheckpointLayout.SHARDED if self.state_dict_type is StateDictType.SHARDED else CheckpointLayout.FULL

    def resolved(self, spec: RunSpec) -> RunSpec:
        return spec  # no files of its own

    def check(self, spec: RunSpec) -> None:
        machine = spec.hardware
        processes_given = f"(hardware.nnodes={machine.nnodes} x hardware.nproc_per_node={machine.nproc_per_node})"
        require(self.tp_size >= 1 and machine.nproc_per_node % self.tp_size == 0,
                f"strategy.tp_size={self.tp_size} does not divide a node's {machine.nproc_per_node} processes "
                f"{processes_given}; a tensor-parallel group exchanges activations at every layer and stays within "
                f"a node: pick a divisor of {machine.nproc_per_node}")
        model_parallel = self.pp_size * self.cp_size * self.tp_size
        sizes = " x ".join(f"strategy.{key}={size}" for key, size in (
            ("pp_size", self.pp_size), ("cp_size", self.cp_size), ("tp_size", self.tp_size)) if size != 1)
        require(self.pp_size >= 1 and self.cp_size >= 1 and machine.world_size % model_parallel == 0,
                f"{sizes} does not divide the {machine.world_size} processes {processes_given}")
        data_parallel = machine.world_size // model_parallel
        group = self.hybrid_group_size(machine)
        if self.sharding_strategy.hybrid:
            split = " / ".join(f"strategy.{key}={size}" for key, size in (
                ("pp_size", self.pp_size), ("cp_size", self.cp_size), ("tp_size", self.tp_size)) if size > 1)
            ranks = (f"the {data_parallel} data-parallel ranks ({machine.world_size} processes / {split})" if split
                     else f"the {machine.world_size} processes {processes_given}")
            require(group >= 1 and data_parallel % group == 0,
                    f"strategy.hybrid_shard_size={group} does not divide {ranks}; pick a divisor of {data_parallel}")
        else:
            require(self.hybrid_shard_size is None,
                    f"strategy.hybrid_shard_size applies to HYBRID_SHARD and HYBRID_SHARD_ZERO2 only, not "
                    f"{self.sharding_strategy.value}")
        if self.tp_size > 1:
            self._check_tensor_parallel(spec)
        if self.async_tp:
            require(self.tp_size > 1 and spec.train.compile and spec.hardware.accelerator is Accelerator.cuda,
                    f"strategy.async_tp=true overlaps tensor parallelism's collectives in the compiled blocks, on CUDA: "
                    f"it needs strategy.tp_size > 1 (not {self.tp_size}), train.compile=true (not "
                    f"{str(spec.train.compile).lower()}) and CUDA GPUs (not {spec.hardware.accelerator.value})")
        if self.pp_size > 1:
            self._check_pipeline(spec)
        if self.cp_size > 1:
            self._check_context_parallel(spec)
        require(self.sync_module_states or not self.cpu_ram_efficient_loading,
                "strategy.cpu_ram_efficient_loading=true needs strategy.sync_module_states=true: the other ranks "
                "get their weights from rank 0")
        require(not (spec.adapter.quantized and self.cpu_ram_efficient_loading),
                "adapter=qlora with strategy.cpu_ram_efficient_loading=true: each process quantizes its own base "
                "to NF4 (the base stays memory-mapped, so this costs little CPU RAM); set "
                "strategy.cpu_ram_efficient_loading=false")
        require(self.min_num_params >= 1, f"strategy.min_num_params={self.min_num_params} must be >= 1")
        require(self.forward_prefetch >= 0 and self.backward_prefetch >= 0,
                "strategy.forward_prefetch and strategy.backward_prefetch must be >= 0")

    def _check_tensor_parallel(self, spec: RunSpec) -> None:
        """What tensor parallelism does not split yet, refused before launch rather than failing in a worker."""
        tp = f"strategy.tp_size={self.tp_size}"
        require(not spec.adapter.quantized,
                f"adapter=qlora with {tp}: torchao's NF4 weights do not split across tensor-parallel ranks; use "
                "adapter=lora, or strategy.tp_size=1 (FSDP shards the NF4 base)")
        require(not (spec.precision.fp8 and spec.precision.fp8.all_gather),
                f"precision.fp8.all_gather=true with {tp}: FSDP's float8 all-gather scales each weight from its "
                "data-parallel shards alone, so the tensor-parallel ranks would cast their parts of one weight with "
                "different scales; set precision.fp8.all_gather=false (the fp8 layers still split, with whole-tensor "
                "scales)")
        require(not spec.train.compile or spec.hardware.accelerator is Accelerator.cuda,
                f"train.compile=true with {tp} on {spec.hardware.accelerator.value}: torch.compile of the split "
                "blocks fails in their DTensor forward on the CPU (torch 2.13); it compiles them on CUDA, as "
                "torchtitan does; set train.compile=false")

    def _check_pipeline(self, spec: RunSpec) -> None:
        """What the pipeline cannot run, refused before launch."""
        pp, train = f"strategy.pp_size={self.pp_size}", spec.train
        schedules = [schedule.value for schedule in PipelineSchedule]
        require(self.pp_schedule in schedules,
                f"strategy.pp_schedule={self.pp_schedule} is not a schedule; use one of {', '.join(schedules)}")
        schedule = self.pipeline_schedule
        stages = self.pp_size * schedule.stages_per_rank
        layers = spec.model.architecture.get("num_hidden_layers")
        require(layers is None or stages <= layers,
                f"{pp} with strategy.pp_schedule={self.pp_schedule} cuts the model into {stages} stages, more "
                f"than its {layers} decoder layers")
        problem = schedule.microbatches_problem(train.grad_accum_steps, self.pp_size)
        require(problem is None,
                f"strategy.pp_schedule={self.pp_schedule} with {pp}: {problem}, and a step has "
                f"{train.grad_accum_steps} (train.grad_accum_steps, the micro batches each rank runs a step); raise "
                "train.grad_accum_steps, or use strategy.pp_schedule=GPipe")
        for refused, why in (
            (spec.data.seq_len % self.tp_size != 0, f"strategy.tp_size={self.tp_size}: data.seq_len="
                                                    f"{spec.data.seq_len} must be a multiple of it (the stages pass on "
                                                    "each tensor-parallel rank's equal part of the sequence)"),
            (spec.adapter.active, f"adapter={spec.adapter.kind.value}: the adapters are not cut into stages yet"),
            (bool(spec.precision.fp8), "precision.fp8: float8 layers are not cut into stages yet"),
            (spec.precision.compute_dtype is Dtype.fp16 and spec.precision.param_dtype is not Dtype.fp16,
             "precision=fp16: the schedule runs the backward itself, without fp16's loss scaling; use bf16"),
            (train.compile, "train.compile=true: the stages run eagerly; set train.compile=false"),
            (self.cpu_ram_efficient_loading, "strategy.cpu_ram_efficient_loading=true: every rank builds the model "
                                             "and keeps its stages' weights; set it to false"),
        ):
            require(not refused, f"{pp} with {why}")

    def _check_context_parallel(self, spec: RunSpec) -> None:
        """Where torch's ring attention cannot run, and what it is not composed with yet, refused before launch."""
        cp = f"strategy.cp_size={self.cp_size}"
        require(spec.hardware.accelerator is Accelerator.cuda,
                f"{cp} needs CUDA GPUs: torch's context parallelism runs the attention's ring on CUDA's flash, "
                f"memory-efficient and cuDNN kernels only (torch 2.13), and this run's accelerator is "
                f"{spec.hardware.accelerator.value}")
        for refused, why in (
            (spec.data.packing, "data.packing=true: packed rows need a mask between their examples, and the ring "
                                "attends causally over the whole row; set data.packing=false"),
            (self.pp_size > 1, f"strategy.pp_size={self.pp_size}: not composed yet"),
            (self.tp_size > 1, f"strategy.tp_size={self.tp_size}: not composed yet"),
            (spec.train.compile, "train.compile=true: the ring attention runs eagerly; set train.compile=false"),
        ):
            require(not refused, f"{cp} with {why}")

    def describe(self, hardware: HardwareConfig) -> str:
        dims = self.dims(hardware)
        described = (f"fsdp {self.sharding_strategy.value}, {processes(hardware.world_size)}, {dims.describe()}, "
                     f"{self.auto_wrap_policy.value}")
        if self.pp_size > 1:
            described += f"; pipeline schedule {self.pp_schedule}"
        if self.sharding_strategy.hybrid and dims.dp_replicate == 1:
            same = "FULL_SHARD" if self.sharding_strategy.reshards_after_forward else "SHARD_GRAD_OP"
            described += (f"; one shard group of the node's {dims.dp_shard} data-parallel ranks is {same}: "
                          f"strategy.hybrid_shard_size=<a divisor of {dims.dp_shard}> gives replicas")
        return described

    def hybrid_group_size(self, hardware: HardwareConfig) -> int:
        return self.hybrid_shard_size or max(1, hardware.nproc_per_node // (self.tp_size * self.pp_size * self.cp_size))

    def dims(self, hardware: HardwareConfig) -> ParallelDims:
        pp, cp, tp = self.pp_size, self.cp_size, self.tp_size
        data_parallel = hardware.world_size // (pp * cp * tp)
        if self.sharding_strategy is ShardingStrategy.NO_SHARD:
            replicate, shard = data_parallel, 1
        elif self.sharding_strategy.hybrid:
            group = self.hybrid_group_size(hardware)
            replicate, shard = data_parallel // group, group
        else:
            replicate, shard = 1, data_parallel
        stages_per_rank = self.pipeline_schedule.stages_per_rank if pp > 1 else 1
        return ParallelDims(pp=pp, dp_replicate=replicate, dp_shard=shard, cp=cp, tp=tp,
                            stages_per_rank=stages_per_rank)

    def sequence_split(self, dims: ParallelDims, device_type: str) -> Optional[SequenceSplit]:
        from runner.parallel.context import RingSplit

        return RingSplit(dims.mesh(device_type)["cp"]) if dims.cp > 1 else None

    def loads_weights(self, rank: int) -> bool:
        return rank == 0 or not self.cpu_ram_efficient_loading

    def wrap(self, model: nn.Module, spec: RunSpec, device: torch.device, dims: ParallelDims,
             whole: Optional[WholeWeights] = None) -> nn.Module:
        """`fully_shard` on each unit, then on the root, over the mesh's data-parallel dimensions; rank 0's weights
        in every shard."""
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        if self.async_tp:  # read when the blocks compile, at their first forward
            import torch._inductor.config

            torch._inductor.config._micro_pipeline_tp = True
        if whole is None and self.sync_module_states:
            _broadcast_from_rank0(model, dims.mesh(device.type))
        mesh = dims.sharding_mesh(device.type)
        offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if self.offload_params else OffloadPolicy()
        options = {"mesh": mesh, "reshard_after_forward": self.sharding_strategy.reshards_after_forward,
                   "mp_policy": mixed_precision_policy(spec.precision), "offload_policy": offload}
        units = wrap_units(model, self)
        for unit in units:
            fully_shard(unit, **options)
        fully_shard(model, **options)
        set_prefetch(units, self)
        if whole is not None:  # the model was laid out on the meta device; rank 0's weights go into its shards
            _load_whole(model, whole, "cpu" if self.offload_params else device)
        return model

    def frozen(self, model: nn.Module, spec: RunSpec, device: torch.device, dims: ParallelDims,
               whole: Optional[WholeWeights] = None) -> nn.Module:
        return self.wrap(model, spec, device, dims, whole)

    def frozen_shards(self, hardware: HardwareConfig) -> int:
        dims = self.dims(hardware)
        return dims.dp_shard * dims.cp * dims.tp

    def stepper(self, model: nn.Module, optimizer: torch.optim.Optimizer, spec: RunSpec, device: torch.device,
                stages: Optional[PipelineStages] = None) -> tuple[nn.Module, TorchStepper]:
        def sync(last: bool) -> ContextManager:
            model.set_requires_gradient_sync(last)
            return contextlib.nullcontext()

        scaler = grad_scaler(spec.precision, device, sharded=True)
        return model, TorchStepper(model, optimizer, spec.train.max_grad_norm, self.checkpoint_layout, scaler, sync,
                                   stages)

    def estimate_memory(self, spec: RunSpec, facts: ModelFacts) -> Estimate:
        """weights P_S.w, gradients P_S.w, states k.P_S.w, with P_S = sum over parameters of ceil(rows / S) x
        columns (FSDP2 shards dim 0, padded evenly) and S the shard group: N (FULL_SHARD, SHARD_GRAD_OP), 1
        (NO_SHARD), the group (HYBRID_SHARD*). offload_params moves (2 + k).P_S.w per process to CPU RAM.
        With an adapter P is the adapters' parameters, and the frozen base is sharded alike in its stored dtypes
        (NF4 included: torchao's NF4 shards and all-gathers as NF4)."""
        precision, parameters = spec.precision, parameters_of(spec, facts)
        dims = self.dims(spec.hardware)
        shards = dims.dp_shard * dims.cp  # FSDP shards over the context-parallel ranks too
        w = precision.param_dtype.bytes
        gathered = min(w, precision.compute_dtype.bytes)  # FSDP's mixed-precision policy gathers in compute dtype
        reduce = precision.reduce_dtype.bytes
        k, states = spec.optim.states()
        held = sharded_elements(list(parameters.trained_shapes), shards)
        frozen = parameters.frozen_bytes(shards)
        (root, root_trained), (largest, largest_trained), whole = unit_sizes(facts.model, self, parameters, gathered,
                                                                            self.tp_size)
        _, fp8_blocks = fp8_linears(facts.model, precision)
        dtypes = ActivationDtypes(compute=gathered, stream=gathered, casts=False, fp8=fp8_blocks)
        if not self.sharding_strategy.reshards_after_forward:
            all_gathered = whole + largest
            gather_note = f"{dtype_name(gathered)} all-gathers: every unit stays gathered from forward to backward"
        else:
            # The root unit stays gathered from forward to backward; each other unit is gathered, copied out of the
            # all-gather buffer, and the next ones prefetched.
            prefetch = max(self.forward_prefetch, self.backward_prefetch)
            all_gathered = root + (2 + prefetch) * largest
            gather_note = f"{dtype_name(gathered)} all-gathers: the root unit and {2 + prefetch} x the largest unit"
        if parameters.frozen:
            gather_note = gather_note.replace(dtype_name(gathered), parameters.frozen_note() + " base", 1)
        dequantized, dequantized_note = adapter_transients(parameters, precision.compute_dtype.bytes)
        part_of = share(shards, self.tp_size) + (" of a pipeline rank's stages" if self.pp_size > 1 else "")
        nproc = spec.hardware.nproc_per_node or 1
        loaders = 1 if self.cpu_ram_efficient_loading else nproc
        loss_gradient = loss_gradient_bytes(spec, facts)
        result = Estimate(
            weights=Part(held * w + frozen + facts.buffer_bytes,
                         weights_note(parameters, dtype_name(w), f"{part_of} ({self.sharding_strategy.value})")),
            gradients=Part(held * w, f"{dtype_name(w)}{part_of}"),
            optimizer_states=Part(k * held * w, f"{states}, {dtype_name(w)}{part_of}"),
            activations=(pipeline_activations_part(spec, facts, dtypes, self.pipeline_schedule) if self.pp_size > 1
                         else activations_part(spec, facts, dtypes)),
            backward_start=Part(all_gathered + loss_gradient + largest_trained * (gathered + reduce) + dequantized,
                                f"{gather_note}; the loss gradient; a unit's reduce-scatter{dequantized_note}"),
            # The root unit's gradients are reduced last, its parameters still gathered.
            backward_end=Part(root + root_trained * (gathered + reduce) + largest, "the root unit's reduce-scatter"),
            step=Part(spec.optim.step_copies() * held * w, "the optimizer's foreach temporaries"),
            host_loading=host_loading(spec, facts, loaders),
        )
        if self.offload_params:
            frozen_note = f", and the frozen base{part_of}" if frozen else ""
            result.host_offload = Part(nproc * ((2 + k) * held * w + frozen),
                                       f"offload_params: each process's weights, gradients and {states}{part_of}"
                                       + frozen_note)
            result.weights = Part(facts.buffer_bytes, "in CPU RAM (offload_params); buffers only")
            result.gradients = Part(0, "in CPU RAM (offload_params)")
            result.optimizer_states = Part(0, "in CPU RAM (offload_params); the step runs on the CPU")
            result.step = Part(0, "on the CPU")
        return result

    def memory_changes(self, spec: RunSpec) -> list[Change]:
        changes = []
        if self.sharding_strategy is not ShardingStrategy.FULL_SHARD and spec.hardware.world_size > 1:
            changes.append(strategy_change("strategy.sharding_strategy=FULL_SHARD", 1.0,
                                           sharding_strategy=ShardingStrategy.FULL_SHARD, hybrid_shard_size=None))
        if not self.offload_params:
            changes.append(strategy_change("strategy.offload_params=true", 3.0, offload_params=True))
        if not self.cpu_ram_efficient_loading and not spec.adapter.quantized:  # qlora: each process quantizes
            changes.append(strategy_change("strategy.cpu_ram_efficient_loading=true", 0.5,
                                           cpu_ram_efficient_loading=True, sync_module_states=True))
        return changes + self._tensor_parallel_changes(spec)

    def _tensor_parallel_changes(self, spec: RunSpec) -> list[Change]:
        """Splitting each block over 2, 4 or 8 of a node's processes, where the model's heads allow: it divides the
        activations too, which no sharding does. Its collectives at every layer cost more the more ranks share them.
        (Pipeline stages are no such change: with FSDP over the other ranks, each rank holds the same share of
        weights, gradients and states, and under 1F1B the first stage keeps as many layers' activations in flight.)"""
        if self.tp_size > 1:
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


def switch_to_fsdp() -> Change:
    """The other strategies' way out when they do not fit: FSDP's defaults, sharding everything across the ranks."""
    return Change(("strategy=fsdp",), 1.5, lambda spec: replace(
        spec, strategy=FSDPStrategy(activation_checkpointing=spec.strategy.activation_checkpointing)))


def mixed_precision_policy(precision: PrecisionConfig) -> MixedPrecisionPolicy:
    """Parameters all-gathered and computed in compute_dtype (the fp32 shards stay the master weights), gradients
    reduced in reduce_dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    low = precision.compute_dtype is not Dtype.fp32 and precision.param_dtype is Dtype.fp32
    return MixedPrecisionPolicy(param_dtype=precision.compute_dtype.torch if low else None,
                                reduce_dtype=precision.reduce_dtype.torch)


def _broadcast_from_rank0(model: nn.Module, mesh: DeviceMesh) -> None:
    """Rank 0's trained parameters and buffers, over the data-parallel dimensions: each rank gets those of the rank
    with its tensor-parallel part. A frozen base is left alone: every rank builds the same one, and QLoRA's NF4
    tensors cannot be broadcast."""
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        for tensor in [*(p for p in model.parameters() if p.requires_grad), *model.buffers()]:
            for dimension in ("cp", "dp_shard", "dp_replicate"):
                dist.broadcast(local(tensor), group=mesh.get_group(dimension), group_src=0)


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


def unit_sizes(model: nn.Module, strategy: FSDPStrategy, parameters: Parameters, gathered: int,
               tp: int = 1) -> tuple[tuple[int, int], tuple[int, int], int]:
    """(all-gathered bytes, trained parameters) of the root unit and of the largest other unit under the strategy's
    wrap policy, and the whole model's all-gathered bytes. Trained parameters gather in `gathered` bytes, as do the
    adapters beside an adapted linear (each rank's parts already); frozen ones in the dtype they are stored in (NF4
    as NF4). Under tensor parallelism FSDP gathers a rank's parts: a tp-th of each unit (its norms, whole on every
    rank, are a rounding error)."""
    def size(module: nn.Module, prefix: str) -> tuple[int, int]:
        gathered_bytes, trained = 0.0, 0
        for name, parameter in module.named_parameters(prefix=prefix):
            stored = parameters.stored.get(name)
            gathered_bytes += parameter.numel() * (gathered if stored is None else stored)
            trained += parameter.numel() if stored is None else 0
        adapters = sum(parameters.adapters.get(name, 0) for name, _ in module.named_modules(prefix=prefix))
        return math.ceil(gathered_bytes / tp) + adapters * gathered, trained // tp + adapters

    names = {id(module): name for name, module in model.named_modules()}
    units = [size(unit, names[id(unit)]) for unit in wrap_units(model, strategy)]
    whole = size(model, "")
    root = (whole[0] - sum(unit[0] for unit in units), whole[1] - sum(unit[1] for unit in units))
    return root, max(units, default=(0, 0)), whole[0]
