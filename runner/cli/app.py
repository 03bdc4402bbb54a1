"""The Hydra app: `ValidateSpec` checks every job's spec and runs its task's pre-launch step before Hydra makes a
directory or starts a job; `run_job`, Hydra's task function, then runs the job: in this process (one process),
through the elastic launcher (several), or as one task of a submitit job (a cluster)."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from runner.cli.compose import CONF_DIR
from runner.cli.run_dir import chosen_options, discard_run_dir, run_identity, scrub_secrets, spec_file
from runner.cli.user_errors import USER_ERRORS, one_line
from runner.config.hardware import check_rendezvous
from runner.config.spec import RunSpec, load_spec, to_yaml, validate, with_absolute_paths
from runner.errors import (
    DeviceOutOfMemory,
    EndedInOneLine,
    ExitStatus,
    LaunchRefused,
    NonFiniteLoss,
    NothingToLaunch,
    RewardFailed,
    SpecError,
    Stopped,
    SweepStopped,
    WorkerFailed,
    WriteFailed,
)
from runner.files.checkpoint_dirs import complete_checkpoints
from runner.framework_imports import collector_paused
from runner.library_noise import name_deepspeed_accelerator, quiet_libraries
from runner.memory.disk import check_disk, check_sweep_disk, disk_need
from runner.planning.time_plan import plan
from runner.processes.cluster import (
    Task,
    check_launcher,
    check_submitter,
    current_task,
    requeue,
    requeued,
    submits_to_cluster,
)
from runner.processes.signals import SweepStop
from runner.tools.sweep_report import print_estimates, record_error, requeues, write_report

if TYPE_CHECKING:
    from hydra.core.override_parser.types import Override

    from runner.config.tracker import RunIdentity


def run_job(config: DictConfig) -> float:
    """Hydra's task function: the job of `config`, checked and its input read, then run; its objective."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    task = current_task()  # a task of a submitit job is one rank; every task of the job runs this
    hydra_config = HydraConfig.get()
    run_dir = Path(hydra_config.runtime.output_dir)
    if task is not None:  # started by submitit, not by `run`
        start_cluster_task(config, task, run_dir)
    sweeping = hydra_config.mode == RunMode.MULTIRUN and task is None
    if sweeping:
        stop_if_asked(hydra_config, "started")  # by a signal between the jobs
    spec, identity, inputs = start_job(config, hydra_config, first=task is None or task.rank == 0)
    if sweeping:
        stop_if_asked(hydra_config, "trained")  # by a signal while the job read its data
    log_format = OmegaConf.to_container(hydra_config.job_logging.formatters.simple)
    try:
        return run_job_here_or_on_workers(spec, run_dir, identity, inputs, task, log_format)
    except Stopped as stop:
        if task is not None:
            end_if_requeued(task, stop)
        if not sweeping:
            raise
        record_error(run_dir, stop)
        raise stopped_sweep(hydra_config, f"job {hydra_config.job.num} {stop}", next_job=hydra_config.job.num + 1)
    except Exception as error:
        one_line_statuses = {
            WriteFailed: ExitStatus.WRITE_FAILED,
            DeviceOutOfMemory: ExitStatus.FAILED,
            WorkerFailed: ExitStatus.FAILED,
            RewardFailed: ExitStatus.FAILED,
        }
        if type(error) in one_line_statuses and task is None and hydra_config.mode == RunMode.RUN:
            raise EndedInOneLine(str(error), one_line_statuses[type(error)]) from None
        failure = job_failure(error, task, run_dir, sweep_job=hydra_config.mode == RunMode.MULTIRUN)
        if failure is None:
            raise
        raise failure from None
    finally:
        if sweeping:  # the elastic launcher leaves its own signal handlers behind
            SWEEP.stop.install()


def start_cluster_task(config: DictConfig, task: Task, run_dir: Path) -> None:
    """A task of a submitit job (one rank), started by submitit rather than by `run`: the libraries kept quiet,
    and a job that SLURM started again resumed."""
    quiet_libraries()
    # submitit reports the task's end in its own files; in run.log, its "completed" would follow a failure that
    # Hydra caught.
    logging.getLogger("submitit").propagate = False
    resume_requeued(config, task, run_dir)


