"""Files and directories written whole: a reader that looks while one is written finds the old or the new."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any


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
