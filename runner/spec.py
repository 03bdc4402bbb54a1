"""The run spec: Hydra composes the config groups into one typed RunSpec, and `validate` checks what spans fields.

Each group's schemas live in the group's own module (runner/strategy.py for conf/strategy/ ...) and are
registered here under `schema/<group>/<name>`; every option in conf/ starts from one of them (or, for the
tracker group, whose options combine, from the RunSpec field's type), so an unknown key or a value of the wrong
type fails while Hydra composes.
"""

from __future__ import annotations

import importlib.util
import os
import sysconfig
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from runner import data as data_module
from runner import recipes
from runner.data import DataConfig
from runner.hardware import Accelerator, HardwareConfig
from runner.model import BYTES, ModelConfig
from runner.optim import AdamWConfig, OptimConfig, SGDConfig
from runner.precision import Dtype, Float8Backend, Float8Recipe, PrecisionConfig
from runner.scheduler import SchedulerConfig
from runner.strategy import (
    DDPStrategy,
    DeepSpeedStrategy,
    OffloadDevice,
    FSDPStrategy,
    SingleStrategy,
    StrategyConfig,
    hybrid_group_size,
)
from runner.task import EstimateTask, TaskConfig, TrainTask
from runner.tracker import TrackerConfig
from runner.train import TrainConfig


class SpecError(Exception):
    """A user error in the spec: reported as one line, before anything is written."""


@dataclass
class RunSpec:
    hardware: HardwareConfig = MISSING
    strategy: StrategyConfig = MISSING
    precision: PrecisionConfig = MISSING
    tracker: TrackerConfig = MISSING
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    optim: OptimConfig = MISSING
    scheduler: SchedulerConfig = MISSING
    task: TaskConfig = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = 0
    # The checkpoint to continue from; the command line's resume=auto or resume=<run dir> is resolved to it.
    resume: Optional[str] = None


SCHEMAS = {
    "hardware": {"base": HardwareConfig},
    "strategy": {"single": SingleStrategy, "ddp": DDPStrategy, "fsdp": FSDPStrategy, "deepspeed": DeepSpeedStrategy},
    "precision": {"base": PrecisionConfig},
    "model": {"base": ModelConfig},
    "data": {"base": DataConfig},
    "optim": {"adamw": AdamWConfig, "sgd": SGDConfig},
    "scheduler": {"base": SchedulerConfig},
    "task": {"train": TrainTask, "estimate": EstimateTask},
}


def register(*recipe_dirs: Path) -> None:
    """Puts the schemas, the recipes of these directories (later ones shadowing earlier ones) in Hydra's
    ConfigStore and the `${stdlib:}` resolver in OmegaConf."""
    store = ConfigStore.instance()
    store.store(name="run_spec", node=RunSpec)
    for group, schemas in SCHEMAS.items():
        for name, node in schemas.items():
            store.store(group=f"schema/{group}", name=name, node=node)
    # <recipe dir>/<name>.yaml is the option `recipe=<name>`: a global overlay on the whole spec.
    for name, path in recipes.find(list(recipe_dirs)).items():
        store.store(group="recipe", name=name, node=recipes.load(path), package="_global_")
    if not OmegaConf.has_resolver("stdlib"):
        OmegaConf.register_new_resolver("stdlib", lambda: sysconfig.get_paths()["stdlib"])
    if not OmegaConf.has_resolver("gpus_per_node"):  # conf/hydra/launcher/: a SLURM job's GPUs, none for CPUs
        OmegaConf.register_new_resolver("gpus_per_node", lambda accelerator, nproc: nproc if accelerator == "cuda" else None)


def load_spec(config: DictConfig) -> RunSpec:
    """The typed spec of a composed config (Hydra's own `hydra` node, when present, is left out)."""
    _reject_unknown_keys(config, "")
    sections = {f.name: config[f.name] for f in fields(RunSpec)}
    return RunSpec(**{name: OmegaConf.to_object(node) if isinstance(node, DictConfig) else node
                      for name, node in sections.items()})


def _reject_unknown_keys(node: DictConfig, prefix: str) -> None:
    """Hydra's `+key=value` adds keys that no schema has; they would be silently ignored, so they are errors."""
    schema = OmegaConf.get_type(node)
    if is_dataclass(schema):
        known = [f.name for f in fields(schema)]
        for key in node.keys():
            if key not in known and not (prefix == "" and key == "hydra"):
                has = f"the keys {', '.join(known)}" if known else "no keys"
                raise SpecError(f"unknown key {prefix}{key}: {schema.__name__} has {has}")
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig) and key != "hydra" and not child._is_missing() and not child._is_none():
            _reject_unknown_keys(child, f"{prefix}{key}.")


