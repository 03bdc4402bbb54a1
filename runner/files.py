"""Writing files: the run directory's JSON (atomically where a reader may look while it is written) and tensors
in safetensors, whole or each rank's shards (torch.distributed.checkpoint's safetensors format, which records each
shard's offsets), so that nothing the runner reads back is ever unpickled; the recipes the runner's commands write;
the spec's local paths made absolute."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from runner.distributed import cpu_copy, local, process_group_up
from runner.errors import SpecError, WriteFailed

if TYPE_CHECKING:
    import torch
    from torch import nn


def bundled(name: str) -> Path:
    """conf/ and recipes/ ship inside the installed package (runner/conf) and sit beside it in a checkout."""
    package = Path(__file__).resolve().parent
    return package / name if (package / name).is_dir() else package.parent / name


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def write_json_atomically(path: Path, value: Any) -> None:
    partial = path.with_suffix(path.suffix + ".partial")
    write_json(partial, value)
    move_into_place(partial, path)


# The suffix of a directory that move_into_place moved aside, removed once the new one is in place.
log = logging.getLogger("runner")
ASIDE = ".previous"


def move_into_place(partial: Path, final: Path) -> None:
    """Moves a completely written file or directory to `final`, replacing what is there. A directory there is moved
    aside (`<final>.previous`) and removed once the new one is in place, so that a reader always finds one of them."""
    if partial.is_dir() and final.exists():
        previous = final.with_name(final.name + ASIDE)
        shutil.rmtree(previous, ignore_errors=True)  # left by a run killed before it removed it
        os.replace(final, previous)
        os.replace(partial, final)
        shutil.rmtree(previous)
    else:
        os.replace(partial, final)


def absolute_path(path: Optional[str], base: Path) -> Optional[str]:
    """A local path with `~` expanded, from `base` when relative, normalised without resolving symlinks; None or
    empty as it is."""
    return os.path.abspath(os.path.join(base, os.path.expanduser(path))) if path else path


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({name: cpu_copy(t) for name, t in tensors.items()}, path)


def read_tensors(path: Path, wanted: Optional[set[str]] = None,
                 name_of: Callable[[str], str] = lambda key: key) -> dict[str, torch.Tensor]:
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
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16",
                      "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


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
        dcp.load(_named_once(state), storage_reader=dcp.HuggingFaceStorageReader(str(directory)),
                 no_dist=not process_group_up())


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
    return DTensor.from_local(inner, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape,
                             stride=tensor.stride())


def new_recipe(name: str, retry: str) -> Path:
    """./recipes/<name>.yaml, where `run recipe=<name>` finds it: a plain name (no path) that no recipe there has.
    `retry` is the command to give another name with."""
    if not re.fullmatch(r"\w[\w-]*", name):
        raise SpecError(f"{name} cannot name a recipe: use letters, digits, _ and -; {retry}")
    target = Path("recipes") / f"{name}.yaml"
    if target.exists():
        raise SpecError(f"{target} exists already; give the recipe another name: {retry}")
    return target


PARTIAL = ".partial"


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoints of a run, oldest first; half-written ones are left out with a warning."""
    found = []
    for path in sorted(checkpoints_dir(run_dir).glob("step_*")):
        if path.name.endswith(ASIDE):  # a step written again, its earlier copy not yet removed
            continue
        if path.name.endswith(PARTIAL) or not (path / "meta.json").is_file():
            log.warning("skipping %s: it was not completely written", path)
            continue
        found.append(path)
    return found


# How the libraries that write tensors say that the filesystem refused a write: safetensors ("I/O error: No space
# left on device (os error 28)"), torch.save ("file write failed"); Python's own raise OSError.
REFUSED_WRITE = re.compile(r"No space left on device|os error 28|Disk quota exceeded|Read-only file system|"
                           r"file write failed|Input/output error", re.IGNORECASE)
