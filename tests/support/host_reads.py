"""Counting the reads that make the host wait for the device, as a training step would on a GPU: the ops whose result
the host needs (`.item()`, a tensor's truth value, data-dependent shapes such as boolean-mask indexing and nonzero),
and the copies to the host (`Tensor.tolist`, `.cpu`, `.numpy`). On the CPU nothing waits, but every such read there
is one on a GPU, where it stalls the queue of kernels the host has launched ahead."""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# Ops whose output the host must wait for: a scalar read, or a shape that depends on the values.
WAITING_OPS = {
    aten._local_scalar_dense.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.unique_consecutive.default,
    aten._unique2.default,
    aten.unique_dim.default,
}
COPIES_TO_HOST = ("tolist", "cpu", "numpy")


def _waits(func, args) -> bool:
    if func in WAITING_OPS:
        return True
    if func is aten.repeat_interleave.Tensor:  # without output_size, its length is read from the repeats
        return True
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        return any(index is not None and index.dtype == torch.bool for index in args[1])
    return False


def _place(frame: traceback.FrameSummary) -> str:
    return f"{'/'.join(frame.filename.rsplit('/', 2)[-2:])}:{frame.lineno} ({frame.name})"


class HostReads(TorchDispatchMode):
    """Counts the host reads of everything run inside it, by the place in the code that made them, except those made
    under a file whose path holds one of `leave_out`."""

    def __init__(self, leave_out: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.reads: Counter[str] = Counter()
        self.leave_out = leave_out

    def snapshot(self) -> Counter[str]:
        return Counter(self.reads)

    def note(self, what: str) -> None:
        frames = [frame for frame in traceback.extract_stack()[:-2] if "host_reads.py" not in frame.filename]
        # The code that made the read: the innermost frame outside torch's own machinery (its optimizers aside).
        maker = next(
            (
                frame
                for frame in reversed(frames)
                if "/torch/" not in frame.filename or "/torch/optim/" in frame.filename
            ),
            frames[-1],
        )
        if any(part in maker.filename for part in self.leave_out):
            return
        ours = [frame for frame in frames if "/runner/" in frame.filename] or frames
        self.reads[f"{what} at {_place(ours[-1])} in {_place(maker)}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _waits(func, args):
            self.note(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_host_reads(leave_out: tuple[str, ...] = ()) -> Iterator[HostReads]:
    counter = HostReads(leave_out)
    originals = {name: getattr(torch.Tensor, name) for name in COPIES_TO_HOST}

    def counted(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            counter.note(f"Tensor.{name}")
            return original(self, *args, **kwargs)

        return read

    for name in COPIES_TO_HOST:
        setattr(torch.Tensor, name, counted(name))
    try:
        with counter:
            yield counter
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