def validate(spec: RunSpec, on_this_machine: bool = True) -> RunSpec:
    """Checks the rules that span fields or need this machine; returns the spec with the hardware detected.

    A spec for other machines (task=estimate, or a job submitted to a cluster) is checked against the hardware
    it declares instead of this machine's.
    """
    _check_ranges(spec)
    _check_model(spec.model)
    _check_data(spec.data)
    planned = isinstance(spec.task, EstimateTask) or not on_this_machine
    spec = replace(spec, hardware=_planned_hardware(spec) if planned else _check_hardware(spec))
    _check_strategy(spec.strategy, spec.hardware)
    _check_precision(spec)
    if isinstance(spec.strategy, DeepSpeedStrategy):
        _check_deepspeed(spec)
    if spec.resume:
        _check_resume(spec)
    _check_trackers(spec)
    _check_task(spec)
    return spec


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise SpecError(message)


def _check_ranges(spec: RunSpec) -> None:
    train, optim, scheduler = spec.train, spec.optim, spec.scheduler
    for key in ("max_steps", "micro_batch_size", "grad_accum_steps", "log_every", "eval_batches"):
        value = getattr(train, key)
        _require(value > 0, f"train.{key}={value} must be a positive integer")
    _require(train.checkpoint_every >= 0, f"train.checkpoint_every={train.checkpoint_every} must be >= 0")
    _require(train.keep_checkpoints >= 1, f"train.keep_checkpoints={train.keep_checkpoints} must be >= 1")
    _require(train.eval_every >= 0, f"train.eval_every={train.eval_every} must be >= 0 (0 evaluates only at the end)")
    _require(train.max_grad_norm >= 0, f"train.max_grad_norm={train.max_grad_norm} must be >= 0 (0 turns clipping off)")
    _require(optim.lr > 0, f"optim.lr={optim.lr} must be > 0")
    _require(optim.weight_decay >= 0, f"optim.weight_decay={optim.weight_decay} must be >= 0")
    if isinstance(optim, AdamWConfig):
        _require(len(optim.betas) == 2 and all(0 <= b < 1 for b in optim.betas),
                 f"optim.betas={list(optim.betas)} must be two numbers in [0, 1)")
    if isinstance(optim, SGDConfig):
        _require(optim.momentum >= 0, f"optim.momentum={optim.momentum} must be >= 0")
    _require(0 <= scheduler.warmup_ratio < 1, f"scheduler.warmup_ratio={scheduler.warmup_ratio} must be in [0, 1)")
    if scheduler.warmup_steps is not None:
        _require(0 <= scheduler.warmup_steps < train.max_steps,
                 f"scheduler.warmup_steps={scheduler.warmup_steps} must be in [0, train.max_steps={train.max_steps})")
    _require(0 <= scheduler.min_lr_ratio <= 1, f"scheduler.min_lr_ratio={scheduler.min_lr_ratio} must be in [0, 1]")


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or os.path.exists(name)


def _check_model(model: ModelConfig) -> None:
    _require(bool(model.pretrained) != bool(model.architecture),
             "set exactly one of model.pretrained (a name or directory) and model.architecture (random init)")
    if model.pretrained and _looks_like_path(model.pretrained):
        _require(Path(model.pretrained).expanduser().is_dir(),
                 f"model.pretrained={model.pretrained} is not a directory; give a saved model's directory or a hub name")
    if model.architecture:
        _require("model_type" in model.architecture,
                 "model.architecture needs a model_type (for example llama); add model.architecture.model_type=llama")
        _require(model.tokenizer is not None,
                 f"model.tokenizer is needed with model.architecture: set model.tokenizer={BYTES} or a tokenizer's name")
    if model.tokenizer and model.tokenizer != BYTES and _looks_like_path(model.tokenizer):
        _require(Path(model.tokenizer).expanduser().is_dir(), f"model.tokenizer={model.tokenizer} is not a directory")


def _check_data(data: DataConfig) -> None:
    _require(bool(data.files) != bool(data.hub_dataset),
             "set exactly one of data.files (a local file, directory or glob) and data.hub_dataset (a hub name)")
    _require(data.seq_len >= 2, f"data.seq_len={data.seq_len} must be at least 2")
    _require(0 < data.eval_fraction < 1, f"data.eval_fraction={data.eval_fraction} must be between 0 and 1")
    if data.files:
        files = data_module.resolve_files(data.files)
        _require(bool(files), f"data.files={data.files} matches no file; give an existing file, directory or glob")
        kinds = {data_module.BUILDERS.get(os.path.splitext(f)[1].lower(), "text") for f in files}
        _require(len(kinds) == 1, f"data.files={data.files} mixes file kinds ({', '.join(sorted(kinds))}); pick one")


