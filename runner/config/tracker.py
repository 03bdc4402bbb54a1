"""The `tracker` group: where a run's metrics go, besides `metrics.jsonl`, which is always written.

Each option fills its own section of the tracker config, so several combine: `tracker=[wandb,tensorboard]`.
Only the main process tracks. A tracker's files live inside the run directory, and a resumed run continues the
same tracker run.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, List, Optional, Protocol

from runner.config.reachable import unanswered, wandb_key_known
from runner.errors import require

# Key names (or their _-separated parts) that hold secrets: api_key, hub_token, password; not tokenizer.
SECRET_KEY = re.compile(r"(^|_)(api_?key|token|secret|password)(_|$)", re.IGNORECASE)
REDACTED = "<redacted>"


@dataclass
class WandbConfig:
    project: str = "runner"
    entity: Optional[str] = None
    # offline needs no account; `wandb sync <run dir>/wandb/offline-run-*` uploads later.
    mode: str = "offline"
    tags: List[str] = field(default_factory=list)
    # Used to log in, never written: prefer the WANDB_API_KEY environment variable.
    api_key: Optional[str] = None

    module: ClassVar[str] = "wandb"
    package: ClassVar[str] = "wandb"

    def check(self) -> None:
        require(self.mode in ("offline", "online"), f"tracker.wandb.mode={self.mode} must be offline or online")

    def check_service(self) -> None:
        if self.mode == "online":
            require(wandb_key_known(self.api_key),
                    "tracker.wandb.mode=online needs a W&B API key: set WANDB_API_KEY (or run `wandb login`), or log "
                    "with tracker.wandb.mode=offline and `wandb sync` later")

    def open(self, run_dir: Path, identity: RunIdentity, spec: dict, start_step: int) -> Tracker:
        return WandbTracker(self, run_dir, identity, spec, start_step)


@dataclass
class TensorBoardConfig:
    flush_secs: int = 30

    module: ClassVar[str] = "tensorboard"
    package: ClassVar[str] = "tensorboard"

    def check(self) -> None:
        pass

    def check_service(self) -> None:
        pass  # files in the run directory

    def open(self, run_dir: Path, identity: RunIdentity, spec: dict, start_step: int) -> Tracker:
        return TensorBoardTracker(self, run_dir, spec, start_step)


@dataclass
class MLflowConfig:
    # Unset: a local file store in the run directory (in the sweep directory for a sweep).
    tracking_uri: Optional[str] = None
    experiment: str = "runner"

    module: ClassVar[str] = "mlflow"
    package: ClassVar[str] = "mlflow-skinny"

    def check(self) -> None:
        pass

    def check_service(self) -> None:
        uri = self.tracking_uri or ""
        if uri.startswith(("http://", "https://")):
            why = unanswered(f"{uri.rstrip('/')}/health")
            require(why is None, f"tracker.mlflow.tracking_uri={uri} does not answer ({why}); start the server, or "
                                 "leave tracker.mlflow.tracking_uri unset for a file store in the run directory")

    def open(self, run_dir: Path, identity: RunIdentity, spec: dict, start_step: int) -> Tracker:
        return MLflowTracker(self, run_dir, identity, spec, start_step)


@dataclass
class TrackerConfig:
    """One section per tracker; an option (conf/tracker/) fills its own, so several combine."""

    wandb: Optional[WandbConfig] = None
    tensorboard: Optional[TensorBoardConfig] = None
    mlflow: Optional[MLflowConfig] = None

    def chosen(self) -> list[tuple[str, Any]]:
        """(section name, its config) of each tracker the spec turns on."""
        return [(f.name, getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None]


def check(tracker: TrackerConfig) -> None:
    import importlib.util

    for section, config in tracker.chosen():
        require(importlib.util.find_spec(config.module) is not None,
                f"tracker={section} needs the {config.package} package: pip install {config.package} "
                "(or '.[trackers]' from the runner's checkout)")
        config.check()


def check_services(tracker: TrackerConfig) -> None:
    """The services the trackers log to, asked before a run launches (a bounded wait each): not part of checking
    the spec, which sweeps and estimates do without them."""
    for _, config in tracker.chosen():
        config.check_service()


@dataclass(frozen=True)
class RunIdentity:
    """How trackers name a run: a sweep's jobs share the group and are named by their overrides."""

    name: str
    group: Optional[str] = None


