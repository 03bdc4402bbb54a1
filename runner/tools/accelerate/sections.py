"""The sections of an accelerate config file (fsdp_config, deepspeed_config, fp8_config), each key with its
handler. FSDP keys are read in FSDP1's vocabulary, which the runner's FSDP2 strategy keeps
(runner/strategies/fsdp.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from runner.config.float8 import Float8Backend
from runner.strategies import STRATEGIES
from runner.strategies.deepspeed import OffloadDevice
from runner.strategies.fsdp import AutoWrapPolicy, ShardingStrategy, StateDictType
from runner.tools.accelerate.values import (
    Handler,
    Settings,
    count,
    flag,
    fsdp2_sharding,
    mixed_precision,
    named,
    no_meaning,
    parallel_sizes,
    setting,
    transformer_engine,
)

# accelerate's own orders: a file may give a value as its 1-based position in the list.
SHARDING_STRATEGIES = [s.value for s in ShardingStrategy]
BACKWARD_PREFETCH = ["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"]
STATE_DICT_TYPES = ["FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"]
FP8_BACKENDS = {"AO": Float8Backend.torchao.value, "TE": Float8Backend.transformer_engine.value}


def fsdp_version_of(file: dict) -> int:
    """The file's FSDP version: 1 unless it says 2. accelerate reads a file's keys differently under each."""
    return int(file["fsdp_config"].get("fsdp_version", 1))


def under_version_1(handler: Handler, version_2_note: str) -> Handler:
    """A key that accelerate reads with fsdp_version 1 only, and leaves unread (or replaced) with version 2."""

    def handled(value: Any, file: dict) -> tuple[Settings, str]:
        if fsdp_version_of(file) == 2:
            return {}, f"no meaning here: accelerate's fsdp_version 2 does not read it; {version_2_note}"
        return handler(value, file)

    return handled


def sharding_strategy(value: Any, file: dict) -> tuple[Settings, str]:
    return {"strategy.sharding_strategy": named(value, SHARDING_STRATEGIES)}, ""


def reshard_after_forward(value: Any, file: dict) -> tuple[Settings, str]:
    if fsdp_version_of(file) == 2:  # a bool, and what decides the sharding: fsdp_sharding_strategy goes unread
        if not isinstance(value, bool):
            raise ValueError("fsdp_version 2 takes true or false, as accelerate does")
        return {"strategy.sharding_strategy": fsdp2_sharding(file, value)}, "fsdp_version 2's form"
    if not isinstance(value, bool):  # the form accelerate's questionnaire writes for version 1: a strategy's name
        return sharding_strategy(value, file)
    given = file["fsdp_config"].get("fsdp_sharding_strategy")
    if given is None:
        return {"strategy.sharding_strategy": "FULL_SHARD" if value else "SHARD_GRAD_OP"}, "FSDP2's form"
    name = named(given, SHARDING_STRATEGIES)
    if name != "NO_SHARD" and value != ShardingStrategy(name).reshards_after_forward:
        raise ValueError(f"contradicts fsdp_sharding_strategy: {name}")
    return {}, f"no meaning here: fsdp_sharding_strategy: {name} says it already"


def fsdp_version(value: Any, file: dict) -> tuple[Settings, str]:
    if str(value) not in ("1", "2"):
        raise ValueError("choose 1 or 2")
    if int(value) == 2:
        return {}, (
            "no meaning here: the runner's FSDP is FSDP2 (fully_shard); the keys are read as accelerate's "
            "fsdp_version 2 reads them"
        )
    return {}, "no meaning here: the runner's FSDP is FSDP2 (fully_shard); the keys keep FSDP1's meaning"


def ignored_modules(value: Any, file: dict) -> tuple[Settings, str]:
    if value in (None, "", []):
        return {}, "no meaning here: no module is left out of sharding"
    raise ValueError("the runner shards every module of the model; it has no modules to leave unsharded")


def auto_wrap_policy(file: dict) -> str:
    """The file's policy, or the runner's default, which the recipe then keeps."""
    return named(
        file["fsdp_config"].get("fsdp_auto_wrap_policy", STRATEGIES["fsdp"]().auto_wrap_policy.value),
        [p.value for p in AutoWrapPolicy],
    )


def layer_classes(value: Any, file: dict) -> tuple[Settings, str]:
    if auto_wrap_policy(file) != "TRANSFORMER_BASED_WRAP":
        return {}, "no meaning here: fsdp_auto_wrap_policy is not TRANSFORMER_BASED_WRAP"
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) and n.strip() for n in names):
        raise ValueError("must be class names separated by commas")
    return {"strategy.transformer_layer_cls": [n.strip() for n in names]}, ""


def min_num_params(value: Any, file: dict) -> tuple[Settings, str]:
    if auto_wrap_policy(file) != "SIZE_BASED_WRAP":
        return {}, "no meaning here: fsdp_auto_wrap_policy is not SIZE_BASED_WRAP"
    return {"strategy.min_num_params": count(value, 1)}, ""


def state_dict_type(value: Any, file: dict) -> tuple[Settings, str]:
    name = named(value, STATE_DICT_TYPES)
    if name == "LOCAL_STATE_DICT":
        return {"strategy.state_dict_type": StateDictType.SHARDED.value}, (
            "each rank writes its own shards, as LOCAL_STATE_DICT, and they resume on any layout"
        )
    return {"strategy.state_dict_type": name.removesuffix("_STATE_DICT")}, ""


def backward_prefetch(value: Any, file: dict) -> tuple[Settings, str]:
    name = named(value, BACKWARD_PREFETCH)
    if name == "NO_PREFETCH":
        return {"strategy.backward_prefetch": 0}, "no block's all-gather is issued early"
    if name == "BACKWARD_POST":
        return {"strategy.backward_prefetch": 1}, (
            "FSDP2 issues the next block's all-gather as a block's backward starts, as BACKWARD_PRE does; it has no "
            "later point to issue it, so the one-block prefetch is the nearest"
        )
    return {"strategy.backward_prefetch": 1}, "the next block's all-gather is issued before this block's gradients"


def forward_prefetch(value: Any, file: dict) -> tuple[Settings, str]:
    return {"strategy.forward_prefetch": int(flag(value))}, "one block ahead" if value else ""


def checkpointing_offload(value: Any, file: dict) -> tuple[Settings, str]:
    if flag(value):
        raise ValueError(
            "the runner does not offload activations to the CPU; fsdp_activation_checkpointing recomputes them instead"
        )
    return {}, "no meaning here: activations are not offloaded"


def cpu_ram_efficient_loading(value: Any, file: dict) -> tuple[Settings, str]:
    if not flag(value):
        return {"strategy.cpu_ram_efficient_loading": False}, ""
    if fsdp_version_of(file) == 1 and file["fsdp_config"].get("fsdp_sync_module_states") is False:
        raise ValueError(
            "needs fsdp_sync_module_states: true, as accelerate says: the other ranks get their weights from rank 0"
        )
    return {"strategy.cpu_ram_efficient_loading": True, "strategy.sync_module_states": True}, (
        "rank 0 loads the weights and sends them to the others"
    )


VERSION_2_PREFETCH = "FSDP2 issues the next block's all-gather early in backward, the runner's default"

FSDP_KEYS: dict[str, Handler] = {
    "fsdp_version": fsdp_version,
    "fsdp_sharding_strategy": under_version_1(
        sharding_strategy,
        (
            "fsdp_reshard_after_forward decides: sharding across all processes, resharded after forward or not (the "
            "runner's hybrid mesh is strategy.sharding_strategy=HYBRID_SHARD)"
        ),
    ),
    "fsdp_reshard_after_forward": reshard_after_forward,
    "fsdp_auto_wrap_policy": lambda value, file: ({"strategy.auto_wrap_policy": auto_wrap_policy(file)}, ""),
    "fsdp_transformer_layer_cls_to_wrap": layer_classes,
    "fsdp_min_num_params": min_num_params,
    "fsdp_offload_params": setting("strategy.offload_params"),
    "fsdp_cpu_ram_efficient_loading": cpu_ram_efficient_loading,
    "fsdp_sync_module_states": under_version_1(
        setting("strategy.sync_module_states"),
        ("rank 0's weights reach the others' shards whenever fsdp_cpu_ram_efficient_loading is on"),
    ),
    "fsdp_activation_checkpointing": setting("strategy.activation_checkpointing"),
    "fsdp_activation_checkpointing_offload": checkpointing_offload,
    "fsdp_state_dict_type": state_dict_type,
    "fsdp_backward_prefetch": under_version_1(backward_prefetch, VERSION_2_PREFETCH),
    # The name accelerate's FSDP guide and PEFT's docs still give fsdp_backward_prefetch; accelerate no longer reads it.
    "fsdp_backward_prefetch_policy": under_version_1(backward_prefetch, VERSION_2_PREFETCH),
    "fsdp_forward_prefetch": under_version_1(forward_prefetch, "no block's all-gather is issued early in forward"),
    "fsdp_use_orig_params": no_meaning("FSDP2 always keeps the original parameters (each sharded as a DTensor)"),
    "fsdp_ignored_modules": ignored_modules,
}


def offload_device(key: str) -> Handler:
    def handler(value: Any, file: dict) -> tuple[Settings, str]:
        devices = [d.value for d in OffloadDevice]
        if str(value).lower() not in devices:
            raise ValueError(f"choose one of {', '.join(devices)}")
        return {key: str(value).lower()}, ""

    return handler


def nvme_path(device_key: str) -> Handler:
    def handler(value: Any, file: dict) -> tuple[Settings, str]:
        if str(file["deepspeed_config"].get(device_key, "none")).lower() != "nvme":
            return {}, f"no meaning here: {device_key} is not nvme"
        if device_key == "offload_param_device" and zero_stage_of(file) < 3:
            return {}, f"no meaning here: {PARAM_OFFLOAD_BELOW_3}"
        return {"strategy.nvme_path": str(value)}, ""

    return handler


def zero_stage_of(file: dict) -> int:
    return file["deepspeed_config"].get("zero_stage", STRATEGIES["deepspeed"]().zero_stage)


PARAM_OFFLOAD_BELOW_3 = "DeepSpeed offloads parameters at ZeRO-3 only and ignores the setting at lower stages"


def offload_param(value: Any, file: dict) -> tuple[Settings, str]:
    assigned, _ = offload_device("strategy.offload_param")(value, file)
    if assigned["strategy.offload_param"] != "none" and zero_stage_of(file) < 3:
        return {}, f"dropped: {PARAM_OFFLOAD_BELOW_3} (zero_stage: {zero_stage_of(file)})"
    return assigned, ""


def config_file(value: Any, file: dict) -> tuple[Settings, str]:
    """Read from where `accelerate launch` runs, as accelerate reads it; the recipe names it wherever it runs."""
    path = Path(str(value)).expanduser()
    return {"strategy.config_file": str(path.resolve()) if path.is_file() else str(value)}, (
        'its ZeRO stage, offload and precision blocks are read into the spec and its "auto" values filled from '
        "it, as the Trainer does; a value that contradicts the spec is refused"
    )


def zero_stage(value: Any, file: dict) -> tuple[Settings, str]:
    if value not in (0, 1, 2, 3) or isinstance(value, bool):
        raise ValueError("choose 0, 1, 2 or 3")
    return {"strategy.zero_stage": value}, ""


def zero3_init(value: Any, file: dict) -> tuple[Settings, str]:
    if flag(value):
        return {}, (
            "no meaning here: each process builds the whole model and DeepSpeed partitions it; "
            "`run task=estimate` counts that loading peak"
        )
    return {}, "no meaning here: each process builds the whole model and DeepSpeed partitions it"


def moe_layers(value: Any, file: dict) -> tuple[Settings, str]:
    raise ValueError("the runner does not mark MoE layers as ZeRO-3 leaf modules")


def sequence_parallel_reduce(value: Any, file: dict) -> tuple[Settings, str]:
    """Under sequence parallelism DeepSpeed reduces the gradients in this dtype, not communication_data_type's."""
    if count(parallel_sizes(file).get("sp_size", 1), 1) == 1:
        return {}, "no meaning here: DeepSpeed reads it under sequence parallelism (sp_size > 1) only"
    if value not in ("fp32", "bf16", "fp16"):
        raise ValueError("choose fp32, bf16 or fp16")
    return {"precision.reduce_dtype": value}, "the gradients' reduction under sequence parallelism"


