"""accelerate config files, both ways.

`run --from-accelerate <file> [<name>]` turns an `accelerate config` YAML into a recipe in ./recipes and prints,
for every key of the file, the spec keys it became or why it has no meaning here; a key the runner cannot honour
is an error and nothing is written. `run --to-accelerate [overrides]` prints the accelerate config of the
composed spec, and on stderr what of the spec such a file cannot say.

Key names and values are those `accelerate config` writes and `accelerate launch` reads. FSDP keys are read in
FSDP1's vocabulary, which the runner's FSDP2 strategy keeps (runner/strategy.py), and written back in it.
"""

from __future__ import annotations

import re
from dataclasses import fields
from enum import Enum
from pathlib import Path
from typing import Any, Callable

import yaml

from runner.hardware import Accelerator, HardwareConfig
from runner.precision import Dtype, Float8Backend, PrecisionConfig
from runner.spec import SCHEMAS, RunSpec, SpecError
from runner.strategy import (
    AutoWrapPolicy,
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    OffloadDevice,
    ShardingStrategy,
    SingleStrategy,
    StateDictType,
    hybrid_group_size,
)
from runner.train import TrainConfig

# Spec keys ("strategy.zero_stage") and chosen options ("strategy": "deepspeed") that keys of the file set.
Settings = dict[str, Any]
# A key's handler: (its value, the whole file) -> (what it sets, a note); ValueError when it cannot be converted.
Handler = Callable[[Any, dict], tuple[Settings, str]]

STRATEGIES = {"NO": "single", "MULTI_CPU": "ddp", "MULTI_GPU": "ddp", "FSDP": "fsdp", "DEEPSPEED": "deepspeed"}
PRECISIONS = {"no": "fp32", "fp16": "fp16", "bf16": "bf16", "fp8": "fp8"}
# accelerate's own orders: a file may give a value as its 1-based position in the list.
SHARDING_STRATEGIES = [s.value for s in ShardingStrategy]
BACKWARD_PREFETCH = ["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"]
STATE_DICT_TYPES = ["FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"]
FP8_BACKENDS = {"AO": Float8Backend.torchao.value, "TE": Float8Backend.transformer_engine.value}
DEFAULT_PORT = 29500  # accelerate's (and torchrun's) main_process_port
NO_RESHARD = (ShardingStrategy.SHARD_GRAD_OP.value, ShardingStrategy.HYBRID_SHARD_ZERO2.value)
SECTION_ORDER = ["hardware", "strategy", "precision", "train"]


# ---- reading values ----

def shown(value: Any) -> str:
    """A value as the YAML file has it."""
    if isinstance(value, (bool, type(None), dict, list)):
        return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()
    return str(value)


def flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


def count(value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"must be a whole number >= {minimum}")
    return value


def named(value: Any, names: list[str]) -> str:
    """A value given by name (any case) or by its 1-based position in accelerate's list of names."""
    if isinstance(value, str) and value.upper() in names:
        return value.upper()
    if not isinstance(value, bool) and str(value).isdigit() and 1 <= int(value) <= len(names):
        return names[int(value) - 1]
    raise ValueError(f"choose one of {', '.join(names)} (or 1 to {len(names)})")


def mixed_precision(file: dict) -> str:
    value = file.get("mixed_precision")
    if value is None:
        return "fp16" if file.get("fp16") is True else "no"
    return str(value).lower()


def accelerator(file: dict) -> str:
    if file.get("use_cpu") is True or file["distributed_type"] == "MULTI_CPU":
        return "cpu"
    return "auto" if file["distributed_type"] == "NO" else "cuda"


def no_meaning(reason: str) -> Handler:
    return lambda value, file: ({}, f"no meaning here: {reason}")


# ---- top-level keys ----

def compute_environment(value: Any, file: dict) -> tuple[Settings, str]:
    if value != "LOCAL_MACHINE":
        raise ValueError("the runner starts its processes on the machines it runs on; SageMaker jobs are not supported")
    return {}, "no meaning here: the runner starts its processes itself, on this machine (or on each node)"


