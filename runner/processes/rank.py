"""One rank of a multi-process job, from its start to its end: a worker of the elastic launcher (which ends with
its controller), or a task of a submitit job (which meets the job's other tasks itself); its logging, its process
group and the task it runs on its rank."""

from __future__ import annotations

import logging
import os
import select
import socket
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from torch.distributed.elastic.multiprocessing.errors import record

from runner.distributed import Ranks, close_process_group
from runner.errors import CollectiveTimedOut, ExitStatus, Stopped, WorkerFailed
from runner.framework_imports import import_frameworks
from runner.library_noise import name_deepspeed_accelerator, quiet_loggers
from runner.processes.cluster import Task, check_reachable
from runner.processes.collective_timeouts import record_collectives, timed_out, timed_out_line
from runner.processes.stall_watch import StallWatch, stalls_file, watched_phase

if TYPE_CHECKING:
    from datetime import timedelta

    from runner.config.spec import RunSpec
    from runner.config.tracker import RunIdentity
    from runner.config.training import TrainConfig

# prctl(2)'s option for the signal a process gets when its parent ends.
PR_SET_PDEATHSIG = 1


@record
def worker(
    spec: RunSpec, run_dir: Path, log_format: dict[str, str], identity: RunIdentity, controller: int
) -> dict[str, Any]:
    """One rank of the elastic launcher's group, which ends with its controller (process `controller`): a stop ends
    it with the status that the controller reports."""
    end_with_controller(controller)
    try:
        return rank_main(spec, run_dir, log_format, identity)
    except Stopped as stop:
        logging.getLogger("runner").warning("%s", stop)
        sys.exit(ExitStatus.STOPPED)  # the launcher sees the exit status, and the controller reports the stop


def end_with_controller(controller: int) -> None:
    """A worker whose `run` process died (killed, out of memory) ends at once, saying why, instead of training on
    without it. torch's spawn would send it a SIGINT, which the loop takes for a stop that every rank of the job
    agrees on: the other nodes would then report a stop by a signal that none of them got."""
    import ctypes

    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, 0)
    try:
        ended = os.pidfd_open(controller)
    except ProcessLookupError:
        ended = None

    def watch() -> None:
        if ended is not None:
            select.select([ended], [], [])  # readable once the process has ended
        logging.getLogger("runner").error(
            "rank %s: this node's run process (%d) ended; leaving the job", os.environ["RANK"], controller
        )
        os._exit(ExitStatus.FAILED)

    threading.Thread(target=watch, name="end_with_controller", daemon=True).start()


def rank_main(
    spec: RunSpec, run_dir: Path, log_format: dict[str, str], identity: RunIdentity, task: Optional[Task] = None
) -> dict[str, Any]:
    """Runs the task as one rank of the job's process group: of the elastic launcher's workers, or the submitit job's
    `task`."""
    quiet_worker(spec.hardware.accelerator.value)  # before the imports: torchao's warn as they load
    import_frameworks()  # a spawned worker (CUDA) starts without them
    import torch
    import torch.distributed as dist

    ranks = Ranks(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))
    configure_worker_logging(run_dir, ranks.rank, log_format)
    logging.getLogger("runner.rank").info("rank %d of %d, process %d", ranks.rank, ranks.world_size, os.getpid())
    if spec.hardware.accelerator.value == "cuda":
        torch.cuda.set_device(ranks.local_rank)
        # NCCL reduces CUDA tensors only. Gloo takes the CPU ones: the loop's host-side sums, and under FSDP's
        # offload_params the gradients on the CPU that clipping reduces and the buffers that loading broadcasts.
        backend, device = "cpu:gloo,cuda:nccl", torch.device("cuda", ranks.local_rank)
    else:
        if "OMP_NUM_THREADS" not in os.environ:  # share the cores, as torchrun does, instead of oversubscribing them
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(os.environ["LOCAL_WORLD_SIZE"])))
        backend, device = "gloo", None
    record_collectives(run_dir, ranks.rank)
    joining = StallWatch(ranks.rank, spec.train.stall_report_s, stalls_file(run_dir, ranks.rank))
    joining.entering("joining the process group")
    try:
        timeout = collective_timeout(spec.train)
        if task is None:  # the elastic launcher's agent holds the rendezvous
            dist.init_process_group(backend, device_id=device, timeout=timeout)
        else:
            join_task_group(task, backend, device, spec.hardware.rdzv_timeout_s, timeout)
    finally:
        joining.close()
    try:
        return spec.task.run(spec, run_dir, ranks, identity)
    except Exception as error:
        # This rank's error goes to the launcher's error file before the group closes: closing it fails a peer that
        # waits in a collective, and the launcher, seeing that peer fail first, may end this rank before the
        # error file is written (the peer's lost connection would then be all the job could say).
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        if timed_out(error):  # its one line for the report; the traceback, of no use to the user, to its log
            logging.getLogger("runner.rank").error("rank %d: a collective timed out", ranks.rank, exc_info=error)
            line = CollectiveTimedOut(timed_out_line(ranks.rank, run_dir, watched_phase()))
            ErrorHandler().record_exception(line)
            raise line from None
        ErrorHandler().record_exception(error)
        raise
    finally:
        close_process_group()


