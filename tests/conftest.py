import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

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


def run_cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The `run` command as a user types it, in its own process (with `env` added to the environment)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "runner", *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=600
    )


def run_dirs(cwd: Path) -> list[Path]:
    return sorted(p.parent for p in (cwd / "outputs").glob("*/*/spec.yaml"))


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path
