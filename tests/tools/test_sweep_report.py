"""The sweep report (runner/tools/sweep_report.py) of a sweep directory written by hand, as a sweep leaves it: each
job's predicted and measured time, GPU-hours and cost, and a column for every benchmark score any job has;
benchmarks.png where jobs logged scores. tests/cli/test_sweeps.py runs real sweeps."""

import csv
import json

import yaml

from runner.tools.sweep_report import say_where, write_report

SCORES = ["bench/arc_easy_local/acc", "bench/arc_easy_local/acc_norm", "bench/piqa_local/acc"]


def a_job(sweep_dir, number, overrides, summary=None, records=(), error=None):
    job_dir = sweep_dir / str(number)
    (job_dir / ".hydra").mkdir(parents=True)
    (job_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if summary is not None:
        (job_dir / "summary.json").write_text(json.dumps(summary))
    if error is not None:
        (job_dir / "error.txt").write_text(error + "\n")
    (job_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))


def a_summary(wall_time_s, processes, price, scores):
    gpu_hours = wall_time_s * processes / 3600
    predicted_wall_s = wall_time_s * 0.9
    predicted_gpu_hours = predicted_wall_s * processes / 3600
    return {
        "train_loss": 2.5,
        "eval_loss": 2.6,
        "tokens_per_s": 16080.0,
        "peak_memory_gib": 0.5,
        "wall_time_s": wall_time_s,
        "step_time_s": 0.1,
        "gpu_hours": gpu_hours,
        "cost": gpu_hours * price or None,
        "predicted": {
            "step_time_s": 0.09,
            "wall_time_s": predicted_wall_s,
            "gpu_hours": predicted_gpu_hours,
            "cost": predicted_gpu_hours * price or None,
            "flops": 1e15,
            "rate_source": "a test",
        },
        **scores,
    }


def trained(scores):
    """A job's metrics.jsonl: its losses, and a benchmark record at steps 10 and 20 with the tokens trained."""
    losses = [{"step": step, "loss": 3.0 - step / 20, "tokens_seen": 2048.0 * step} for step in (5, 10, 15, 20)]
    bench = [
        {"step": step, **{name: value * step / 20 for name, value in scores.items()}, "tokens_seen": 2048.0 * step}
        for step in (10, 20)
    ]
    return sorted(losses + bench, key=lambda record: record["step"])


def test_the_report_has_predicted_and_measured_time_gpu_hours_cost_and_every_benchmark_score(tmp_path, capsys):
    sweep_dir = tmp_path / "sweep"
    first = {SCORES[0]: 0.31, SCORES[1]: 0.29}
    second = {SCORES[0]: 0.35, SCORES[2]: 0.6}  # one score of its own, one it lacks
    a_job(
        sweep_dir, 0, ["optim.lr=1e-3", "hardware.cost_per_gpu_hour=2"], a_summary(120.0, 2, 2.0, first), trained(first)
    )
    a_job(
        sweep_dir,
        1,
        ["optim.lr=2e-3", "hardware.cost_per_gpu_hour=2"],
        a_summary(240.0, 2, 2.0, second),
        trained(second),
    )
    a_job(sweep_dir, 2, ["optim.lr=4e-3", "hardware.cost_per_gpu_hour=2"], error="RuntimeError: it failed")
    write_report(sweep_dir, ended=True)

    rows = list(csv.DictReader((sweep_dir / "report.csv").open()))
    assert list(rows[0]) == [
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
        "cost",
        "predicted_cost",
        *SCORES,
        "error",
    ]
    assert [row["status"] for row in rows] == ["completed", "completed", "failed"]
    for row, wall_time_s in zip(rows, (120.0, 240.0)):
        assert float(row["wall_time_s"]) == wall_time_s
        assert float(row["predicted_wall_time_s"]) == wall_time_s * 0.9
        assert float(row["gpu_hours"]) == wall_time_s * 2 / 3600  # wall time x 2 processes
        assert float(row["predicted_gpu_hours"]) == wall_time_s * 0.9 * 2 / 3600
        assert float(row["cost"]) == 2 * float(row["gpu_hours"])
        assert float(row["predicted_cost"]) == 2 * float(row["predicted_gpu_hours"])
    assert [rows[0][score] for score in SCORES] == ["0.31", "0.29", ""]
    assert [rows[1][score] for score in SCORES] == ["0.35", "", "0.6"]
    assert all(rows[2][column] == "" for column in ["wall_time_s", "gpu_hours", "cost", *SCORES])
    assert rows[2]["error"] == "RuntimeError: it failed"
    markdown = (sweep_dir / "report.md").read_text()
    assert "| predicted_wall_time_s |" in markdown and f"| {SCORES[2]} | error |" in markdown

    assert (sweep_dir / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
    assert (sweep_dir / "benchmarks.png").read_bytes()[:4] == b"\x89PNG"
    say_where(sweep_dir)
    assert capsys.readouterr().out == (
        f"sweep report: {sweep_dir / 'report.md'} (and report.csv, loss_curves.png, benchmarks.png)\n"
    )


def test_a_sweep_without_scores_or_prices_has_no_columns_or_plot_for_them(tmp_path, capsys):
    sweep_dir = tmp_path / "sweep"
    for number, lr in enumerate(("1e-3", "2e-3")):
        a_job(sweep_dir, number, [f"optim.lr={lr}"], a_summary(60.0, 1, 0.0, {}), trained({}))
    write_report(sweep_dir, ended=True)
    header = next(csv.reader((sweep_dir / "report.csv").open()))
    assert "cost" not in header and "predicted_cost" not in header
    assert not [column for column in header if column.startswith("bench/")]
    assert (sweep_dir / "loss_curves.png").exists() and not (sweep_dir / "benchmarks.png").exists()
    say_where(sweep_dir)
    assert capsys.readouterr().out == f"sweep report: {sweep_dir / 'report.md'} (and report.csv, loss_curves.png)\n"