def distributed_type(value: Any, file: dict) -> tuple[Settings, str]:
    where = accelerator(file)
    settings = {"strategy": STRATEGIES[value], "hardware": "auto" if where == "cuda" else where}
    if value == "NO":
        settings["hardware.nproc_per_node"] = 1
    if where == "cuda":
        settings["hardware.accelerator"] = "cuda"
        return settings, "the GPUs' model and memory are read from the machine the run starts on"
    if where == "auto":
        return settings, "a GPU when the machine has one, else the CPU, as accelerate"
    return settings, "gloo between CPU processes" if value != "NO" else ""


def num_processes(value: Any, file: dict) -> tuple[Settings, str]:
    if value == -1:
        return {}, ("no meaning here: -1 leaves the count to the launcher; hardware.nproc_per_node stays unset: "
                    "one process per GPU of the machine")
    machines = count(file.get("num_machines", 1), 1)
    if count(value, 1) % machines:
        raise ValueError(f"{value} processes do not split evenly over num_machines: {machines}")
    note = f"{value} processes over {machines} machines" if machines > 1 else ""
    return {"hardware.nproc_per_node": value // machines}, note


def machine_rank(value: Any, file: dict) -> tuple[Settings, str]:
    note = "each node runs with its own" if file.get("num_machines", 1) != 1 else ""
    return {"hardware.node_rank": count(value, 0)}, note


def main_process_ip(value: Any, file: dict) -> tuple[Settings, str]:
    if value is None:
        return {}, "no meaning here: unset"
    port = file.get("main_process_port") or DEFAULT_PORT
    return {"hardware.rdzv_endpoint": f"{value}:{count(port, 1)}"}, "where the nodes' processes meet"


def main_process_port(value: Any, file: dict) -> tuple[Settings, str]:
    if file.get("main_process_ip"):
        return main_process_ip(file["main_process_ip"], file)
    return {}, ("no meaning here: without main_process_ip the processes meet on this machine, on a free port the "
                "runner picks")


def gpu_ids(value: Any, file: dict) -> tuple[Settings, str]:
    if value in (None, "all"):
        return {}, "no meaning here: the runner uses the machine's GPUs, as many as hardware.nproc_per_node"
    return {}, f"not in the spec: set CUDA_VISIBLE_DEVICES={value} when you run it to choose these GPUs"


def use_cpu(value: Any, file: dict) -> tuple[Settings, str]:
    if flag(value):
        return {"hardware": "cpu"}, ""
    return {}, "no meaning here: distributed_type says where the run goes"


def precision(value: Any, file: dict) -> tuple[Settings, str]:
    name = mixed_precision(file)
    if name not in PRECISIONS:
        raise ValueError(f"choose one of {', '.join(PRECISIONS)}")
    note = ""
    if name in ("fp16", "bf16") and file["distributed_type"] == "FSDP":
        note = (f"gradients are reduced in fp32, where accelerate's FSDP reduces them in {name}: "
                f"precision.reduce_dtype={name} does that")
    if name == "fp8":
        note = "torchao float8 matmuls in the large linear layers, bf16 elsewhere; fp8_config below"
    return {"precision": PRECISIONS[name]}, note


def legacy_fp16(value: Any, file: dict) -> tuple[Settings, str]:
    if not flag(value) or "mixed_precision" in file:
        return {}, "no meaning here: the old form of mixed_precision, which the file gives"
    return {"precision": "fp16"}, "the old form of mixed_precision: fp16"


def dynamo(value: Any, file: dict) -> tuple[Settings, str]:
    backend = value.get("dynamo_backend") if isinstance(value, dict) else value
    if backend in (None, "NO", "no"):
        return {}, "no meaning here: no torch.compile"
    return {}, "no meaning here: the runner does not torch.compile the model; the same run trains uncompiled"


def parallelism(value: Any, file: dict) -> tuple[Settings, str]:
    if value:
        raise ValueError("the runner has no tensor, context or sequence parallelism; FSDP's replicate x shard mesh "
                         "comes from strategy.sharding_strategy (HYBRID_SHARD, strategy.hybrid_shard_size)")
    return {}, "no meaning here: empty"


TPU = no_meaning("a TPU pod's setting; the runner trains on CPUs and CUDA GPUs")

KEYS: dict[str, Handler] = {
    "compute_environment": compute_environment,
    "distributed_type": distributed_type,
    "num_processes": num_processes,
    "num_machines": lambda value, file: ({"hardware.nnodes": count(value, 1)}, ""),
    "machine_rank": machine_rank,
    "main_process_ip": main_process_ip,
    "main_process_port": main_process_port,
    "rdzv_backend": no_meaning("the runner's launcher meets at hardware.rdzv_endpoint with static rendezvous "
                               "(fixed node ranks, hardware.node_rank)"),
    "same_network": no_meaning("the nodes meet at hardware.rdzv_endpoint, whatever their network"),
    "gpu_ids": gpu_ids,
    "use_cpu": use_cpu,
    "mixed_precision": precision,
    "fp16": legacy_fp16,
    "downcast_bf16": no_meaning("a TPU setting"),
    "debug": no_meaning("the runner checks the spec before it launches, and a failing rank's error leads its report"),
    "enable_cpu_affinity": no_meaning("the runner leaves its processes' CPU affinity to the operating system"),
    "main_training_function": no_meaning("the runner's training loop is its own"),
    "dynamo_config": dynamo,
    "dynamo_backend": dynamo,
    "megatron_lm_config": no_meaning("Megatron-LM's settings, read with distributed_type MEGATRON_LM only"),
    "mpirun_config": no_meaning("the runner starts CPU processes through torch's elastic launcher, not mpirun"),
    "parallelism_config": parallelism,
    **{key: TPU for key in ("tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands",
                            "tpu_vm", "tpu_env")},
}


# ---- fsdp_config ----

def sharding_strategy(value: Any, file: dict) -> tuple[Settings, str]:
    return {"strategy.sharding_strategy": named(value, SHARDING_STRATEGIES)}, ""


def reshard_after_forward(value: Any, file: dict) -> tuple[Settings, str]:
    if not isinstance(value, bool):  # FSDP1's form: a sharding strategy
        return sharding_strategy(value, file)
    given = file["fsdp_config"].get("fsdp_sharding_strategy")
    if given is None:
        return {"strategy.sharding_strategy": "FULL_SHARD" if value else "SHARD_GRAD_OP"}, "FSDP2's form"
    name = named(given, SHARDING_STRATEGIES)
    if name != "NO_SHARD" and value == (name in NO_RESHARD):
        raise ValueError(f"contradicts fsdp_sharding_strategy: {name}")
    return {}, f"no meaning here: fsdp_sharding_strategy: {name} says it already"


def fsdp_version(value: Any, file: dict) -> tuple[Settings, str]:
    if value not in (1, 2):
        raise ValueError("choose 1 or 2")
    return {}, "no meaning here: the runner's FSDP is FSDP2 (fully_shard); the keys keep FSDP1's meaning"


def auto_wrap_policy(file: dict) -> str:
    """The file's policy, or the runner's default, which the recipe then keeps."""
    return named(file["fsdp_config"].get("fsdp_auto_wrap_policy", FSDPStrategy.auto_wrap_policy.value),
                 [p.value for p in AutoWrapPolicy])


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
            "each rank writes its own shards and resumes on the same number of processes, as LOCAL_STATE_DICT")
    return {"strategy.state_dict_type": name.removesuffix("_STATE_DICT")}, ""