# torch.save's writer when the filesystem refuses the rest of a file: it keeps no reason.
CUT_SHORT = re.compile(r"unexpected pos|iostream error")
# A filesystem with less room than this is full: the write that failed on it failed for want of room.
FULL_BELOW = 2**20


def _causes(error: BaseException) -> list[BaseException]:
    """An error and those it was raised from or while handling (torch.save's "unexpected pos" is raised while
    handling the failed write's own error)."""
    chain = [error]
    while len(chain) < 8 and (chain[-1].__cause__ or chain[-1].__context__) is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    return chain


def refused_write(error: BaseException) -> bool:
    return any(isinstance(cause, OSError) or REFUSED_WRITE.search(str(cause)) or CUT_SHORT.search(str(cause))
               for cause in _causes(error))


@contextlib.contextmanager
def written_whole(partial: Path, what: str, run_dir: Path, needed: Callable[[], int], trained: bool = False,
                  shared: bool = False):
    """Writes `what` into `partial`: a write the filesystem refuses removes what was written of it and ends the run
    in one line (WriteFailed) with the path, the bytes it needs (`needed()`) and those free, the last complete
    checkpoint and the command that continues (`trained`: the training is done, the last checkpoint holds it).
    `shared`: other ranks write into `partial` too, having made it before they write."""
    try:
        yield
    except BaseException as error:  # torch.distributed.checkpoint's CheckpointException is one
        # A writer that fails some other way on a filesystem left without room failed for want of it; one whose
        # shared directory is gone failed because a peer's write was refused and the peer removed it (below).
        removed_by_peer = shared and isinstance(error, Exception) and not partial.exists()
        if not (refused_write(error) or free_bytes(partial) < FULL_BELOW or removed_by_peer):
            raise
        shutil.rmtree(partial, ignore_errors=True)
        raise WriteFailed(write_failed_line(error, partial, what, run_dir, needed(), trained,
                                            removed_by_peer)) from None


def _refusal(error: BaseException, short_of_room: bool) -> str:
    """What the filesystem said, or, where the writer kept no reason (torch.save), what the room left says."""
    for cause in _causes(error):
        said = REFUSED_WRITE.search(str(cause))
        if said:
            return said.group(0)
    return "No space left on device" if short_of_room else "the file was cut short"


def existing_parent(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(existing_parent(path)).free


def write_failed_line(error: BaseException, partial: Path, what: str, run_dir: Path, needed: int,
                      trained: bool = False, removed_by_peer: bool = False) -> str:
    failures = getattr(error, "failures", None)  # CheckpointException: each rank's (exception, traceback)
    if isinstance(failures, dict) and failures:
        error = next(iter(failures.values()))[0]
    where = existing_parent(partial)
    free = shutil.disk_usage(where).free
    reason, path = _refusal(error, free < needed), partial
    told = next((cause for cause in _causes(error) if isinstance(cause, OSError) and cause.strerror), None)
    if removed_by_peer:  # this rank's error is the missing directory; the room left says why the peer's failed
        reason = "No space left on device" if free < needed else "another rank's write was refused"
    elif told is not None:
        reason, path = told.strerror, told.filename or partial
    found = complete_checkpoints(run_dir)
    last, then = ((f"the last complete checkpoint, {found[-1]}, is intact", f"continue with: run resume={run_dir}")
                  if found else ("no checkpoint was complete yet", "run it again"))
    if trained and found:  # the trained weights are in that checkpoint, which the inference tasks read
        last, then = (f"the training is done and its last checkpoint, {found[-1]}, holds it",
                      f"task=evaluate and task=generate read it (task.trained={found[-1]})")
    return (f"writing {what} failed: {reason} ({path}); it needs about {needed / 2**20:,.1f} MiB and "
            f"{free / 2**20:,.1f} MiB are free on {where}; {last}. Make room (or keep fewer checkpoints: "
            f"train.keep_checkpoints=1), then {then}")
