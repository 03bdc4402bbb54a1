"""A sweep through Hydra's submitit launcher: one job per point, nodes and tasks from the hardware group, each
task one rank. submitit's local executor runs it here as SLURM would on a cluster."""

import csv
import json
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from runner.cli.compose import CONF_DIR
from tests.support.command import run_cli
from tests.support.specs import QUICK

SHORT = [
    *QUICK,
    "train.max_steps=6",
    "train.log_every=3",
    "train.eval_every=0",
    "train.eval_batches=2",
    "train.save_model=false",
]


@pytest.mark.distributed
def test_local_executor_runs_a_job_one_rank_per_task(workdir):
    """hydra/launcher=slurm_local: submitit's local executor starts each rank as a task, as SLURM does
    (tests/processes/test_slurm.py sweeps ddp and fsdp on a real SLURM cluster)."""
    result = run_cli(
        "-m",
        "hydra/launcher=slurm_local",
        "hardware=cpu",
        "hardware.nproc_per_node=2",
        "strategy=fsdp",
        *SHORT,
        cwd=workdir,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [sweep_dir] = workdir.glob("outputs/multirun/*/*")
    [row] = list(csv.DictReader((sweep_dir / "report.csv").open()))
    assert row["status"] == "completed"
    job_dir = sweep_dir / "0"
    assert json.loads((job_dir / "summary.json").read_text())["steps"] == 6
    # submitit started both tasks; each was one rank, and none started workers of its own.
    assert "rank 1 of 2" in (job_dir / "rank1.log").read_text()
    assert "starting 2 worker processes" not in (job_dir / "run.log").read_text()
    submitted = sorted(p.name for p in sweep_dir.glob(".submitit/*/*_log.out"))
    assert len(submitted) == 2 and {name.split("_")[1] for name in submitted} == {"0", "1"}


@pytest.mark.parametrize(
    "args,message",
    [
        (["hydra/launcher=slurm_local"], "a cluster job needs a hardware option that declares its nodes' devices"),
        (
            ["hydra/launcher=submitit_local", "hardware=cpu", "hardware.nproc_per_node=2", "strategy=ddp"],
            "hydra.launcher asks for 1 node(s) x 1 task(s) but the spec has hardware.nnodes=1 x "
            "hardware.nproc_per_node=2",
        ),
        (["hydra/launcher=slurm", "hardware=8xh100_80gb", "strategy=fsdp"], "hydra/launcher=slurm submits with sbatch"),
    ],
)
def test_cluster_sweeps_that_cannot_work_stop_before_submitting(args, message, workdir):
    result = run_cli("-m", *args, cwd=workdir, env={"PATH": str(workdir)})  # a machine without SLURM's commands
    assert result.returncode == 2
    assert message in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert not (workdir / "outputs").exists()


@pytest.mark.parametrize(
    "hardware,expected",
    [
        (["hardware=8xh100_80gb"], (1, 8, 8)),
        (["hardware=8xh100_80gb", "hardware.nnodes=4"], (4, 8, 8)),
        (["hardware=cpu", "hardware.nproc_per_node=2"], (1, 2, None)),
    ],
)
def test_the_slurm_job_takes_nodes_tasks_and_gpus_from_the_hardware_group(hardware, expected):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        config = compose("config", overrides=["hydra/launcher=slurm", *hardware], return_hydra_config=True)
    launcher = config.hydra.launcher
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == expected
    assert launcher._target_.endswith("SlurmLauncher") and launcher.timeout_min == 1440


@pytest.mark.parametrize(
    "missing,package",
    [("hydra/sweeper/optuna", "hydra-optuna-sweeper"), ("hydra/launcher/submitit_slurm", "hydra-submitit-launcher")],
)
def test_a_missing_hydra_plugin_names_its_package(missing, package):
    from hydra.errors import MissingConfigException

    from runner.cli.user_errors import one_line

    error = MissingConfigException(f"Could not load '{missing}'.", missing_cfg_file=missing, options=["basic"])
    assert one_line(error).endswith(f"plugin, which is not installed: pip install {package}")


def test_a_first_node_without_an_address_is_one_clear_error_not_a_wait():
    from runner.processes.cluster import check_reachable

    with pytest.raises(
        RuntimeError,
        match=r"the job's first node, node-that-is-not\.invalid \(SLURM_JOB_NODELIST\), "
        r"has no address on .*: its ranks cannot meet there",
    ):
        check_reachable("node-that-is-not.invalid")
    check_reachable("localhost")


def test_a_cluster_jobs_rendezvous_port_is_never_one_the_host_lends_to_outgoing_connections():
    """Every task draws the port alike from the job's id; a port in the host's ephemeral range may be held by any
    client socket (one such draw, 33791, failed with EADDRINUSE while a sweep's jobs ran side by side)."""
    from runner.processes.rank import task_port

    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ids = [str(n) for n in range(1, 5000)] + [f"{n}_{i}" for n in range(1, 500) for i in range(4)]
    ports = {task_port(job_id) for job_id in ids}
    assert all(1024 <= port < low or port > high for port in ports), (low, high)
    assert len(ports) > 0.5 * len(ids)  # drawn across the range, not one port for every job
    assert task_port("4_1") == task_port("4_1")


@pytest.mark.slow  # waits on real timeouts
@pytest.mark.parametrize(
    "rank,cause",
    [
        (0, r"Timed out after \d+ seconds waiting for clients\. 1/2 clients joined\."),
        (1, r"task 0 never listened \(.*Connection refused\)"),
    ],
)
def test_a_task_whose_peers_never_come_ends_its_wait_with_one_line(rank, cause):
    """A task of a SLURM job waits hardware.rdzv_timeout_s for the others at the job's first node, then says where it
    waited and for whom: task 0 for the others, the others for task 0 (which failed before it got there, say)."""
    import socket

    from runner.errors import WorkerFailed
    from runner.processes.cluster import Task
    from runner.processes.rank import join_task_group, task_port

    def free(port: int) -> bool:
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", port)) != 0

    job_id = next(job for job in map(str, range(100, 200)) if free(task_port(job)))
    task = Task(
        rank=rank, local_rank=rank, world_size=2, tasks_per_node=2, main_host="127.0.0.1", job_id=job_id, restarts=0
    )
    with pytest.raises(WorkerFailed) as failed:
        join_task_group(task, "gloo", None, timeout_s=2)
    message = str(failed.value)
    assert "\n" not in message
    assert re.fullmatch(
        rf"task {rank} of 2 \(SLURM job {job_id}\): the job's tasks did not meet at "
        rf"127\.0\.0\.1:{task_port(job_id)}, where each waits up to 2 s \(hardware\.rdzv_timeout_s\) "
        rf"for the others: {cause}",
        message,
    ), message


def test_a_requeued_job_that_starts_over_writes_its_metrics_afresh(tmp_path):
    """A job requeued before its first checkpoint runs again from step 0 in its own run directory."""
    from runner.components.trackers import MetricsFile

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n')
    metrics = MetricsFile(path)
    metrics.log({"loss": 5.0}, step=1)
    metrics.finish()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1]
