"""How close a run's predicted time comes (runner/planning/time_plan.py, issue 48): one calibration run of the
default job, then runs of other sequence lengths and micro batches, each predicted from the calibration run alone
and timed. Not a test: the figures are this machine's.

    .venv/bin/python bench/plan_accuracy.py

Each run's summary.json holds its prediction (`predicted`) and what happened: the wall time of the loop (its first
evaluation to its saved model: `wall_time_s`) and the steps' own time (tokens seen / tokens_per_s). Every run has
hardware=cpu, 30 steps, no evaluation but the first and the last (one batch each), and trains in its own working
directory whose outputs/ holds the calibration run only.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

RUN = Path(sys.executable).with_name("run")
COMMON = ["hardware=cpu", "train.max_steps=30", "train.eval_every=0", "train.eval_batches=1", "train.log_every=10"]
CONFIGS = [
    ["data.seq_len=128", "train.micro_batch_size=8"],
    ["data.seq_len=512", "train.micro_batch_size=8"],
    ["data.seq_len=256", "train.micro_batch_size=4"],
    ["data.seq_len=256", "train.micro_batch_size=16"],
    ["data.seq_len=128", "train.micro_batch_size=8", "train.grad_accum_steps=4"],
]


def run(cwd: Path, overrides: list[str]) -> dict:
    done = subprocess.run([str(RUN), *COMMON, *overrides], cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"run {' '.join(overrides)} failed:\n{done.stderr[-2000:]}")
    newest = max(cwd.glob("outputs/*/*/summary.json"), key=os.path.getmtime)
    return json.loads(newest.read_text())


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="plan_accuracy-"))
    try:
        calibration = root / "calibration"
        calibration.mkdir()
        reached = run(calibration, [])
        print(
            f"{datetime.date.today()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
            f"calibration: the default job (seq_len 256, micro batch 8), {reached['achieved_tflops']:.4f} TFLOP/s"
        )
        print("| overrides | predicted step | measured step | predicted wall | measured wall | wall error |")
        print("|---|---|---|---|---|---|")
        for overrides in CONFIGS:
            cwd = root / f"run{CONFIGS.index(overrides)}"
            shutil.copytree(calibration / "outputs", cwd / "outputs")  # the calibration run alone
            summary = run(cwd, overrides)
            predicted = summary["predicted"]
            step = summary["tokens_seen"] / summary["tokens_per_s"] / summary["steps"]
            error = predicted["wall_time_s"] / summary["wall_time_s"] - 1
            print(
                f"| {' '.join(overrides)} | {predicted['step_time_s']:.3f} s | {step:.3f} s | "
                f"{predicted['wall_time_s']:.2f} s | {summary['wall_time_s']:.2f} s | {error:+.0%} |"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
