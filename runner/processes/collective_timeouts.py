"""A collective that waits past the process group's timeout ends the job in one line: the rank that waited, what it
was doing (the stall watch's phase: a step, an evaluation, a checkpoint) and the collective, from torch's flight
recorder, which every rank keeps (TORCH_FR_BUFFER_SIZE). The rank's record goes to `flight_recorder_rank<N>` in the
run directory, in torch's own pickled format.

gloo ends the wait with an error in the rank, which the rank turns into the line. NCCL's watchdog ends the process
instead, writing the record first (TORCH_FR_DUMP_TEMP_FILE); the launcher's report then reads the record and the
rank's stall reports."""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any, Optional

from runner.processes.stall_watch import last_reported_phase, stalls_file

# The collectives each rank remembers, oldest dropped first.
RECORDED_COLLECTIVES = 2000
RECORD = "flight_recorder_rank"  # torch appends the rank
# gloo's words for a collective that waited past the timeout (the next one on the same connection: the pair's
# closure); NCCL's, where its errors reach Python.
TIMED_OUT = (
    r"Timed out waiting \d+ms for \w+ operation to complete|Application timeout caused pair closure"
    r"|Watchdog caught collective operation timeout"
)


def record_collectives(run_dir: Path, rank: int) -> None:
    """Before the process group starts: the flight recorder on (unless the user sized it), its record written to the
    run directory. A record left by an earlier attempt of this run is removed: the report would read it as this
    one's."""
    if "TORCH_FR_BUFFER_SIZE" not in os.environ and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(RECORDED_COLLECTIVES)
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")  # the watchdog writes it before it ends the process
    os.environ["TORCH_FR_DUMP_TEMP_FILE"] = str(run_dir / RECORD)
    (run_dir / f"{RECORD}{rank}").unlink(missing_ok=True)


def timed_out(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and re.search(TIMED_OUT, str(error)) is not None


def timed_out_line(rank: int, run_dir: Path, phase: Optional[str]) -> str:
    """The line of a rank whose collective timed out in this process: its record written, then read back."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace

        (run_dir / f"{RECORD}{rank}").write_bytes(_dump_fr_trace())
    except (ImportError, OSError):  # a torch without the recorder's dump, a full disk: the line goes on without it
        pass
    return f"rank {rank} {waited(rank, run_dir, phase)}"


def waited(rank: int, run_dir: Path, phase: Optional[str] = None) -> str:
    """What a rank that waited past the timeout was doing (`phase`, else its last stall report's) and the last
    collective it started, with where the record and the threads' stacks are."""
    path, stalls = run_dir / f"{RECORD}{rank}", stalls_file(run_dir, rank)
    entry = last_collective(path)
    phase = phase or last_reported_phase(stalls)
    seconds = f" {entry['timeout_ms'] / 1000:.0f} s" if entry else ""
    told = (
        f"waited{seconds} in a collective that another rank did not join{f', {phase}' if phase else ''}: "
        f"{described(entry)}; the process group's timeout (train.collective_timeout_s) ended it"
    )
    if stalls.exists():
        told += f"; where each thread waited: {stalls}"
    return told + (f"; torch's record of the rank's collectives: {path}" if entry else "")


def last_collective(path: Path) -> Optional[dict[str, Any]]:
    """The last collective a rank started, from its flight record (torch's pickled dump); None without one."""
    try:
        entries = pickle.loads(path.read_bytes()).get("entries") or []
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError):
        return None
    return max(entries, key=lambda entry: entry["record_id"]) if entries else None


def described(entry: Optional[dict[str, Any]]) -> str:
    """ "gloo:all_reduce #482 of group default_pg, Float [24832]"."""
    if entry is None:
        return "torch kept no record of it"
    tensors = ", ".join(f"{dtype} {list(size)}" for dtype, size in zip(entry["input_dtypes"], entry["input_sizes"]))
    name, description = entry["process_group"]  # a group made without a description (DeepSpeed's): "undefined"
    group = description if description not in ("", "undefined") else name
    return f"{entry['profiling_name']} #{entry['collective_seq_id']} of group {group}, {tensors or 'no tensors'}"
