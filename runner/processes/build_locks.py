"""torch's JIT-compiled extensions (DeepSpeed builds its CPU communication op the first time it runs on a machine)
compile under a lock file that holds no process id. A run stopped while compiling leaves the file behind, and every
later load waits on it forever, printing nothing. Before starting workers, a lock older than any compile is removed
and a recent one is reported: the workers will wait for that compile."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

# A compile of DeepSpeed's CPU ops takes a minute or two on two cores: a lock this old has no compile behind it.
STALE_AFTER_S = 600

log = logging.getLogger("runner")


def extension_locks() -> list[Path]:
    """torch.utils.cpp_extension's lock files: <root>/<name>/lock, root TORCH_EXTENSIONS_DIR or, by default,
    ~/.cache/torch_extensions/<python>_<accelerator>."""
    given = os.environ.get("TORCH_EXTENSIONS_DIR")
    if given:
        return sorted(Path(given).glob("*/lock"))
    from torch.utils.cpp_extension import get_default_build_root

    return sorted(Path(get_default_build_root()).glob("*/*/lock"))


def clear_stale_build_locks() -> None:
    now = time.time()
    for lock in extension_locks():
        try:
            age = now - lock.stat().st_mtime
            if age > STALE_AFTER_S:
                lock.unlink()
                log.warning("removed %s, a compile lock %.0f minutes old that no compile holds any more (a run "
                            "stopped while compiling leaves it)", lock, age / 60)
            else:
                log.warning("waiting on %s: a compile of %s started %.0f s ago; the workers wait until it ends",
                            lock, lock.parent.name, age)
        except FileNotFoundError:  # the compile that held it has just ended
            continue
