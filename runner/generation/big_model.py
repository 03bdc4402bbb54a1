"""A model too big for one device, placed for inference with accelerate's big-model tools (device_map="auto").

The model is first built on the meta device (shapes only, no memory), and accelerate's `infer_auto_device_map`
fills the devices in order - the GPUs, then CPU RAM, then an offload folder on disk - up to each device's limit,
never splitting a decoder layer (the model's `_no_split_modules`). The weights then go where the map says:
  - from a saved model (safetensors), transformers' from_pretrained loads each weight straight to its device; the
    disk's weights are read from the checkpoint's own files when they need no conversion, else re-saved in the
    offload folder;
  - from an architecture (random init), the model is built whole on the CPU with the seed, as training builds it
    (fp32, then cast), and then dispatched: accelerate writes the disk part's weights to the offload folder (one
    raw file per tensor, index.json) and frees them from RAM. RAM then holds the whole fp32 model for a moment,
    whatever the CPU limit: the limit holds from then on.
Hooks then bring each offloaded layer's weights to its execution device for its forward and drop them after.
"""

from __future__ import annotations

import json
import logging
import re
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional

import torch

from runner.components.modeling import build_model
from runner.config.model import ModelConfig
from runner.errors import require
from runner.memory.breakdown import readable
from runner.memory.device_map import DISK, Device, automatic_device_map, device_of

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase


# accelerate's dispatch_model warns on every placement that offloads, which is exactly what was asked for here.
OFFLOAD_WARNING = "Some parameters are on the meta device because they were offloaded"


def place_for_inference(
    model: ModelConfig,
    tokenizer: PreTrainedTokenizerBase,
    max_memory: dict[Device, int],
    offload_dir: Path,
    weights_dir: Optional[Path] = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device_map: Optional[dict[str, Device]] = None,
) -> tuple[nn.Module, dict[str, Device]]:
    """The model in eval mode with its layers on the devices that `max_memory` allows (see the module's docstring),
    and the device map used. Weights come from `weights_dir` (a save_pretrained directory), else
    `model.pretrained`, else random init from `model.architecture` with torch.manual_seed(seed). An explicit
    `device_map` overrides the automatic one."""
    source = ModelConfig(pretrained=str(weights_dir), tokenizer=model.tokenizer) if weights_dir else model
    meta_model = build_model(source, tokenizer, weights=False)
    if device_map is None:
        device_map = automatic_device_map(meta_model, max_memory, dtype)
    else:
        check_tied_weights_together(meta_model, device_map)
    offload_dir = Path(offload_dir)
    clear_offloaded_weights(offload_dir)
    with offload_warning_silenced():
        if source.pretrained:
            placed = load_placed(source.pretrained, device_map, offload_dir, dtype)
        else:
            placed = initialize_placed(source, tokenizer, device_map, offload_dir, dtype, seed)
    return placed.eval(), device_map


def check_tied_weights_together(meta_model: nn.Module, device_map: dict[str, Device]) -> None:
    """Weights shared between modules (tied input and output embeddings) must share a device: transformers, loading
    a checkpoint, finds no weight for the copy it expects on disk when only one of them is put there."""
    from accelerate.utils import find_tied_parameters

    for tied in find_tied_parameters(meta_model):
        devices = {device_of(name, device_map) for name in tied}
        require(
            len(devices) == 1,
            f"the device map splits the tied weights {' and '.join(tied)} between "
            f"{' and '.join(map(str, devices))}: put their modules on one device",
        )


def load_placed(pretrained: str, device_map: dict[str, Device], offload_dir: Path, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        pretrained, dtype=dtype, device_map=device_map, offload_folder=str(offload_dir)
    )


def initialize_placed(
    model: ModelConfig,
    tokenizer: PreTrainedTokenizerBase,
    device_map: dict[str, Device],
    offload_dir: Path,
    dtype: torch.dtype,
    seed: int,
) -> nn.Module:
    from accelerate import dispatch_model

    torch.manual_seed(seed)
    whole = build_model(model, tokenizer).to(dtype)
    return dispatch_model(whole, device_map, offload_dir=str(offload_dir))