def _check_hardware(spec: RunSpec) -> HardwareConfig:
    """The hardware the spec declares, checked against this machine and filled in from it."""
    from runner import hardware as hw

    declared = spec.hardware
    _require(declared.nnodes >= 1, f"hardware.nnodes={declared.nnodes} must be >= 1")
    _require(declared.nproc_per_node is None or declared.nproc_per_node >= 1,
             f"hardware.nproc_per_node={declared.nproc_per_node} must be >= 1")
    if declared.accelerator is Accelerator.cuda:
        _require(hw.cuda_device_count() > 0,
                 "hardware asks for CUDA GPUs but this machine has none; use hardware=auto or hardware=cpu")
    _require(0 <= declared.node_rank < declared.nnodes,
             f"hardware.node_rank={declared.node_rank} must be in [0, hardware.nnodes={declared.nnodes})")
    _require(declared.nnodes == 1 or bool(declared.rdzv_endpoint),
             f"hardware.nnodes={declared.nnodes} needs hardware.rdzv_endpoint=<host of node 0>:<free port>, "
             "the same on every node")
    machine = hw.detect(declared)
    if machine.accelerator is Accelerator.cuda:
        _require(machine.nproc_per_node <= hw.cuda_device_count(),
                 f"hardware.nproc_per_node={machine.nproc_per_node} asks for more GPUs than the "
                 f"{hw.cuda_device_count()} this machine has")
    return machine


def _planned_hardware(spec: RunSpec) -> HardwareConfig:
    """The CUDA hardware the spec declares, which need not be this machine's."""
    declared = spec.hardware
    if declared.accelerator is not Accelerator.cuda:
        return _check_hardware(spec)
    _require(declared.nproc_per_node is not None and declared.nproc_per_node >= 1,
             "task=estimate for CUDA hardware needs hardware.nproc_per_node (or a hardware option such as 2xrtx4090)")
    _require(declared.nnodes >= 1, f"hardware.nnodes={declared.nnodes} must be >= 1")
    return declared


def _check_task(spec: RunSpec) -> None:
    """A training run must train a causal LM, and fit its hardware's memory (runner/memory.py)."""
    if isinstance(spec.task, TrainTask):
        from runner import memory

        memory.check_causal_lm(spec)
        if spec.precision.fp8:  # an fp8 run without an fp8 layer is an error, not a bf16 run
            memory.fp8_linears(memory.meta_model(spec.model), spec)
        if spec.task.fit_check:
            memory.check_fit(spec)