def backward_prefetch(value: Any, file: dict) -> tuple[Settings, str]:
    name = named(value, BACKWARD_PREFETCH)
    if name == "NO_PREFETCH":
        return {"strategy.backward_prefetch": 0}, "no block's all-gather is issued early"
    if name == "BACKWARD_POST":
        return {"strategy.backward_prefetch": 1}, (
            "FSDP2 issues the next block's all-gather as a block's backward starts, as BACKWARD_PRE does; it has no "
            "later point to issue it, so the one-block prefetch is the nearest")
    return {"strategy.backward_prefetch": 1}, "the next block's all-gather is issued before this block's gradients"


def forward_prefetch(value: Any, file: dict) -> tuple[Settings, str]:
    return {"strategy.forward_prefetch": int(flag(value))}, "one block ahead" if value else ""


def checkpointing_offload(value: Any, file: dict) -> tuple[Settings, str]:
    if flag(value):
        raise ValueError("the runner does not offload activations to the CPU; fsdp_activation_checkpointing "
                         "recomputes them instead")
    return {}, "no meaning here: activations are not offloaded"


def setting(key: str) -> Handler:
    return lambda value, file: ({key: flag(value)}, "")


FSDP_KEYS: dict[str, Handler] = {
    "fsdp_version": fsdp_version,
    "fsdp_sharding_strategy": sharding_strategy,
    "fsdp_reshard_after_forward": reshard_after_forward,
    "fsdp_auto_wrap_policy": lambda value, file: ({"strategy.auto_wrap_policy": auto_wrap_policy(file)}, ""),
    "fsdp_transformer_layer_cls_to_wrap": layer_classes,
    "fsdp_min_num_params": min_num_params,
    "fsdp_offload_params": setting("strategy.offload_params"),
    "fsdp_cpu_ram_efficient_loading": setting("strategy.cpu_ram_efficient_loading"),
    "fsdp_sync_module_states": setting("strategy.sync_module_states"),
    "fsdp_activation_checkpointing": setting("strategy.activation_checkpointing"),
    "fsdp_activation_checkpointing_offload": checkpointing_offload,
    "fsdp_state_dict_type": state_dict_type,
    "fsdp_backward_prefetch": backward_prefetch,
    "fsdp_forward_prefetch": forward_prefetch,
    "fsdp_use_orig_params": no_meaning("FSDP2 always keeps the original parameters (each sharded as a DTensor)"),
}


