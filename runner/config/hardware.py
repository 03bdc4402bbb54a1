"""The `hardware` group: what machine a run is for, and what this machine really has."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from enum import Enum
from typing import Optional

from runner.config.fields import setting
from runner.errors import require

GIB = 1024**3


class Accelerator(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class StartMethod(str, Enum):
    """How `run` starts a node's worker processes: `auto` spawns them on CUDA GPUs and forks them elsewhere."""

    auto = "auto"
    fork = "fork"
    spawn = "spawn"


@dataclass
class HardwareConfig:
    accelerator: Accelerator = setting(
        Accelerator.auto,
        "cpu, cuda, or auto: CUDA GPUs where there are some, else the CPU.",
    )
    nnodes: int = setting(1, "Machines the run spans; each starts `run` with its own node_rank.")
    nproc_per_node: Optional[int] = setting(
        None,
        "Processes on each machine, one per GPU; unset: the GPUs of this machine (1 on a CPU).",
    )
    node_rank: int = setting(0, "This machine's index among nnodes (0: the one rdzv_endpoint names).")
    rdzv_endpoint: Optional[str] = setting(
        None,
        "host:port on node 0 where the nodes' processes meet (torchrun's rendezvous); needed when nnodes > 1.",
    )
    rdzv_timeout_s: int = setting(
        900,
        "How long a node (a task, in a cluster job) waits at the rendezvous for the others before it gives up.",
    )
    start_method: StartMethod = setting(
        StartMethod.auto,
        "How the workers start: forked from `run`, which has imported torch and the runner (on CPUs, a worker trains "
        "within a second), or spawned, each a new interpreter (what CUDA needs); auto: spawn on CUDA, fork elsewhere.",
    )
    device_name: Optional[str] = setting(
        None,
        "The device's name (NVIDIA H100 80GB HBM3, ...), which finds its peak FLOP rate; unset: detected.",
    )
    device_memory_gib: Optional[float] = setting(
        None,
        "Memory of one device, which the memory estimate checks the run against; unset: detected (on a CPU, the host's "
        "RAM).",
    )
    host_memory_gib: Optional[float] = setting(
        None,
        "CPU RAM of one machine, which offloading and loading fill; unset: detected.",
    )
    peak_bf16_tflops: float = setting(
        0.0,
        "Dense bf16 peak per device, for MFU; 0: from device_name where it is known.",
    )
    compute_capability: Optional[float] = setting(
        None,
        "CUDA compute capability (8.0 for A100, 8.9 for RTX 4090, 9.0 for H100): what bf16 and fp8 need.",
    )
    cost_per_gpu_hour: float = setting(
        0.0,
        "The price of a device for an hour, for the cost a run's plan shows (0: no cost shown).",
    )
    measured_runs: Optional[str] = setting(
        None,
        "Where the past runs are whose summaries tell the FLOP rate this hardware reaches (runner/planning/); unset: "
        "./outputs.",
    )

    @property
    def world_size(self) -> int:
        return self.nnodes * (self.nproc_per_node or 1)


# Dense (not sparse) bf16 peaks from the vendors' data sheets, matched on the device name.
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "RTX 4090": 165.2,
    "RTX 3090": 71.0,
}


def detect(config: HardwareConfig) -> HardwareConfig:
    """Fill what the config leaves open from the machine the run starts on."""
    host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    accelerator = config.accelerator
    if accelerator is Accelerator.auto:
        accelerator = Accelerator.cuda if cuda_device_count() else Accelerator.cpu
    if accelerator is Accelerator.cpu:
        return replace(
            config,
            accelerator=accelerator,
            nproc_per_node=config.nproc_per_node or 1,
            device_name=config.device_name or "cpu",
            device_memory_gib=config.device_memory_gib or round(host_memory, 1),
            host_memory_gib=config.host_memory_gib or round(host_memory, 1),
        )
    import torch

    props = torch.cuda.get_device_properties(0)
    peak = next((tflops for name, tflops in PEAK_BF16_TFLOPS.items() if name in props.name), 0.0)
    return replace(
        config,
        accelerator=accelerator,
        nproc_per_node=config.nproc_per_node or torch.cuda.device_count(),
        device_name=config.device_name or props.name,
        device_memory_gib=config.device_memory_gib or round(props.total_memory / GIB, 1),
        host_memory_gib=config.host_memory_gib or round(host_memory, 1),
        peak_bf16_tflops=config.peak_bf16_tflops or peak,
        compute_capability=config.compute_capability or float(f"{props.major}.{props.minor}"),
    )


