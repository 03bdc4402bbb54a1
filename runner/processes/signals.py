"""Stopping a run gracefully: after the current step, with a checkpoint to resume from."""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any, Optional

log = logging.getLogger("runner")


class GracefulStop:
    """The first SIGTERM or SIGINT asks the loop to stop after the current step, with a checkpoint; another one
    stops the process at once. Signals within a second of the first (a terminal's Ctrl-C reaching the whole
    process group, then the launcher passing it on) count as that one request. SIGUSR2 is the warning a SLURM job
    of the submitit launcher gets before its time limit; the loop takes it for a SIGTERM too, ahead of submitit's
    own handler, which would end rank 0 in the middle of a step."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)

    def __init__(self) -> None:
        self.requested: Optional[str] = None
        self._at = 0.0
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested is None:
            self.requested, self._at = signal.Signals(signum).name, time.monotonic()
            log.warning(
                "%s: stopping after this step, with a checkpoint (send it again to stop at once)", self.requested
            )
        elif time.monotonic() - self._at > 1.0:
            stop_at_once(signum)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class StopVote:
    """Every rank stops after the same step. Each step, every rank's vote (whether it was asked to stop) is summed
    across the ranks without waiting for it: an asynchronous collective of a host tensor (gloo's, beside NCCL on
    GPUs), read at the next step, when it has long arrived. The run then stops after that next step. A single
    process takes its own request at once."""

    def __init__(self, stop: GracefulStop):
        self._stop = stop
        self._pending: Optional[tuple[Any, Any]] = None

    def after_step(self) -> bool:
        """Whether the run stops after this step."""
        from runner.distributed import process_group_up

        if not process_group_up():
            return self._stop.requested is not None
        import torch
        import torch.distributed as dist

        decided = self._result()
        votes = torch.tensor([float(self._stop.requested is not None)])
        self._pending = (dist.all_reduce(votes, async_op=True), votes)
        return decided

    def close(self) -> None:
        """Waits for the last vote (every rank cast as many), so that no collective is left behind."""
        self._result()

    def _result(self) -> bool:
        if self._pending is None:
            return False
        work, votes = self._pending
        self._pending = None
        work.wait()
        return votes.item() > 0


class SweepStop:
    """A sweep stops as a whole. While a job trains, its loop takes the signals (GracefulStop) and the job ends
    Stopped; between jobs, or while one loads its data, the first SIGINT or SIGTERM is noted here, and the job
    about to train does not. Another one stops the process at once."""

    def __init__(self) -> None:
        self.requested: Optional[str] = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested is None:
            self.requested = signal.Signals(signum).name
            log.warning("%s: stopping the sweep before its next job (send it again to stop at once)", self.requested)
        else:
            stop_at_once(signum)


def stop_at_once(signum: int) -> None:
    """The signal's default action (end the process), as if no handler had caught it."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
