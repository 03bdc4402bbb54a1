"""A spec to an accelerate config file: `run --to-accelerate [overrides]` prints the accelerate config of the
composed spec, and on stderr what of the spec such a file cannot say. FSDP keys are written in FSDP1's vocabulary.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Optional

import yaml

from runner.config.float8 import delayed_scaling
from runner.config.hardware import Accelerator, HardwareConfig, cuda_device_count, detect
from runner.config.precision import Dtype, PrecisionConfig
from runner.config.spec import RunSpec
from runner.errors import SpecError
from runner.strategies.deepspeed import OffloadDevice
from runner.strategies.fsdp import AutoWrapPolicy
from runner.tools.accelerate.sections import FP8_BACKENDS
from runner.tools.accelerate.values import shown


def accelerate_file(spec: RunSpec) -> tuple[str, list[str]]:
    """`run --to-accelerate`: the accelerate config YAML of a composed spec, and lines on what it cannot say."""
    declared = spec.hardware
    spec = replace(spec, hardware=planned_hardware(declared))
    hardware = spec.hardware
    on_cpu = hardware.accelerator is Accelerator.cpu
    notes: list[str] = []
    on_cpus, on_gpus, write_keys = WRITTEN_AS[spec.strategy.name]
    file: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": on_cpus if on_cpu else on_gpus,
        "machine_rank": hardware.node_rank,
        "main_training_function": "main",
        "num_machines": hardware.nnodes,
        "num_processes": hardware.world_size,
        "use_cpu": on_cpu,
    }
    file["mixed_precision"] = precision_name(spec, file["distributed_type"], notes)
    if hardware.rdzv_endpoint:
        host, _, port = hardware.rdzv_endpoint.rpartition(":")
        file.update(main_process_ip=host, main_process_port=int(port), rdzv_backend="static")
    if write_keys is not None:
        file.update(write_keys(spec, hardware, notes))
    if spec.strategy.activation_checkpointing and "fsdp_config" not in file:
        notes.append(
            "strategy.activation_checkpointing=true: accelerate's file says it under FSDP only; the script "
            "calls model.gradient_checkpointing_enable()"
        )
    if spec.precision.fp8:
        file["fp8_config"] = fp8_section(spec.precision, notes)
    described = [
        f"hardware.{key}={value}"
        for key in ("device_name", "device_memory_gib", "host_memory_gib", "peak_bf16_tflops", "compute_capability")
        if (value := getattr(declared, key))
    ]
    if described:
        notes.append(
            f"{', '.join(described)}: what the spec says of the machine, for the memory estimate; "
            "accelerate reads the machine it runs on"
        )
    carried = " (but gradient accumulation and clipping, in deepspeed_config)" if "deepspeed_config" in file else ""
    notes.append(
        f"model, data, optim, scheduler, train, task, tracker and seed{carried}: the training script's "
        "business under accelerate, not its config file's"
    )
    return yaml.safe_dump(file, sort_keys=True), notes


def planned_hardware(declared: HardwareConfig) -> HardwareConfig:
    """The hardware as the spec declares it; what it leaves to detection is read from this machine."""
    if declared.accelerator is not Accelerator.auto and declared.nproc_per_node is not None:
        return declared
    if declared.accelerator is Accelerator.cuda and not cuda_device_count():
        raise SpecError("hardware.nproc_per_node is unset and this machine has no GPU to count; set it")
    return detect(declared)


def precision_name(spec: RunSpec, distributed_type: str, notes: list[str]) -> str:
    precision = spec.precision
    names = {Dtype.fp32: "no", Dtype.fp16: "fp16", Dtype.bf16: "bf16"}
    name = "fp8" if precision.fp8 else names[precision.compute_dtype]
    if precision.param_dtype is not Dtype.fp32:
        notes.append(
            f"precision.param_dtype={precision.param_dtype.value}: accelerate keeps fp32 weights under "
            f"mixed precision; the file says {name}"
        )
    # accelerate's FSDP reduces gradients in the mixed-precision dtype; DDP and DeepSpeed here in fp32.
    reduced = precision.compute_dtype if distributed_type == "FSDP" else Dtype.fp32
    if precision.reduce_dtype is not reduced and precision.compute_dtype is not Dtype.fp32:
        notes.append(
            f"precision.reduce_dtype={precision.reduce_dtype.value}: accelerate reduces these gradients in "
            f"{reduced.value}, and its file cannot choose otherwise"
        )
    defaults = PrecisionConfig()
    if precision.compute_dtype is Dtype.fp16 and (
        (precision.initial_loss_scale, precision.loss_scale_growth_interval)
        != (defaults.initial_loss_scale, defaults.loss_scale_growth_interval)
    ):
        notes.append(
            f"precision.initial_loss_scale={precision.initial_loss_scale:g}, precision.loss_scale_growth_"
            f"interval={precision.loss_scale_growth_interval}: accelerate takes them in the script "
            "(GradScalerKwargs)"
        )
    return name


def fsdp_keys(spec: RunSpec, hardware: HardwareConfig, notes: list[str]) -> dict[str, Any]:
    strategy = spec.strategy
    notes.append(
        "fsdp_config is in FSDP1's form (accelerate's default fsdp_version 1), whose keys the runner's FSDP2 "
        "takes; accelerate's fsdp_version 2 has no prefetch or sync_module_states keys"
    )
    section: dict[str, Any] = {
        "fsdp_sharding_strategy": strategy.sharding_strategy.value,
        "fsdp_auto_wrap_policy": strategy.auto_wrap_policy.value,
        "fsdp_offload_params": strategy.offload_params,
        "fsdp_cpu_ram_efficient_loading": strategy.cpu_ram_efficient_loading,
        "fsdp_sync_module_states": strategy.sync_module_states,
        "fsdp_activation_checkpointing": strategy.activation_checkpointing,
        "fsdp_state_dict_type": f"{strategy.state_dict_type.value}_STATE_DICT",
        "fsdp_backward_prefetch": "BACKWARD_PRE" if strategy.backward_prefetch else "NO_PREFETCH",
        "fsdp_forward_prefetch": strategy.forward_prefetch > 0,
        # The runner's optimizer keeps matrices and the rest in separate groups, which FSDP1 allows only so.
        "fsdp_use_orig_params": True,
    }
    if strategy.auto_wrap_policy is AutoWrapPolicy.TRANSFORMER_BASED_WRAP and strategy.transformer_layer_cls:
        section["fsdp_transformer_layer_cls_to_wrap"] = ",".join(strategy.transformer_layer_cls)
    if strategy.auto_wrap_policy is AutoWrapPolicy.SIZE_BASED_WRAP:
        section["fsdp_min_num_params"] = strategy.min_num_params
    for key in ("forward_prefetch", "backward_prefetch"):
        if getattr(strategy, key) > 1:
            notes.append(f"strategy.{key}={getattr(strategy, key)}: FSDP1 prefetches one block; the file says so")
    if strategy.tp_size > 1 or strategy.cp_size > 1:
        dims = spec.layout
        return {
            "fsdp_config": section,
            "parallelism_config": {
                "parallelism_config_dp_replicate_size": dims.dp_replicate,
                "parallelism_config_dp_shard_size": dims.dp_shard,
                "parallelism_config_tp_size": dims.tp,
                "parallelism_config_cp_size": dims.cp,
            },
        }
    if strategy.sharding_strategy.hybrid and strategy.hybrid_group_size(hardware) != hardware.nproc_per_node:
        notes.append(
            f"strategy.sharding_strategy={strategy.sharding_strategy.value} shards within groups of "
            f"{strategy.hybrid_group_size(hardware)} processes; accelerate's within each node"
        )
    return {"fsdp_config": section}


def deepspeed_keys(spec: RunSpec, hardware: HardwareConfig, notes: list[str]) -> dict[str, Any]:
    strategy = spec.strategy
    if strategy.config_file:
        notes.append(
            f"strategy.config_file: accelerate takes the whole DeepSpeed config from {strategy.config_file}; "
            f"the runner adds the spec's to it: zero_stage={strategy.zero_stage}, offload_optimizer="
            f"{strategy.offload_optimizer.value}, offload_param={strategy.offload_param.value}, gradient "
            f"accumulation {spec.train.grad_accum_steps}, clipping {spec.train.max_grad_norm:g}"
        )
        section: dict[str, Any] = {"deepspeed_config_file": strategy.config_file, "zero3_init_flag": False}
    else:
        section = {
            "zero_stage": strategy.zero_stage,
            "offload_optimizer_device": strategy.offload_optimizer.value,
            "offload_param_device": strategy.offload_param.value,
            "gradient_accumulation_steps": spec.train.grad_accum_steps,
            "gradient_clipping": spec.train.max_grad_norm,
            "zero3_init_flag": False,  # each process builds the whole model, then DeepSpeed partitions it
        }
        for key in ("offload_optimizer", "offload_param"):
            if getattr(strategy, key) is OffloadDevice.nvme:
                section[f"{key}_nvme_path"] = strategy.nvme_path
    if strategy.sp_size == 1:
        return {"deepspeed_config": section}
    if not strategy.config_file:
        section["seq_parallel_communication_data_type"] = spec.precision.reduce_dtype.value
    dims = spec.layout
    return {
        "deepspeed_config": section,
        "parallelism_config": {
            "parallelism_config_dp_replicate_size": 1,
            "parallelism_config_dp_shard_size": dims.dp_shard,
            "parallelism_config_tp_size": 1,
            "parallelism_config_sp_size": dims.cp,
            "parallelism_config_sp_backend": "deepspeed",
        },
    }


def fp8_section(precision: PrecisionConfig, notes: list[str]) -> dict[str, Any]:
    fp8 = precision.fp8
    notes.append(
        f"precision.fp8.recipe={fp8.recipe.value}, min_features={fp8.min_features}, skip={shown(fp8.skip)}, "
        f"emulate={shown(fp8.emulate)}: accelerate's file has no such keys"
    )
    backend = {value: name for name, value in FP8_BACKENDS.items()}[fp8.backend.value]
    section = {"backend": backend, "enable_fsdp_float8_all_gather": fp8.all_gather}
    if backend == "TE":  # Transformer Engine's delayed scaling: DelayedScaling's names are accelerate's keys
        section.update(delayed_scaling(fp8))
    return section


def ddp_keys(spec: RunSpec, hardware: HardwareConfig, notes: list[str]) -> dict[str, Any]:
    """DDP has no section: its keys are the script's."""
    strategy, default = spec.strategy, type(spec.strategy)()
    if (strategy.find_unused_parameters, strategy.bucket_cap_mb) != (
        default.find_unused_parameters,
        default.bucket_cap_mb,
    ):
        notes.append(
            f"strategy.find_unused_parameters={shown(strategy.find_unused_parameters)}, "
            f"strategy.bucket_cap_mb={strategy.bucket_cap_mb}: accelerate takes them in the script "
            "(DistributedDataParallelKwargs)"
        )
    return {}


# Each strategy option as accelerate says it: its distributed_type on CPUs and on GPUs, and what writes its keys.
WRITTEN_AS: dict[str, tuple[str, str, Optional[Callable[[RunSpec, HardwareConfig, list[str]], dict[str, Any]]]]] = {
    "single": ("NO", "NO", None),
    "ddp": ("MULTI_CPU", "MULTI_GPU", ddp_keys),
    "fsdp": ("FSDP", "FSDP", fsdp_keys),
    "deepspeed": ("DEEPSPEED", "DEEPSPEED", deepspeed_keys),
}
