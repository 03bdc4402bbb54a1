"""The `optim` group: the optimizer. Weight decay applies to matrices only, never to biases or norm weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass
class OptimConfig:
    """What every optimizer option shares; each option's schema adds its own keys."""

    lr: float = 1e-3
    weight_decay: float = 0.0


@dataclass
class AdamWConfig(OptimConfig):
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8


@dataclass
class SGDConfig(OptimConfig):
    momentum: float = 0.0
    nesterov: bool = False


def build_optimizer(model: nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": optim.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    match optim:
        case AdamWConfig():
            return torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps)
        case SGDConfig():
            return torch.optim.SGD(groups, lr=optim.lr, momentum=optim.momentum, nesterov=optim.nesterov)
    raise TypeError(f"unknown optimizer {type(optim).__name__}")
