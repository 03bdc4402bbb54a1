"""The top-level keys of an accelerate config file, each with its handler."""

from __future__ import annotations

from typing import Any

from runner.tools.accelerate.values import (
    Handler,
    Settings,
    accelerator,
    count,
    flag,
    fsdp2_sharding,
    mixed_precision,
    no_meaning,
    parallel_sizes,
    transformer_engine,
)

# accelerate's distributed types and the strategy option each is here.
DISTRIBUTED_TYPES = {"NO": "single", "MULTI_CPU": "ddp", "MULTI_GPU": "ddp", "FSDP": "fsdp", "DEEPSPEED": "deepspeed"}
PRECISIONS = {"no": "fp32", "fp16": "fp16", "bf16": "bf16", "fp8": "fp8"}
DEFAULT_PORT = 29500  # accelerate's (and torchrun's) main_process_port


def compute_environment(value: Any, file: dict) -> tuple[Settings, str]:
    if value != "LOCAL_MACHINE":
        raise ValueError("the runner starts its processes on the machines it runs on; SageMaker jobs are not supported")
    return {}, "no meaning here: the runner starts its processes itself, on this machine (or on each node)"


def distributed_type(value: Any, file: dict) -> tuple[Settings, str]:
    where = accelerator(file)
    settings = {"strategy": DISTRIBUTED_TYPES[value], "hardware": "auto" if where == "cuda" else where}
    if value == "NO":
        settings["hardware.nproc_per_node"] = 1
    if where == "cuda":
        settings["hardware.accelerator"] = "cuda"
        return settings, "the GPUs' model and memory are read from the machine the run starts on"
    if where == "auto":
        return settings, "a GPU when the machine has one, else the CPU, as accelerate"
    return settings, "gloo between CPU processes" if value != "NO" else ""


def num_processes(value: Any, file: dict) -> tuple[Settings, str]:
    if file["distributed_type"] == "NO":
        return {}, "no meaning here: distributed_type NO runs one process, as accelerate does"
    if value == -1:
        return {}, (
            "no meaning here: -1 leaves the count to the launcher; hardware.nproc_per_node stays unset: "
            "one process per GPU of the machine"
        )
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
    return {}, (
        "no meaning here: without main_process_ip the processes meet on this machine, on a free port the runner picks"
    )


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
        note = (
            f"gradients are reduced in fp32, where accelerate's FSDP reduces them in {name}: "
            f"precision.reduce_dtype={name} does that"
        )
    if name == "fp8":
        backend = "Transformer Engine" if transformer_engine(file) else "torchao"
        note = f"{backend} float8 matmuls in the large linear layers, bf16 elsewhere; fp8_config below"
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
    """accelerate's ParallelismConfig: the data-parallel sizes are FSDP's hybrid mesh, tp_size and cp_size its
    tensor- and context-parallel dimensions (strategy.tp_size, strategy.cp_size); sp_size with sp_backend deepspeed
    DeepSpeed's Ulysses (strategy.sp_size)."""
    if not value:
        return {}, "no meaning here: empty"
    if not isinstance(value, dict):
        raise ValueError("must be a mapping of keys")
    sizes = parallel_sizes(file)
    if count(sizes.get("sp_size", 1), 1) > 1:
        return ulysses(value, sizes, file)
    replicate, shard = count(sizes.get("dp_replicate_size", 1), 1), count(sizes.get("dp_shard_size", 1), 1)
    cp, tp = count(sizes.get("cp_size", 1), 1), count(sizes.get("tp_size", 1), 1)
    if replicate == 1 and cp == 1 and tp == 1:
        return {}, "no meaning here: one replicate group, so sharding follows fsdp_config"
    if file["distributed_type"] != "FSDP":
        raise ValueError(
            "dp_replicate_size, cp_size and tp_size > 1 lay out FSDP's mesh; they need distributed_type FSDP"
        )
    settings: Settings = {f"strategy.{name}_size": size for name, size in (("cp", cp), ("tp", tp)) if size > 1}
    if replicate > 1:
        reshards = (file.get("fsdp_config") or {}).get("fsdp_reshard_after_forward", True) is not False
        settings.update(
            {"strategy.sharding_strategy": fsdp2_sharding(file, reshards), "strategy.hybrid_shard_size": shard}
        )
    shown = [
        (name, size)
        for name, size in (("dp_replicate", replicate), ("dp_shard", shard), ("cp", cp), ("tp", tp))
        if name not in ("cp", "tp") or size > 1
    ]
    return settings, (f"mesh {' x '.join(str(size) for _, size in shown)} ({' x '.join(name for name, _ in shown)})")


def ulysses(value: dict, sizes: dict[str, Any], file: dict) -> tuple[Settings, str]:
    """Sequence parallelism: DeepSpeed's Ulysses, over the data-parallel (ZeRO) ranks alone."""
    sp, backend = sizes["sp_size"], value.get("parallelism_config_sp_backend", "deepspeed")
    if file["distributed_type"] != "DEEPSPEED" or backend != "deepspeed":
        raise ValueError(
            f"sp_size: {sp} with sp_backend {backend} under distributed_type {file['distributed_type']}: "
            "the runner's sequence parallelism is DeepSpeed's Ulysses (distributed_type DEEPSPEED); "
            "strategy=fsdp strategy.cp_size splits sequences as a ring"
        )
    others = [
        f"{name}: {sizes[name]}"
        for name in ("dp_replicate_size", "tp_size", "cp_size")
        if count(sizes.get(name, 1), 1) > 1
    ]
    if others:
        raise ValueError(
            f"{', '.join(others)} with sp_size: {sp}: DeepSpeed's Ulysses composes with ZeRO's data-parallel ranks only"
        )
    attention = value.get("parallelism_config_sp_attn_implementation")
    return {"strategy.sp_size": count(sp, 1)}, (
        f"each sequence split over {sp} ranks (Ulysses: DeepSpeed's all-to-all around causal sdpa"
        f"{f', not {attention}' if attention not in (None, 'sdpa') else ''}), of any length; ZeRO over every rank"
    )


TPU = no_meaning("a TPU pod's setting; the runner trains on CPUs and CUDA GPUs")

KEYS: dict[str, Handler] = {
    "compute_environment": compute_environment,
    "distributed_type": distributed_type,
    "num_processes": num_processes,
    "num_machines": lambda value, file: ({"hardware.nnodes": count(value, 1)}, ""),
    "machine_rank": machine_rank,
    "main_process_ip": main_process_ip,
    "main_process_port": main_process_port,
    "rdzv_backend": no_meaning(
        "the runner's launcher meets at hardware.rdzv_endpoint with static rendezvous "
        "(fixed node ranks, hardware.node_rank)"
    ),
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
    **{
        key: TPU
        for key in (
            "tpu_name",
            "tpu_zone",
            "tpu_use_cluster",
            "tpu_use_sudo",
            "command_file",
            "commands",
            "tpu_vm",
            "tpu_env",
        )
    },
}
