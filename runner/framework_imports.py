"""torch and transformers, imported with Python's garbage collector paused."""

from __future__ import annotations

import contextlib
import gc
import importlib
from typing import Iterator

# What a rank imports before its first step: torch, transformers' model base class and its Auto classes.
FRAMEWORKS = ("torch", "transformers.modeling_utils", "transformers.models.auto.modeling_auto")
# Whether this process, or the one it was forked from, froze what it holds. A flag, not gc.get_freeze_count(),
# which walks every frozen object: 35 ms after the frameworks' imports, at each call.
_frozen = False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The first time in a process: no garbage collection inside, then what the process holds is frozen (left out
    of later collections); after that, nothing.

    Importing torch and transformers makes millions of objects, and each full collection during the imports walks
    all made so far: a quarter of their time (0.8 of 3.4 s on a 2-core machine), at every `run`, every spawned
    rank and every task of a cluster job. Frozen, those objects also stay out of the run's own full collections:
    a run starts about 1.5 s sooner. Freezing once only keeps the cycles of later garbage (each sweep point's config)
    collectable."""
    global _frozen
    if _frozen:  # frozen before, or by the process this one was forked from
        yield
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        _frozen = True
        if enabled:
            gc.enable()


def import_frameworks() -> None:
    with collector_paused():
        for name in FRAMEWORKS:
            importlib.import_module(name)
