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
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.compat import shutdown_timeout
from runner.distributed import free_port
from runner.errors import CollectiveTimedOut, ExitStatus, Stopped, WorkerFailed, WriteFailed
from runner.files.checkpoint_dirs import complete_checkpoints
from runner.library_noise import quiet_launcher
from runner.memory.out_of_memory_report import out_of_memory_line, take_out_of_memory_record
from runner.processes.collective_timeouts import RECORD, waited
from runner.processes.rank import wait_until_listening, worker

if TYPE_CHECKING:
    from runner.config.hardware import HardwareConfig
    from runner.config.spec import RunSpec
    from runner.config.tracker import RunIdentity

# A peer's end as gloo reports it, after the source location: "Read error [10.0.0.2]:6552: Connection reset by
# peer", "Connection closed by peer [10.0.0.2]:6552".
log = logging.getLogger("runner")
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
    _say_starting(hardware, endpoint, config.start_method)
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


def _say_starting(hardware: HardwareConfig, endpoint: str, method: str) -> None:
    # A spawned worker imports torch and the runner anew before it trains: seconds, which the line accounts for.
    spawned = " (spawned: each imports the libraries anew)" if method == "spawn" else ""
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