LAUNCHER = no_meaning(
    "the runner starts each node's processes itself (hardware.node_rank, hardware.rdzv_endpoint), with no hostfile"
)

DEEPSPEED_KEYS: dict[str, Handler] = {
    "deepspeed_config_file": config_file,
    "zero_stage": zero_stage,
    "offload_optimizer_device": offload_device("strategy.offload_optimizer"),
    "offload_param_device": offload_param,
    "offload_optimizer_nvme_path": nvme_path("offload_optimizer_device"),
    "offload_param_nvme_path": nvme_path("offload_param_device"),
    "gradient_accumulation_steps": lambda value, file: ({"train.grad_accum_steps": count(value, 1)}, ""),
    "gradient_clipping": lambda value, file: ({"train.max_grad_norm": float(value)}, ""),
    "zero3_init_flag": zero3_init,
    "zero3_save_16bit_model": no_meaning(
        "the runner saves the final model gathered from the partitions (train.save_model)"
    ),
    "deepspeed_moe_layer_cls_names": moe_layers,
    "seq_parallel_communication_data_type": sequence_parallel_reduce,
    **{
        key: LAUNCHER
        for key in (
            "deepspeed_hostfile",
            "deepspeed_multinode_launcher",
            "deepspeed_inclusion_filter",
            "deepspeed_exclusion_filter",
        )
    },
}


