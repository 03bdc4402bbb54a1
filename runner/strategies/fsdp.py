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

The schema (the dataclass conf/strategy/fsdp.yaml fills) and its checks are here; `wrap`, which calls `fully_shard`,
and the stepper are in runner/strategies/fsdp_placement.py; the memory terms in runner/strategies/fsdp_memory.py;
the values of the keys in runner/strategies/fsdp_settings.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar, List, Optional

from runner.config.fields import setting
from runner.config.hardware import Accelerator
from runner.config.strategy import StrategyConfig
from runner.errors import require
from runner.memory.breakdown import Change, processes
from runner.parallel.dims import ParallelDims
from runner.parallel.experts_layout import check_expert_parallel
from runner.parallel.pipeline.layout import PipelineSchedule, check_pipeline
from runner.strategies import fsdp_memory, fsdp_placement
from runner.strategies.fsdp_settings import AutoWrapPolicy, ShardingStrategy, StateDictType
from runner.strategies.strategy_protocol import CheckpointLayout, PipelineStages, WholeWeights

if TYPE_CHECKING:
    import torch
    from torch import nn

    from runner.config.hardware import HardwareConfig
    from runner.config.spec import RunSpec
    from runner.memory.breakdown import Estimate
    from runner.memory.model_shapes import ModelFacts
    from runner.parallel.sequence import SequenceSplit
    from runner.strategies.torch_stepper import TorchStepper


