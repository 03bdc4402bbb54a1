"""The `task` group: what `run` does with the composed spec.

train (the default) trains it, after checking that the run fits the hardware's memory; estimate prints the
run's memory estimate per device (runner/memory.py) and exits, starting no process and writing nothing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TaskConfig:
    """What every task option shares; each option's schema adds its own keys."""


@dataclass
class TrainTask(TaskConfig):
    # Before launch, refuse a run whose estimated peak memory exceeds the hardware's (false: launch anyway).
    fit_check: bool = True


@dataclass
class EstimateTask(TaskConfig):
    # Also print accelerate's `estimate-memory` table for the model (Adam, batch size 1, no activations).
    accelerate_view: bool = True
