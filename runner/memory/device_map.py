"""Where accelerate's big-model placement (device_map="auto") puts each layer of a model, under the memory each
device may use: what the inference estimate counts before launch and what runner/engine/big_model.py places."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

from runner.config.hardware import GIB
from runner.errors import require

if TYPE_CHECKING:
    import torch
    from torch import nn

DISK = "disk"
Device = Union[int, str]


def memory_limits(device_memory_gib: Optional[float], gpus: int, host_memory_gib: float,
                  overrides: dict[str, Union[str, float]]) -> dict[Device, int]:
    """accelerate's max_memory in bytes: each of `gpus` GPUs (0, 1, ...) may hold `device_memory_gib`, the CPU
    `host_memory_gib`; `overrides` ("0", "1", ... or "cpu" to GiB, as 12, "12" or "12GiB") win over both."""
    limits_gib: dict[Device, Optional[float]] = {index: device_memory_gib for index in range(gpus)}
    limits_gib["cpu"] = host_memory_gib
    for key, value in overrides.items():
        device = override_device(str(key), gpus)
        limits_gib[device] = gib_value(device, value)
    for device, gib in limits_gib.items():
        require(gib is not None, f"GPU {device}'s memory is unknown: set hardware.device_memory_gib or a limit for {device}")
    return {device: int(gib * GIB) for device, gib in limits_gib.items()}


def override_device(key: str, gpus: int) -> Device:
    if key == "cpu":
        return key
    gpu_indices = [str(index) for index in range(gpus)]
    require(key in gpu_indices,
            f"no device {key!r} to limit: name the CPU (cpu) or a GPU index ({', '.join(gpu_indices) or 'no GPUs here'})")
    return int(key)


def gib_value(device: Device, value: Union[str, float]) -> float:
    try:
        gib = float(str(value).strip().removesuffix("GiB"))
    except ValueError:
        gib = -1.0
    require(gib >= 0, f"the memory limit for {device} is {value!r}: give a number of GiB, such as 12 or 12.5")
    return gib


def automatic_device_map(meta_model: nn.Module, max_memory: dict[Device, int], dtype: torch.dtype,
                         ) -> dict[str, Device]:
    """The device of each module, filling the GPUs, then CPU RAM, then disk, never splitting a decoder layer."""
    from accelerate import infer_auto_device_map

    return dict(infer_auto_device_map(meta_model, max_memory=max_memory, dtype=dtype,
                                      no_split_module_classes=list(meta_model._no_split_modules or [])))


def device_of(name: str, device_map: dict[str, Device]) -> Device:
    """The device of a parameter or module `name`: that of the longest device-map entry that contains it."""
    holders = [key for key in device_map if key == "" or name == key or name.startswith(f"{key}.")]
    require(bool(holders), f"the device map places no module that holds {name}")
    return device_map[max(holders, key=len)]
