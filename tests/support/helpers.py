"""What the tests share: the `run` command as a user types it, the run directories it writes, specs, groups of worker
processes, and waiting for what a run does.

Starting Python and importing torch and transformers takes about 4 s here, longer than most test runs themselves.
Every process these helpers start (a `run`, a worker of a group) is forked from multiprocessing's forkserver,
which has imported them once, after quieting the libraries as `run` quiets them before it imports them. Each is a
process of its own: its own pid, session, signals, environment, working directory, standard output and error and
exit status; it starts only without Python's start and those imports. `run_cli(..., fresh=True)` starts a new
interpreter instead, for what a fresh one shows (the imports it makes, what libraries print as they are imported).
"""

from __future__ import annotations

import atexit
import functools
import io
import json
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from runner.cli.compose import RECIPES_DIR, compose_config, register
from runner.config.spec import RunSpec, load_spec, validate

register(RECIPES_DIR)

# A small slice of the default corpus keeps test runs to seconds: 20 documents, 2 held out, in steps of two rows
# of 128 tokens (a step of four took 44 ms here, one of two 25 ms: the same code, half the arithmetic).
SMALL_CORPUS = f"{sysconfig.get_paths()['stdlib']}/email/*.py"
# Two of the default model's four blocks: a strategy's work goes block by block, and two blocks show it in two thirds
# of the time (a step's time is its arithmetic's here).
TWO_BLOCKS = ["model.architecture.num_hidden_layers=2"]
# The data and steps of a quick run, for the tests that bring their own model (model=pretrained).
QUICK_STEPS = [
    f"data.files={SMALL_CORPUS}",
    "data.eval_fraction=0.1",
    "data.seq_len=128",
    "train.micro_batch_size=2",
    "train.max_steps=30",
    "train.log_every=10",
    "train.eval_every=15",
    "train.eval_batches=2",
]
QUICK = [*QUICK_STEPS, *TWO_BLOCKS]

# What the forkserver imports once: what `python -m runner` imports before it runs, then what a run imports (a run
# that saves its model imports DeepSpeed too, through transformers' save_pretrained, where it is installed, and each
# rank of strategy=deepspeed imports its Muon optimizer, and torch's compiler with it, as it starts: 1.6 s); last,
# frozen_heap, which takes all of it out of the garbage collector's passes.
WARM_IMPORTS = ["runner.cli.main", "torch", "transformers.models.llama.modeling_llama", "datasets",
                "runner.engine.job", "runner.engine.loop", "deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer",
                "tests.support.helpers", "tests.support.frozen_heap"]
# What the forkserver imports first, for the runs alone (the tests' own processes seldom need them): pipeline
# parallelism's stages, peft for adapters, and wandb with what its init imports (its launch inputs: 1.5 s), each
# imported by 4 to 16 runs of the suite otherwise.
RUN_IMPORTS = ["torch.distributed.pipelining", "peft", "wandb", "wandb.sdk.launch.inputs.internal"]
# The longest any one `run` of the tests may take before it is ended and the test fails.
RUN_TIMEOUT_S = 600


# ---- specs


def composed(overrides: list[str]) -> RunSpec:
    """The typed spec, not validated: its hardware is as declared, not this machine's."""
    return load_spec(compose_config(overrides))


def resolved_spec(overrides: list[str]) -> RunSpec:
    """The spec as `run` launches it: validated on this machine, its task's pre-launch checks passed."""
    spec = validate(composed(overrides))
    spec.task.before_launch(spec)
    return spec


# ---- run directories


def run_dirs(cwd: Path) -> list[Path]:
    return sorted(p.parent for p in (cwd / "outputs").glob("*/*/spec.yaml"))


def logged(run_dir: Path, key: str) -> dict[int, float]:
    """The values of one metric in a run's metrics.jsonl, by step. A line still being written (the run goes on)
    is left out: only whole lines count."""
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    records = [json.loads(line) for line in text.split("\n")[:-1]]  # the part after the last newline is not whole
    return {r["step"]: r[key] for r in records if key in r}


def step_losses(run_dir: Path) -> list[float]:
    """A run's logged training losses, in step order."""
    return list(logged(run_dir, "loss").values())


def last_step(run_dir: Optional[Path]) -> int:
    """The last step a run logged a training loss for (0 before its first)."""
    return max(logged(run_dir, "loss"), default=0) if run_dir else 0


# ---- waiting


T = TypeVar("T")


