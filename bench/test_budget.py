"""The test budget (issue 46, item 7): the whole suite may cost at most 25 times the default job's own training
time and the fast tier at most 4 times, both measured on this machine in this session, so that the budget holds on
a machine of any speed. Not a test.

    .venv/bin/python bench/test_budget.py                # the default job, the fast tier, the full suite
    .venv/bin/python bench/test_budget.py --fast-only    # without the full suite
    python3 bench/test_budget.py --python /path/to/venv/bin/python

The default job is `run` with no arguments (the `run` beside --python), in a temporary working directory; its time
is the one its done line ends with (runner/engine/run_end.py: from its first step to its saved model, without the
start-up and the first evaluation), read unrounded from the summary.json of the run directory the output names.
The two tiers run in the repository as CI runs them, `python -m pytest` (pyproject.toml's addopts), each timed
wall-clock; their last line and exit status are shown. Exit status 1 when a limit is missed or a run failed. Each
measurement is appended, one JSON line, to bench/results/test_budget.jsonl, the record of every one so far.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "test_budget.jsonl"
# 20 before mixture-of-experts, Ray and vision-language models; their multi-process tests have the difference.
SUITE_LIMIT = 25
FAST_LIMIT = 4
# "... | peak memory 0.52 GiB | 28 s" or "... | 28 s (torch.compile: 9 s of it)", after the log's time stamp.
DONE = re.compile(r"\bdone: train loss .*\| (\d+(?:\.\d+)?) s(?: \(torch\.compile: [^)]*\))?\s*$")
OUTPUTS = re.compile(r"\boutputs: (\S+)")


def training_seconds(output: str) -> float:
    """The training time the job's (last) done line gives, in seconds; ValueError without one."""
    for line in reversed(output.splitlines()):
        found = DONE.search(line)
        if found:
            return float(found.group(1))
    raise ValueError("the job printed no done line")


def summary_seconds(output: str, cwd: Path) -> Optional[float]:
    """The same time unrounded: wall_time_s of the summary.json in the run directory the output names."""
    found = OUTPUTS.findall(output)
    summary = (cwd / found[-1] / "summary.json") if found else None
    return json.loads(summary.read_text())["wall_time_s"] if summary and summary.is_file() else None


def default_job(python: Path) -> float:
    run = python.parent / "run"
    command = [str(run)] if run.exists() else [str(python), "-m", "runner"]
    print(f"running the default job ({' '.join(command)}) ...", flush=True)
    with tempfile.TemporaryDirectory(prefix="test_budget_") as folder:
        done = subprocess.run(command, cwd=folder, capture_output=True, text=True)
        output = done.stdout + done.stderr
        if done.returncode:
            sys.exit(f"the default job failed ({done.returncode}):\n{output[-3000:]}")
        rounded = training_seconds(output)
        seconds = summary_seconds(output, Path(folder)) or rounded
    print(f"default job: {seconds:.1f} s of training (its done line: {rounded:.0f} s)", flush=True)
    return seconds


def tier(python: Path, name: str, selection: list[str], job_s: float, limit: int) -> dict:
    """The tier's seconds, its ratio to the default job, whether it met its limit, and its last line."""
    command = [str(python), "-m", "pytest", *selection]
    print(f"running the {name} ...", flush=True)
    began = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - began
    last = (done.stdout.strip().splitlines() or ["no output"])[-1].strip("= ")
    ratio = seconds / job_s
    met = done.returncode == 0 and ratio <= limit
    print(
        f"{name} ({shlex.join(['python', '-m', 'pytest', *selection])}): {seconds:.0f} s, {ratio:.1f} times the "
        f"default job, limit {limit}: {'met' if ratio <= limit else 'missed'}"
        f"{'' if done.returncode == 0 else f' (but exit status {done.returncode})'} | {last}",
        flush=True,
    )
    return {"s": round(seconds, 1), "ratio": round(ratio, 1), "limit": limit, "met": met, "result": last}


def record(measurement: dict) -> None:
    """Appends the measurement to the results file."""
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS, "a") as file:
        file.write(json.dumps(measurement) + "\n")
    print(f"recorded in {RESULTS.relative_to(ROOT)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fast-only", action="store_true", help="skip the full suite")
    parser.add_argument(
        "--python",
        type=Path,
        default=Path(sys.executable),
        help="the interpreter of the venv to measure (default: this one)",
    )
    args = parser.parse_args()
    python = args.python.absolute()  # not resolved: a venv's python is a link out of the venv

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    torch_version = (
        subprocess.run(
            [str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True
        ).stdout.strip()
        or "(not importable)"
    )
    when = datetime.datetime.now()
    print(
        f"test budget, {when:%Y-%m-%d %H:%M}, commit {commit}{' (dirty)' if dirty else ''}, "
        f"{os.cpu_count()} CPUs, torch {torch_version}, {python}",
        flush=True,
    )

    job_s = default_job(python)
    measurement = {
        "date": f"{when:%Y-%m-%d %H:%M}",
        "commit": commit,
        "dirty": bool(dirty),
        "cpus": os.cpu_count(),
        "torch": torch_version,
        "how": "bench/test_budget.py",
        "default_job_s": round(job_s, 1),
        "fast": tier(python, "fast tier", ["-m", "not slow"], job_s, FAST_LIMIT),
    }
    if not args.fast_only:
        measurement["suite"] = tier(python, "full suite", [], job_s, SUITE_LIMIT)
    record(measurement)
    sys.exit(0 if all(measurement[name]["met"] for name in ("fast", "suite") if name in measurement) else 1)


if __name__ == "__main__":
    main()
