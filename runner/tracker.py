"""The `tracker` group: where a run's metrics go. `metrics.jsonl` in the run directory is always written."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


@dataclass
class TrackerConfig:
    """What every tracker option shares; each option's schema adds its own keys."""


@dataclass
class NoTracker(TrackerConfig):
    """Only the run directory's metrics.jsonl."""


class Tracker(Protocol):
    def log(self, metrics: dict[str, Any], step: int) -> None: ...

    def finish(self) -> None: ...


class MetricsFile:
    """One JSON object per logged step, appended and flushed as it comes. A resumed run first drops the records
    after its checkpoint's step, which it is about to log again."""

    def __init__(self, path: Path, start_step: int = 0):
        if start_step and path.exists():
            kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= start_step]
            path.write_text("".join(line + "\n" for line in kept))
        self._file = open(path, "a", encoding="utf-8")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def finish(self) -> None:
        self._file.close()


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def build_trackers(tracker: TrackerConfig, run_dir: Path, start_step: int = 0) -> list[Tracker]:
    match tracker:
        case NoTracker():
            return [MetricsFile(run_dir / "metrics.jsonl", start_step)]
    raise TypeError(f"unknown tracker {type(tracker).__name__}")