# ---- deepspeed_config ----

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
        return {"strategy.nvme_path": str(value)}, ""
    return handler


def zero_stage(value: Any, file: dict) -> tuple[Settings, str]:
    if value not in (0, 1, 2, 3) or isinstance(value, bool):
        raise ValueError("choose 0, 1, 2 or 3")
    return {"strategy.zero_stage": value}, ""


def zero3_init(value: Any, file: dict) -> tuple[Settings, str]:
    if flag(value):
        return {}, ("no meaning here: each process builds the whole model and DeepSpeed partitions it; "
                    "`run task=estimate` counts that loading peak")
    return {}, "no meaning here: each process builds the whole model and DeepSpeed partitions it"


def moe_layers(value: Any, file: dict) -> tuple[Settings, str]:
    raise ValueError("the runner does not mark MoE layers as ZeRO-3 leaf modules")


LAUNCHER = no_meaning("the runner starts each node's processes itself (hardware.node_rank, hardware.rdzv_endpoint), "
                      "with no hostfile")

DEEPSPEED_KEYS: dict[str, Handler] = {
    "deepspeed_config_file": lambda value, file: ({"strategy.config_file": str(value)}, (
        "its keys are added to the config the runner makes from the spec; one that contradicts the spec is an "
        "error at launch")),
    "zero_stage": zero_stage,
    "offload_optimizer_device": offload_device("strategy.offload_optimizer"),
    "offload_param_device": offload_device("strategy.offload_param"),
    "offload_optimizer_nvme_path": nvme_path("offload_optimizer_device"),
    "offload_param_nvme_path": nvme_path("offload_param_device"),
    "gradient_accumulation_steps": lambda value, file: ({"train.grad_accum_steps": count(value, 1)}, ""),
    "gradient_clipping": lambda value, file: ({"train.max_grad_norm": float(value)}, ""),
    "zero3_init_flag": zero3_init,
    "zero3_save_16bit_model": no_meaning("the runner saves the final model gathered from the partitions "
                                         "(train.save_model)"),
    "deepspeed_moe_layer_cls_names": moe_layers,
    **{key: LAUNCHER for key in ("deepspeed_hostfile", "deepspeed_multinode_launcher", "deepspeed_inclusion_filter",
                                 "deepspeed_exclusion_filter")},
}


