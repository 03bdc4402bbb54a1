"""Jobs on a real SLURM cluster (slurmctld, two slurmd, slurmdbd: tests/support/slurm.py) through Hydra's submitit
launcher, `hydra/launcher=slurm`, as on a real cluster: sweeps, a failed job, the time limit's warning, `scontrol
requeue`, `scancel`, and a job over two nodes. The final states are SLURM's own, from sacct."""

import contextlib
import csv
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Optional

import pytest

from tests.support.command import Started, run_cli, start_cli
from tests.support.runs import hold_at_step, last_step, step_losses, wait_until
from tests.support.specs import QUICK

pytestmark = pytest.mark.cluster

SHORT = [*QUICK, "train.max_steps=6", "train.log_every=1", "train.eval_every=0", "train.eval_batches=2"]
ON_SLURM = ["-m", "hydra/launcher=slurm", "hardware=cpu"]


def start(*args: str, cwd: Path) -> Started:
    return start_cli(*args, cwd=cwd, new_session=True)


def finished(job: Started, timeout: float = 600) -> tuple[int, str, str]:
    try:
        stdout, stderr = job.communicate(timeout=timeout)
    finally:
        job.kill()
    return job.returncode, stdout, stderr


def sweep_dir(cwd: Path) -> Path:
    [found] = cwd.glob("outputs/multirun/*/*")
    return found


def report(cwd: Path) -> list[dict[str, str]]:
    return list(csv.DictReader((sweep_dir(cwd) / "report.csv").open()))


def slurm_jobs(cwd: Path) -> list[str]:
    """The SLURM job ids of a sweep's jobs, from the names of their tasks' logs (<job>_<task>_log.out)."""
    logs = (sweep_dir(cwd) / ".submitit").glob("*/*_log.out")
    return sorted({re.sub(r"_\d+_log\.out$", "", log.name) for log in logs})


def sacct(job_id: str, *fields: str, every_run: bool = False) -> list[dict[str, str]]:
    """SLURM's accounting records of a job (each run of a requeued one with `every_run`)."""
    names = ["JobID", "State", *fields]
    done = subprocess.run(
        ["sacct", "-j", job_id, "-X", "-n", "-P", "-o", ",".join(names), *(["--duplicates"] if every_run else [])],
        capture_output=True,
        text=True,
        check=True,
    )
    return [dict(zip(names, line.split("|"))) for line in done.stdout.splitlines()]


def final_state(job_id: str) -> str:
    """The job's state once slurmdbd has it (it comes a moment after the job ends)."""
    deadline = time.monotonic() + 30
    while True:
        [record] = sacct(job_id)
        if record["State"] not in ("RUNNING", "COMPLETING", "PENDING", "REQUEUED") or time.monotonic() > deadline:
            return record["State"]
        time.sleep(1)


def rank_processes(run_dir: Path, ranks: int) -> list[int]:
    """The processes of a job's ranks (SLURM's tasks), from their rank logs: those of the job's latest run."""
    pids = [
        re.findall(rf"rank {rank} of {ranks}, process (\d+)", (run_dir / f"rank{rank}.log").read_text())
        for rank in range(ranks)
    ]
    return [int(found[-1]) for found in pids]


