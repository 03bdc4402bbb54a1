"""The `strategy` group: how the model is placed and wrapped across processes and devices."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass
class StrategyConfig:
    """What every strategy option shares; each option's schema adds its own keys."""


@dataclass
class SingleStrategy(StrategyConfig):
    """One process on one device, no wrapping."""


def data_parallel_size(strategy: StrategyConfig) -> int:
    """How many ranks split each global batch."""
    match strategy:
        case SingleStrategy():
            return 1
    raise TypeError(f"unknown strategy {type(strategy).__name__}")


def apply_strategy(model: nn.Module, strategy: StrategyConfig, device: torch.device) -> nn.Module:
    match strategy:
        case SingleStrategy():
            return model.to(device)
    raise TypeError(f"unknown strategy {type(strategy).__name__}")
