"""An out-of-memory error in a rank, recorded where the loop was: the step, and of it the forward, the backward or
the optimizer step (an evaluation, a checkpoint), with the device's allocated and reserved bytes against its own.
Rank 0 writes the allocator's summary beside the run's logs. runner/memory/out_of_memory_report.py makes the line."""

from __future__ import annotations

import time
import traceback
from typing import TYPE_CHECKING, Any

from runner.memory.breakdown import readable
from runner.memory.out_of_memory_report import write_record

if TYPE_CHECKING:
    from runner.engine.job import PreparedJob

# The CPU allocator's words: host RAM runs out as a RuntimeError, a GPU's as torch.OutOfMemoryError.
CPU_ALLOCATOR = "can't allocate memory"
# Where in a step the error came from, by the frames it passed through (the innermost that matches).
PHASES = (
    ("torch/autograd/", "backward"),
    ("torch/_tensor.py", "backward"),
    ("torch/optim/", "optimizer step"),
    ("deepspeed/runtime/zero/", "optimizer step"),
    ("runner/generation/", "generation"),
)


def out_of_memory(error: BaseException) -> bool:
    import torch

    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(error, RuntimeError) and CPU_ALLOCATOR in str(error)
    )


def phase_of(error: BaseException) -> str:
    """forward, backward, optimizer step or generation, from the frames the error passed through."""
    frames = [frame.filename for frame in traceback.extract_tb(error.__traceback__)]
    for filename in reversed(frames):
        for part, phase in PHASES:
            if part in filename:
                return phase
    return "forward"


def record_out_of_memory(error: BaseException, job: PreparedJob, doing: str) -> dict[str, Any]:
    """What this rank saw, written to the run directory at once (a peer's lost connection may end the job
    next)."""
    import torch

    device = job.device
    where = doing if doing.startswith(("evaluating", "saving")) else f"{doing}, in the {phase_of(error)}"
    summary = ""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        held = (
            f"{readable(torch.cuda.memory_allocated(device))} allocated and "
            f"{readable(torch.cuda.memory_reserved(device))} reserved of the device's {readable(total)}"
        )
        if job.ranks.rank == 0:
            (job.run_dir / "memory_summary.txt").write_text(torch.cuda.memory_summary(device))
            summary = f"; the allocator's summary: {job.run_dir / 'memory_summary.txt'}"
    else:
        held = "of the host's RAM (the CPU's allocator keeps no count)"
    record = {"rank": job.ranks.rank, "where": where, "held": held, "summary": summary, "time": time.time()}
    write_record(job.run_dir, record)
    return record