def wait_until(condition: Callable[[], T], what: str, job: Optional[Started] = None, timeout: float = 300,
               every: float = 0.05) -> T:
    """Polls `condition` until it returns something true, and returns that. Fails, saying what it waited for, when
    `job` ends first or after `timeout` seconds: a bound for a stalled run, far above what any step takes."""
    deadline = time.monotonic() + timeout
    while True:
        found = condition()
        if found:
            return found
        if job is not None and job.poll() is not None:
            raise AssertionError(f"the run ended ({job.returncode}) before {what}: {job.stderr()[-2000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:.0f} s for {what}")
        time.sleep(every)


def hold_at_step(job: Started, cwd: Path, timeout: float = 300) -> tuple[Path, int]:
    """Returns once the run under `cwd`, started with `stop_at_step`, has stopped itself right after logging that
    step, every process of its group stopped (SIGSTOP): what the test does next reaches it mid-run whatever the
    machine's speed, and however little of the CPU the test gets. The run directory and the last step logged;
    `resume` the run, or kill it."""
    step = job.stop_at_step
    assert step is not None, "start the run with stop_at_step"
    wait_until(lambda: group_stopped(job.pid), f"the run to stop itself after step {step}", job, timeout)
    run_dir = next(d for d in run_dirs(cwd) if last_step(d) >= step)
    return run_dir, last_step(run_dir)


def group_stopped(group: int) -> bool:
    """Whether every live process of a process group is stopped (state T in /proc/<pid>/stat)."""
    states = [state for _, state in _group_processes(group)]
    return bool(states) and all(state in "Tt" for state in states)


def deleted_files_mapped(group: int, under: Path) -> dict[int, list[str]]:
    """The files under `under`, deleted since, that each live process of a process group still maps (a tensor that
    is a view of a removed checkpoint's file keeps its space taken), from /proc/<pid>/maps; only the processes that
    map one."""
    prefix = f"{under.resolve()}/"
    mapped = {}
    for process, _ in _group_processes(group):
        try:
            lines = (process / "maps").read_text().splitlines()
        except OSError:  # a process that ended meanwhile
            continue
        paths = sorted({line.split(None, 5)[5] for line in lines
                        if line.endswith(" (deleted)") and f" {prefix}" in line})
        if paths:
            mapped[int(process.name)] = paths
    return mapped