def pending(pid: int, signum: int) -> bool:
    """Whether a signal waits for a stopped process (the kernel's pending set, /proc/<pid>/status); False once the
    process has ended."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    masks = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("ShdPnd:", "SigPnd:"))]
    return any(mask & (1 << (signum - 1)) for mask in masks)


TIME_LIMIT_TEST = "test_a_job_at_its_time_limit_checkpoints_is_requeued_and_ends_with_the_uninterrupted_losses"
TIME_LIMITED = [
    "strategy=ddp",
    "hardware.nproc_per_node=2",
    *QUICK,
    "train.max_steps=12",
    "train.log_every=1",
    "train.eval_every=0",
    "train.save_model=false",
]


# A job at most this old (SLURM's clock) when its ranks are held: cut to a one-minute limit, it still has 31 s or
# more left, so that one of SLURM's next two time checks finds less than 31 s left and none finds it past its end.
YOUNG_S = 28


def run_time_s(job_id: str) -> int:
    """How long the job has run, by SLURM's clock (`scontrol show job`'s RunTime)."""
    shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, check=True).stdout
    days, hours, minutes, seconds = re.search(r"RunTime=(?:(\d+)-)?(\d+):(\d+):(\d+)", shown).groups()
    return ((int(days or 0) * 24 + int(hours)) * 60 + int(minutes)) * 60 + int(seconds)


class TimeLimitedJob:
    """A job with a two-minute time limit and the warning 1 s ahead: SLURM sends SIGUSR2 once its time checks
    (every 30 s) find less than 31 s left, 89 to 119 s into the run. Its ranks are held still (SIGSTOP) from
    their third step until the warning reaches them, so that it comes mid-run on a machine of any speed: SLURM
    continues them as it signals them, or the signal waits for them and the thread continues them. The thread
    does that while the module's other tests use the cluster; their jobs are submitted once the ranks are held,
    so that these start alone. A job held within YOUNG_S of its start has its limit cut to one minute as its
    ranks stop (`scontrol update`, as an administrator may): SLURM's warning then comes 29 to 59 s into the run,
    a minute sooner. Once warned it has its two minutes back, for the run after the requeue. A job held later
    keeps its two minutes throughout."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.job = start(
            *ON_SLURM, "hydra.launcher.timeout_min=2", "hydra.launcher.signal_delay_s=1", *TIME_LIMITED, cwd=cwd
        )
        self.error: Optional[BaseException] = None
        self.held = threading.Event()  # its ranks are held (or the thread failed)
        self.thread = threading.Thread(target=self._hold_until_warned, name="time limit", daemon=True)
        self.thread.start()

    def _hold_until_warned(self) -> None:
        try:
            self.run_dir = wait_until(
                lambda: next(iter(self.cwd.glob("outputs/multirun/*/*/0")), None),
                "the job's run directory",
                self.job,
                timeout=600,
            )
            wait_until(lambda: last_step(self.run_dir) >= 3, "the job's third step", self.job, timeout=600)
            ranks = rank_processes(self.run_dir, 2)
            for pid in ranks:
                os.kill(pid, signal.SIGSTOP)
            [job_id] = slurm_jobs(self.cwd)
            self.cut_short = run_time_s(job_id) <= YOUNG_S
            if self.cut_short:
                subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=1"], check=True)
            self.held.set()

            def warned() -> bool:
                return (
                    any(pending(pid, signal.SIGUSR2) for pid in ranks)
                    or "stopped by SIGUSR2" in (self.run_dir / "run.log").read_text()
                )

            wait_until(warned, "SLURM's warning before the time limit", self.job, timeout=240, every=0.5)
            for pid in ranks:  # SLURM may have continued them itself, and they may have ended since
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            if self.cut_short:  # not checked: without it, the run after the requeue may be warned once more
                subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=2"], capture_output=True)
        except BaseException as error:  # raised again in the test
            self.error = error
            self.held.set()

    def finished(self) -> tuple[int, str, str]:
        self.thread.join(timeout=900)
        if self.error is not None:
            self.job.kill()
            raise self.error
        return finished(self.job, timeout=900)


@pytest.fixture(scope="module", autouse=True)
def time_limited_job(request, tmp_path_factory):
    """Started as the module starts, when its test is chosen: SLURM's clock then runs while the other tests run."""
    if not any(item.originalname == TIME_LIMIT_TEST for item in request.session.items):
        yield None
        return
    request.getfixturevalue("slurm_cluster")
    job = TimeLimitedJob(tmp_path_factory.mktemp("time_limited"))
    yield job
    job.job.kill()


def test_sweeps_failures_and_two_nodes_run_as_slurm_jobs(slurm_cluster, time_limited_job, tmp_path):
    """A 2-point sweep of 2-task jobs, a one-task job that fails, and a job over SLURM's two nodes, side by side."""
    if time_limited_job is not None:  # its ranks start alone, to be held while it is young (TimeLimitedJob)
        time_limited_job.held.wait(timeout=900)
    sweep = start(*ON_SLURM, "hardware.nproc_per_node=2", "strategy=ddp,fsdp", *SHORT, cwd=tmp_path / "sweep")
    # 4 query heads cannot share 3 key-value heads: the spec is valid, the first forward fails.
    failing = start(
        *ON_SLURM,
        "hardware.nproc_per_node=1",
        *SHORT,
        "model.architecture.num_key_value_heads=3",
        cwd=tmp_path / "failing",
    )
    two_nodes = start(
        *ON_SLURM, "hardware.nnodes=2", "hardware.nproc_per_node=1", "strategy=fsdp", *SHORT, cwd=tmp_path / "two_nodes"
    )

    code, stdout, stderr = finished(sweep)
    assert code == 0, stderr[-3000:]
    rows = report(tmp_path / "sweep")
    assert [(row["swept"], row["status"]) for row in rows] == [
        ("strategy=ddp", "completed"),
        ("strategy=fsdp", "completed"),
    ]
    for job in ("0", "1"):
        run_dir = sweep_dir(tmp_path / "sweep") / job
        assert json.loads((run_dir / "summary.json").read_text())["steps"] == 6
        assert (run_dir / "model" / "config.json").exists() and (run_dir / "spec.yaml").exists()
        assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00000006"]
        assert "rank 1 of 2" in (run_dir / "rank1.log").read_text()
    assert [final_state(job) for job in slurm_jobs(tmp_path / "sweep")] == ["COMPLETED", "COMPLETED"]

    code, stdout, stderr = finished(failing)
    assert code == 1
    first_line = stderr[stderr.index("run: error: ") :].splitlines()[0]
    assert "must match the size of tensor b (3)" in first_line
    [row] = report(tmp_path / "failing")
    assert row["status"] == "failed" and "must match the size of tensor b (3)" in row["error"]
    assert "must match the size of tensor b (3)" in (sweep_dir(tmp_path / "failing") / "0" / "error.txt").read_text()

    code, stdout, stderr = finished(two_nodes)
    assert code == 0, stderr[-3000:]
    [job_id] = slurm_jobs(tmp_path / "two_nodes")
    [record] = sacct(job_id, "NNodes", "NodeList")
    assert record["NNodes"] == "2", record
    two_node_run = sweep_dir(tmp_path / "two_nodes") / "0"
    assert "fsdp FULL_SHARD, 2 processes" in (two_node_run / "run.log").read_text()
    # Two nodes of one rank each compute what one node of two ranks does.
    assert step_losses(two_node_run) == step_losses(sweep_dir(tmp_path / "sweep") / "1")