def _check_precision(spec: RunSpec) -> None:
    precision, machine = spec.precision, spec.hardware
    _require(precision.param_dtype in (Dtype.fp32, Dtype.bf16),
             f"precision.param_dtype={precision.param_dtype.value} is not supported: fp16 weights need fp32 master "
             "copies; use precision=fp16 (fp32 weights, fp16 forward)")
    if precision.param_dtype is Dtype.bf16:
        _require(precision.compute_dtype is Dtype.bf16 and precision.reduce_dtype is Dtype.bf16,
                 "precision.param_dtype=bf16 needs precision.compute_dtype=bf16 and precision.reduce_dtype=bf16 "
                 "(bf16 weights have bf16 gradients); choose precision=pure_bf16")
        _require(not isinstance(spec.strategy, DeepSpeedStrategy),
                 "strategy=deepspeed keeps fp32 master weights itself; precision.param_dtype=bf16 applies to "
                 "single, ddp and fsdp (use precision=bf16)")
    scale = precision.initial_loss_scale
    _require(scale >= 1 and float(scale).is_integer() and (int(scale) & (int(scale) - 1)) == 0,
             f"precision.initial_loss_scale={scale:g} must be a power of two (65536 is usual)")
    _require(precision.loss_scale_growth_interval > 0,
             f"precision.loss_scale_growth_interval={precision.loss_scale_growth_interval} must be a positive integer")
    if isinstance(spec.strategy, DDPStrategy) and precision.reduce_dtype not in (Dtype.fp32, precision.param_dtype):
        _require(machine.accelerator is Accelerator.cuda,
                 f"precision.reduce_dtype={precision.reduce_dtype.value} under strategy=ddp uses torch's gradient "
                 "compression hook, which needs NCCL (a GPU); leave precision.reduce_dtype=fp32 on a CPU")
    if isinstance(spec.strategy, DeepSpeedStrategy) and precision.compute_dtype is Dtype.fp16:
        _require(machine.accelerator is Accelerator.cuda,
                 "strategy=deepspeed with precision=fp16 needs a GPU (DeepSpeed's CPU accelerator has no fp16); "
                 "use precision=bf16, or precision=fp16 with strategy=single, ddp or fsdp")
    capability = machine.compute_capability or 0.0
    if precision.compute_dtype is Dtype.bf16 and machine.accelerator is Accelerator.cuda and machine.compute_capability:
        _require(capability >= 8.0,
                 f"precision.compute_dtype=bf16 needs a GPU of compute capability 8.0+ (A100, RTX 30xx or newer), "
                 f"and {machine.device_name} has {capability}; use precision=fp16")
    fp8 = precision.fp8
    if fp8 is None:
        return
    _require(precision.compute_dtype in (Dtype.bf16, Dtype.fp32),
             f"precision.fp8 runs its other operations in bf16 or fp32, not "
             f"precision.compute_dtype={precision.compute_dtype.value}")
    _require(precision.param_dtype is Dtype.fp32,
             "precision.fp8 keeps fp32 master weights; set precision.param_dtype=fp32")
    _require(fp8.min_features >= 16, f"precision.fp8.min_features={fp8.min_features} must be >= 16 (fp8 kernels "
             "need dimensions that are multiples of 16)")
    if fp8.all_gather:
        _require(isinstance(spec.strategy, FSDPStrategy),
                 "precision.fp8.all_gather=true is FSDP's float8 all-gather; it needs strategy=fsdp")
        _require(fp8.recipe is Float8Recipe.tensorwise,
                 f"precision.fp8.all_gather=true needs precision.fp8.recipe=tensorwise, not {fp8.recipe.value}")
    if fp8.backend is Float8Backend.transformer_engine:
        _require(not isinstance(spec.strategy, DeepSpeedStrategy),
                 "precision.fp8.backend=transformer_engine works with strategy=single, ddp or fsdp; "
                 "use precision.fp8.backend=torchao with strategy=deepspeed")
        _require(importlib.util.find_spec("transformer_engine") is not None,
                 "precision.fp8.backend=transformer_engine needs TransformerEngine: pip install "
                 "'transformer-engine[pytorch]' (on a CUDA machine), or use precision.fp8.backend=torchao")
        _require(machine.accelerator is Accelerator.cuda and not fp8.emulate,
                 "precision.fp8.backend=transformer_engine runs on CUDA GPUs only and cannot emulate; "
                 "use precision.fp8.backend=torchao")
    else:
        _require(importlib.util.find_spec("torchao") is not None,
                 "precision=fp8 needs torchao: pip install torchao (or '.[fp8]' from the runner's checkout)")
    if not fp8.emulate:
        if machine.accelerator is Accelerator.cuda:
            known = capability or "unknown: set hardware.compute_capability"
            has = f"{machine.device_name} (compute capability {known})"
        else:
            has = "a CPU"
        _require(machine.accelerator is Accelerator.cuda and capability >= 8.9,
                 f"precision=fp8 needs a GPU with fp8 tensor cores (CUDA compute capability 8.9+: H100, H200, L40S, "
                 f"RTX 4090) and this run has {has}; set precision.fp8.emulate=true to emulate fp8 (same numerics, "
                 "no speed-up)")


def _check_strategy(strategy: StrategyConfig, machine: HardwareConfig) -> None:
    processes = f"(hardware.nnodes={machine.nnodes} x hardware.nproc_per_node={machine.nproc_per_node})"
    if isinstance(strategy, SingleStrategy):
        _require(machine.world_size == 1,
                 f"strategy=single runs one process but the hardware gives {machine.world_size} {processes}; "
                 "choose strategy=ddp or strategy=fsdp, or set hardware.nproc_per_node=1")
    if isinstance(strategy, FSDPStrategy):
        group = hybrid_group_size(strategy, machine)
        if strategy.hybrid:
            _require(group >= 1 and machine.world_size % group == 0,
                     f"strategy.hybrid_shard_size={group} does not divide the {machine.world_size} processes "
                     f"{processes}; pick a divisor of {machine.world_size}")
        else:
            _require(strategy.hybrid_shard_size is None,
                     f"strategy.hybrid_shard_size applies to HYBRID_SHARD and HYBRID_SHARD_ZERO2 only, not "
                     f"{strategy.sharding_strategy.value}")
        _require(strategy.sync_module_states or not strategy.cpu_ram_efficient_loading,
                 "strategy.cpu_ram_efficient_loading=true needs strategy.sync_module_states=true: the other ranks "
                 "get their weights from rank 0")
        _require(strategy.min_num_params >= 1, f"strategy.min_num_params={strategy.min_num_params} must be >= 1")
        _require(strategy.forward_prefetch >= 0 and strategy.backward_prefetch >= 0,
                 "strategy.forward_prefetch and strategy.backward_prefetch must be >= 0")


