"""A rank that makes no progress says what it waits on, instead of waiting in silence: a collective that a lost or
stopped rank never joins, a lock, a slow filesystem. The wait itself ends with the process group's timeout."""

from __future__ import annotations

import faulthandler
import logging
import re
import threading
import time
from pathlib import Path
from typing import Optional

log = logging.getLogger("runner")
# Each report's heading in the stack file, above the threads' stacks, and its phase read back.
HEADING = "== rank {rank}, {phase}: no progress for {waited:.0f} s"
HEADING_PHASE = r"^== rank \d+, (.*): no progress for \d+ s$"


def stalls_file(run_dir: Path, rank: int) -> Path:
    """Where a rank's stall reports go."""
    return run_dir / f"stalls_rank{rank}.txt"


def last_reported_phase(stack_file: Path) -> Optional[str]:
    """What the rank was doing at its last stall report ("in step 12"); None without one."""
    if not stack_file.exists():
        return None
    phases = re.findall(HEADING_PHASE, stack_file.read_text(), re.MULTILINE)
    return phases[-1] if phases else None


class StallWatch:
    """After `after_s` seconds in the same phase of the loop (a step, an evaluation, a checkpoint), a warning names
    the rank, the phase and how long it has been in it, and every thread's stack goes to `stack_file` (the stdlib's
    faulthandler: the line it waits on, a collective's included); again every `after_s` while it lasts."""

    def __init__(self, rank: int, after_s: float, stack_file: Path) -> None:
        self.rank, self.after_s, self.stack_file = rank, after_s, stack_file
        self._current = ("starting", time.monotonic())  # one tuple: the watching thread reads it whole
        self._closed = threading.Event()
        if after_s > 0:
            threading.Thread(target=self._watch, name="stall-watch", daemon=True).start()

    def entering(self, phase: str) -> None:
        self._current = (phase, time.monotonic())

    @property
    def doing(self) -> str:
        return self._current[0]

    def close(self) -> None:
        self._closed.set()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def _watch(self) -> None:
        watched, reports = self._current, 0
        while not self._closed.wait(min(self.after_s, 5.0)):
            if self._current is not watched:
                watched, reports = self._current, 0
            phase, since = watched
            waited = time.monotonic() - since
            if waited < self.after_s * (reports + 1):
                continue
            reports += 1
            with self.stack_file.open("a") as out:
                out.write(f"\n{HEADING.format(rank=self.rank, phase=phase, waited=waited)}\n")
                out.flush()
                faulthandler.dump_traceback(out, all_threads=True)
            log.warning(
                "rank %d: no progress for %.0f s, %s; where each thread waits: %s",
                self.rank,
                waited,
                phase,
                self.stack_file,
            )


_PROCESS_WATCH: Optional[StallWatch] = None


def watched_phase() -> Optional[str]:
    """What this process's watch of a training job last saw it doing ("in step 12"); None without one."""
    return _PROCESS_WATCH.doing if _PROCESS_WATCH is not None else None


def process_watch(rank: int, after_s: float, stack_file: Path) -> StallWatch:
    """This process's watch of a training job, from its preparation (its data, the model's placement, whose
    collectives wait on every rank) to its end: the one already watching, else a new one."""
    global _PROCESS_WATCH
    if _PROCESS_WATCH is None or _PROCESS_WATCH.closed:
        _PROCESS_WATCH = StallWatch(rank, after_s, stack_file)
    return _PROCESS_WATCH
