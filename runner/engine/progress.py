"""What the training loop has counted, which a checkpoint keeps and a resumed run goes on from."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Progress:
    """What the loop has counted; a checkpoint keeps it, and a resumed run goes on from it."""

    first_eval_loss: float = math.nan
    tokens_seen: float = 0
    train_time: float = 0.0  # the steps' own, compilation aside
    skipped_steps: int = 0
    best_value: float = math.nan  # train.keep_best's metric's best value so far, and its step
    best_step: int = 0

    @property
    def tokens_per_s(self) -> float:
        """The mean rate of the training steps so far, as the done line gives it."""
        return self.tokens_seen / self.train_time
