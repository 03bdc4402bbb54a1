"""The forkserver every process the tests start comes from (a `run`, a worker of a group).

Starting Python and importing torch and transformers takes about 4 s here, longer than most test runs themselves.
Every process the tests start (a `run`, a worker of a group) is forked from multiprocessing's forkserver,
which has imported them once, after quieting the libraries as `run` quiets them before it imports them. Each is a
process of its own: its own pid, session, signals, environment, working directory, standard output and error and
exit status; it starts only without Python's start and those imports. `run_cli(..., fresh=True)` (command.py) starts
a new interpreter instead, for what a fresh one shows (the imports it makes, what libraries print as they are
imported).
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import multiprocessing.forkserver
import os
import signal
from pathlib import Path

# What the forkserver imports once: what `python -m runner` imports before it runs, then what a run imports (a run
# that saves its model imports DeepSpeed too, through transformers' save_pretrained, where it is installed, and each
# rank of strategy=deepspeed imports its Muon optimizer, and torch's compiler with it, as it starts: 1.6 s); last,
# frozen_heap, which takes all of it out of the garbage collector's passes.
WARM_IMPORTS = [
    "runner.cli.main",
    "torch",
    "transformers.models.llama.modeling_llama",
    "datasets",
    "runner.engine.job",
    "runner.engine.loop",
    "deepspeed",
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "tests.support.specs",
    "tests.support.command",
    "tests.support.runs",
    "tests.support.workers",
    "tests.support.frozen_heap",
]
# What the forkserver imports first, for the runs alone (the tests' own processes seldom need them): pipeline
# parallelism's stages, peft for adapters, and wandb with what its init imports (its launch inputs: 1.5 s), each
# imported by 4 to 16 runs of the suite otherwise.
RUN_IMPORTS = ["torch.distributed.pipelining", "peft", "wandb", "wandb.sdk.launch.inputs.internal"]


@functools.cache
def warm_processes() -> multiprocessing.context.BaseContext:
    """multiprocessing's forkserver, its imports made once, after the libraries were quieted as `run` quiets them
    before it imports them (their verbosity comes from the environment they were imported in). Python 3.11's
    forkserver ignores the tests' sys.path as it imports (3.12 passes it on), so PYTHONPATH names the tests' own
    modules for it (the repository, home of the package `tests`); without them, every process it forked imported
    the support modules again, and froze nothing."""
    from runner.library_noise import name_deepspeed_accelerator, quiet_libraries

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*RUN_IMPORTS, *WARM_IMPORTS])
    before = dict(os.environ)
    quiet_libraries()
    name_deepspeed_accelerator("cpu")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[2]), before.get("PYTHONPATH")]))
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(before)
    atexit.register(_end_started_runs)
    return context


def _end_started_runs() -> None:
    """A test that failed may leave a run going: end it, or this process would wait for it at its exit."""
    for process in multiprocessing.active_children():
        if process.name == "run":
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                process.kill()
        process.join(10)
