"""Where the runner's own files are (conf/, recipes/), and the spec's local paths made absolute."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def bundled(name: str) -> Path:
    """conf/ and recipes/ ship inside the installed package (runner/conf) and sit beside it in a checkout."""
    package = Path(__file__).resolve().parent.parent
    return package / name if (package / name).is_dir() else package.parent / name


def absolute_path(path: Optional[str], base: Path) -> Optional[str]:
    """A local path with `~` expanded, from `base` when relative, normalised without resolving symlinks; None or
    empty as it is."""
    return os.path.abspath(os.path.join(base, os.path.expanduser(path))) if path else path
