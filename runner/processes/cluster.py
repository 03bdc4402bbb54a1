"""Clusters: a sweep submitted through Hydra's submitit launcher (`hydra/launcher=slurm`, or `slurm_local`, the
same through submitit's local executor) runs each sweep point as one SLURM job whose nodes and tasks per node
come from the hardware group (conf/hydra/launcher/). SLURM starts every task, and each task is one rank: the
job starts no launcher of its own.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from typing import Optional

from omegaconf import DictConfig

from runner.errors import SpecError

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
    # How many times SLURM has requeued the job (its time limit, a preemption, `scontrol requeue`).
    restarts: int


def current_task() -> Optional[Task]:
    """The submitit task this process is, or None outside a submitit job."""
    if "SUBMITIT_EXECUTOR" not in os.environ:
        return None
    import submitit

    job = submitit.JobEnvironment()
    return Task(
        job.global_rank,
        job.local_rank,
        job.num_tasks,
        job.num_tasks // job.num_nodes,
        job.hostnames[0],
        job.job_id,
        int(os.environ.get("SLURM_RESTART_COUNT", "0")),
    )


def check_reachable(host: str) -> None:
    """The ranks meet on the job's first node, by its SLURM name: a name without an address would keep them
    waiting until the rendezvous times out."""
    try:
        socket.getaddrinfo(host, None)
    except OSError as error:
        raise RuntimeError(
            f"the job's first node, {host} (SLURM_JOB_NODELIST), has no address on "
            f"{socket.gethostname()} ({error.strerror}): its ranks cannot meet there"
        ) from None


def requeued(task: Task) -> bool:
    """Whether SLURM is putting the job back in the queue (`scontrol requeue`, a preemption) rather than ending it
    (scancel): it counts the restart as it signals the job."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", task.job_id], capture_output=True, text=True, timeout=60)
    restarts = re.search(r"\bRestarts=(\d+)", shown.stdout)
    return restarts is not None and int(restarts.group(1)) > task.restarts


def requeue(task: Task) -> None:
    """Puts the job back in the queue; SLURM ends this run of it and starts it again, from its checkpoint."""
    done = subprocess.run(["scontrol", "requeue", task.job_id], capture_output=True, text=True, timeout=60)
    # The SIGTERM by which SLURM ends this run of the job reaches every process of it, scontrol too, and on a busy
    # node it may do so before scontrol exits: then the restart count says whether the requeue was done.
    if done.returncode != 0 and not requeued(task):
        said = (done.stderr or done.stdout).strip() or f"exit status {done.returncode}, nothing said"
        raise RuntimeError(
            f"scontrol requeue {task.job_id} failed: {said}; the checkpoint is kept: requeue or "
            "resubmit the job to continue"
        )
    logging.getLogger("runner").warning(
        "the time limit is near: requeued SLURM job %s, which resumes from its checkpoint", task.job_id
    )


def is_first_task() -> bool:
    task = current_task()
    return task is None or task.rank == 0


def submits_to_cluster(config: DictConfig) -> bool:
    """Whether the sweep's jobs go through submitit, where each task is one rank."""
    return str(config.hydra.launcher.get("_target_", "")).startswith(SUBMITIT_LAUNCHERS)


def check_submitter(launcher: DictConfig) -> None:
    """A sweep whose jobs go to SLURM (not one that only plans them, task=estimate) is submitted with sbatch."""
    if launcher._target_.endswith("SlurmLauncher") and not shutil.which("sbatch"):
        raise SpecError(
            "hydra/launcher=slurm submits with sbatch, which this machine does not have: submit from a "
            "SLURM login node, or try the sweep here with hydra/launcher=slurm_local"
        )


def check_launcher(launcher: DictConfig, job_config: DictConfig) -> None:
    """The submitit job of a sweep point must have one task per rank of that point's spec, as its hardware option
    declares it (before validation fills in the submitting machine's)."""
    from omegaconf.errors import OmegaConfBaseException

    declared = job_config.hardware
    if declared.accelerator == "auto" or declared.nproc_per_node is None:
        raise SpecError(
            "a cluster job needs a hardware option that declares its nodes' devices (for example "
            "hardware=8xh100_80gb, or hardware=cpu hardware.nproc_per_node=2), not hardware=auto: "
            "the machine that submits is not the one that trains"
        )
    try:
        asked = (launcher.nodes, launcher.tasks_per_node)
    except OmegaConfBaseException:  # the sweep's own hardware declares no process count
        asked = None
    if asked != (declared.nnodes, declared.nproc_per_node):
        shape = f"{asked[0]} node(s) x {asked[1]} task(s)" if asked else "no fixed number of tasks"
        raise SpecError(
            f"hydra.launcher asks for {shape} but the spec has hardware.nnodes={declared.nnodes} x "
            f"hardware.nproc_per_node={declared.nproc_per_node} ranks, one per task; choose "
            "hydra/launcher=slurm (or slurm_local), which takes both from the hardware group, and keep "
            "them the same across a sweep's points"
        )
