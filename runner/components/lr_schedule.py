"""The learning-rate schedule the `scheduler` group names (runner/config/scheduler.py), stepped once per
optimizer step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.config.scheduler import SchedulerConfig, lr_factor

if TYPE_CHECKING:
    import torch


def build_scheduler(
    optimizer: torch.optim.Optimizer, scheduler: SchedulerConfig, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(scheduler, step, total_steps))
