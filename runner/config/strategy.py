"""The `strategy` group's base schema. Its options (single, ddp, fsdp, deepspeed) are backends in
runner/strategies/, one file each behind the Strategy protocol (runner/strategies/strategy_protocol.py)."""

from __future__ import annotations

from dataclasses import dataclass

from runner.config.fields import setting


@dataclass
class StrategyConfig:
    """What every strategy option shares; each option's schema adds its own keys."""

    activation_checkpointing: bool = setting(
        False,
        "Recompute each transformer block's activations in backward instead of keeping them (less memory, about a "
        "third more compute).",
    )