# ---- fp8_config ----

def fp8_backend(value: Any, file: dict) -> tuple[Settings, str]:
    name = str(value).upper()
    if name not in FP8_BACKENDS:
        raise ValueError("the runner's fp8 backends are AO (torchao) and TE (Transformer Engine)")
    return {"precision.fp8.backend": FP8_BACKENDS[name]}, ""


TE_SCALING = no_meaning("a Transformer Engine scaling setting; the runner uses its fp8_autocast defaults")

FP8_KEYS: dict[str, Handler] = {
    "backend": fp8_backend,
    "enable_fsdp_float8_all_gather": setting("precision.fp8.all_gather"),
    "pad_inner_dim": no_meaning("the runner always pads, since a micro batch's token count is an inner dimension "
                                "of the weight gradient; layers whose sizes are not multiples of 16 stay in bf16 "
                                "(precision.fp8.min_features)"),
    "optimization_level": no_meaning("an MS-AMP setting"),
    **{key: TE_SCALING for key in ("use_autocast_during_eval", "margin", "interval", "fp8_format",
                                   "amax_history_length", "amax_history_len", "amax_compute_algorithm",
                                   "amax_compute_algo", "override_linear_precision")},
}

# A section's keys, and when the section is read.
SECTIONS: dict[str, tuple[dict[str, Handler], Callable[[dict], str]]] = {
    "fsdp_config": (FSDP_KEYS, lambda file: "" if file["distributed_type"] == "FSDP" else
                    f"distributed_type is {file['distributed_type']}, not FSDP"),
    "deepspeed_config": (DEEPSPEED_KEYS, lambda file: "" if file["distributed_type"] == "DEEPSPEED" else
                         f"distributed_type is {file['distributed_type']}, not DEEPSPEED"),
    "fp8_config": (FP8_KEYS, lambda file: "" if mixed_precision(file) == "fp8" else "mixed_precision is not fp8"),
}


# ---- an accelerate file to a recipe ----

