"""Where accelerate's big-model placement (device_map="auto") puts each layer of a model, under the memory each
device may use: what the inference estimate counts before launch and what runner/generation/big_model.py places."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

from runner.config.hardware import GIB
from runner.errors import require

if TYPE_CHECKING:
    import torch
    from torch import nn

    from runner.config.task import MaxMemory

DISK = "disk"
Device = Union[int, str]


def memory_limits(
    device_memory_gib: Optional[float], gpus: int, host_memory_gib: float, limits: MaxMemory
) -> dict[Device, int]:
    """accelerate's max_memory in bytes: each of `gpus` GPUs (0, 1, ...) may hold `limits.gpu` GiB, else
    `device_memory_gib`; the CPU `limits.cpu`, else `host_memory_gib`."""
    gpu = limits.gpu or device_memory_gib
    require(
        gpus == 0 or gpu is not None,
        "the GPUs' memory is unknown: set hardware.device_memory_gib or task.max_memory.gpu",
    )
    return {**{index: int(gpu * GIB) for index in range(gpus)}, "cpu": int((limits.cpu or host_memory_gib) * GIB)}


def automatic_device_map(
    meta_model: nn.Module,
    max_memory: dict[Device, int],
    dtype: torch.dtype,
) -> dict[str, Device]:
    """The device of each module, filling the GPUs, then CPU RAM, then disk, never splitting a decoder layer."""
    from accelerate import infer_auto_device_map

    return dict(
        infer_auto_device_map(
            meta_model,
            max_memory=max_memory,
            dtype=dtype,
            no_split_module_classes=list(meta_model._no_split_modules or []),
        )
    )


def device_of(name: str, device_map: dict[str, Device]) -> Device:
    """The device of a parameter or module `name`: that of the longest device-map entry that contains it."""
    holders = [key for key in device_map if key == "" or name == key or name.startswith(f"{key}.")]
    require(bool(holders), f"the device map places no module that holds {name}")
    return device_map[max(holders, key=len)]
