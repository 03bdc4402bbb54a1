"""The worker processes of a multi-process job: started through PyTorch's elastic launcher (torchrun's
machinery), or, in a job of Hydra's submitit launcher, each task of the job one worker.

The controller (the `run` process, where Hydra composed and validated the spec) starts one worker per local
device; each worker gets the resolved spec itself and never runs Hydra. A worker that fails stops the whole
group, and the controller reports that rank's error first.
"""

from __future__ import annotations

import logging
import os
import re
import select
import shutil
import socket
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from torch.distributed.elastic.multiprocessing.errors import record

from runner.compat import shutdown_timeout
from runner.distributed import Ranks, close_process_group, free_port
from runner.errors import CollectiveTimedOut, ExitStatus, Stopped, WorkerFailed, WriteFailed
from runner.files.checkpoint_dirs import complete_checkpoints
from runner.framework_imports import import_frameworks
from runner.library_noise import name_deepspeed_accelerator, quiet_launcher, quiet_loggers
from runner.memory.out_of_memory_report import out_of_memory_line, take_out_of_memory_record
from runner.processes.cluster import Task, check_reachable
from runner.processes.collective_timeouts import RECORD, record_collectives, timed_out, timed_out_line, waited
from runner.processes.stall_watch import StallWatch, stalls_file, watched_phase

if TYPE_CHECKING:
    from datetime import timedelta

    from runner.config.hardware import HardwareConfig
    from runner.config.spec import RunSpec
    from runner.config.tracker import RunIdentity
    from runner.config.training import TrainConfig

# prctl(2)'s option for the signal a process gets when its parent ends.
PR_SET_PDEATHSIG = 1
# A peer's end as gloo reports it, after the source location: "Read error [10.0.0.2]:6552: Connection reset by
# peer", "Connection closed by peer [10.0.0.2]:6552".
LOST_PEER = r"(\w[\w ]*\[[\w.:]+\]:\d+: )?Connection (reset|closed) by peer( \[[\w.:]+\]:\d+)?"


def launch(spec: RunSpec, run_dir: Path, log_format: dict[str, str], identity: RunIdentity) -> dict[str, Any]:
    """Runs the job's task on hardware.nproc_per_node local workers (of hardware.nnodes nodes); returns the summary of
    this node's first rank (every rank computes the same one)."""
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    hardware = spec.hardware
    endpoint = hardware.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    error_files = Path(tempfile.mkdtemp(prefix="runner-errors-"))
    config = LaunchConfig(
        min_nodes=hardware.nnodes,
        max_nodes=hardware.nnodes,
        nproc_per_node=hardware.nproc_per_node,
        # The rendezvous keeps a job's keys under its id, so every node must name the job alike, whatever the run
        # directory (named by the second it started) or the spelling of node 0's host (localhost, 127.0.0.1): the
        # store at the endpoint serves this one job.
        run_id="runner",
        rdzv_backend="static",
        rdzv_endpoint=endpoint,
        rdzv_configs={"rank": hardware.node_rank, "timeout": hardware.rdzv_timeout_s},
        max_restarts=0,
        start_method=start_method(hardware),
        # The workers' error files, for the report below: off the run directory's disk, which may be full.
        logs_specs=DefaultLogsSpecs(log_dir=str(error_files)),
        # On SIGTERM the workers finish their step and checkpoint before the launcher would kill them (torch 2.11:
        # within its fixed 30 s).
        **shutdown_timeout(600),
    )
    log = logging.getLogger("runner")
    # A spawned worker imports torch and the runner anew before it trains: seconds, which the line accounts for.
    spawned = " (spawned: each imports the libraries anew)" if config.start_method == "spawn" else ""
    if hardware.nnodes == 1:
        log.info("starting %d worker processes on this node%s", hardware.nproc_per_node, spawned)
    else:
        log.info(
            "node %d of %d: waiting up to %d s (hardware.rdzv_timeout_s) for the job's %d nodes at the rendezvous "
            "%s, then starting %d worker processes on this node%s",
            hardware.node_rank,
            hardware.nnodes,
            hardware.rdzv_timeout_s,
            hardware.nnodes,
            endpoint,
            hardware.nproc_per_node,
            spawned,
        )
    quiet_launcher()
    if hardware.node_rank:
        wait_for_node0(hardware, endpoint)
    try:
        results = elastic_launch(config, worker)(spec, run_dir, log_format, identity, os.getpid())
    except ChildFailedError as error:
        raise job_ended(error, spec, run_dir) from None
    except SignalException as error:
        raise stopped(run_dir, error.sigval.name) from None
    except DistError as error:  # outside the workers, only the rendezvous talks to the other nodes
        cause = str(error).splitlines()[0]  # a C++ stack trace may follow
        raise WorkerFailed(rendezvous_report(hardware, endpoint, cause)) from None
    finally:
        shutil.rmtree(error_files, ignore_errors=True)
    if hardware.node_rank:
        log.info(
            "node %d of %d: this node's ranks (%s) finished; the job's outputs are in node 0's run directory",
            hardware.node_rank,
            hardware.nnodes,
            ", ".join(map(str, sorted(results))),
        )
    return results[min(results)]