def _check_trackers(spec: RunSpec) -> None:
    import importlib.util

    needs = {"wandb": ("wandb", "wandb"), "tensorboard": ("tensorboard", "tensorboard"),
             "mlflow": ("mlflow", "mlflow-skinny")}
    for section, (module, package) in needs.items():
        if getattr(spec.tracker, section) is not None:
            _require(importlib.util.find_spec(module) is not None,
                     f"tracker={section} needs the {package} package: pip install {package} "
                     "(or '.[trackers]' from the runner's checkout)")
    if spec.tracker.wandb:
        _require(spec.tracker.wandb.mode in ("offline", "online"),
                 f"tracker.wandb.mode={spec.tracker.wandb.mode} must be offline or online")


def to_plain(spec: RunSpec, hide_secrets: bool = True) -> dict:
    """The resolved spec as plain data, secrets hidden unless asked: what trackers record and spec.yaml shows."""
    from runner.tracker import redacted

    plain = OmegaConf.to_container(OmegaConf.structured(spec), resolve=True, enum_to_str=True)
    return redacted(plain) if hide_secrets else plain


def _check_resume(spec: RunSpec) -> None:
    import json

    meta = Path(spec.resume) / "meta.json"
    _require(meta.is_file(), f"resume={spec.resume} is not a complete checkpoint")
    written = json.loads(meta.read_text())
    if written["layout"] in ("sharded", "deepspeed"):
        _require(written["world_size"] == spec.hardware.world_size,
                 f"the checkpoint {spec.resume} holds {written['world_size']} ranks' shards ({written['layout']}) and "
                 f"this run has {spec.hardware.world_size} processes; resume on {written['world_size']}, or write FULL "
                 "checkpoints (strategy.state_dict_type=FULL), which resume on any number")
    _require(written["strategy"] == type(spec.strategy).__name__ or written["layout"] == "full",
             f"the checkpoint {spec.resume} was written by {written['strategy']}, this run uses "
             f"{type(spec.strategy).__name__}; only FULL checkpoints move between strategies")
    _require(written["step"] < spec.train.max_steps,
             f"the checkpoint {spec.resume} is at step {written['step']}, the end of train.max_steps="
             f"{spec.train.max_steps}; raise train.max_steps to train further")


def _check_deepspeed(spec: RunSpec) -> None:
    import importlib.util

    from runner.strategy import deepspeed_config

    strategy = spec.strategy
    _require(importlib.util.find_spec("deepspeed") is not None,
             "strategy=deepspeed needs the deepspeed package: pip install deepspeed "
             "(or '.[deepspeed]' from the runner's checkout)")
    _require(strategy.zero_stage in (0, 1, 2, 3), f"strategy.zero_stage={strategy.zero_stage} must be 0, 1, 2 or 3")
    _require(strategy.offload_param is OffloadDevice.none or strategy.zero_stage == 3,
             f"strategy.offload_param={strategy.offload_param.value} needs strategy.zero_stage=3")
    _require(strategy.offload_optimizer is OffloadDevice.none or strategy.zero_stage >= 1,
             f"strategy.offload_optimizer={strategy.offload_optimizer.value} needs strategy.zero_stage >= 1")
    nvme = OffloadDevice.nvme in (strategy.offload_optimizer, strategy.offload_param)
    _require(not nvme or (strategy.nvme_path and Path(strategy.nvme_path).is_dir()),
             f"NVMe offload needs strategy.nvme_path=<an existing directory on the NVMe drive>, "
             f"not {strategy.nvme_path}")
    if strategy.config_file:
        _require(Path(strategy.config_file).is_file(), f"strategy.config_file={strategy.config_file} does not exist")
        try:
            deepspeed_config(spec)
        except ValueError as error:  # JSON that does not parse
            raise SpecError(f"strategy.config_file={strategy.config_file} is not valid JSON: {error}") from None


def to_yaml(spec: RunSpec) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(to_plain(spec)))
