"""The trackers a run logs to: metrics.jsonl always, and the services its `tracker` sections turn on
(runner/config/tracker.py), each checked for reachability before a run launches."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Protocol

from runner.components.tracker_services import unanswered, wandb_key_known
from runner.config.tracker import REDACTED, MLflowConfig, RunIdentity, TensorBoardConfig, TrackerConfig, WandbConfig
from runner.errors import require
from runner.files.refused_writes import refused_write

log = logging.getLogger("runner")


def check_wandb_service(config: WandbConfig) -> None:
    if config.mode == "online":
        require(
            wandb_key_known(config.api_key),
            "tracker.wandb.mode=online needs a W&B API key: set WANDB_API_KEY (or run `wandb login`), or log "
            "with tracker.wandb.mode=offline and `wandb sync` later",
        )


def check_mlflow_service(config: MLflowConfig) -> None:
    uri = config.tracking_uri or ""
    if uri.startswith(("http://", "https://")):
        why = unanswered(f"{uri.rstrip('/')}/health")
        require(
            why is None,
            f"tracker.mlflow.tracking_uri={uri} does not answer ({why}); start the server, or "
            "leave tracker.mlflow.tracking_uri unset for a file store in the run directory",
        )


# Each tracker section's service check (TensorBoard writes files in the run directory: nothing to ask).
SERVICE_CHECKS: dict[str, Callable[[Any], None]] = {"wandb": check_wandb_service, "mlflow": check_mlflow_service}


def check_services(tracker: TrackerConfig) -> None:
    """The services the trackers log to, asked before a run launches (a bounded wait each): not part of checking
    the spec, which sweeps and estimates do without them."""
    for section, config in tracker.chosen():
        SERVICE_CHECKS.get(section, lambda _: None)(config)


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
            dir=str(run_dir),
            mode=config.mode,
            project=config.project,
            entity=config.entity,
            name=identity.name,
            group=identity.group,
            tags=list(config.tags),
            config=spec,
            id=stable_id(run_dir),
            resume="allow" if start_step else None,
            # wandb's metadata records the command line, an api_key typed there included.
            settings=wandb.Settings(silent=True, console="off", x_disable_meta=bool(config.api_key)),
        )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._run.log(metrics, step=step)

    def finish(self) -> None:
        self._run.finish()


class TensorBoardTracker:
    def __init__(self, config: TensorBoardConfig, run_dir: Path, identity: RunIdentity, spec: dict, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops what a killed run logged after the checkpoint it resumes from.
        self._writer = SummaryWriter(
            str(run_dir / "tensorboard"),
            flush_secs=config.flush_secs,
            purge_step=start_step + 1 if start_step else None,
        )
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


TRACKERS = {"wandb": WandbTracker, "tensorboard": TensorBoardTracker, "mlflow": MLflowTracker}


def build_trackers(
    tracker: TrackerConfig, run_dir: Path, spec: dict, identity: RunIdentity, start_step: int = 0
) -> list[Tracker]:
    """The run's trackers; `spec` is the resolved spec as plain data, secrets already redacted."""
    trackers: list[Tracker] = [MetricsFile(run_dir / "metrics.jsonl", start_step)]
    return trackers + [
        TRACKERS[section](config, run_dir, identity, spec, start_step) for section, config in tracker.chosen()
    ]


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


def call_tracker(trackers: list[Tracker], tracker: Tracker, call: Callable[[], None]) -> None:
    """A tracker that cannot write (a full disk, a read-only directory) is reported once and dropped; training goes
    on, its checkpoints say whether the disk holds them."""
    try:
        call()
    except Exception as error:
        if not refused_write(error):
            raise
        log.warning(
            "%s stopped recording: %s; training goes on without it",
            type(tracker).__name__,
            " ".join(str(error).split())[:200],
        )
        trackers.remove(tracker)