def fp8_backend(value: Any, file: dict) -> tuple[Settings, str]:
    name = str(value).upper()
    if name not in FP8_BACKENDS:
        raise ValueError("the runner's fp8 backends are AO (torchao) and TE (Transformer Engine)")
    return {"precision.fp8.backend": FP8_BACKENDS[name]}, ""


def te_only(handler: Handler) -> Handler:
    """A Transformer Engine setting: accelerate's AO backend does not read it."""

    def handled(value: Any, file: dict) -> tuple[Settings, str]:
        if not transformer_engine(file):
            return {}, "no meaning here: a Transformer Engine setting, which accelerate's AO backend does not read"
        return handler(value, file)

    return handled


def fp8_format(value: Any, file: dict) -> tuple[Settings, str]:
    name = str(value).upper()
    if name == "E5M2":
        raise ValueError("Transformer Engine refuses pure E5M2 training; HYBRID has E5M2 gradients")
    if name not in ("HYBRID", "E4M3"):
        raise ValueError("choose HYBRID or E4M3")
    return {"precision.fp8.format": name.lower()}, ""


def amax_algorithm(value: Any, file: dict) -> tuple[Settings, str]:
    if str(value) not in ("max", "most_recent"):
        raise ValueError("choose max or most_recent")
    return {"precision.fp8.amax_compute_algo": str(value)}, ""