def _group_processes(group: int) -> list[tuple[Path, str]]:
    """The live processes of a process group: each one's /proc/<pid> and its state (in /proc/<pid>/stat)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # a process that ended meanwhile
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            found.append((stat.parent, fields[0]))
    return found


def _stop_after_logging(step: int) -> None:
    """In a started run's process, before the run: once rank 0 has logged `step`, it stops the run's whole process
    group (SIGSTOP). The workers are forked from this process, and inherit it; rank 0 alone stops the group, once,
    so that no other rank stops it again after the test has let it go on."""
    from runner.engine import loop

    log = loop._log

    def logged_then_stopped(job, at, record):
        logged = log(job, at, record)
        if at == step and job.ranks.rank == 0:
            os.killpg(os.getpgid(0), signal.SIGSTOP)
        return logged

    loop._log = logged_then_stopped


def _out_of_memory_at(step: int) -> None:
    """In a started run's process, before the run: the last rank's backward of `step` raises torch.OutOfMemoryError
    (the workers are forked from this process, and inherit it)."""
    import torch

    from runner.engine import loop
    from runner.strategies.protocol import unwrapped

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


# ---- the `run` command


class Started:
    """A `run` going on in the background, as subprocess.Popen shows one: its pid, poll(), wait(), its signals, and
    its standard output and error once it has ended."""

    def __init__(self, process: multiprocessing.process.BaseProcess, output: Path, errors: Path,
                 new_session: bool, stop_at_step: Optional[int] = None) -> None:
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


def run_cli(*args: str, cwd: Path, env: Optional[dict[str, str]] = None, fresh: bool = False,
            timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    """`run <args>` as a user types it in `cwd` (with `env` added to the environment), to its end: its exit status,
    standard output and error. `fresh`: in a new interpreter, for what its start and imports show."""
    if fresh:
        a_second_of_its_own(cwd)
        return subprocess.run([sys.executable, "-m", "runner", *args], cwd=cwd, capture_output=True, text=True,
                              env=environment(env), timeout=timeout)
    job = start_cli(*args, cwd=cwd, env=env, new_session=True)
    try:
        stdout, stderr = job.communicate(timeout)
    finally:
        job.kill()
    return subprocess.CompletedProcess(["run", *args], job.returncode, stdout, stderr)


def start_cli(*args: str, cwd: Path, env: Optional[dict[str, str]] = None, new_session: bool = False,
              stop_at_step: Optional[int] = None, out_of_memory_at_step: Optional[int] = None) -> Started:
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
    process = warm_processes().Process(target=_run_command, name="run",
                                       args=(list(args), str(cwd), environment(env), str(output), str(errors),
                                             new_session, stop_at_step, out_of_memory_at_step))
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


@functools.cache
def warm_processes() -> multiprocessing.context.BaseContext:
    """multiprocessing's forkserver, its imports made once, after the libraries were quieted as `run` quiets them
    before it imports them (their verbosity comes from the environment they were imported in). Python 3.11's
    forkserver ignores the tests' sys.path as it imports (3.12 passes it on), so PYTHONPATH names the tests' own
    modules for it (the repository, home of the package `tests`); without them, every process it forked imported
    helpers again, and froze nothing."""
    from runner.quiet import name_deepspeed_accelerator, quiet_libraries

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


def _run_command(args: list[str], cwd: str, env: dict[str, str], output: str, errors: str, new_session: bool,
                 stop_at_step: Optional[int], out_of_memory_at_step: Optional[int] = None) -> None:
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
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), write_through=True,
                                                   errors="backslashreplace")
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


# ---- kill and resume


_UNINTERRUPTED: dict[tuple[str, ...], dict[int, float]] = {}


def uninterrupted_losses(args: list[str], tmp_path_factory) -> dict[int, float]:
    """The per-step losses of `run <args>` without a stop: run once per session for each `args`, then reused."""
    key = tuple(args)
    if key not in _UNINTERRUPTED:
        cwd = tmp_path_factory.mktemp("uninterrupted")
        result = run_cli(*args, cwd=cwd)
        assert result.returncode == 0, result.stderr[-2000:]
        _UNINTERRUPTED[key] = logged(run_dirs(cwd)[0], "loss")
    return _UNINTERRUPTED[key]


def kill_at_step(args: list[str], cwd: Path, step: int) -> Path:
    """Starts `run`, and kills it and its workers with SIGKILL once it has logged `step`; its run directory."""
    job = start_cli(*args, cwd=cwd, stop_at_step=step)
    try:
        run_dir, _ = hold_at_step(job, cwd)
    finally:
        job.kill()
    return run_dir


def killed_and_resumed(args: list[str], tmp_path: Path, step: int, tmp_path_factory) -> tuple[dict, dict]:
    """The losses of an uninterrupted run, and of the same run killed at `step` and resumed (`resume=auto`)."""
    expected = uninterrupted_losses(args, tmp_path_factory)
    run_dir = kill_at_step(args, tmp_path, step)
    resumed = run_cli("resume=auto", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    return expected, logged(run_dir, "loss")


# ---- groups of worker processes


def _in_process_group(fn, args):
    import torch
    import torch.distributed as dist

    from runner.distributed import Ranks, close_process_group

    ranks = Ranks(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))
    # The cores shared among the group, as `run` shares them among its workers.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // ranks.world_size))
    dist.init_process_group("gloo")
    try:
        return fn(ranks, *args)
    finally:
        if dist.is_initialized():  # fn may have closed it
            close_process_group()


def run_in_workers(fn, *args, nproc: int) -> list:
    """fn(ranks, *args) in each of `nproc` worker processes of one gloo group; the results in rank order.

    `fn` must be importable (a module-level function): the workers are forked from the warm forkserver.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from runner.distributed import free_port

    warm_processes()
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, rdzv_backend="static", run_id="test",
        rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_configs={"rank": 0}, max_restarts=0, start_method="forkserver",
    )
    results = elastic_launch(config, _in_process_group)(fn, args)
    return [results[rank] for rank in range(nproc)]


def _train_each(ranks, specs, run_dirs):
    """Each spec's task (train, dpo) run into its run directory."""
    return [spec.task.run(spec, Path(run_dir), ranks, None) for spec, run_dir in zip(specs, run_dirs)]


def train_in_workers(specs, run_dirs: list[Path], nproc: int = 2) -> list[dict]:
    """Each spec trained in turn into its run directory (made if missing) by one group of `nproc` worker processes;
    rank 0's summaries."""
    for run_dir in run_dirs:
        run_dir.mkdir(parents=True, exist_ok=True)
    return run_in_workers(_train_each, specs, [str(d) for d in run_dirs], nproc=nproc)[0]