def configure_worker_logging(run_dir: Path, rank: int, log_format: dict[str, str]) -> None:
    """rank<N>.log for every rank; rank 0 also writes the console and the run's run.log, as a single run does. The
    handlers Hydra set up for the whole job (in a forked worker, or a task of a submitit job) go first."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    formatter = logging.Formatter(log_format.get("format"), log_format.get("datefmt"))
    handlers: list[logging.Handler] = [logging.FileHandler(run_dir / f"rank{rank}.log")]
    if rank == 0:
        # The console and run.log show the job as a whole: rank 0's lines, without the per-rank ones.
        for shared in (logging.StreamHandler(sys.stdout), logging.FileHandler(run_dir / "run.log")):
            shared.addFilter(lambda record: record.name != "runner.rank")
            handlers.append(shared)
    root.setLevel(logging.INFO)
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)


def quiet_worker(accelerator: str) -> None:
    """A spawned worker starts with fresh warning filters: the controller's do not reach it."""
    import warnings

    quiet_loggers()
    name_deepspeed_accelerator(accelerator)
    # DeepSpeed still calls collectives that torch has renamed, once per step.
    warnings.filterwarnings("ignore", category=FutureWarning, message=r".*torch\.distributed\..* is deprecated")
    # FSDP's sharded fp16 loss scaler hands DTensor a one-element tensor for its overflow flag, as designed.
    warnings.filterwarnings("ignore", category=UserWarning, message=r"Found a non-scalar tensor with numel=1")


def run_task(
    task: Task, spec: RunSpec, run_dir: Path, log_format: dict[str, str], identity: RunIdentity
) -> dict[str, Any]:
    """Runs the job as rank `task.rank` of a submitit job: the rendezvous is the job's first host, on a port drawn from
    its id. SLURM started every task; none starts workers of its own."""
    check_reachable(task.main_host)
    os.environ.update(
        RANK=str(task.rank),
        LOCAL_RANK=str(task.local_rank),
        WORLD_SIZE=str(task.world_size),
        LOCAL_WORLD_SIZE=str(task.tasks_per_node),
        MASTER_ADDR=task.main_host,
        MASTER_PORT=str(task_port(task.job_id)),
    )
    return rank_main(spec, run_dir, log_format, identity, task)


def collective_timeout(train: TrainConfig) -> Optional[timedelta]:
    """How long a collective may wait for a rank before the process group ends it with an error (NCCL's watchdog,
    gloo's own wait): train.collective_timeout_s, else three stall reports (train.stall_report_s), and at least 10
    minutes, torch's NCCL default, which a large model's checkpoint can take; torch's own without stall reports."""
    from datetime import timedelta

    if train.collective_timeout_s is not None:
        return timedelta(seconds=train.collective_timeout_s)
    return timedelta(seconds=max(600.0, 3 * train.stall_report_s)) if train.stall_report_s > 0 else None


def join_task_group(
    task: Task, backend: str, device: Any, timeout_s: int, collective_timeout: Optional[timedelta] = None
) -> None:
    """The tasks of a submitit job meet at a store on the job's first node, each waiting there up to
    hardware.rdzv_timeout_s for the others. A task that never comes (it failed first, its node went down) ends the
    wait with a report that names the meeting point, where torch would wait half an hour in silence."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    port = task_port(task.job_id)
    endpoint = f"{task.main_host}:{port}"
    logging.getLogger("runner").info(
        "task %d of %d: waiting up to %d s (hardware.rdzv_timeout_s) for the job's tasks at %s",
        task.rank,
        task.world_size,
        timeout_s,
        endpoint,
    )

    def not_met(cause: str) -> WorkerFailed:
        return WorkerFailed(
            f"task {task.rank} of {task.world_size} (SLURM job {task.job_id}): the job's tasks did not "
            f"meet at {endpoint}, where each waits up to {timeout_s} s (hardware.rdzv_timeout_s) for "
            f"the others: {cause}"
        )

    deadline = time.monotonic() + timeout_s
    # Task 0 serves the store; the others connect once it listens (torch's client, trying, prints C++ stack traces).
    refused = task.rank and wait_until_listening(task.main_host, port, deadline)
    if refused:
        raise not_met(f"task 0 never listened ({refused})")
    try:
        store = dist.TCPStore(
            task.main_host,
            port,
            task.world_size,
            is_master=task.rank == 0,
            wait_for_workers=True,
            timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())),
        )
        dist.init_process_group(
            backend,
            store=store,
            rank=task.rank,
            world_size=task.world_size,
            device_id=device,
            timeout=collective_timeout,
        )
    except dist.DistError as error:
        raise not_met(str(error).splitlines()[0]) from None
    # Past the meeting, the store serves the process groups, as torch's would.
    store.set_timeout(collective_timeout or default_pg_timeout)


def task_port(job_id: str) -> int:
    """The rendezvous port of a cluster job, which every task draws alike from the job's id: from 15000 to 24999,
    below the ports that Linux lends to outgoing connections (32768 on), which any process on the host may hold at
    any moment (a port drawn among them once collided with a client socket of another job)."""
    return 15000 + zlib.crc32(job_id.encode()) % 10000


def wait_until_listening(host: str, port: int, deadline: float) -> str:
    """Waits until a server accepts connections at host:port; past the deadline, the last refusal's words."""
    while True:
        try:
            socket.create_connection((host, port), timeout=5).close()
            return ""
        except OSError as error:
            if time.monotonic() > deadline:
                return str(error)
            time.sleep(1)
