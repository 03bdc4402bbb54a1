"""The tests' shared helpers, and their tiers.

Tiers, as pytest markers (registered in pyproject.toml):
    slow          starts `run` or worker processes, or trains more than a few steps: not in the fast tier
    distributed   real multi-process gloo groups or multi-process `run` jobs (always slow too)
The fast tier, `python -m pytest -m "not slow"`, covers composing, validation and errors, the estimate's formulas
and one short single-process training run; the full suite is `python -m pytest`.
"""

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from runner.cli.compose import RECIPES_DIR, compose_config, register
from runner.config.spec import RunSpec, load_spec, validate

register(RECIPES_DIR)

# A small slice of the default corpus keeps test runs to seconds: 20 documents, 2 held out.
SMALL_CORPUS = f"{sysconfig.get_paths()['stdlib']}/email/*.py"
QUICK = [
    f"data.files={SMALL_CORPUS}",
    "data.eval_fraction=0.1",
    "data.seq_len=128",
    "train.max_steps=30",
    "train.log_every=10",
    "train.eval_every=15",
    "train.eval_batches=4",
]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "distributed" in item.keywords or "cluster" in item.keywords:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real SLURM cluster on this host, started once for the session (tests/cluster/slurm.py) and stopped after
    it; its clients (sbatch, scontrol, sacct, and submitit through them) find it by $SLURM_CONF."""
    from cluster import slurm

    try:
        env = slurm.start()
    except slurm.Unavailable as reason:
        pytest.skip(f"no SLURM cluster on this machine: {reason}")
    before = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    yield env
    slurm.stop()
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def run_cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The `run` command as a user types it, in its own process (with `env` added to the environment)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "runner", *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=600
    )


def run_dirs(cwd: Path) -> list[Path]:
    return sorted(p.parent for p in (cwd / "outputs").glob("*/*/spec.yaml"))


def logged(run_dir: Path, key: str) -> dict[int, float]:
    """The values of one metric in a run's metrics.jsonl, by step. A line still being written (the run goes on)
    is left out: only whole lines count."""
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    records = [json.loads(line) for line in text.split("\n")[:-1]]  # the part after the last newline is not whole
    return {r["step"]: r[key] for r in records if key in r}


def step_losses(run_dir: Path) -> list[float]:
    """A run's logged training losses, in step order."""
    return list(logged(run_dir, "loss").values())


def composed(overrides: list[str]) -> RunSpec:
    """The typed spec, not validated: its hardware is as declared, not this machine's."""
    return load_spec(compose_config(overrides))


def resolved_spec(overrides: list[str]) -> RunSpec:
    """The spec as `run` launches it: validated on this machine, its task's pre-launch checks passed."""
    spec = validate(composed(overrides))
    spec.task.before_launch(spec)
    return spec


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path