def start_method(hardware: HardwareConfig) -> str:
    """How the workers start: hardware.start_method, or by default (auto) as the accelerator needs. On CPUs, forked
    from this process, which has imported torch, transformers and the runner while it checked the spec: a worker
    trains within a second instead of importing them anew. On GPUs, spawned: a forked process cannot use the CUDA
    driver that its parent's libraries initialised. `spawn` on the CPU starts the workers as on GPUs."""
    if hardware.start_method.value != "auto":
        return hardware.start_method.value
    return "spawn" if hardware.accelerator.value == "cuda" else "fork"


def stopped(run_dir: Path, cause: str) -> Stopped:
    found = complete_checkpoints(run_dir)
    where = f"checkpoint {found[-1]}" if found else "no checkpoint"
    return Stopped(f"stopped by {cause}, {where}; continue with: run resume={run_dir}")


def failures_report(error: Any, hardware: HardwareConfig, run_dir: Path) -> str:
    """The first failed rank's error on the first line, its traceback below. A rank that failed only because a
    connection to a peer closed reports a consequence: the rank that ended first (killed, say) is the cause, whichever
    of them torch saw first. When every rank of this node lost a peer, the cause is another node, which the first line
    names."""
    causes = {rank: failure for rank, failure in error.failures.items() if not lost_peer(failure)}
    rank = min(causes or error.failures, key=lambda rank: error.failures[rank].timestamp)
    failure = error.failures[rank]
    report = failure_report(rank, failure, run_dir / f"rank{rank}.log")
    if hardware.nnodes == 1 or causes:
        return report
    gone = f"node {1 - hardware.node_rank}" if hardware.nnodes == 2 else "another node"
    return f"{gone} left the job: rank {rank} on this node lost its connection to it ({lost_peer(failure)})\n\n{report}"


def job_ended(error: Any, spec: RunSpec, run_dir: Path) -> Exception:
    """What a job whose workers failed raises: a stop that every rank made, a write the filesystem refused, a
    collective that timed out, or the first failed rank's error."""
    if all(failure.exitcode == ExitStatus.STOPPED for failure in error.failures.values()):
        return stopped(run_dir, "a signal")
    # whichever rank's error torch reports, a peer's lost connection say
    out_of_memory = take_out_of_memory_record(run_dir)
    if out_of_memory is not None:
        return WorkerFailed(out_of_memory_line(out_of_memory, spec))
    for failure in sorted(error.failures.values(), key=lambda failure: failure.timestamp):
        message = failure.message.get("message", "") if isinstance(failure.message, dict) else ""
        kind, _, line = message.partition(": ")
        # the rank's own line, its traceback left to its log
        if kind == WriteFailed.__name__:
            return WriteFailed(line)
        if kind == CollectiveTimedOut.__name__:
            return WorkerFailed(line)
    return WorkerFailed(failures_report(error, spec.hardware, run_dir))


def lost_peer(failure: Any) -> str:
    """gloo's words for a connection that the peer closed (it ended), or nothing for any other error."""
    message = failure.message.get("message", "") if isinstance(failure.message, dict) else str(failure.message)
    found = re.search(LOST_PEER, message)
    return found.group(0) if found else ""


def wait_for_node0(hardware: HardwareConfig, endpoint: str) -> None:
    """Node 0 listens at the endpoint from the moment it reaches the rendezvous. The other nodes wait for that here,
    until hardware.rdzv_timeout_s: torch's own client would try twice as long, printing C++ stack traces."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(endpoint, default_port=-1)
    refused = wait_until_listening(host, port, time.monotonic() + hardware.rdzv_timeout_s)
    if refused:
        raise WorkerFailed(rendezvous_report(hardware, endpoint, refused))


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


def rendezvous_report(hardware: HardwareConfig, endpoint: str, cause: str) -> str:
    """Node 0 waits at the rendezvous for the other nodes, the others wait there for node 0."""
    awaited = "the other nodes" if hardware.node_rank == 0 else "node 0"
    return (
        f"node {hardware.node_rank} of {hardware.nnodes}: the job's nodes did not meet at the rendezvous "
        f"{endpoint}, where this node waits up to {hardware.rdzv_timeout_s} s (hardware.rdzv_timeout_s) for "
        f"{awaited}: {cause}"
    )


def failure_report(rank: int, failure: Any, rank_log: Path) -> str:
    """The failed rank's error on the first line, its traceback below (or, for a rank killed by a signal, where its
    log is, and, where its collective timed out first, which one: NCCL's watchdog ends the process after it writes
    the rank's flight record)."""
    if isinstance(failure.message, dict):
        detail = " ".join(line.strip() for line in failure.message.get("message", "").splitlines() if line.strip())
        trace = failure.message.get("extraInfo", {}).get("py_callstack", "")
        return f"rank {rank} failed: {detail}\n\nrank {rank}'s traceback:\n{trace}".rstrip()
    cause = failure.message or f"exit code {failure.exitcode}"
    if (rank_log.parent / f"{RECORD}{rank}").exists():
        cause += f", after it {waited(rank, rank_log.parent)}"
    return f"rank {rank} failed: {cause} (see {rank_log})"


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