# A GPU needs its kernel driver, which shows here (NVIDIA's, or AMD's for ROCm builds of torch): without one,
# `hardware=auto` is the CPU without importing torch, which `run --cfg job` must not.
GPU_DRIVER_FILES = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd")


def cuda_device_count() -> int:
    if not any(os.path.exists(path) for path in GPU_DRIVER_FILES):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def on_this_machine(declared: HardwareConfig) -> HardwareConfig:
    """The hardware the spec declares, checked against this machine and filled in from it."""
    check_declared(declared)
    if declared.accelerator is Accelerator.cuda:
        require(
            cuda_device_count() > 0,
            "hardware asks for CUDA GPUs but this machine has none; use hardware=auto or hardware=cpu",
        )
    require(
        0 <= declared.node_rank < declared.nnodes,
        f"hardware.node_rank={declared.node_rank} must be in [0, hardware.nnodes={declared.nnodes})",
    )
    machine = detect(declared)
    if machine.accelerator is Accelerator.cuda:
        require(
            machine.nproc_per_node <= cuda_device_count(),
            f"hardware.nproc_per_node={machine.nproc_per_node} asks for more GPUs than the "
            f"{cuda_device_count()} this machine has",
        )
        require(
            machine.start_method is not StartMethod.fork,
            "hardware.start_method=fork on CUDA GPUs: a forked worker cannot use the CUDA driver that `run` has "
            "initialised; use hardware.start_method=spawn (or auto)",
        )
    return machine


def check_rendezvous(declared: HardwareConfig) -> None:
    """Nodes that `run` starts itself meet at an endpoint the user gives (a cluster's job meets on its first
    node)."""
    require(
        declared.nnodes == 1 or bool(declared.rdzv_endpoint),
        f"hardware.nnodes={declared.nnodes} needs hardware.rdzv_endpoint=<host of node 0>:<free port>, "
        "the same on every node",
    )


def planned(declared: HardwareConfig) -> HardwareConfig:
    """The CUDA hardware the spec declares, which need not be this machine's (a CPU is always this machine's)."""
    if declared.accelerator is not Accelerator.cuda:
        return on_this_machine(declared)
    require(
        declared.nproc_per_node is not None,
        "task=estimate for CUDA hardware needs hardware.nproc_per_node (or a hardware option such as 2xrtx4090)",
    )
    check_declared(declared)
    return declared


def check_declared(declared: HardwareConfig) -> None:
    """What the spec's values must be wherever the run goes."""
    require(declared.nnodes >= 1, f"hardware.nnodes={declared.nnodes} must be >= 1")
    require(
        declared.nproc_per_node is None or declared.nproc_per_node >= 1,
        f"hardware.nproc_per_node={declared.nproc_per_node} must be >= 1",
    )
    if declared.rdzv_endpoint is not None:
        host, _, port = declared.rdzv_endpoint.rpartition(":")
        require(
            bool(host) and port.isdigit() and 0 < int(port) < 65536,
            f"hardware.rdzv_endpoint={declared.rdzv_endpoint} must be <host of node 0>:<port>, for example "
            "10.0.0.1:29500",
        )
    require(declared.rdzv_timeout_s >= 1, f"hardware.rdzv_timeout_s={declared.rdzv_timeout_s} must be >= 1")
    for key in ("device_memory_gib", "host_memory_gib"):
        given = getattr(declared, key)
        require(given is None or given > 0, f"hardware.{key}={given} must be > 0 (or unset: read from the machine)")
    require(
        declared.compute_capability is None or declared.compute_capability > 0,
        f"hardware.compute_capability={declared.compute_capability} must be > 0, for example 8.9",
    )
    require(
        declared.cost_per_gpu_hour >= 0,
        f"hardware.cost_per_gpu_hour={declared.cost_per_gpu_hour} must be >= 0 (0: no cost shown)",
    )
    require(
        declared.peak_bf16_tflops >= 0,
        f"hardware.peak_bf16_tflops={declared.peak_bf16_tflops} must be >= 0 (0: unknown, no MFU shown)",
    )
