"""The sweep report: after each job of a sweep, `report.md`, `report.csv` and `loss_curves.png` in the sweep
directory, one row per job so far (a failed job as failed, with its error), so that a sweep that dies still
leaves its report; once more when the sweep ends, when the jobs that ran side by side (on a cluster) are all done,
or when a signal stops it (the job it reached as stopped, the later ones as not started). A sweep of estimates
prints each job's answer, the requeues a cluster's time limit costs it, and the sweep's total time instead."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from runner.errors import Stopped
from runner.planning.time_plan import TimePlan, requeue_line, sweep_line
from runner.processes.cluster import is_first_task

COLUMNS = [
    "job",
    "swept",
    "overrides",
    "status",
    "train_loss",
    "eval_loss",
    "tokens_per_s",
    "peak_memory_gib",
    "wall_time_s",
    "predicted_wall_time_s",
    "gpu_hours",
    "predicted_gpu_hours",
    "error",
]
# The objective's own metrics (task=dpo's, task=grpo's), after eval_loss where a job has them.
OBJECTIVE_COLUMNS = ["eval_rewards/accuracies", "eval_rewards/margins", "eval_reward"]
# Where a job set hardware.cost_per_gpu_hour: its cost, and the one its plan predicted.
COST_COLUMNS = ["cost", "predicted_cost"]
SCORES = "bench/"  # each benchmark score's column (runner/generation/benchmarks.py), after the others
BENCHMARKS_PLOT = "benchmarks.png"
# A failed job's error, in its run directory: the report's `error` column and a job's status before the sweep ends.
ERROR_FILE = "error.txt"


class SweepReport(Callback):
    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus
        from hydra.types import RunMode

        # Every task of a cluster job ends the job; the first one, which wrote its summary, reports it.
        if config.hydra.mode != RunMode.MULTIRUN or not is_first_task():
            return
        if job_return.status is JobStatus.FAILED:
            try:
                job_return.return_value  # raises the job's error
            except Exception as error:
                record_error(Path(config.hydra.runtime.output_dir), error)
        write_report(Path(config.hydra.sweep.dir), ended=False)
        if job_return.status is JobStatus.FAILED:  # the sweep ends here, without on_multirun_end
            say_where(Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        write_report(sweep_dir, ended=True)
        if is_first_task():
            say_where(sweep_dir)


def record_error(job_dir: Path, error: BaseException) -> None:
    message = " ".join(str(error).split())
    (job_dir / ERROR_FILE).write_text(f"{type(error).__name__}: {message}\n")


def say_where(sweep_dir: Path) -> None:
    plots = "loss_curves.png" + (f", {BENCHMARKS_PLOT}" if (sweep_dir / BENCHMARKS_PLOT).exists() else "")
    print(f"sweep report: {sweep_dir / 'report.md'} (and report.csv, {plots})", flush=True)


def job_rows(sweep_dir: Path, ended: bool, not_started: list[list[str]]) -> list[dict[str, Any]]:
    """One row per job directory: its overrides, its summary when it completed, its error when it failed or was
    stopped; a job with neither is still running, or, once the sweep has ended, failed without a word (killed).
    Then a row for each point of a stopped sweep that did not start."""
    import yaml

    rows = []
    for job_dir in sorted(
        (p.parent.parent for p in sweep_dir.glob("*/.hydra/overrides.yaml")),
        key=lambda p: int(p.name) if p.name.isdigit() else p.name,
    ):
        overrides = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text()) or []
        summary_file = job_dir / "summary.json"
        summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
        error_file = job_dir / ERROR_FILE
        error = error_file.read_text().strip() if error_file.exists() else None
        predicted = summary.get("predicted") or {}
        rows.append(
            {
                "job": job_dir.name,
                "overrides": " ".join(overrides),
                "swept": overrides,
                "status": "completed" if summary else status_of(error) if error else "failed" if ended else "running",
                **{key: summary.get(key) for key in [*COLUMNS[4:-1], "cost"]},
                **{f"predicted_{key}": predicted.get(key) for key in ("wall_time_s", "gpu_hours", "cost")},
                **{key: summary[key] for key in OBJECTIVE_COLUMNS if key in summary},
                **{key: value for key, value in summary.items() if key.startswith(SCORES)},
                "error": error,
            }
        )
    first = int(rows[-1]["job"]) + 1 if rows and rows[-1]["job"].isdigit() else 0
    rows += [
        {
            "job": str(first + i),
            "overrides": " ".join(point),
            "swept": point,
            "status": "not started",
            **{key: None for key in COLUMNS[4:]},
        }
        for i, point in enumerate(not_started)
    ]
    # What tells the jobs apart: the overrides not shared by all of them.
    shared = set.intersection(*(set(row["swept"]) for row in rows)) if rows else set()
    for row in rows:
        row["swept"] = " ".join(o for o in row["swept"] if o not in shared)
    return rows


def status_of(error: str) -> str:
    return "stopped" if error.startswith(f"{Stopped.__name__}:") else "failed"


def write_report(sweep_dir: Path, ended: bool, not_started: Optional[list[list[str]]] = None) -> None:
    rows = job_rows(sweep_dir, ended, not_started or [])
    objective = [key for key in OBJECTIVE_COLUMNS if any(key in row for row in rows)]
    cost = [key for key in COST_COLUMNS if any(row.get(key) is not None for row in rows)]
    scores = sorted({key for row in rows for key in row if key.startswith(SCORES)})
    columns = COLUMNS[:6] + objective + COLUMNS[6:-1] + cost + scores + COLUMNS[-1:]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, restval="", extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    (sweep_dir / "report.csv").write_text(buffer.getvalue())

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
        return "" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    (sweep_dir / "report.md").write_text(f"# Sweep {sweep_dir}\n\n" + "\n".join(lines) + "\n")
    plot_curves(sweep_dir, rows)


def plot_curves(sweep_dir: Path, rows: list[dict[str, Any]]) -> None:
    """loss_curves.png: the training loss against step, a line per job; benchmarks.png, where jobs scored
    benchmarks: a panel per score, each against the tokens trained, a line per job (matplotlib is optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    files = {row["job"]: sweep_dir / row["job"] / "metrics.jsonl" for row in rows}
    records = {
        job: [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        for job, path in files.items()
    }
    labels = {row["job"]: f"{row['job']}: {row['swept']}"[:80] for row in rows}
    figure, axes = plt.subplots(figsize=(8, 5))
    draw(axes, records, labels, "step", "loss", "training loss")
    axes.set_title(str(sweep_dir))
    figure.savefig(sweep_dir / "loss_curves.png", dpi=100, bbox_inches="tight")
    plt.close(figure)
    scores = sorted(
        {key for logged in records.values() for record in logged for key in record if key.startswith(SCORES)}
    )
    if not scores:
        return
    columns = min(3, len(scores))
    lines = -(-len(scores) // columns)
    figure, panels = plt.subplots(lines, columns, figsize=(5 * columns, 3.5 * lines), squeeze=False)
    for score, axes in zip(scores, panels.flat):
        draw(axes, records, labels, "tokens_seen", score, score.removeprefix(SCORES))
    for axes in panels.flat[len(scores) :]:
        axes.set_visible(False)
    figure.suptitle(str(sweep_dir))
    figure.savefig(sweep_dir / BENCHMARKS_PLOT, dpi=100, bbox_inches="tight")
    plt.close(figure)


def draw(
    axes: Any, records: dict[str, list[dict[str, Any]]], labels: dict[str, str], x: str, y: str, name: str
) -> None:
    """`y` against `x` for each job that logged both in one record, each job in its own colour in every panel."""
    for number, (job, logged) in enumerate(records.items()):
        points = [(record[x], record[y]) for record in logged if x in record and y in record]
        if points:
            # Markers: a short job's single logged step is a point, which a line alone would not draw.
            axes.plot(*zip(*points), marker="o", markersize=3, label=labels[job], color=f"C{number % 10}")
    axes.set_xlabel("tokens trained" if x == "tokens_seen" else x)
    axes.set_ylabel(name)
    if axes.lines:
        axes.legend(fontsize="small")


def print_estimates(
    answered: dict[str, str], plans: dict[str, Optional[TimePlan]], launcher: Optional[DictConfig]
) -> None:
    """Each job's estimate, its cluster time limit's requeues where it passes it, then the sweep's total time
    (`plans`: each job's TimePlan, or None where its task plans no training run)."""
    for name, answer in answered.items():
        said = "\n".join(filter(None, [answer, requeues(plans.get(name), launcher)]))
        print(f"== {name}\n{said}\n", flush=True)
    planned = [planned for planned in plans.values() if planned is not None]
    if planned:
        print(sweep_line(planned), flush=True)


def requeues(planned: Optional[TimePlan], launcher: Optional[DictConfig]) -> Optional[str]:
    """How many requeues a job planned to take longer than the submitit launcher's time limit will take; None
    where it fits, or where there is no launcher, time limit or plan."""
    if planned is None or launcher is None or "timeout_min" not in launcher:
        return None
    return requeue_line(planned, launcher.timeout_min, launcher.get("signal_delay_s", 0))