def linear_precision(value: Any, file: dict) -> tuple[Settings, str]:
    overrides = (
        value
        if isinstance(value, list)
        else [part.strip().lower() == "true" for part in str(value).strip("()").split(",")]
    )
    if any(overrides):
        raise ValueError("the runner runs every fp8 layer's three matmuls in fp8")
    return {}, "no meaning here: no matmul is kept in higher precision, as the runner does"


FP8_KEYS: dict[str, Handler] = {
    "fp8_backend": fp8_backend,
    "fp8_enable_fsdp_float8_all_gather": setting("precision.fp8.all_gather"),
    "fp8_pad_inner_dim": no_meaning(
        "the runner always pads, since a micro batch's token count is an inner dimension "
        "of the weight gradient; layers whose sizes are not multiples of 16 stay in bf16 "
        "(precision.fp8.min_features)"
    ),
    **{f"fp8_{key}": no_meaning("an MS-AMP setting") for key in ("optimization_level", "opt_level")},
    "fp8_format": te_only(fp8_format),
    **{
        f"fp8_{key}": te_only(lambda value, file: ({"precision.fp8.amax_history_len": count(value, 1)}, ""))
        for key in ("amax_history_len", "amax_history_length")
    },
    **{f"fp8_{key}": te_only(amax_algorithm) for key in ("amax_compute_algo", "amax_compute_algorithm")},
    "fp8_margin": te_only(lambda value, file: ({"precision.fp8.margin": count(value, 0)}, "")),
    "fp8_interval": no_meaning("Transformer Engine no longer reads it (its scale is updated every step)"),
    "fp8_override_linear_precision": te_only(linear_precision),
    "fp8_use_autocast_during_eval": no_meaning("the runner evaluates as it trains, in fp8"),
}

# A section's keys, when the section is read, and the prefix accelerate adds to a key given without it.
SECTIONS: dict[str, tuple[dict[str, Handler], Callable[[dict], str], str]] = {
    "fsdp_config": (
        FSDP_KEYS,
        lambda file: (
            "" if file["distributed_type"] == "FSDP" else f"distributed_type is {file['distributed_type']}, not FSDP"
        ),
        "fsdp_",
    ),
    "deepspeed_config": (
        DEEPSPEED_KEYS,
        lambda file: (
            ""
            if file["distributed_type"] == "DEEPSPEED"
            else f"distributed_type is {file['distributed_type']}, not DEEPSPEED"
        ),
        "",
    ),
    "fp8_config": (
        FP8_KEYS,
        lambda file: "" if mixed_precision(file) == "fp8" else "mixed_precision is not fp8",
        "fp8_",
    ),
}