def start_job(config: DictConfig, hydra_config: DictConfig, first: bool) -> tuple[RunSpec, RunIdentity, Any]:
    """Starts the job: checks its spec (its task's pre-launch step run), writes the run directory's spec.yaml
    (the first of its processes, `first`) and reads its input, whose failure refuses the launch and removes a new
    run's directory; the spec, the job's identity and its input."""
    spec = validated(config, Path(hydra_config.runtime.cwd))
    name_deepspeed_accelerator(spec.hardware.accelerator.value)
    task_checked(spec)  # on a cluster's node, the first time on this machine
    run_dir = Path(hydra_config.runtime.output_dir)
    if first:
        (run_dir / "spec.yaml").write_text(spec_file(spec, hydra_config, run_dir))
        scrub_secrets(run_dir, spec)
    identity = run_identity(hydra_config, run_dir)
    logging.getLogger("runner").info("run directory %s | reading the job's input", run_dir)
    if first and spec.task.trains:
        logging.getLogger("runner").info("%s", disk_need(spec).line())
    try:
        inputs = spec.task.inputs(spec)
    except SpecError as error:
        if first and not spec.resume:  # a new run's directory holds nothing yet: leave nothing behind
            discard_run_dir(run_dir)
        raise LaunchRefused(str(error)) from None
    return spec, identity, inputs


def run_job_here_or_on_workers(
    spec: RunSpec, run_dir: Path, identity: RunIdentity, inputs: Any, task: Optional[Task], log_format: Any
) -> float:
    """Runs the job in this process (one process), as this task of a cluster job, or through the elastic launcher
    (several processes); its objective."""
    # The engine (and torch with it) is imported once a job runs: `run --help`, `run --cfg job` and the tasks that
    # launch nothing answer without it.
    from runner.distributed import Ranks
    from runner.processes.launch import launch
    from runner.processes.rank import run_task

    if not spec.strategy.distributed:
        return spec.task.run(spec, run_dir, Ranks(), identity, inputs)["objective"]
    if task is not None:
        return run_task(task, spec, run_dir, log_format, identity)["objective"]
    return launch(spec, run_dir, log_format, identity)["objective"]


def job_failure(error: Exception, task: Optional[Task], run_dir: Path, sweep_job: bool) -> Optional[WorkerFailed]:
    """What a failed job raises in place of `error` (None: `error` itself): a cluster task's error in one line, as
    WorkerFailed. A sweep's job logs its error here."""
    # Hydra holds a sweep job's error until the whole sweep has run: its log says why it failed now.
    if sweep_job:
        logging.getLogger("runner").exception("the job failed")
    told_in_one_line = (WorkerFailed, NonFiniteLoss, RewardFailed, WriteFailed, DeviceOutOfMemory)
    if task is not None and not isinstance(error, told_in_one_line):  # `run` says it in one line
        return WorkerFailed(
            f"rank {task.rank} failed (SLURM job {task.job_id}): {one_line(error)} (its "
            f"traceback: the logs in {run_dir})"
        )
    return None


def end_if_requeued(task: Task, stop: Stopped) -> None:
    """A cluster job stopped after its checkpoint that SLURM will run again ends this run without a result, which
    would tell submitit the job is over: near its time limit (SIGUSR2) it requeues itself; requeued by SLURM
    (`scontrol requeue`, a preemption) it is already. Stopped otherwise (scancel), it ends stopped, as the sweep
    report then says."""
    logging.getLogger("runner").warning("%s", stop)
    if stop.signal == "SIGUSR2":
        if task.rank == 0:
            requeue(task)
    elif not requeued(task):
        return
    sys.exit(ExitStatus.STOPPED)


def resume_requeued(config: DictConfig, task: Task, run_dir: Path) -> None:
    """A cluster job that SLURM started again (near its time limit, preempted, `scontrol requeue`) continues from
    its last complete checkpoint; without one, it starts over."""
    found = complete_checkpoints(run_dir)
    if found and not config.resume:
        config.resume = str(found[-1])
        logging.getLogger("runner").info(
            "SLURM started job %s again (restart %d): resuming from %s", task.job_id, task.restarts, found[-1]
        )


