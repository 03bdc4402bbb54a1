"""Writing files: the run directory's JSON (atomically where a reader may look while it is written) and tensors
in safetensors, so that nothing the runner reads back is ever unpickled; the recipes the runner's commands write;
the spec's local paths made absolute."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from runner.distributed import cpu_copy
from runner.errors import SpecError

if TYPE_CHECKING:
    import torch


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def write_json_atomically(path: Path, value: Any) -> None:
    partial = path.with_suffix(path.suffix + ".partial")
    write_json(partial, value)
    move_into_place(partial, path)


# The suffix of a directory that move_into_place moved aside, removed once the new one is in place.
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
    """The tensors of a safetensors file, or those whose key's `name_of` is in `wanted`, read alone from the file."""
    from safetensors import safe_open

    with safe_open(path, "pt") as tensors:
        return {key: tensors.get_tensor(key) for key in tensors.keys() if wanted is None or name_of(key) in wanted}


def new_recipe(name: str, retry: str) -> Path:
    """./recipes/<name>.yaml, where `run recipe=<name>` finds it: a plain name (no path) that no recipe there has.
    `retry` is the command to give another name with."""
    if not re.fullmatch(r"\w[\w-]*", name):
        raise SpecError(f"{name} cannot name a recipe: use letters, digits, _ and -; {retry}")
    target = Path("recipes") / f"{name}.yaml"
    if target.exists():
        raise SpecError(f"{target} exists already; give the recipe another name: {retry}")
    return target
