"""The `run` command as a user types it, in a process of its own forked from the warm forkserver (warm.py): to its end
(run_cli), or left running (start_cli), and what a test makes a started run do (stop itself after a step, run out
of memory).
"""

from __future__ import annotations

import atexit
import functools
import io
import multiprocessing
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from tests.support.warm import warm_processes

# The longest any one `run` of the tests may take before it is ended and the test fails.
RUN_TIMEOUT_S = 600


# ---- the `run` command


class Started:
    """A `run` going on in the background, as subprocess.Popen shows one: its pid, poll(), wait(), its signals, and
    its standard output and error once it has ended."""

    def __init__(
        self,
        process: multiprocessing.process.BaseProcess,
        output: Path,
        errors: Path,
        new_session: bool,
        stop_at_step: Optional[int] = None,
    ) -> None:
        self._process, self._output, self._errors, self._group = process, output, errors, new_session
        self.stop_at_step = stop_at_step

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> Optional[int]:
        return self._process.exitcode

    def poll(self) -> Optional[int]:
        return self._process.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"run (process {self.pid})", timeout)
        return self._process.exitcode

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def resume(self) -> None:
        """Lets a process group that hold_at_step stopped go on (SIGCONT)."""
        os.killpg(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        """Ends the run (and, in a session of its own, every process of its group) if it still runs."""
        if self._process.exitcode is None:
            try:
                os.killpg(self.pid, signal.SIGKILL) if self._group else self._process.kill()
            except ProcessLookupError:
                pass
            self._process.join(60)

    def stdout(self) -> str:
        return self._output.read_text(errors="replace") if self._output.exists() else ""

    def stderr(self) -> str:
        return self._errors.read_text(errors="replace") if self._errors.exists() else ""

    def communicate(self, timeout: Optional[float] = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.stdout(), self.stderr()


def run_cli(
    *args: str, cwd: Path, env: Optional[dict[str, str]] = None, fresh: bool = False, timeout: float = RUN_TIMEOUT_S
) -> subprocess.CompletedProcess:
    """`run <args>` as a user types it in `cwd` (with `env` added to the environment), to its end: its exit status,
    standard output and error. `fresh`: in a new interpreter, for what its start and imports show."""
    if fresh:
        a_second_of_its_own(cwd)
        return subprocess.run(
            [sys.executable, "-m", "runner", *args],
            cwd=cwd,
            capture_output=True,
            text=True,
            env=environment(env),
            timeout=timeout,
        )
    job = start_cli(*args, cwd=cwd, env=env, new_session=True)
    try:
        stdout, stderr = job.communicate(timeout)
    finally:
        job.kill()
    return subprocess.CompletedProcess(["run", *args], job.returncode, stdout, stderr)


def start_cli(
    *args: str,
    cwd: Path,
    env: Optional[dict[str, str]] = None,
    new_session: bool = False,
    stop_at_step: Optional[int] = None,
    out_of_memory_at_step: Optional[int] = None,
) -> Started:
    """`run <args>` started in `cwd` and left running; `new_session`: in a session and process group of its own, as
    `setsid run ...` starts it (signal the group with os.killpg). `stop_at_step`: the run stops itself, in a session
    of its own, once it has logged that step (train.log_every=1): hold_at_step waits for it.
    `out_of_memory_at_step`: the last rank's backward of that step raises torch.OutOfMemoryError, as a GPU's
    allocator does."""
    new_session = new_session or stop_at_step is not None
    cwd.mkdir(parents=True, exist_ok=True)
    a_second_of_its_own(cwd)
    output_dir = Path(tempfile.mkdtemp(prefix="output-", dir=_outputs()))
    output, errors = output_dir / "stdout", output_dir / "stderr"
    process = warm_processes().Process(
        target=_run_command,
        name="run",
        args=(
            list(args),
            str(cwd),
            environment(env),
            str(output),
            str(errors),
            new_session,
            stop_at_step,
            out_of_memory_at_step,
        ),
    )
    process.start()
    return Started(process, output, errors, new_session, stop_at_step)


def a_second_of_its_own(cwd: Path) -> None:
    """Hydra names a run's directory after the second the run starts in, and `run` refuses a directory that holds a
    run: a run that would start in the second of the last one in `cwd` (a short task after another) waits for the
    next second."""
    while any((cwd / "outputs" / sweep / time.strftime("%Y-%m-%d/%H-%M-%S")).exists() for sweep in ("", "multirun")):
        time.sleep(0.05)


@functools.cache
def _outputs() -> Path:
    """Where the started runs' standard output and error go, removed at the end of the session."""
    outputs = Path(tempfile.mkdtemp(prefix="runner-tests-"))
    atexit.register(shutil.rmtree, outputs, ignore_errors=True)
    return outputs


def environment(added: Optional[dict[str, str]]) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", **(added or {})}


def _run_command(
    args: list[str],
    cwd: str,
    env: dict[str, str],
    output: str,
    errors: str,
    new_session: bool,
    stop_at_step: Optional[int],
    out_of_memory_at_step: Optional[int] = None,
) -> None:
    """In the forked process: `python -m runner <args>`, as a new interpreter would run it, to its exit."""
    _as_a_main_process()
    if new_session:
        os.setsid()
    if stop_at_step is not None:
        _stop_after_logging(stop_at_step)
    if out_of_memory_at_step is not None:
        _out_of_memory_at(out_of_memory_at_step)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # what the forkserver printed stays its own
    for fd, path in ((1, output), (2, errors)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    # Unbuffered, as under PYTHONUNBUFFERED=1.
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        open(2, "wb", buffering=0, closefd=False), write_through=True, errors="backslashreplace"
    )
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["run", *args]
    code = 0
    try:
        runpy.run_module("runner", run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = _exit_status(exit_.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        _flush_and_run_exit_handlers()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # as Python ends on an uncaught KeyboardInterrupt
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _flush_and_run_exit_handlers()
    os._exit(code)


def _as_a_main_process() -> None:
    """multiprocessing's view of this process as a new interpreter has it: the main process, with no parent."""
    import multiprocessing.process as processes

    current = processes.current_process()
    current._name, current._identity, current._parent_pid, current._parent_name = "MainProcess", (), None, None
    processes._parent_process = None
    processes._children = set()


def _exit_status(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _flush_and_run_exit_handlers() -> None:
    """What Python does at its exit: wait for the threads that are not daemons, run the atexit handlers, flush."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    import atexit as exit_handlers

    exit_handlers._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


# ---- what a test makes a started run do


def _stop_after_logging(step: int) -> None:
    """In a started run's process, before the run: once rank 0 has logged `step`, it stops the run's whole process
    group (SIGSTOP). The workers are forked from this process, and inherit it; rank 0 alone stops the group, once,
    so that no other rank stops it again after the test has let it go on."""
    from runner.engine import loop

    log = loop._log

    def logged_then_stopped(job, at, *rest):
        logged = log(job, at, *rest)
        if at == step and job.ranks.rank == 0:
            os.killpg(os.getpgid(0), signal.SIGSTOP)
        return logged

    loop._log = logged_then_stopped


def _out_of_memory_at(step: int) -> None:
    """In a started run's process, before the run: the last rank's backward of `step` raises torch.OutOfMemoryError
    (the workers are forked from this process, and inherit it)."""
    import torch

    from runner.engine import loop
    from runner.strategies.strategy_protocol import unwrapped

    real_step = loop.train_step

    def out_of_memory(module, gradients):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def step_that_runs_out(job, batch):
        if job.ranks.rank == job.ranks.world_size - 1 and _steps_taken(job) == step - 1:
            unwrapped(job.model).model.layers[0].mlp.register_full_backward_pre_hook(out_of_memory)
        return real_step(job, batch)

    loop.train_step = step_that_runs_out


def _steps_taken(job) -> int:
    return job.scheduler.last_epoch
