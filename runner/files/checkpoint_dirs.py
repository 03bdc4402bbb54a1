"""Where a run's checkpoints are, and which of them were completely written."""

from __future__ import annotations

import logging
from pathlib import Path

from runner.files.atomic import ASIDE

log = logging.getLogger("runner")
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
