"""The `optim` group: the optimizer. Weight decay applies to matrices only, never to biases or norm weights.

Each option's schema answers what the rest of the runner asks of an optimizer: which torch optimizer runs it, what it
keeps per parameter (for the memory estimate), and whether its values make sense.

The schema and its checks; runner/components/optimizers.py builds what it names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List

from runner.config.fields import setting
from runner.errors import require

if TYPE_CHECKING:
    pass


@dataclass
class OptimConfig:
    """What every optimizer option shares; each option's schema adds its own keys."""

    lr: float = setting(3e-3, "The peak learning rate, which the scheduler warms up to and decays from.")
    weight_decay: float = setting(
        0.1,
        "Decoupled weight decay (AdamW's) on the weight matrices; biases and norm weights are not decayed.",
    )


@dataclass
class AdamWConfig(OptimConfig):
    betas: List[float] = setting([0.9, 0.95], "Adam's decay rates of the first and second moment estimates.")
    eps: float = setting(1e-8, "Added to the second moment's root, for stability.")

    def check(self) -> None:
        _check_shared(self)
        require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            f"optim.betas={list(self.betas)} must be two numbers in [0, 1)",
        )
        require(self.eps >= 0, f"optim.eps={self.eps} must be >= 0")

    def torch_optimizer(self) -> tuple[str, dict[str, Any]]:
        """The torch.optim class that runs this option, and its keywords."""
        return "AdamW", {"lr": self.lr, "betas": tuple(self.betas), "eps": self.eps}

    def states(self) -> tuple[int, str]:
        """States per parameter, and their name."""
        return 2, "AdamW's 2 states"

    def step_copies(self) -> int:
        """Parameter-sized temporaries of torch's foreach step: the square root of the second moment."""
        return 1


@dataclass
class SGDConfig(OptimConfig):
    momentum: float = setting(0.9, "The momentum factor (0: plain SGD).")
    nesterov: bool = setting(False, "Nesterov momentum.")

    def check(self) -> None:
        _check_shared(self)
        require(self.momentum >= 0, f"optim.momentum={self.momentum} must be >= 0")

    def torch_optimizer(self) -> tuple[str, dict[str, Any]]:
        return "SGD", {"lr": self.lr, "momentum": self.momentum, "nesterov": self.nesterov}

    def states(self) -> tuple[int, str]:
        if self.momentum > 0:
            return 1, "SGD's momentum"
        return 0, "none (SGD without momentum)"

    def step_copies(self) -> int:
        return int(self.weight_decay > 0 or self.nesterov)


def _check_shared(optim: OptimConfig) -> None:
    require(optim.lr > 0, f"optim.lr={optim.lr} must be > 0")
    require(optim.weight_decay >= 0, f"optim.weight_decay={optim.weight_decay} must be >= 0")
