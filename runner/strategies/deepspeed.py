"""strategy=deepspeed: `deepspeed.initialize` with a config made from the spec (ZeRO stage, offload, accumulation,
clipping, precision); its engine wraps model and optimizer together and keeps the fp32 master weights.

The schema (the dataclass conf/strategy/deepspeed.yaml fills) and its checks are here; the config in
runner/strategies/deepspeed_json.py, the engine and its stepper in runner/strategies/deepspeed_engine.py, the memory
terms in runner/strategies/deepspeed_memory.py."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Optional

from runner.config.fields import setting
from runner.config.float8 import Float8Backend
from runner.config.hardware import Accelerator
from runner.config.precision import Dtype
from runner.config.strategy import StrategyConfig
from runner.errors import require
from runner.memory.breakdown import Change, processes, strategy_change
from runner.memory.model_shapes import facts_of
from runner.parallel.dims import ParallelDims
from runner.strategies import deepspeed_engine, deepspeed_memory
from runner.strategies.deepspeed_json import OffloadDevice, deepspeed_config, read_into_spec
from runner.strategies.fsdp import switch_to_fsdp
from runner.strategies.strategy_protocol import CheckpointLayout, PipelineStages, WholeWeights

if TYPE_CHECKING:
    import torch
    from torch import nn

    from runner.config.hardware import HardwareConfig
    from runner.config.spec import RunSpec
    from runner.memory.breakdown import Estimate
    from runner.memory.model_shapes import ModelFacts
    from runner.parallel.sequence import SequenceSplit


@dataclass
class DeepSpeedStrategy(StrategyConfig):
    zero_stage: int = setting(
        2,
        "ZeRO stage: 0 (DDP-like), 1 (optimizer states sharded), 2 (and gradients), 3 (and parameters).",
    )
    offload_optimizer: OffloadDevice = setting(
        OffloadDevice.none,
        "Optimizer states (stages 1-3) and parameters (stage 3) can live in CPU RAM or on an NVMe drive.",
    )
    offload_param: OffloadDevice = setting(
        OffloadDevice.none,
        "Where the parameters live under zero_stage=3: none (the GPU), cpu or nvme.",
    )
    nvme_path: Optional[str] = setting(None, "The NVMe directory an nvme offload writes to.")
    config_file: Optional[str] = setting(
        None,
        "A DeepSpeed JSON whose keys are added to the generated config; one the spec also sets must agree with it.",
    )
    sp_size: int = setting(
        1,
        "Sequence-parallel ranks (Ulysses, DeepSpeed's ALST): each sequence split into this many slices, each rank "
        "attending over whole sequences for its share of the heads (sp_size divides the heads); ZeRO partitions over "
        "them too.",
    )

    name: ClassVar[str] = "deepspeed"
    distributed: ClassVar[bool] = True
    forward_cast: ClassVar[Optional[str]] = "DeepSpeed engine"
    float8_all_gather: ClassVar[bool] = False
    shards_inference: ClassVar[bool] = False
    checkpoint_layout: ClassVar[CheckpointLayout] = CheckpointLayout.ENGINE

    def check(self, spec: RunSpec) -> None:
        precision, machine = spec.precision, spec.hardware
        require(
            not spec.adapter.quantized,
            "adapter=qlora runs under strategy=single, ddp and fsdp: DeepSpeed flattens and partitions the "
            "module's tensors, which cannot hold torchao's NF4 base (use strategy=fsdp, or adapter=lora)",
        )
        require(
            not spec.train.compile,
            "train.compile=true runs under strategy=single, ddp and fsdp; DeepSpeed's ZeRO hooks swap the "
            "parameters a compiled block would trace (use strategy=fsdp, or train.compile=false)",
        )
        require(
            precision.param_dtype is Dtype.fp32,
            "strategy=deepspeed keeps fp32 master weights itself; precision.param_dtype=bf16 applies to "
            "single, ddp and fsdp (use precision=bf16)",
        )
        if precision.compute_dtype is Dtype.fp16:
            require(
                machine.accelerator is Accelerator.cuda,
                "strategy=deepspeed with precision=fp16 needs a GPU (DeepSpeed's CPU accelerator has no fp16); "
                "use precision=bf16, or precision=fp16 with strategy=single, ddp or fsdp",
            )
        if precision.fp8:
            require(
                precision.fp8.backend is not Float8Backend.transformer_engine,
                "precision.fp8.backend=transformer_engine works with strategy=single, ddp or fsdp; "
                "use precision.fp8.backend=torchao with strategy=deepspeed",
            )
        import importlib.util

        require(
            importlib.util.find_spec("deepspeed") is not None,
            "strategy=deepspeed needs the deepspeed package: pip install deepspeed "
            "(or '.[deepspeed]' from the runner's checkout)",
        )
        require(self.zero_stage in (0, 1, 2, 3), f"strategy.zero_stage={self.zero_stage} must be 0, 1, 2 or 3")
        require(
            self.offload_param is OffloadDevice.none or self.zero_stage == 3,
            f"strategy.offload_param={self.offload_param.value} needs strategy.zero_stage=3",
        )
        require(
            self.offload_optimizer is OffloadDevice.none or self.zero_stage >= 1,
            f"strategy.offload_optimizer={self.offload_optimizer.value} needs strategy.zero_stage >= 1",
        )
        nvme = OffloadDevice.nvme in (self.offload_optimizer, self.offload_param)
        require(
            not nvme or (self.nvme_path and Path(self.nvme_path).is_dir()),
            f"NVMe offload needs strategy.nvme_path=<an existing directory on the NVMe drive>, not {self.nvme_path}",
        )
        if self.sp_size != 1:
            self._check_sequence_parallel(spec)
        if self.config_file:
            deepspeed_config(spec)  # the file's contradictions with the spec, before launch

    def _check_sequence_parallel(self, spec: RunSpec) -> None:
        """What Ulysses cannot split, refused before launch: it trades sequence slices for whole heads."""
        sp, world = f"strategy.sp_size={self.sp_size}", spec.hardware.world_size
        require(
            self.sp_size >= 1 and world % self.sp_size == 0,
            f"{sp} does not divide the {world} processes (hardware.nnodes x hardware.nproc_per_node)",
        )
        layer = facts_of(spec.model).layer
        require(
            layer.heads % self.sp_size == 0
            and (layer.kv_heads % self.sp_size == 0 or self.sp_size % layer.kv_heads == 0),
            f"{sp} does not divide the model's {layer.heads} attention heads, or its {layer.kv_heads} key-value "
            "heads (nor they it): each rank attends with an equal share of the heads; pick a divisor of both",
        )
        reduce_scatter = deepspeed_config(spec)["zero_optimization"].get("reduce_scatter", True)
        require(
            self.zero_stage != 3 or reduce_scatter,
            f"{sp} with ZeRO-3 and zero_optimization.reduce_scatter=false (strategy.config_file): DeepSpeed then "
            "divides some gradient buckets by the data-parallel ranks and others by every rank; remove the key",
        )

    def resolved(self, spec: RunSpec) -> RunSpec:
        """What the config file decides where the spec does not (runner/strategies/deepspeed_json.py)."""
        return read_into_spec(spec) if self.config_file else spec

    def describe(self, spec: RunSpec) -> str:
        described = f"deepspeed ZeRO-{self.zero_stage}, {processes(spec.hardware.world_size)}"
        if self.sp_size > 1:
            described += f", {spec.layout.describe()}, Ulysses sequence parallel"
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

    def wrap(
        self,
        model: nn.Module,
        spec: RunSpec,
        device: torch.device,
        dims: ParallelDims,
        whole: Optional[WholeWeights] = None,
    ) -> nn.Module:
        """Nothing yet: DeepSpeed's engine takes model and optimizer together (`stepper`), moves the module to the
        device and broadcasts rank 0's weights."""
        return model

    def frozen(
        self,
        model: nn.Module,
        spec: RunSpec,
        device: torch.device,
        dims: ParallelDims,
        whole: Optional[WholeWeights] = None,
    ) -> nn.Module:
        """ZeRO-3: an engine of its own, without optimizer, which partitions the weights as the trained model's are
        and gathers them layer by layer in the forward (as TRL places its reference); otherwise a replica."""
        if self.zero_stage < 3:
            return model.to(device)
        return deepspeed_engine.initialized(model, None, spec, self.sp_size)

    def frozen_shards(self, spec: RunSpec) -> int:
        return spec.hardware.world_size if self.zero_stage == 3 else 1

    def stepper(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        spec: RunSpec,
        device: torch.device,
        stages: Optional[PipelineStages] = None,
    ) -> tuple[nn.Module, deepspeed_engine.DeepSpeedStepper]:
        return deepspeed_engine.stepper(model, optimizer, spec, self.zero_stage, self.sp_size)

    def estimate_memory(self, spec: RunSpec, facts: ModelFacts) -> Estimate:
        return deepspeed_memory.estimate_memory(spec, facts, self.zero_stage, self.offload_optimizer)

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
            changes += [
                strategy_change(f"strategy.sp_size={sp}", 1.0 + 0.5 * math.log2(sp), sp_size=sp) for sp in (2, 4, 8)
            ]
        return changes