@dataclass
class Sweep:
    """The sweep this process runs, for stopping it as a whole: its points in order (the basic sweeper's; another
    sweeper chooses its own as it goes) and the signals that come between its jobs."""

    points: list[list[str]] = field(default_factory=list)
    stop: SweepStop = field(default_factory=SweepStop)


SWEEP = Sweep()


def stop_if_asked(hydra_config: DictConfig, before: str) -> None:
    """Stops the sweep before this job has `before` (started, trained) if a signal asked for it."""
    if SWEEP.stop.requested:
        discard_run_dir(Path(hydra_config.runtime.output_dir))
        raise stopped_sweep(
            hydra_config,
            f"{SWEEP.stop.requested} before job {hydra_config.job.num} {before}",
            next_job=hydra_config.job.num,
        )


def stopped_sweep(hydra_config: DictConfig, what: str, next_job: int) -> SweepStopped:
    """The report of a sweep that a signal stopped, the job it reached stopped or never started; how to go on."""
    sweep_dir = Path(hydra_config.sweep.dir)
    not_started = SWEEP.points[next_job:]
    write_report(sweep_dir, ended=True, not_started=not_started)
    lines = [f"the sweep stopped: {what}", f"sweep report: {sweep_dir / 'report.md'}"]
    lines += [f"not started: run {' '.join(point)}" for point in not_started]
    return SweepStopped("\n".join(lines))


def validated(config: DictConfig, started_in: Path, on_this_machine: bool = True) -> RunSpec:
    """The composed config as a checked spec, its local paths absolute from the directory `run` started in."""
    return validate(with_absolute_paths(load_spec(config), started_in), on_this_machine=on_this_machine)


def task_checked(spec: RunSpec) -> Optional[str]:
    """The task's own checks before launch (its answer, where it launches nothing). A process imports torch and
    transformers in them the first time: a training task builds the model on the meta device."""
    with collector_paused():
        return spec.task.before_launch(spec)


hydra_main = hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")(run_job)


def checked(
    config: DictConfig, prefix: str = "", launcher: Optional[DictConfig] = None, print_spec: bool = False
) -> tuple[RunSpec, Optional[str]]:
    """The validated spec of a job and, when it launches nothing, what to print instead: the task's answer (the
    estimate), or with `print_spec` the spec itself (`run --cfg job`: the spec's checks, not the task's, which
    would import torch).

    `launcher`: the submitit launcher that will start the job on a cluster's nodes; they are checked there, and
    here the spec against the hardware it declares.
    """
    try:
        if launcher is not None:
            check_launcher(launcher, config)
        spec = validated(config, Path.cwd(), on_this_machine=launcher is None)
        if launcher is None:
            check_rendezvous(spec.hardware)
        elif spec.task.runs_on_this_machine:  # an estimate submits nothing
            check_submitter(launcher)
        return spec, shown_spec(config, spec) if print_spec else task_checked(spec)
    except USER_ERRORS as error:
        raise LaunchRefused(f"{prefix}{one_line(error)}") from None


def shown_spec(config: DictConfig, spec: RunSpec) -> str:
    """The checked spec under a line of the options it was composed from, which the sections do not name."""
    options = chosen_options(config.hydra.runtime.choices)
    return f"# {' '.join(f'{group}={choice}' for group, choice in options.items())}\n{to_yaml(spec)}"


