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

    `items` must run no collective: every rank issues those in the same order, from its main thread."""
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
        on_one_core()
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

    keep_this_threads_cores()
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


def keep_this_threads_cores() -> None:
    """Fixes the calling thread's count of torch threads at what it is now. torch gives a thread its count when the
    thread first asks for it, from a default that on_one_core lowers to 1: a loop thread that had run no parallel
    kernel before its thread ahead started would otherwise train on one core (torch.set_num_threads alone does not
    fix it)."""
    import torch

    torch.get_num_threads()


def on_one_core() -> None:
    """torch's operations on this thread run on it alone.

    Nothing a batch needs is worth a parallel kernel, and a torch operation that runs one here (torch.randperm of
    more than 32,768 rows fills them in parallel) gives this thread an OpenMP team of its own, idle but kept. With
    more OpenMP threads than cores, libgomp stops spinning between parallel regions, and each kernel of the training
    thread then waits to be woken: a CPU step of the default model over 35k rows took 1.5 times as long. OpenMP and
    MKL keep the count per thread, and the thread that started this one fixed its own first
    (keep_this_threads_cores); torch's default for threads it has not seen yet becomes 1."""
    import torch

    torch.set_num_threads(1)
