"""Clusters: a sweep submitted through Hydra's submitit launcher (`hydra/launcher=slurm`, or `slurm_local`, the
same through submitit's local executor) runs each sweep point as one SLURM job whose nodes and tasks per node
come from the hardware group (conf/hydra/launcher/). SLURM starts every task, and each task is one rank: the
job starts no launcher of its own.
"""

from __future__ import annotations

import os
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

if TYPE_CHECKING:
    from runner.spec import RunSpec
    from runner.tracker import RunIdentity

SUBMITIT_LAUNCHERS = "hydra_plugins.hydra_submitit_launcher.submitit_launcher."


@dataclass(frozen=True)
class Task:
    """This process's place in a submitit job."""

    rank: int
    local_rank: int
    world_size: int
    tasks_per_node: int
    main_host: str
    job_id: str


def current_task() -> Task | None:
    """The submitit task this process is, or None outside a submitit job."""
    if "SUBMITIT_EXECUTOR" not in os.environ:
        return None
    import submitit

    job = submitit.JobEnvironment()
    return Task(job.global_rank, job.local_rank, job.num_tasks, job.num_tasks // job.num_nodes,
                job.hostnames[0], job.job_id)


def is_first_task() -> bool:
    task = current_task()
    return task is None or task.rank == 0


def submits_to_cluster(config: DictConfig) -> bool:
    """Whether the sweep's jobs go through submitit, where each task is one rank."""
    return str(config.hydra.launcher.get("_target_", "")).startswith(SUBMITIT_LAUNCHERS)


def check_launcher(launcher: DictConfig, job_config: DictConfig) -> None:
    """The submitit job of a sweep point must have one task per rank of that point's spec, as its hardware option
    declares it (before validation fills in the submitting machine's)."""
    from omegaconf.errors import OmegaConfBaseException

    from runner.spec import SpecError

    if launcher._target_.endswith("SlurmLauncher") and not shutil.which("sbatch"):
        raise SpecError("hydra/launcher=slurm submits with sbatch, which this machine does not have: submit from a "
                        "SLURM login node, or try the sweep here with hydra/launcher=slurm_local")
    declared = job_config.hardware
    if declared.accelerator == "auto" or declared.nproc_per_node is None:
        raise SpecError("a cluster job needs a hardware option that declares its nodes' devices (for example "
                        "hardware=8xh100_80gb, or hardware=cpu hardware.nproc_per_node=2), not hardware=auto: "
                        "the machine that submits is not the one that trains")
    try:
        asked = f"{launcher.nodes} node(s) x {launcher.tasks_per_node} task(s)"
    except OmegaConfBaseException:  # the sweep's own hardware declares no process count
        asked = "no fixed number of tasks"
    if asked != f"{declared.nnodes} node(s) x {declared.nproc_per_node} task(s)":
        raise SpecError(f"hydra.launcher asks for {asked} but the spec has hardware.nnodes={declared.nnodes} x "
                        f"hardware.nproc_per_node={declared.nproc_per_node} ranks, one per task; choose "
                        "hydra/launcher=slurm (or slurm_local), which takes both from the hardware group, and keep "
                        "them the same across a sweep's points")


def run_task(task: Task, spec: RunSpec, run_dir: Path, log_format: dict[str, str], identity: RunIdentity) -> dict[str, Any]:
    """Trains as rank `task.rank` of the job: the rendezvous is the job's first host, on a port drawn from its id."""
    import logging

    from runner.launch import worker

    os.environ.update(
        RANK=str(task.rank),
        LOCAL_RANK=str(task.local_rank),
        WORLD_SIZE=str(task.world_size),
        LOCAL_WORLD_SIZE=str(task.tasks_per_node),
        MASTER_ADDR=task.main_host,
        MASTER_PORT=str(20000 + zlib.crc32(task.job_id.encode()) % 20000),
    )
    # Hydra set up this task's logging as for a single run; the worker's own puts rank 0 on the console and in
    # run.log and every rank in rank<N>.log.
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    # submitit reports the task's end in its own files; in run.log, its "completed" would follow a failure that
    # Hydra caught.
    logging.getLogger("submitit").propagate = False
    return worker(spec, run_dir, log_format, identity)