class Tracker(Protocol):
    def log(self, metrics: dict[str, Any], step: int) -> None: ...

    def finish(self) -> None: ...


class MetricsFile:
    """One JSON object per logged step, appended and flushed as it comes, with the wall-clock time it was
    written at (`time`, seconds since the epoch). A resumed run first drops the records after its checkpoint's
    step, which it is about to log again; a run that starts over (a cluster job requeued before its first
    checkpoint) drops them all."""

    def __init__(self, path: Path, start_step: int = 0):
        if start_step and path.exists():
            # A killed run may have left its last line half-written: only whole lines (ending in a newline) count.
            whole = path.read_text().split("\n")[:-1]
            kept = [line for line in whole if json.loads(line)["step"] <= start_step]
            path.write_text("".join(line + "\n" for line in kept))
        self._file = open(path, "a" if start_step else "w", encoding="utf-8")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        record = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def finish(self) -> None:
        self._file.close()


class WandbTracker:
    def __init__(self, config: WandbConfig, run_dir: Path, identity: RunIdentity, spec: dict, start_step: int):
        import os

        os.environ.setdefault("WANDB_MODE", config.mode)  # read at import: offline then reaches for no server
        import wandb

        if config.api_key and config.api_key != REDACTED and config.mode == "online":  # a resumed spec hides it
            wandb.login(key=config.api_key, verify=False)
        self._run = wandb.init(
            dir=str(run_dir), mode=config.mode, project=config.project, entity=config.entity, name=identity.name,
            group=identity.group, tags=list(config.tags), config=spec, id=stable_id(run_dir),
            resume="allow" if start_step else None,
            # wandb's metadata records the command line, an api_key typed there included.
            settings=wandb.Settings(silent=True, console="off", x_disable_meta=bool(config.api_key)),
        )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._run.log(metrics, step=step)

    def finish(self) -> None:
        self._run.finish()


class TensorBoardTracker:
    def __init__(self, config: TensorBoardConfig, run_dir: Path, spec: dict, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops what a killed run logged after the checkpoint it resumes from.
        self._writer = SummaryWriter(str(run_dir / "tensorboard"), flush_secs=config.flush_secs,
                                     purge_step=start_step + 1 if start_step else None)
        if not start_step:
            self._writer.add_text("spec", "```\n" + json.dumps(spec, indent=2) + "\n```")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)

    def finish(self) -> None:
        self._writer.close()


class MLflowTracker:
    def __init__(self, config: MLflowConfig, run_dir: Path, identity: RunIdentity, spec: dict, start_step: int):
        import os

        import mlflow

        if not config.tracking_uri:
            # A plain directory store needs no database; MLflow 3 keeps it working behind this switch.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        store = run_dir.parent if identity.group else run_dir
        self._client = mlflow.tracking.MlflowClient(config.tracking_uri or (store / "mlruns").as_uri())
        experiment = self._client.get_experiment_by_name(config.experiment)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(config.experiment)
        id_file = run_dir / "mlflow_run_id"
        if start_step and id_file.exists():
            self._run_id = id_file.read_text().strip()
            self._client.update_run(self._run_id, status="RUNNING")
        else:
            tags = {"mlflow.runName": identity.name, **({"group": identity.group} if identity.group else {})}
            self._run_id = self._client.create_run(experiment_id, tags=tags).info.run_id
            id_file.write_text(self._run_id + "\n")
            for key, value in flatten(spec).items():
                self._client.log_param(self._run_id, key, str(value)[:6000])

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for key, value in metrics.items():
            self._client.log_metric(self._run_id, key, float(value), step=step)

    def finish(self) -> None:
        self._client.set_terminated(self._run_id)


def build_trackers(
    tracker: TrackerConfig, run_dir: Path, spec: dict, identity: RunIdentity, start_step: int = 0
) -> list[Tracker]:
    """The run's trackers; `spec` is the resolved spec as plain data, secrets already redacted."""
    trackers: list[Tracker] = [MetricsFile(run_dir / "metrics.jsonl", start_step)]
    return trackers + [config.open(run_dir, identity, spec, start_step) for _, config in tracker.chosen()]


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


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in flatten(item, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): value}


def stable_id(run_dir: Path) -> str:
    """The same tracker run id for a run directory, so that a resumed run continues its tracker run."""
    return hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
