"""The `scheduler` group: the learning-rate schedule, stepped once per optimizer step.

The schema and its checks; runner/components/lr_schedule.py builds what it names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Optional

from runner.config.fields import setting
from runner.errors import require

if TYPE_CHECKING:
    pass


class Decay(str, Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


@dataclass
class SchedulerConfig:
    decay: Decay = setting(
        Decay.cosine,
        "After warmup: cosine or linear decay to optim.lr x min_lr_ratio, or a constant rate.",
    )
    warmup_ratio: float = setting(
        0.1,
        "Linear warmup from 0 to optim.lr over this share of train.max_steps, or over warmup_steps when set.",
    )
    warmup_steps: Optional[int] = setting(None, "Warmup steps; unset: warmup_ratio of train.max_steps.")
    min_lr_ratio: float = setting(0.1, "The decay ends at optim.lr x min_lr_ratio on the last step.")


def check(scheduler: SchedulerConfig, total_steps: int) -> None:
    require(0 <= scheduler.warmup_ratio < 1, f"scheduler.warmup_ratio={scheduler.warmup_ratio} must be in [0, 1)")
    if scheduler.warmup_steps is not None:
        require(
            0 <= scheduler.warmup_steps < total_steps,
            f"scheduler.warmup_steps={scheduler.warmup_steps} must be in [0, train.max_steps={total_steps})",
        )
    require(0 <= scheduler.min_lr_ratio <= 1, f"scheduler.min_lr_ratio={scheduler.min_lr_ratio} must be in [0, 1]")


def warmup_steps(scheduler: SchedulerConfig, total_steps: int) -> int:
    if scheduler.warmup_steps is not None:
        return scheduler.warmup_steps
    return round(scheduler.warmup_ratio * total_steps)


def lr_factor(scheduler: SchedulerConfig, step: int, total_steps: int) -> float:
    """The multiple of optim.lr used for optimizer step `step` (0-based)."""
    warmup = warmup_steps(scheduler, total_steps)
    if step < warmup:
        return (step + 1) / warmup
    if scheduler.decay is Decay.constant:
        return 1.0
    progress = (step - warmup) / max(1, total_steps - warmup)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if scheduler.decay is Decay.cosine else 1 - progress
    return scheduler.min_lr_ratio + (1 - scheduler.min_lr_ratio) * shape
