"""A write the filesystem refused (a full disk, a quota, a read-only mount): what was written of it removed, and
one line that says what it needed, what was free, and how the run goes on."""

from __future__ import annotations

import contextlib
import re
import shutil
from pathlib import Path
from typing import Callable

from runner.errors import WriteFailed
from runner.files.checkpoint_dirs import complete_checkpoints

# How the libraries that write tensors say that the filesystem refused a write: safetensors ("I/O error: No space
# left on device (os error 28)"), torch.save ("file write failed"); Python's own raise OSError.
REFUSED_WRITE = re.compile(
    r"No space left on device|os error 28|Disk quota exceeded|Read-only file system|"
    r"file write failed|Input/output error",
    re.IGNORECASE,
)
# torch.save's writer when the filesystem refuses the rest of a file: it keeps no reason.
CUT_SHORT = re.compile(r"unexpected pos|iostream error")
# A filesystem with less room than this is full: the write that failed on it failed for want of room.
FULL_BELOW = 2**20


def _causes(error: BaseException) -> list[BaseException]:
    """An error and those it was raised from or while handling (torch.save's "unexpected pos" is raised while
    handling the failed write's own error)."""
    chain = [error]
    while len(chain) < 8 and (chain[-1].__cause__ or chain[-1].__context__) is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    return chain


def refused_write(error: BaseException) -> bool:
    return any(
        isinstance(cause, OSError) or REFUSED_WRITE.search(str(cause)) or CUT_SHORT.search(str(cause))
        for cause in _causes(error)
    )


@contextlib.contextmanager
def written_whole(
    partial: Path, what: str, run_dir: Path, needed: Callable[[], int], trained: bool = False, shared: bool = False
):
    """Writes `what` into `partial`: a write the filesystem refuses removes what was written of it and ends the run
    in one line (WriteFailed) with the path, the bytes it needs (`needed()`) and those free, the last complete
    checkpoint and the command that continues (`trained`: the training is done, the last checkpoint holds it).
    `shared`: other ranks write into `partial` too, having made it before they write."""
    try:
        yield
    except BaseException as error:  # torch.distributed.checkpoint's CheckpointException is one
        # A writer that fails some other way on a filesystem left without room failed for want of it; one whose
        # shared directory is gone failed because a peer's write was refused and the peer removed it (below).
        removed_by_peer = shared and isinstance(error, Exception) and not partial.exists()
        if not (refused_write(error) or free_bytes(partial) < FULL_BELOW or removed_by_peer):
            raise
        shutil.rmtree(partial, ignore_errors=True)
        raise WriteFailed(
            write_failed_line(error, partial, what, run_dir, needed(), trained, removed_by_peer)
        ) from None


def _refusal(error: BaseException, short_of_room: bool) -> str:
    """What the filesystem said, or, where the writer kept no reason (torch.save), what the room left says."""
    for cause in _causes(error):
        said = REFUSED_WRITE.search(str(cause))
        if said:
            return said.group(0)
    return "No space left on device" if short_of_room else "the file was cut short"


def existing_parent(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(existing_parent(path)).free


def write_failed_line(
    error: BaseException,
    partial: Path,
    what: str,
    run_dir: Path,
    needed: int,
    trained: bool = False,
    removed_by_peer: bool = False,
) -> str:
    failures = getattr(error, "failures", None)  # CheckpointException: each rank's (exception, traceback)
    if isinstance(failures, dict) and failures:
        error = next(iter(failures.values()))[0]
    where = existing_parent(partial)
    free = shutil.disk_usage(where).free
    reason, path = _refusal(error, free < needed), partial
    told = next((cause for cause in _causes(error) if isinstance(cause, OSError) and cause.strerror), None)
    if removed_by_peer:  # this rank's error is the missing directory; the room left says why the peer's failed
        reason = "No space left on device" if free < needed else "another rank's write was refused"
    elif told is not None:
        reason, path = told.strerror, told.filename or partial
    found = complete_checkpoints(run_dir)
    last, then = (
        (f"the last complete checkpoint, {found[-1]}, is intact", f"continue with: run resume={run_dir}")
        if found
        else ("no checkpoint was complete yet", "run it again")
    )
    if trained and found:  # the trained weights are in that checkpoint, which the inference tasks read
        last, then = (
            f"the training is done and its last checkpoint, {found[-1]}, holds it",
            f"task=evaluate and task=generate read it (task.trained={found[-1]})",
        )
    return (
        f"writing {what} failed: {reason} ({path}); it needs about {needed / 2**20:,.1f} MiB and "
        f"{free / 2**20:,.1f} MiB are free on {where}; {last}. Make room (or keep fewer checkpoints: "
        f"train.keep_checkpoints=1), then {then}"
    )
