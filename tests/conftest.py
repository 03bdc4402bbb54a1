"""The tests' fixtures, tiers and order; what they share is in tests/support/ (its __init__.py lists it).

Tiers, as pytest markers (registered in pyproject.toml):
    slow          trains more than a few steps, starts worker processes or a new interpreter that imports torch,
                  or waits on a real timeout: not in the fast tier (a `run` forked from the tests' warm
                  forkserver is not a new interpreter; `--help` without torch is one, and stays fast)
    distributed   real multi-process gloo groups or multi-process `run` jobs (always slow too)
    cluster       jobs on a real SLURM cluster (always slow too)
    signals       signals, kills and stalls of running jobs (always slow too)
The fast tier, `python -m pytest -m "not slow"`, covers composing, validation and errors, the estimate's formulas
and short single-process training runs; the full suite is `python -m pytest`.

pytest-xdist runs two workers (pyproject.toml's addopts), each taking whole modules; `-n 0` runs one process.
"""

import importlib
import os
from pathlib import Path

import pytest

from tests.support.warm import WARM_IMPORTS, warm_processes

# One thread per process: two workers share the two cores, and each test's processes take one each. Two runs of the
# default job at once took 8.7 s with one thread each, 11.9 s with torch's two (one alone: 8.2 s and 7.6 s).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The modules start in this order of their heaviest tests, then of their tests that keep processes computing
# (multi-process, not waiting on a signal or a stall), then of their slow tests, then of all their tests, among the
# tests the command selected: the cluster's first (they mostly wait on SLURM, and overlap the rest), then those
# that fill both cores while it waits, the big ones before the small ones, so that the two workers end together.
# Modules alike in all four keep the order of their names, whatever folder of tests/ holds them.
KINDS = ("slow", "distributed", "cluster")


def pytest_itemcollected(item):
    if any(marker in item.keywords for marker in ("distributed", "cluster", "signals")):
        item.add_marker(pytest.mark.slow)


@pytest.hookimpl(trylast=True)  # after `-m` has deselected: the order of what runs
def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.module.__name__.rpartition(".")[2])  # stable: each module keeps its order
    weights: dict[str, tuple[int, int, int, int]] = {}
    for item in items:
        kind = max((rank + 1 for rank, marker in enumerate(KINDS) if marker in item.keywords), default=0)
        computing = "distributed" in item.keywords and "signals" not in item.keywords
        heaviest, busy, slow, count = weights.get(item.module.__name__, (0, 0, 0, 0))
        weights[item.module.__name__] = (max(heaviest, kind), busy + computing, slow + (kind > 0), count + 1)
    items.sort(key=lambda item: weights[item.module.__name__], reverse=True)  # stable: each module keeps its order


@pytest.fixture(scope="session", autouse=True)
def token_store(tmp_path_factory):
    """The token store (runner/data/store.py) of this session, which its workers share, among pytest's temporary
    directories (it keeps the last three sessions'): what the tests tokenize neither piles up in the user's cache
    nor comes from an earlier session's code."""
    base = tmp_path_factory.getbasetemp()
    os.environ["RUNNER_TOKEN_CACHE"] = str((base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "tokens")


@pytest.fixture(scope="session", autouse=True)
def warm_server(token_store):
    """The forkserver every `run` and worker of the tests comes from, started before the first test, so that no
    test finds it among its new processes; its children inherit its environment, the token store's place with it.
    This process imports what the forkserver imports, and freezes it as the forkserver does
    (tests/support/frozen_heap.py)."""
    warm_processes()
    for module in WARM_IMPORTS:
        importlib.import_module(module)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real SLURM cluster on this host, started once for the session (tests/support/slurm.py) and stopped after
    it; its clients (sbatch, scontrol, sacct, and submitit through them) find it by $SLURM_CONF."""
    from tests.support import slurm

    try:
        env = slurm.start()
    except slurm.Unavailable as reason:
        pytest.skip(f"no SLURM cluster on this machine: {reason}")
    before = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    yield env
    slurm.stop()
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path
