"""Tensors in safetensors, whole or each rank's shards (torch.distributed.checkpoint's safetensors format, which
records each shard's offsets), so that nothing the runner reads back is ever unpickled."""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from runner.distributed import cpu_copy, local, process_group_up

if TYPE_CHECKING:
    import torch
    from torch import nn


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({name: cpu_copy(t) for name, t in tensors.items()}, path)


def read_tensors(
    path: Path, wanted: Optional[set[str]] = None, name_of: Callable[[str], str] = lambda key: key
) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, or those whose key's `name_of` is in `wanted`, read alone from the file,
    each straight into memory of the process's own: safetensors' readers give views of the file's memory mapping,
    and a tensor the run keeps (an optimizer's state) would keep a rotated-out checkpoint's space on disk taken. Each
    tensor's bytes are in memory once, never also in a mapping or in a buffer they are copied from."""
    import torch

    tensors = {}
    with open(path, "rb") as file:
        header_size = int.from_bytes(file.read(8), "little")  # the format: its size, its JSON header, the data
        header = json.loads(file.read(header_size))
        header.pop("__metadata__", None)
        for key, entry in header.items():
            if wanted is not None and name_of(key) not in wanted:
                continue
            begin, end = entry["data_offsets"]
            data = torch.empty(end - begin, dtype=torch.uint8)
            file.seek(8 + header_size + begin)
            if file.readinto(data.numpy()) != end - begin:
                raise OSError(f"{path} ends before the data of its tensor {key}")
            tensors[key] = data.view(getattr(torch, SAFETENSORS_DTYPES[entry["dtype"]])).reshape(entry["shape"])
    return tensors


# The safetensors format's dtype names, as torch names them.
SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def write_shards(directory: Path, state: dict[str, torch.Tensor]) -> None:
    """Each rank's shards of `state` (a collective), in safetensors files that record each shard's offsets."""
    import torch.distributed.checkpoint as dcp

    with _quiet_about_one_process():
        writer = dcp.HuggingFaceStorageWriter(str(directory), save_distributed=True)
        dcp.save(_named_once(state), storage_writer=writer, no_dist=not process_group_up())


def read_shards(directory: Path, state: dict[str, torch.Tensor]) -> None:
    """Fills `state`'s tensors (this process's shards of them, or whole ones) in place from shards written under
    any layout."""
    import torch.distributed.checkpoint as dcp

    with _quiet_about_one_process():
        dcp.load(
            _named_once(state),
            storage_reader=dcp.HuggingFaceStorageReader(str(directory)),
            no_dist=not process_group_up(),
        )


def read_model_shards(model: nn.Module, directory: Path) -> None:
    """A model's weights, however it is wrapped or sharded here, from shards written under any layout."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = get_model_state_dict(model)
    read_shards(directory, state)
    set_model_state_dict(model, state)


@contextlib.contextmanager
def _quiet_about_one_process():
    """DCP warns that it assumes one process whenever it is told so."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
        yield


def _named_once(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor under its first name, as a plain tensor over the same memory: a tied weight (an LM head sharing
    the embeddings) is written and read once, as safetensors refuses one memory under two names."""
    seen, named = set(), {}
    for name, tensor in state.items():
        tensor = _plain(tensor)
        part = local(tensor)
        where = (part.untyped_storage().data_ptr(), part.storage_offset()) if part.numel() else name
        if where not in seen:
            seen.add(where)
            named[name] = tensor
    return named


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """A wrapper subclass (torchao's float8 training weight, under FSDP a DTensor's local shard) as the plain tensor
    inside it, which holds its memory: what safetensors writes, and what a load writes into in place."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    part = local(tensor)
    inner = part
    while is_traceable_wrapper_subclass(inner):
        names, _ = inner.__tensor_flatten__()
        inner = getattr(inner, names[0])
    if inner is part:
        return tensor
    if not isinstance(tensor, DTensor):
        return inner
    return DTensor.from_local(
        inner, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
    )