class ValidateSpec(Callback):
    """Checks every job before Hydra creates a directory or starts a job; answers the tasks that launch nothing.
    `print_spec` (`run --cfg job`): print each job's checked spec instead of running it."""

    def __init__(self, print_spec: bool = False) -> None:
        self.print_spec = print_spec

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        spec, answer = checked(config, print_spec=self.print_spec)
        if answer is None and not config.resume:
            refuse_used_directory(Path(config.hydra.run.dir), "hydra.run.dir")
        if answer is None and spec.task.trains and not self.print_spec:
            try:
                check_disk(spec, Path(config.hydra.run.dir))
            except SpecError as error:
                raise LaunchRefused(str(error)) from None
        if answer is not None:
            # An estimate composed with the submitit launcher (which only a sweep submits to) says its requeues.
            launcher = config.hydra.launcher if submits_to_cluster(config) and not self.print_spec else None
            planned = spec.task.planned(spec) if launcher is not None else None
            print("\n".join(filter(None, [answer, requeues(planned, launcher)])), flush=True)
            raise NothingToLaunch()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.global_hydra import GlobalHydra
        from hydra.core.override_parser.overrides_parser import OverridesParser

        # The launcher is made once, from the sweep's own config, for all its points.
        launcher = config.hydra.launcher if submits_to_cluster(config) else None
        if not self.print_spec:
            refuse_used_directory(Path(config.hydra.sweep.dir), "hydra.sweep.dir")
        # Every sweep syntax, as the sweepers expand it: the sweeper's own params first, then the command line's,
        # with the config loader that gives glob() its options.
        loader = GlobalHydra.instance().config_loader()
        params = [f"{key}={value}" for key, value in (config.hydra.sweeper.get("params") or {}).items()]
        overrides = OverridesParser.create(config_loader=loader).parse_overrides(
            [*params, *config.hydra.overrides.task]
        )
        basic = config.hydra.sweeper._target_ == f"{BasicSweeper.__module__}.{BasicSweeper.__name__}"
        # The basic sweeper's points are its jobs; another sweeper (Optuna) chooses its own as it goes, from any
        # value of each parameter.
        points = BasicSweeper.split_arguments(overrides, None)[0] if basic else each_value(overrides)
        answers, specs, training = {}, {}, []
        for job_overrides in points:
            name = " ".join(job_overrides)
            try:
                job_config = loader.load_sweep_config(config, job_overrides)
            except USER_ERRORS as error:
                raise LaunchRefused(f"{name}: {one_line(error)}") from None
            spec, answers[name] = checked(job_config, f"{name}: ", launcher, self.print_spec)
            specs[name] = spec
            if answers[name] is None and spec.task.trains:
                training.append(spec)
        if training and not self.print_spec:
            try:
                check_sweep_disk(training, Path(config.hydra.sweep.dir))
            except SpecError as error:
                raise LaunchRefused(str(error)) from None
        answered = {name: answer for name, answer in answers.items() if answer is not None}
        if not answered and launcher is None:  # jobs run here, one after another
            SWEEP.points = [list(point) for point in points] if basic else []
            SWEEP.stop.install()
        if answered and not basic and not self.print_spec:
            raise LaunchRefused(
                "task=estimate prints estimates for the basic sweeper's points (-m a,b), not for a "
                "sweeper that chooses its own"
            )
        if answered and len(answered) < len(answers):
            raise LaunchRefused("a sweep is either all task=estimate or all training jobs")
        if answered:
            # `run --cfg job` prints the specs alone: their plans would import the model's libraries.
            plans = {} if self.print_spec else {name: specs[name].task.planned(specs[name]) for name in answered}
            print_estimates(answered, plans, launcher)
            raise NothingToLaunch()
        if launcher is not None and not self.print_spec:
            for name, spec in specs.items():
                said = requeues(plan(spec), launcher) if spec.task.trains else None
                if said:
                    print(f"{name}: {said}", flush=True)


def refuse_used_directory(directory: Path, key: str) -> None:
    """A run or sweep directory that holds a run already: a new run would append to its metrics and overwrite its
    model."""
    held = [path for path in (directory / "spec.yaml", directory / "multirun.yaml") if path.exists()]
    held += sorted(directory.glob("*/spec.yaml"))[:1]
    if held:
        raise LaunchRefused(
            f"{key}={directory} holds a run already ({held[0]}); choose another directory, or "
            f"continue that run with: run resume={held[0].parent}"
        )


def each_value(overrides: list[Override]) -> list[list[str]]:
    """The points that hold every value a sweeper may choose for each parameter: each value of a choice, range or
    glob and both ends of an interval, the other parameters at their first."""
    values = []
    for override in overrides:
        key = override.get_key_element()
        if not override.is_sweep_override():
            given = [override.get_value_element_as_str()]
        elif override.is_discrete_sweep():
            given = list(override.sweep_string_iterator())
        else:
            interval = override.value()
            given = [str(interval.start), str(interval.end)]
        values.append([f"{key}={value}" for value in given])
    firsts = [options[0] for options in values]
    return [firsts] + [
        [*firsts[:i], option, *firsts[i + 1 :]] for i, options in enumerate(values) for option in options[1:]
    ]
