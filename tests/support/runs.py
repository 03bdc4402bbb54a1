"""What a run leaves and does, seen from outside: its run directories and logged metrics, waiting for what it does,
its processes stopped or mapping deleted files, and a run killed and resumed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional, TypeVar

from tests.support.command import Started, run_cli, start_cli

# ---- run directories


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


def last_step(run_dir: Optional[Path]) -> int:
    """The last step a run logged a training loss for (0 before its first)."""
    return max(logged(run_dir, "loss"), default=0) if run_dir else 0


# ---- waiting


T = TypeVar("T")


def wait_until(
    condition: Callable[[], T], what: str, job: Optional[Started] = None, timeout: float = 300, every: float = 0.05
) -> T:
    """Polls `condition` until it returns something true, and returns that. Fails, saying what it waited for, when
    `job` ends first or after `timeout` seconds: a bound for a stalled run, far above what any step takes."""
    deadline = time.monotonic() + timeout
    while True:
        found = condition()
        if found:
            return found
        if job is not None and job.poll() is not None:
            raise AssertionError(f"the run ended ({job.returncode}) before {what}: {job.stderr()[-2000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:.0f} s for {what}")
        time.sleep(every)


def hold_at_step(job: Started, cwd: Path, timeout: float = 300) -> tuple[Path, int]:
    """Returns once the run under `cwd`, started with `stop_at_step`, has stopped itself right after logging that
    step, every process of its group stopped (SIGSTOP): what the test does next reaches it mid-run whatever the
    machine's speed, and however little of the CPU the test gets. The run directory and the last step logged;
    `resume` the run, or kill it."""
    step = job.stop_at_step
    assert step is not None, "start the run with stop_at_step"
    wait_until(lambda: group_stopped(job.pid), f"the run to stop itself after step {step}", job, timeout)
    run_dir = next(d for d in run_dirs(cwd) if last_step(d) >= step)
    return run_dir, last_step(run_dir)


def group_stopped(group: int) -> bool:
    """Whether every live process of a process group is stopped (state T in /proc/<pid>/stat)."""
    states = [state for _, state in _group_processes(group)]
    return bool(states) and all(state in "Tt" for state in states)


def deleted_files_mapped(group: int, under: Path) -> dict[int, list[str]]:
    """The files under `under`, deleted since, that each live process of a process group still maps (a tensor that
    is a view of a removed checkpoint's file keeps its space taken), from /proc/<pid>/maps; only the processes that
    map one."""
    prefix = f"{under.resolve()}/"
    mapped = {}
    for process, _ in _group_processes(group):
        try:
            lines = (process / "maps").read_text().splitlines()
        except OSError:  # a process that ended meanwhile
            continue
        paths = sorted(
            {line.split(None, 5)[5] for line in lines if line.endswith(" (deleted)") and f" {prefix}" in line}
        )
        if paths:
            mapped[int(process.name)] = paths
    return mapped


def _group_processes(group: int) -> list[tuple[Path, str]]:
    """The live processes of a process group: each one's /proc/<pid> and its state (in /proc/<pid>/stat)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # a process that ended meanwhile
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            found.append((stat.parent, fields[0]))
    return found


# ---- kill and resume


_UNINTERRUPTED: dict[tuple[str, ...], dict[int, float]] = {}


def uninterrupted_losses(args: list[str], tmp_path_factory) -> dict[int, float]:
    """The per-step losses of `run <args>` without a stop: run once per session for each `args`, then reused."""
    key = tuple(args)
    if key not in _UNINTERRUPTED:
        cwd = tmp_path_factory.mktemp("uninterrupted")
        result = run_cli(*args, cwd=cwd)
        assert result.returncode == 0, result.stderr[-2000:]
        _UNINTERRUPTED[key] = logged(run_dirs(cwd)[0], "loss")
    return _UNINTERRUPTED[key]


def kill_at_step(args: list[str], cwd: Path, step: int) -> Path:
    """Starts `run`, and kills it and its workers with SIGKILL once it has logged `step`; its run directory."""
    job = start_cli(*args, cwd=cwd, stop_at_step=step)
    try:
        run_dir, _ = hold_at_step(job, cwd)
    finally:
        job.kill()
    return run_dir


def killed_and_resumed(args: list[str], tmp_path: Path, step: int, tmp_path_factory) -> tuple[dict, dict]:
    """The losses of an uninterrupted run, and of the same run killed at `step` and resumed (`resume=auto`)."""
    expected = uninterrupted_losses(args, tmp_path_factory)
    run_dir = kill_at_step(args, tmp_path, step)
    resumed = run_cli("resume=auto", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    return expected, logged(run_dir, "loss")