def read(path: Path) -> dict:
    try:
        file = yaml.safe_load(path.read_text())
    except OSError as error:
        raise SpecError(f"cannot read the accelerate config {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise SpecError(f"{path} is not valid YAML: {' '.join(str(error).split())}") from None
    if not isinstance(file, dict):
        raise SpecError(f"{path} is not an accelerate config: it must be a mapping of keys")
    return file


def convert(file: dict) -> tuple[Settings, list[str]]:
    """What the file's keys set, and one line per key on how it was mapped (a section's keys indented below it)."""
    # YAML 1.1 reads an unquoted NO or no as false.
    for key, word in (("distributed_type", "NO"), ("mixed_precision", "no")):
        if file.get(key) is False:
            file[key] = word
    if "distributed_type" not in file:
        raise SpecError("no distributed_type: an accelerate config names one (NO, MULTI_GPU, FSDP, ...)")
    if file["distributed_type"] not in STRATEGIES:
        raise SpecError(f"distributed_type: {shown(file['distributed_type'])} cannot be expressed here: the "
                        f"runner has {', '.join(STRATEGIES)} (one process, CPU processes, CUDA GPUs, FSDP and "
                        "DeepSpeed)")
    settings: Settings = {}
    origins: dict[str, str] = {}
    lines: list[str] = []
    for key, value in file.items():
        if key not in SECTIONS:
            lines.append(mapped(key, key, value, KEYS, file, settings, origins))
            continue
        table, unread = SECTIONS[key]
        if not isinstance(value, dict):
            raise SpecError(f"{key}: {shown(value)} must be a mapping of keys")
        if not value:
            lines.append(f"{key}: {{}} -> no meaning here: empty")
            continue
        if unread(file):
            lines.append(f"{key}:")
            lines += [f"  {inner}: {shown(v)} -> no meaning here: {unread(file)}" for inner, v in value.items()]
            continue
        lines.append(f"{key}:")
        lines += ["  " + mapped(inner, f"{key}.{inner}", v, table, file, settings, origins)
                  for inner, v in value.items()]
    strategy = SCHEMAS["strategy"][settings["strategy"]]()
    unset = [f"strategy.{f.name}={shown(plain(getattr(strategy, f.name)))}" for f in fields(strategy)
             if f"strategy.{f.name}" not in settings]
    if unset:
        lines.append(f"not in the file, the runner's defaults: {', '.join(unset)}")
    return settings, lines


def plain(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


def mapped(key: str, full_key: str, value: Any, table: dict[str, Handler], file: dict, settings: Settings,
           origins: dict[str, str]) -> str:
    """Applies one key of the file to the settings; its line."""
    if key not in table:
        raise SpecError(f"unknown key {full_key}: not a key of accelerate's config files that the runner knows")
    try:
        assigned, note = table[key](value, file)
    except ValueError as why:
        raise SpecError(f"{full_key}: {shown(value)} cannot be converted: {why}") from None
    for spec_key, spec_value in assigned.items():
        if settings.get(spec_key, spec_value) != spec_value:
            raise SpecError(f"{origins[spec_key]} and {full_key} disagree: one means "
                            f"{spec_key}={shown(settings[spec_key])}, the other {spec_key}={shown(spec_value)}")
        settings[spec_key] = spec_value
        origins.setdefault(spec_key, full_key)
    if not assigned:
        return f"{key}: {shown(value)} -> {note}"
    assignments = ", ".join(f"{k}={shown(v)}" for k, v in assigned.items())
    return f"{key}: {shown(value)} -> {assignments}" + (f" ({note})" if note else "")


def recipe_text(settings: Settings, source: Path, name: str) -> str:
    choices = {group: settings.get(group, default)
               for group, default in (("hardware", "auto"), ("strategy", "single"), ("precision", "fp32"))}
    header = [
        "# @package _global_",
        f"# {description(settings, choices)}, converted from the accelerate config {source.name}",
        "#",
        f"#   run recipe={name} model=pretrained model.pretrained=<hub name or directory> data=text_files "
        "data.files=<files>",
        "#",
        "# The accelerate file says how the run is spread over processes and devices; the model, data, optimizer",
        "# and steps are the runner's defaults until they are set here or on the command line.",
    ]
    if settings.get("hardware.accelerator") == "cuda":
        header += [
            "# The GPUs' model and memory are read from the machine the run starts on. Elsewhere,",
            f"# `run task=estimate recipe={name}` checks the fit once hardware.device_memory_gib=<GiB per GPU> is set",
            "# (or choose a hardware option such as 8xh100_80gb instead of auto).",
        ]
    header += ["defaults:", *[f"  - override /{group}: {option}" for group, option in choices.items()]]
    schemas = {"hardware": HardwareConfig, "strategy": SCHEMAS["strategy"][choices["strategy"]],
               "precision": PrecisionConfig, "train": TrainConfig}
    sections = []
    for section in SECTION_ORDER:
        values = {key.split(".", 1)[1]: value for key, value in settings.items() if key.startswith(f"{section}.")}
        if values:
            order = [f.name for f in fields(schemas[section])]
            ordered = sorted(values.items(), key=lambda item: order.index(item[0].split(".")[0]))
            sections.append(yaml.safe_dump({section: nested(ordered)}, sort_keys=False))
    return "\n".join(header) + "\n\n" + "\n".join(sections)


def nested(items: list[tuple[str, Any]]) -> dict:
    """{"fp8.backend": x} as {"fp8": {"backend": x}}."""
    tree: dict = {}
    for key, value in items:
        *parents, leaf = key.split(".")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return tree


def description(settings: Settings, choices: dict[str, str]) -> str:
    strategy = {
        "single": "One process",
        "ddp": "DDP",
        "fsdp": f"FSDP {settings.get('strategy.sharding_strategy', FSDPStrategy.sharding_strategy.value)}",
        "deepspeed": f"DeepSpeed ZeRO-{settings.get('strategy.zero_stage', DeepSpeedStrategy.zero_stage)}",
    }[choices["strategy"]]
    if choices["strategy"] == "single":
        where = " on the CPU" if choices["hardware"] == "cpu" else ""
    else:
        devices = "CUDA GPUs" if settings.get("hardware.accelerator") == "cuda" else "CPU processes"
        nodes = settings.get("hardware.nnodes", 1)
        per_node = settings.get("hardware.nproc_per_node", "all the")
        where = f" on {f'{nodes} nodes x ' if nodes > 1 else ''}{per_node} {devices}"
    return f"{strategy}{where} in {choices['precision']}"


def write_recipe(source: Path, name: str | None) -> tuple[Path, list[str]]:
    """`run --from-accelerate`: ./recipes/<name>.yaml (never overwritten) and the mapping's lines."""
    name = name or source.stem
    if not re.fullmatch(r"\w[\w-]*", name):
        raise SpecError(f"{name} cannot name a recipe: use letters, digits, _ and -; "
                        f"run --from-accelerate {source} <recipe name>")
    target = Path("recipes") / f"{name}.yaml"
    if target.exists():
        raise SpecError(f"{target} exists already; give the recipe another name: run --from-accelerate {source} "
                        "<recipe name>")
    file = read(source)
    try:
        settings, lines = convert(file)
    except SpecError as error:
        raise SpecError(f"{source}: {error}") from None
    target.parent.mkdir(exist_ok=True)
    target.write_text(recipe_text(settings, source, name))
    return target, lines


# ---- a spec to an accelerate file ----

def accelerate_file(spec: RunSpec) -> tuple[str, list[str]]:
    """`run --to-accelerate`: the accelerate config YAML of a composed spec, and lines on what it cannot say."""
    hardware = planned_hardware(spec.hardware)
    strategy = spec.strategy
    on_cpu = hardware.accelerator is Accelerator.cpu
    notes: list[str] = []
    file: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": {SingleStrategy: "NO", DDPStrategy: "MULTI_CPU" if on_cpu else "MULTI_GPU",
                             FSDPStrategy: "FSDP", DeepSpeedStrategy: "DEEPSPEED"}[type(strategy)],
        "machine_rank": hardware.node_rank,
        "main_training_function": "main",
        "mixed_precision": precision_name(spec, notes),
        "num_machines": hardware.nnodes,
        "num_processes": hardware.world_size,
        "use_cpu": on_cpu,
    }
    if hardware.rdzv_endpoint:
        host, _, port = hardware.rdzv_endpoint.rpartition(":")
        file.update(main_process_ip=host, main_process_port=int(port), rdzv_backend="static")
    if isinstance(strategy, FSDPStrategy):
        file["fsdp_config"] = fsdp_section(strategy, hardware, notes)
    if isinstance(strategy, DeepSpeedStrategy):
        file["deepspeed_config"] = deepspeed_section(spec, notes)
    if isinstance(strategy, DDPStrategy) and strategy != DDPStrategy():
        notes.append(f"strategy.find_unused_parameters={shown(strategy.find_unused_parameters)}, "
                     f"strategy.bucket_cap_mb={strategy.bucket_cap_mb}: accelerate takes them in the script "
                     "(DistributedDataParallelKwargs)")
    if spec.precision.fp8:
        file["fp8_config"] = fp8_section(spec.precision, notes)
    described = [f"hardware.{key}={value}" for key in ("device_name", "device_memory_gib", "host_memory_gib",
                                                        "peak_bf16_tflops", "compute_capability")
                 if (value := getattr(spec.hardware, key))]
    if described:
        notes.append(f"{', '.join(described)}: what the spec says of the machine, for the memory estimate; "
                     "accelerate reads the machine it runs on")
    carried = " (but gradient accumulation and clipping, in deepspeed_config)" if "deepspeed_config" in file else ""
    notes.append(f"model, data, optim, scheduler, train, task, tracker and seed{carried}: the training script's "
                 "business under accelerate, not its config file's")
    return yaml.safe_dump(file, sort_keys=True), notes