@dataclass
class FSDPStrategy(StrategyConfig):
    sharding_strategy: ShardingStrategy = setting(
        ShardingStrategy.FULL_SHARD,
        "What is sharded across the data-parallel ranks: FULL_SHARD (parameters, gradients, optimizer states: ZeRO-3), "
        "SHARD_GRAD_OP (gradients and optimizer states: ZeRO-2), NO_SHARD (replicated), HYBRID_SHARD and "
        "HYBRID_SHARD_ZERO2 (sharded within a group of hybrid_shard_size ranks, replicated across groups).",
    )
    hybrid_shard_size: Optional[int] = setting(
        None,
        "HYBRID_SHARD*: ranks in one shard group; unset: a node's processes.",
    )
    auto_wrap_policy: AutoWrapPolicy = setting(
        AutoWrapPolicy.TRANSFORMER_BASED_WRAP,
        "Which modules become FSDP units (an all-gather each): TRANSFORMER_BASED_WRAP (the blocks "
        "transformer_layer_cls names), SIZE_BASED_WRAP (by min_num_params) or NO_WRAP (the whole model as one unit).",
    )
    transformer_layer_cls: List[str] = setting(
        [],
        "TRANSFORMER_BASED_WRAP: class names of the blocks to shard as units; empty means the model's "
        "_no_split_modules.",
    )
    min_num_params: int = setting(
        100_000_000,
        "SIZE_BASED_WRAP: a module becomes a unit once it holds this many parameters not already in a unit.",
    )
    offload_params: bool = setting(
        False,
        "Keep the sharded parameters, gradients and optimizer states in CPU RAM; the optimizer steps on the CPU.",
    )
    cpu_ram_efficient_loading: bool = setting(
        False,
        "Only rank 0 loads (or initialises) the weights; the others start on the meta device and receive them.",
    )
    sync_module_states: bool = setting(
        True,
        "Broadcast rank 0's weights to the other ranks before sharding, so that all start from the same (needed by "
        "cpu_ram_efficient_loading).",
    )
    state_dict_type: StateDictType = setting(
        StateDictType.FULL,
        "Checkpoints: FULL gathers the whole model and optimizer state on rank 0; SHARDED has each rank write its own "
        "shards (faster, no whole copy in any process). Both resume on any layout.",
    )
    forward_prefetch: int = setting(
        0,
        "How many following blocks' all-gathers to issue early in forward, and preceding ones in backward.",
    )
    backward_prefetch: int = setting(1, "How many preceding blocks' all-gathers to issue early in backward (0: none).")
    tp_size: int = setting(
        1,
        "Tensor-parallel ranks: each block's heads and MLP columns split across this many consecutive processes of a "
        "node; FSDP shards over the rest.",
    )
    async_tp: bool = setting(
        False,
        "Async tensor parallelism: the compiled blocks overlap each split layer's all-gather and reduce-scatter with "
        "its matmul (torch's micro-pipelined TP, as torchtitan's async TP; CUDA, train.compile=true).",
    )
    pp_size: int = setting(
        1,
        "Pipeline stages: the decoder layers cut into this many slices, each held by world / pp_size processes (FSDP "
        "over world / (pp_size x tp_size) of them).",
    )
    pp_schedule: str = setting(
        PipelineSchedule.ONE_F_ONE_B.value,
        "The order of a step's micro batches (train.grad_accum_steps) through the stages: GPipe, 1F1B (at least "
        "pp_size micro batches) or Interleaved1F1B (two stages a process). A string: an enum's member could not be "
        "named 1F1B.",
    )
    cp_size: int = setting(
        1,
        "Context-parallel ranks: each sequence split into this many slices, the attention run as a ring among them "
        "(torch's context parallelism; CUDA only); FSDP shards over them too.",
    )
    ep_size: int = setting(
        1,
        "Expert-parallel ranks (MoE models): each MoE layer's experts split over this many consecutive data-parallel "
        "shards, tokens sent to their experts by an all-to-all; FSDP shards the experts over the other shards.",
    )

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
        require(
            self.tp_size >= 1 and machine.nproc_per_node % self.tp_size == 0,
            f"strategy.tp_size={self.tp_size} does not divide a node's {machine.nproc_per_node} processes "
            f"{processes_given}; a tensor-parallel group exchanges activations at every layer and stays within "
            f"a node: pick a divisor of {machine.nproc_per_node}",
        )
        model_parallel = self.pp_size * self.cp_size * self.tp_size
        require(
            self.pp_size >= 1 and self.cp_size >= 1 and machine.world_size % model_parallel == 0,
            f"{self._model_parallel_sizes(' x ')} does not divide the {machine.world_size} processes {processes_given}",
        )
        self._check_hybrid_group(machine, machine.world_size // model_parallel, processes_given)
        if self.tp_size > 1:
            self._check_tensor_parallel(spec)
        if self.async_tp:
            require(
                self.tp_size > 1 and spec.train.compile and spec.hardware.accelerator is Accelerator.cuda,
                f"strategy.async_tp=true overlaps tensor parallelism's collectives in the compiled blocks, on "
                f"CUDA: it needs strategy.tp_size > 1 (not {self.tp_size}), train.compile=true (not "
                f"{str(spec.train.compile).lower()}) and CUDA GPUs (not {spec.hardware.accelerator.value})",
            )
        if self.pp_size > 1:
            check_pipeline(self, spec)
        if self.cp_size > 1:
            self._check_context_parallel(spec)
        check_expert_parallel(self, spec)
        require(
            self.sync_module_states or not self.cpu_ram_efficient_loading,
            "strategy.cpu_ram_efficient_loading=true needs strategy.sync_module_states=true: the other ranks "
            "get their weights from rank 0",
        )
        require(
            not (spec.adapter.quantized and self.cpu_ram_efficient_loading),
            "adapter=qlora with strategy.cpu_ram_efficient_loading=true: each process quantizes its own base "
            "to NF4 (the base stays memory-mapped, so this costs little CPU RAM); set "
            "strategy.cpu_ram_efficient_loading=false",
        )
        require(self.min_num_params >= 1, f"strategy.min_num_params={self.min_num_params} must be >= 1")
        require(
            self.forward_prefetch >= 0 and self.backward_prefetch >= 0,
            "strategy.forward_prefetch and strategy.backward_prefetch must be >= 0",
        )

    def _model_parallel_sizes(self, joined_by: str) -> str:
        """The model-parallel sizes set (pp, cp, tp), as the command line sets them."""
        sizes = (("pp_size", self.pp_size), ("cp_size", self.cp_size), ("tp_size", self.tp_size))
        return joined_by.join(f"strategy.{key}={size}" for key, size in sizes if size != 1)

    def _check_hybrid_group(self, machine: HardwareConfig, data_parallel: int, processes_given: str) -> None:
        if not self.sharding_strategy.hybrid:
            require(
                self.hybrid_shard_size is None,
                f"strategy.hybrid_shard_size applies to HYBRID_SHARD and HYBRID_SHARD_ZERO2 only, not "
                f"{self.sharding_strategy.value}",
            )
            return
        group, split = self.hybrid_group_size(machine), self._model_parallel_sizes(" / ")
        ranks = (
            f"the {data_parallel} data-parallel ranks ({machine.world_size} processes / {split})"
            if split
            else f"the {machine.world_size} processes {processes_given}"
        )
        require(
            group >= 1 and data_parallel % group == 0,
            f"strategy.hybrid_shard_size={group} does not divide {ranks}; pick a divisor of {data_parallel}",
        )

    def _check_tensor_parallel(self, spec: RunSpec) -> None:
        """What tensor parallelism does not split yet, refused before launch rather than failing in a worker."""
        tp = f"strategy.tp_size={self.tp_size}"
        require(
            not spec.adapter.quantized,
            f"adapter=qlora with {tp}: torchao's NF4 weights do not split across tensor-parallel ranks; use "
            "adapter=lora, or strategy.tp_size=1 (FSDP shards the NF4 base)",
        )
        require(
            not (spec.precision.fp8 and spec.precision.fp8.all_gather),
            f"precision.fp8.all_gather=true with {tp}: FSDP's float8 all-gather scales each weight from its "
            "data-parallel shards alone, so the tensor-parallel ranks would cast their parts of one weight with "
            "different scales; set precision.fp8.all_gather=false (the fp8 layers still split, with whole-tensor "
            "scales)",
        )
        require(
            not spec.train.compile or spec.hardware.accelerator is Accelerator.cuda,
            f"train.compile=true with {tp} on {spec.hardware.accelerator.value}: torch.compile of the split "
            "blocks fails in their DTensor forward on the CPU (torch 2.13); it compiles them on CUDA, as "
            "torchtitan does; set train.compile=false",
        )

    def _check_context_parallel(self, spec: RunSpec) -> None:
        """Where torch's ring attention cannot run, and what it is not composed with yet, refused before launch."""
        cp = f"strategy.cp_size={self.cp_size}"
        require(
            spec.hardware.accelerator is Accelerator.cuda,
            f"{cp} needs CUDA GPUs: torch's context parallelism runs the attention's ring on CUDA's flash, "
            f"memory-efficient and cuDNN kernels only (torch 2.13), and this run's accelerator is "
            f"{spec.hardware.accelerator.value}",
        )
        for refused, why in (
            (
                spec.data.packing,
                "data.packing=true: packed rows need a mask between their examples, and the ring "
                "attends causally over the whole row; set data.packing=false",
            ),
            (self.pp_size > 1, f"strategy.pp_size={self.pp_size}: not composed yet"),
            (self.tp_size > 1, f"strategy.tp_size={self.tp_size}: not composed yet"),
            (spec.train.compile, "train.compile=true: the ring attention runs eagerly; set train.compile=false"),
        ):
            require(not refused, f"{cp} with {why}")

    def describe(self, spec: RunSpec) -> str:
        dims = spec.layout
        described = (
            f"fsdp {self.sharding_strategy.value}, {processes(spec.hardware.world_size)}, {dims.describe()}, "
            f"{self.auto_wrap_policy.value}"
        )
        if self.pp_size > 1:
            described += f"; pipeline schedule {self.pp_schedule}"
        if self.sharding_strategy.hybrid and dims.dp_replicate == 1:
            same = "FULL_SHARD" if self.sharding_strategy.reshards_after_forward else "SHARD_GRAD_OP"
            described += (
                f"; one shard group of the node's {dims.dp_shard} data-parallel ranks is {same}: "
                f"strategy.hybrid_shard_size=<a divisor of {dims.dp_shard}> gives replicas"
            )
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
        return ParallelDims(
            pp=pp,
            dp_replicate=replicate,
            dp_shard=shard,
            cp=cp,
            tp=tp,
            ep=self.ep_size,
            stages_per_rank=stages_per_rank,
        )

    def sequence_split(self, dims: ParallelDims, device_type: str) -> Optional[SequenceSplit]:
        from runner.parallel.context import RingSplit

        return RingSplit(dims.mesh(device_type)["cp"]) if dims.cp > 1 else None

    def loads_weights(self, rank: int) -> bool:
        return rank == 0 or not self.cpu_ram_efficient_loading

    def wrap(
        self,
        model: nn.Module,
        spec: RunSpec,
        device: torch.device,
        dims: ParallelDims,
        whole: Optional[WholeWeights] = None,
    ) -> nn.Module:
        """`fully_shard` on each unit, then on the root, over the mesh's data-parallel dimensions; rank 0's weights
        in every shard (runner/strategies/fsdp_placement.py)."""
        return fsdp_placement.wrap(self, model, spec, device, dims, whole)

    def frozen(
        self,
        model: nn.Module,
        spec: RunSpec,
        device: torch.device,
        dims: ParallelDims,
        whole: Optional[WholeWeights] = None,
    ) -> nn.Module:
        return self.wrap(model, spec, device, dims, whole)

    def frozen_shards(self, spec: RunSpec) -> int:
        dims = spec.layout
        return dims.dp_shard * dims.cp * dims.tp

    def stepper(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        spec: RunSpec,
        device: torch.device,
        stages: Optional[PipelineStages] = None,
    ) -> tuple[nn.Module, TorchStepper]:
        return fsdp_placement.stepper(model, optimizer, spec, device, self.checkpoint_layout, stages)

    def estimate_memory(self, spec: RunSpec, facts: ModelFacts) -> Estimate:
        return fsdp_memory.estimate_memory(self, spec, facts)

    def memory_changes(self, spec: RunSpec) -> list[Change]:
        return fsdp_memory.memory_changes(self, spec)


def switch_to_fsdp() -> Change:
    """The other strategies' way out when they do not fit: FSDP's defaults, sharding everything across the ranks."""
    return Change(
        ("strategy=fsdp",),
        1.5,
        lambda spec: replace(
            spec, strategy=FSDPStrategy(activation_checkpointing=spec.strategy.activation_checkpointing)
        ),
    )