def clear_offloaded_weights(offload_dir: Path) -> None:
    """Removes the weights an earlier placement offloaded here: dispatch_model takes a folder with an index.json as
    already holding this model's weights and would silently reuse stale ones."""
    index_file = offload_dir / "index.json"
    if not index_file.is_file():
        return
    for name in json.loads(index_file.read_text()):
        (offload_dir / f"{name}.dat").unlink(missing_ok=True)
    index_file.unlink()


@contextmanager
def offload_warning_silenced() -> Iterator[None]:
    def drop_offload_warning(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(OFFLOAD_WARNING)

    logger = logging.getLogger("accelerate.big_modeling")
    logger.addFilter(drop_offload_warning)
    try:
        yield
    finally:
        logger.removeFilter(drop_offload_warning)


def placement_lines(
    model: nn.Module,
    device_map: dict[str, Device],
    offload_dir: Optional[Path] = None,
    max_memory: Optional[dict[Device, int]] = None,
) -> list[str]:
    """One line per device, GPUs first, then the CPU, then the disk: the modules it holds (runs of numbered layers
    as ranges) and their weights' size, e.g. 'cpu: model.embed_tokens, layers 0-7 (2.31 GiB)'."""
    module_order = {name: position for position, (name, _) in enumerate(model.named_modules())}
    names_by_device: dict[Device, list[str]] = {}
    for name in sorted(device_map, key=lambda name: module_order.get(name, len(module_order))):
        names_by_device.setdefault(device_map[name], []).append(name)

    counted: set[int] = set()  # a tied weight counts once, on the first device that holds it
    lines = []
    for device in sorted(names_by_device, key=device_rank):
        names = names_by_device[device]
        size = sum(tensor_bytes(model, name, counted) for name in names)
        limit = f" of {readable(max_memory[device])}" if max_memory and device in max_memory else ""
        where = f" in {offload_dir}" if device == DISK and offload_dir is not None else ""
        lines.append(f"{device_label(device)}: {describe_modules(model, names)} ({readable(size)}{limit}){where}")
    return lines


def device_rank(device: Device) -> tuple[int, int]:
    if isinstance(device, int):
        return 0, device
    return (1, 0) if device == "cpu" else (2, 0)


def device_label(device: Device) -> str:
    return f"gpu {device}" if isinstance(device, int) else str(device)


def tensor_bytes(model: nn.Module, name: str, counted: set[int]) -> int:
    """The bytes of a module's parameters and buffers not yet counted (offloaded ones sit on the meta device with
    their shape and dtype, so they count too)."""
    module = model.get_submodule(name)
    size = 0
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) not in counted:
            counted.add(id(tensor))
            size += tensor.numel() * tensor.element_size()
    return size


def describe_modules(model: nn.Module, names: list[str]) -> str:
    """The module names, with the numbered layers of one list shown once as ranges ('layers 0-7,10') where the
    first of them stands."""
    if names == [""]:
        return "the whole model"
    layers: dict[str, list[int]] = {}
    items: list[str] = []
    for name in names:
        numbered = re.fullmatch(r"(.+)\.(\d+)", name)
        if numbered:
            prefix, index = numbered.group(1), int(numbered.group(2))
        elif isinstance(model.get_submodule(name), torch.nn.ModuleList):
            prefix, index = name, None  # a whole list of layers, as accelerate writes it when they share a device
        else:
            items.append(name)
            continue
        if prefix not in layers:
            layers[prefix] = []
            items.append(prefix)
        layers[prefix].extend(range(len(model.get_submodule(name))) if index is None else [index])
    return ", ".join(
        f"{item.rsplit('.', 1)[-1]} {index_ranges(layers[item])}" if item in layers else item for item in items
    )


def index_ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    runs: list[list[int]] = []
    for index in sorted(set(indices)):
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