def planned_hardware(declared: HardwareConfig) -> HardwareConfig:
    """The hardware as the spec declares it; what it leaves to detection is read from this machine."""
    from runner.hardware import cuda_device_count, detect

    if declared.accelerator is not Accelerator.auto and declared.nproc_per_node is not None:
        return declared
    if declared.accelerator is Accelerator.cuda and not cuda_device_count():
        raise SpecError("hardware.nproc_per_node is unset and this machine has no GPU to count; set it")
    return detect(declared)


def precision_name(spec: RunSpec, notes: list[str]) -> str:
    precision = spec.precision
    names = {Dtype.fp32: "no", Dtype.fp16: "fp16", Dtype.bf16: "bf16"}
    name = "fp8" if precision.fp8 else names[precision.compute_dtype]
    if precision.param_dtype is not Dtype.fp32:
        notes.append(f"precision.param_dtype={precision.param_dtype.value}: accelerate keeps fp32 weights under "
                     f"mixed precision; the file says {name}")
    # accelerate's FSDP reduces gradients in the mixed-precision dtype; DDP and DeepSpeed here in fp32.
    reduced = precision.compute_dtype if isinstance(spec.strategy, FSDPStrategy) else Dtype.fp32
    if precision.reduce_dtype is not reduced and precision.compute_dtype is not Dtype.fp32:
        notes.append(f"precision.reduce_dtype={precision.reduce_dtype.value}: accelerate reduces these gradients in "
                     f"{reduced.value}, and its file cannot choose otherwise")
    defaults = PrecisionConfig()
    if precision.compute_dtype is Dtype.fp16 and (
            (precision.initial_loss_scale, precision.loss_scale_growth_interval)
            != (defaults.initial_loss_scale, defaults.loss_scale_growth_interval)):
        notes.append(f"precision.initial_loss_scale={precision.initial_loss_scale:g}, precision.loss_scale_growth_"
                     f"interval={precision.loss_scale_growth_interval}: accelerate takes them in the script "
                     "(GradScalerKwargs)")
    return name