@pytest.mark.signals
def test_the_warning_signal_and_scontrol_requeue_resume_exactly_and_scancel_stops_with_a_checkpoint(
    slurm_cluster, tmp_path
):
    """One job: SLURM's warning signal (sent now, with scancel --signal), then `scontrol requeue`, then scancel;
    against the same job run here without a stop, as far as the job went."""
    job = [
        "strategy=single",
        "hardware.nproc_per_node=1",
        *QUICK,
        "train.max_steps=5000",
        "train.log_every=1",
        "train.eval_every=0",
        "train.save_model=false",
    ]
    submitted = start(*ON_SLURM, *job, cwd=tmp_path / "slurm")
    uninterrupted = None
    try:
        wait_until(lambda: list(tmp_path.glob("slurm/outputs/multirun/*/*/0/metrics.jsonl")), "the job to train")
        run_dir = sweep_dir(tmp_path / "slurm") / "0"
        [job_id] = slurm_jobs(tmp_path / "slurm")
        log = run_dir / "run.log"
        for stop in (["scancel", "--signal=USR2", job_id], ["scontrol", "requeue", job_id], ["scancel", job_id]):
            resumed = [int(step) for step in re.findall(r"resuming from step (\d+)", log.read_text())]
            wait_until(lambda: len(step_losses(run_dir)) >= (resumed[-1] if resumed else 0) + 5, "5 more steps")
            subprocess.run(stop, check=True)
            if stop[0] != "scancel" or stop[1:2] == ["--signal=USR2"]:
                wait_until(lambda: log.read_text().count("resuming from step") > len(resumed), f"{stop} to resume")
        code, stdout, stderr = finished(submitted, timeout=120)
        text = log.read_text()
        stopped_at = [int(step) for step in re.findall(r"stopped by SIG\w+ after step (\d+)", text)]
        # Run here once the job has ended, as far as it went: the two do not share the two cores.
        uninterrupted = start_cli("hardware=cpu", *job, cwd=tmp_path / "here", stop_at_step=stopped_at[-1])
        here, _ = hold_at_step(uninterrupted, tmp_path / "here")
    finally:
        for process in (submitted, uninterrupted):
            if process is not None:
                process.kill()
    assert code == 3, stderr[-3000:]
    assert re.findall(r"stopped by (SIG\w+) after", text) == ["SIGUSR2", "SIGTERM", "SIGTERM"], text
    assert re.findall(r"resuming from step (\d+)", text) == [str(step) for step in stopped_at[:2]]
    [row] = report(tmp_path / "slurm")
    assert row["status"] == "stopped" and f"after step {stopped_at[-1]}, checkpoint" in row["error"]
    assert (run_dir / "checkpoints" / f"step_{stopped_at[-1]:08d}" / "meta.json").exists()
    assert "Stopped: stopped by SIGTERM" in (run_dir / "error.txt").read_text()
    assert [record["State"] for record in sacct(job_id, every_run=True)][:2] == ["REQUEUED", "REQUEUED"]
    assert final_state(job_id).startswith("CANCELLED")
    losses = step_losses(run_dir)
    assert len(losses) == stopped_at[-1] and losses == step_losses(here)[: len(losses)]


@pytest.mark.signals
def test_a_job_at_its_time_limit_checkpoints_is_requeued_and_ends_with_the_uninterrupted_losses(
    time_limited_job, tmp_path
):
    """The time-limited job (TimeLimitedJob) checkpoints after the step the warning reaches, requeues itself,
    resumes, and ends with the losses of the same job run here without a stop."""
    assert run_cli("hardware=cpu", *TIME_LIMITED, cwd=tmp_path / "here").returncode == 0
    code, stdout, stderr = time_limited_job.finished()
    assert code == 0, stderr[-3000:]
    [job_id] = slurm_jobs(time_limited_job.cwd)
    assert final_state(job_id) == "COMPLETED"
    assert "REQUEUED" in [record["State"] for record in sacct(job_id, every_run=True)]
    run_dir = time_limited_job.run_dir
    log = (run_dir / "run.log").read_text()
    stopped_at = [int(step) for step in re.findall(r"stopped by SIGUSR2 after step (\d+)", log)]
    resumed_at = [int(step) for step in re.findall(r"resuming from step (\d+)", log)]
    assert stopped_at and set(resumed_at) == set(stopped_at) and "requeued SLURM job" in log, log
    [here] = (tmp_path / "here").glob("outputs/*/*")
    assert step_losses(run_dir) == step_losses(here) and len(step_losses(here)) == 12
