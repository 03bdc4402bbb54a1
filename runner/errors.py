"""The errors every layer raises and the exit statuses `run` maps them to; this module imports nothing of the runner.

0 done, 1 the job failed (a worker's error, a non-finite loss), 2 bad input (nothing was started or written),
3 stopped by a signal after a checkpoint, 4 a write failed (a full disk, a read-only filesystem, a quota): the last
complete checkpoint is intact and the run continues from it.
"""

from __future__ import annotations

import difflib
from enum import IntEnum
from typing import Iterable, Optional


class ExitStatus(IntEnum):
    DONE = 0
    FAILED = 1
    BAD_INPUT = 2
    STOPPED = 3
    WRITE_FAILED = 4


class SpecError(Exception):
    """A user error in the spec: reported as one line, before anything is written."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise SpecError(message)


class WorkerFailed(Exception):
    """A worker process of a multi-process job raised or died; the message leads with that rank's error."""


class WriteFailed(Exception):
    """Writing a checkpoint or the model failed for want of room or permission; the message names the path, the
    bytes, the last complete checkpoint and how to continue."""


class DeviceOutOfMemory(Exception):
    """A rank ran out of memory; the message says where, with the device's figures and the estimate's."""


class CollectiveTimedOut(RuntimeError):
    """A rank waited in a collective past the process group's timeout; the message names the rank, what it was doing
    and the collective."""


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite; the run stops rather than train on garbage."""


class RewardFailed(RuntimeError):
    """A reward function of task=grpo raised, or returned other than a float or None per completion; the run stops
    after a checkpoint of the last step."""


class Stopped(RuntimeError):
    """A SIGTERM, SIGINT or SIGUSR2 stopped the run after a step, with a checkpoint to resume from. `signal`: the
    one that asked, where known."""

    def __init__(self, message: str, signal: Optional[str] = None):
        super().__init__(message)
        self.signal = signal


class SweepStopped(BaseException):
    """A signal stopped a sweep: the job it reached stopped with a checkpoint, the later ones did not start. Not an
    Exception, which Hydra would hold while it starts the next job."""


class EndedInOneLine(BaseException):
    """A job that is the whole run (no sweep) ended by an error told in one line (WriteFailed, DeviceOutOfMemory),
    with its exit status: past Hydra, which would add a line of its own about any Exception of a job."""

    def __init__(self, message: str, status: ExitStatus):
        super().__init__(message)
        self.status = status


class LaunchRefused(BaseException):
    """A spec rejected before launch. Hydra turns a callback's Exception into a mere warning; this stops it."""


class NothingToLaunch(BaseException):
    """A task that answers without launching (task=estimate) has answered; Hydra stops before it makes a run
    directory."""


def did_you_mean(given: str, choices: Iterable[str], prefix: str = "") -> str:
    """ "; did you mean <prefix><the closest choice>?", or nothing when none is close."""
    close = difflib.get_close_matches(given, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {prefix}{close[0]}?" if close else ""