def fsdp_section(strategy: FSDPStrategy, hardware: HardwareConfig, notes: list[str]) -> dict[str, Any]:
    notes.append("fsdp_config is in FSDP1's form (accelerate's default fsdp_version 1), whose keys the runner's FSDP2 "
                 "takes; accelerate's fsdp_version 2 has no prefetch or sync_module_states keys")
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
    if strategy.hybrid and hybrid_group_size(strategy, hardware) != hardware.nproc_per_node:
        notes.append(f"strategy.sharding_strategy={strategy.sharding_strategy.value} shards within groups of "
                     f"{hybrid_group_size(strategy, hardware)} processes; accelerate's within each node")
    return section


def deepspeed_section(spec: RunSpec, notes: list[str]) -> dict[str, Any]:
    strategy = spec.strategy
    if strategy.config_file:
        notes.append(f"strategy.config_file: accelerate takes the whole DeepSpeed config from {strategy.config_file}; "
                     f"the runner adds the spec's to it: zero_stage={strategy.zero_stage}, offload_optimizer="
                     f"{strategy.offload_optimizer.value}, offload_param={strategy.offload_param.value}, gradient "
                     f"accumulation {spec.train.grad_accum_steps}, clipping {spec.train.max_grad_norm:g}")
        return {"deepspeed_config_file": strategy.config_file, "zero3_init_flag": False}
    section: dict[str, Any] = {
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
    return section


def fp8_section(precision: PrecisionConfig, notes: list[str]) -> dict[str, Any]:
    fp8 = precision.fp8
    notes.append(f"precision.fp8.recipe={fp8.recipe.value}, min_features={fp8.min_features}, skip={shown(fp8.skip)}, "
                 f"emulate={shown(fp8.emulate)}: accelerate's file has no such keys")
    backend = {value: name for name, value in FP8_BACKENDS.items()}[fp8.backend.value]
    return {"backend": backend, "enable_fsdp_float8_all_gather": fp8.all_gather}
