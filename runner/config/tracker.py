"""The `tracker` group: where a run's metrics go, besides `metrics.jsonl`, which is always written.

Each option fills its own section of the tracker config, so several combine: `tracker=[wandb,tensorboard]`.
Only the main process tracks. A tracker's files live inside the run directory, and a resumed run continues the
same tracker run.

The schema and its checks; runner/components/trackers.py builds what it names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any, ClassVar, List, Optional

from runner.config.fields import setting
from runner.errors import require

# Key names (or their _-separated parts) that hold secrets: api_key, hub_token, password; not tokenizer.
SECRET_KEY = re.compile(r"(^|_)(api_?key|token|secret|password)(_|$)", re.IGNORECASE)
REDACTED = "<redacted>"


@dataclass
class WandbConfig:
    project: str = setting("runner", "The W&B project the run is logged under.")
    entity: Optional[str] = setting(None, "The W&B team or user; unset: the account's default.")
    mode: str = setting(
        "offline",
        "offline needs no account; `wandb sync <run dir>/wandb/offline-run-*` uploads later.",
    )
    tags: List[str] = setting([], "Tags on the W&B run.")
    api_key: Optional[str] = setting(
        None,
        "Used to log in, never written: prefer the WANDB_API_KEY environment variable.",
    )

    module: ClassVar[str] = "wandb"
    package: ClassVar[str] = "wandb"

    def check(self) -> None:
        require(self.mode in ("offline", "online"), f"tracker.wandb.mode={self.mode} must be offline or online")


@dataclass
class TensorBoardConfig:
    flush_secs: int = setting(30, "How often the event files are written to disk.")

    module: ClassVar[str] = "tensorboard"
    package: ClassVar[str] = "tensorboard"

    def check(self) -> None:
        pass


@dataclass
class MLflowConfig:
    tracking_uri: Optional[str] = setting(
        None,
        "Unset: a local file store in the run directory (in the sweep directory for a sweep).",
    )
    experiment: str = setting("runner", "The MLflow experiment the run is logged under.")

    module: ClassVar[str] = "mlflow"
    package: ClassVar[str] = "mlflow-skinny"

    def check(self) -> None:
        pass


@dataclass
class TrackerConfig:
    """One section per tracker; an option (conf/tracker/) fills its own, so several combine."""

    wandb: Optional[WandbConfig] = setting(None, "Weights & Biases (tracker=wandb); unset: not used.")
    tensorboard: Optional[TensorBoardConfig] = setting(
        None,
        "TensorBoard event files in <run dir>/tensorboard (tracker=tensorboard); unset: not used.",
    )
    mlflow: Optional[MLflowConfig] = setting(None, "MLflow (tracker=mlflow); unset: not used.")

    def chosen(self) -> list[tuple[str, Any]]:
        """(section name, its config) of each tracker the spec turns on."""
        return [(f.name, getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None]


def check(tracker: TrackerConfig) -> None:
    import importlib.util

    for section, config in tracker.chosen():
        require(
            importlib.util.find_spec(config.module) is not None,
            f"tracker={section} needs the {config.package} package: pip install {config.package} "
            "(or '.[trackers]' from the runner's checkout)",
        )
        config.check()


@dataclass(frozen=True)
class RunIdentity:
    """How trackers name a run: a sweep's jobs share the group and are named by their overrides."""

    name: str
    group: Optional[str] = None


def redacted(value: Any) -> Any:
    """Plain data with every value under a secret-looking key (api_key, token, secret, password) hidden."""
    if isinstance(value, dict):
        return {k: REDACTED if SECRET_KEY.search(str(k)) and v is not None else redacted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redacted(v) for v in value]
    return value


def secrets(value: Any) -> list[str]:
    """The values under secret-looking keys, to keep them out of every file the run writes."""
    if isinstance(value, dict):
        found = [str(v) for k, v in value.items() if SECRET_KEY.search(str(k)) and v not in (None, "")]
        return found + [s for k, v in value.items() if not SECRET_KEY.search(str(k)) for s in secrets(v)]
    if isinstance(value, list):
        return [s for v in value for s in secrets(v)]
    return []
