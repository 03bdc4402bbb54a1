"""The next batch built while the step runs: a thread runs a batch iterator ahead of the loop."""

from __future__ import annotations

import queue
import threading
from typing import Iterator, TypeVar

T = TypeVar("T")

_END = object()  # the iterator's end, or its exception


def ahead(items: Iterator[T], name: str = "batches") -> Iterator[T]:
    """`items`, each built on a thread of its own while the one before is in use: at most one waits in a queue and one
    more is being built. The thread starts at the first next(), and ends (closing `items`, on the thread that runs it)
    when this generator is closed or collected: the loop's end, or its exception; within one item's time, since it
    stops between items. An exception in `items` is raised here with its traceback, the thread's frames included.
    The wait for an item is the loop's own: the stall watch (runner/processes/stall_watch.py) shows where both threads
    are; a thread that ended without an item is said in one line rather than waited on.

    `items` must run no collective: every rank issues those in the same order, from its main thread.

    The thread runs torch on one core: a parallel kernel there (torch.randperm of over 32,768 rows) gives it an idle
    OpenMP team of its own, and with more OpenMP threads than cores libgomp wakes each kernel of the training thread
    instead of spinning (a CPU step took 1.5 times as long). torch.set_num_threads also lowers the default a thread
    takes when it first asks for its count, so the calling thread asks first and keeps its own."""
    import torch

    ready: queue.Queue = queue.Queue(maxsize=1)
    stop = threading.Event()

    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.5)
                return True
            except queue.Full:
                pass
        return False

    def build() -> None:
        torch.set_num_threads(1)
        try:
            for item in items:
                if not put((item, None)):
                    return
            put((_END, None))
        except BaseException as error:  # raised in the loop, which decides
            put((_END, error))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    torch.get_num_threads()
    thread = threading.Thread(target=build, name=f"{name} ahead", daemon=True)
    thread.start()
    try:
        while True:
            try:
                item, error = ready.get(timeout=1.0)
            except queue.Empty:
                if thread.is_alive() or not ready.empty():
                    continue
                raise RuntimeError(f"the thread that builds the {name} ended without one") from None
            if error is not None:
                raise error
            if item is _END:
                return
            yield item
    finally:
        stop.set()
