"""A sweep writes its report, one row per job, a failed job shown as failed while the others still run; Ctrl-C
stops the whole sweep; the Optuna sweeper searches with the run's eval loss as its objective."""

import csv
import json
import os
import re
import signal

import pytest
import yaml

from tests.support.command import run_cli, start_cli
from tests.support.runs import wait_until
from tests.support.specs import QUICK, composed

pytestmark = pytest.mark.slow

SHORT = [
    *QUICK,
    "train.max_steps=4",
    "train.log_every=2",
    "train.eval_every=0",
    "train.eval_batches=2",
    "train.save_model=false",
]


def test_two_by_two_sweep_reports_four_jobs_one_failed(workdir):
    """Each job's predicted and measured time, GPU-hours and cost (a declared peak and price), and its benchmark
    scores, in the report and in benchmarks.png."""
    # 4 query heads cannot share 3 key-value heads: that job fails in its first forward; the other three train.
    result = run_cli(
        "-m",
        *SHORT,
        "hardware.peak_bf16_tflops=1",
        "hardware.cost_per_gpu_hour=2",
        "train.benchmarks=[local_copa]",
        "train.benchmark_limit=8",
        "train.benchmark_every=2",
        "model.architecture.hidden_size=96",
        "model.architecture.num_attention_heads=6,4",
        "model.architecture.num_key_value_heads=2,3",
        cwd=workdir,
    )
    assert result.returncode != 0
    [sweep_dir] = workdir.glob("outputs/multirun/*/*")
    rows = list(csv.DictReader((sweep_dir / "report.csv").open()))
    assert len(rows) == 4
    failed = [row for row in rows if row["status"] == "failed"]
    assert len(failed) == 1
    assert failed[0]["overrides"].endswith(
        "model.architecture.num_attention_heads=4 model.architecture.num_key_value_heads=3"
    )
    assert "the job failed" in (sweep_dir / failed[0]["job"] / "run.log").read_text()  # when it failed, not at the end
    assert failed[0]["error"].startswith("RuntimeError: The size of tensor a (4) must match the size of tensor b (3)")
    assert all(float(row["eval_loss"]) > 0 and float(row["tokens_per_s"]) > 0 for row in rows if row not in failed)
    assert (sweep_dir / "report.md").read_text().count("| completed |") == 3
    assert f"sweep report: {(sweep_dir / 'report.md').relative_to(workdir)}" in result.stdout
    assert "e+" not in (sweep_dir / "report.md").read_text()  # tokens/s as 16,080, not 1.608e+04
    assert (sweep_dir / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
    for row in (row for row in rows if row not in failed):
        summary = json.loads((sweep_dir / row["job"] / "summary.json").read_text())
        assert float(row["predicted_wall_time_s"]) == summary["predicted"]["wall_time_s"] > 0
        assert float(row["cost"]) == pytest.approx(2 * float(row["gpu_hours"])) and float(row["predicted_cost"]) > 0
        assert 0 <= float(row["bench/local_copa/acc"]) == summary["bench/local_copa/acc"] <= 1
    assert (sweep_dir / "benchmarks.png").read_bytes()[:4] == b"\x89PNG" and "benchmarks.png" in result.stdout


@pytest.mark.signals
def test_ctrl_c_stops_the_whole_sweep_with_a_checkpoint(workdir):
    """A terminal's Ctrl-C (SIGINT to the process group) in the second of three jobs: that job stops with a
    checkpoint, the third does not start, `run` exits 3 and says how to continue, without a traceback."""
    job = start_cli("-m", *SHORT, "train.log_every=1", "train.max_steps=4,2000,6", cwd=workdir, new_session=True)
    sweeps = workdir / "outputs" / "multirun"

    def second_job_trains():
        logged = list(sweeps.glob("*/*/1/metrics.jsonl"))
        return logged and any("loss" in json.loads(line) for line in logged[0].read_text().splitlines())

    try:
        wait_until(second_job_trains, "the second job to train", job)
        os.killpg(job.pid, signal.SIGINT)
        stdout, stderr = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 3, stderr[-3000:]
    [sweep_dir] = workdir.glob("outputs/multirun/*/*")
    rows = list(csv.DictReader((sweep_dir / "report.csv").open()))
    assert [row["status"] for row in rows] == ["completed", "stopped", "not started"]
    assert list((sweep_dir / "1" / "checkpoints").glob("step_*/meta.json"))
    assert not (sweep_dir / "2").exists()
    assert f"continue with: run resume={(sweep_dir / '1').resolve()}" in stderr
    last = stderr.rstrip().splitlines()[-1]
    assert last.startswith("not started: run ") and "train.max_steps=6" in last
    assert "Traceback" not in stderr and "Error executing job" not in stderr


def test_optuna_sweeper_minimises_the_eval_loss(workdir):
    result = run_cli(
        "-m",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.sampler.seed=0",
        "optim.lr=interval(0.0005,0.01)",
        *SHORT,
        cwd=workdir,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "setup plugin" not in result.stdout + result.stderr  # alembic's chatter, under Optuna
    assert "\x1b[" not in result.stdout + result.stderr  # Optuna's colours, not on a terminal
    [sweep_dir] = workdir.glob("outputs/multirun/*/*")
    rows = list(csv.DictReader((sweep_dir / "report.csv").open()))
    assert len(rows) == 2 and all(row["status"] == "completed" for row in rows)
    report = (sweep_dir / "report.md").relative_to(workdir)
    assert f"sweep report: {report} (and report.csv, loss_curves.png)" in result.stdout
    best = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    best_row = min(rows, key=lambda row: float(row["eval_loss"]))
    assert best["best_value"] == pytest.approx(float(best_row["eval_loss"]))
    assert f"optim.lr={best['best_params']['optim.lr']}" in best_row["overrides"]


def test_an_estimate_sweep_over_glob_estimates_every_option_and_trains_nothing(workdir):
    result = run_cli("-m", "task=estimate", "strategy=glob(*dp)", "hardware.nproc_per_node=2", cwd=workdir)
    assert result.returncode == 0, result.stderr[-2000:]
    assert [line for line in result.stdout.splitlines() if line.startswith("== ")] == [
        "== task=estimate strategy=ddp hardware.nproc_per_node=2",
        "== task=estimate strategy=fsdp hardware.nproc_per_node=2",
    ]
    assert not (workdir / "outputs").exists()


def test_a_sweep_set_by_hydra_mode_in_a_recipe_or_on_the_command_line_sweeps_without_m(workdir):
    """`hydra.mode: MULTIRUN` with the sweeper's params, as Hydra lets a config declare its sweep: `run` reads the
    mode Hydra composes where a recipe or the command line may set it (and decides it from `-m` alone elsewhere)."""
    (workdir / "recipes").mkdir()
    (workdir / "recipes" / "two_strategies.yaml").write_text(
        "# @package _global_\n# a sweep declared in a recipe\ndefaults:\n  - override /task: estimate\n"
        "hardware: {nproc_per_node: 2}\nhydra: {mode: MULTIRUN, sweeper: {params: {strategy: 'ddp,fsdp'}}}\n"
    )
    for args in (
        ["recipe=two_strategies"],
        ["hydra.mode=MULTIRUN", "task=estimate", "hardware.nproc_per_node=2", "strategy=ddp,fsdp"],
    ):
        result = run_cli(*args, cwd=workdir)
        assert result.returncode == 0, result.stderr[-2000:]
        jobs = [
            re.search(r"strategy=\w+", line).group() for line in result.stdout.splitlines() if line.startswith("== ")
        ]
        assert jobs == ["strategy=ddp", "strategy=fsdp"], (args, result.stdout[-2000:])


def test_an_estimate_sweep_prints_each_jobs_plan_and_their_total(workdir):
    """Three jobs' plans, each after its estimate, then the sweep's: their wall times, GPU-hours and cost summed."""
    from runner.config.spec import validate
    from runner.planning.time_plan import plan, sweep_line

    job = ["task=estimate", "model=llama3_2_1b", "hardware=h100_80gb", "precision=bf16", "hardware.cost_per_gpu_hour=3"]
    result = run_cli("-m", *job, "train.max_steps=10000,20000,40000", cwd=workdir)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not (workdir / "outputs").exists()
    plans = [
        plan(
            validate(composed([*job, f"train.max_steps={steps}"]), on_this_machine=False), runs_dir=workdir / "outputs"
        )
        for steps in (10000, 20000, 40000)
    ]
    lines = result.stdout.strip().splitlines()
    shown = [line for line in lines if line.startswith("time: ")]
    assert shown == [planned.line() for planned in plans]
    assert lines[-1] == sweep_line(plans)

    def hours_and_cost(line):
        return [
            float(value.replace(",", "")) for value in re.search(r"([\d.,]+) GPU-hours, \$([\d.,]+)", line).groups()
        ]

    # the total is the sum of the jobs' plans as their lines show them (to their rounding)
    jobs = [hours_and_cost(line) for line in shown]
    total_hours, total_cost = hours_and_cost(lines[-1])
    assert total_hours == pytest.approx(sum(hours for hours, _ in jobs), rel=1e-2)
    assert total_cost == pytest.approx(sum(cost for _, cost in jobs), abs=0.02) and total_cost > 0
    assert lines[-1].startswith("sweep: 3 jobs, about ")
