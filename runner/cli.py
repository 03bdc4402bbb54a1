"""`run`: Hydra composes the spec, `validate` checks it before anything is written, then the job trains.

User errors (an unknown key or option, a wrong value, an impossible combination, a missing file) end in one
line on stderr and exit status 2, before Hydra creates an output directory.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException, OverrideParseException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner import cluster, recipes
from runner import spec as spec_module
from runner.checkpoint import complete_checkpoints
from runner.spec import SpecError, load_spec, validate
from runner.task import EstimateTask
from runner.train import NonFiniteLoss, Stopped


USER_ERRORS = (HydraException, OmegaConfBaseException, SpecError, recipes.RecipeError)
# Exit statuses: 0 done, 1 the job failed, 2 bad input (nothing started), 3 stopped by a signal with a checkpoint.
EXIT_STOPPED = 3


class WorkerFailed(Exception):
    """A worker process of a multi-process job raised or died; the message leads with that rank's error."""


class LaunchRefused(BaseException):
    """A spec rejected before launch. Hydra turns a callback's Exception into a mere warning; this stops it."""


class NothingToLaunch(BaseException):
    """task=estimate: the estimate is printed, and Hydra stops before it makes a run directory."""


def bundled(name: str) -> Path:
    """conf/ and recipes/ ship inside the installed package and sit beside it in a checkout."""
    package = Path(__file__).resolve().parent
    return package / name if (package / name).is_dir() else package.parent / name


CONF_DIR = bundled("conf")
RECIPES_DIR = bundled("recipes")
# The spec's config groups: conf/'s directories but hydra/, which holds options of Hydra's own groups (launchers).
GROUP_DIRS = [path for path in sorted(CONF_DIR.iterdir()) if path.is_dir() and path.name != "hydra"]


def main() -> None:
    quiet_libraries()
    args = sys.argv[1:]
    recipe_dirs = recipes.search_path(RECIPES_DIR)
    if "--help" in args or "-h" in args:
        print(help_text(recipe_dirs))
        return
    if ("--cfg" in args or "-c" in args) and "--resolve" not in args:
        sys.argv.append("--resolve")
    # Hydra would print its own multi-line report and exit 1; the runner reports user errors itself.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        if args[:1] == ["--recipes"]:
            print(recipes.listing(recipe_dirs, RECIPES_DIR))
            return
        if args[:1] == ["--copy-recipe"]:
            copy_recipe(recipe_dirs, args[1:])
            return
        if args[:1] == ["--from-accelerate"]:
            recipe_from_accelerate(args[1:])
            return
        if args[:1] == ["--to-accelerate"]:
            print_accelerate_config(recipe_dirs, args[1:])
            return
        sys.argv[1:] = resume_arguments(sys.argv[1:])
        spec_module.register(*choosable_recipes(recipe_dirs, sys.argv[1:]))
        hydra_main()
    except USER_ERRORS as error:
        refuse(one_line(error))
    except AssertionError as error:
        # OmegaConf asserts when an override reaches into a section that is null, such as an unselected tracker.
        if not str(error).startswith("Unexpected type for root: NoneType"):
            raise
        keys = [arg.split("=", 1)[0] for arg in sys.argv[1:] if "=" in arg and not arg.startswith("-")]
        refuse(f"a key in {', '.join(keys)} sits in a section this spec leaves unset; select it first "
               "(for example tracker=wandb before tracker.wandb.project=...)")
    except LaunchRefused as refusal:
        refuse(str(refusal))
    except NothingToLaunch:
        return
    except (WorkerFailed, NonFiniteLoss) as failure:
        print(f"run: error: {failure}", file=sys.stderr)
        sys.exit(1)
    except Stopped as stopped:
        print(f"run: {stopped}", file=sys.stderr)
        sys.exit(EXIT_STOPPED)


# Flags that name another primary config, whose defaults list may choose a recipe.
PRIMARY_CONFIG_FLAGS = ("--config-name", "-cn", "--config-dir", "-cd", "--config-path", "-cp")


def choosable_recipes(recipe_dirs: list[Path], args: list[str]) -> list[Path]:
    """The recipe directories, when these arguments can choose a recipe: one of them names the group (`recipe=`, a
    sweep over it, a sweeper's parameter) or another primary config. Otherwise none: Hydra copies every config
    stored for it each time it composes, and reading and copying the recipes would slow every `run`."""
    if any("recipe" in arg or arg.startswith(PRIMARY_CONFIG_FLAGS) for arg in args):
        return recipe_dirs
    return []


def copy_recipe(recipe_dirs: list[Path], args: list[str]) -> None:
    if len(args) not in (1, 2):
        raise recipes.RecipeError("usage: run --copy-recipe <name> [<new name>]")
    target = recipes.copy(recipe_dirs, args[0], args[1] if len(args) == 2 else None)
    print(f"copied recipe {args[0]} to {target}; edit it and run it with: run recipe={target.stem}")


def recipe_from_accelerate(args: list[str]) -> None:
    if len(args) not in (1, 2):
        raise recipes.RecipeError("usage: run --from-accelerate <accelerate config .yaml> [<recipe name>]")
    from runner import accelerate_config

    target, lines = accelerate_config.write_recipe(Path(args[0]), args[1] if len(args) == 2 else None)
    print("\n".join(lines))
    print(f"wrote {target}; run it with: run recipe={target.stem}")


def print_accelerate_config(recipe_dirs: list[Path], overrides: list[str]) -> None:
    """The accelerate config of the spec that `run <overrides>` would compose; what it cannot say, on stderr."""
    from hydra import compose, initialize_config_dir

    from runner import accelerate_config

    spec_module.register(*choosable_recipes(recipe_dirs, overrides))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        spec = load_spec(compose("config", overrides=overrides))
    text, notes = accelerate_config.accelerate_file(spec)
    print(text, end="")
    print("\n".join(notes), file=sys.stderr)


def refuse(message: str) -> None:
    print(f"run: error: {message}", file=sys.stderr)
    sys.exit(2)


def resume_arguments(args: list[str]) -> list[str]:
    """`resume=auto|<run dir>|<checkpoint>` continues a run in its own directory, from its own spec.

    The arguments become: that run's spec.yaml as the primary config, the user's other overrides on top (to
    extend train.max_steps, say), resume=<the checkpoint> and hydra.run.dir=<the run directory>.
    """
    given = [arg.split("=", 1)[1] for arg in args if arg.startswith("resume=")]
    if not given or given[-1] in ("", "null"):
        return args
    if "-m" in args or "--multirun" in args:
        raise SpecError("resume= continues one run; it cannot be part of a sweep (-m)")
    value = given[-1]
    if value == "auto":
        runs = [run for run in Path("outputs").glob("*/*") if complete_checkpoints(run)]
        if not runs:
            raise SpecError("resume=auto found no run with a complete checkpoint under outputs/")
        run_dir = max(runs, key=lambda run: complete_checkpoints(run)[-1].stat().st_mtime)
        checkpoint = complete_checkpoints(run_dir)[-1]
    elif (Path(value) / "meta.json").is_file():
        checkpoint = Path(value)
        run_dir = checkpoint.parent.parent
    elif (Path(value) / "spec.yaml").is_file():
        run_dir = Path(value)
        found = complete_checkpoints(run_dir)
        if not found:
            raise SpecError(f"resume={value}: that run has no complete checkpoint")
        checkpoint = found[-1]
    else:
        raise SpecError(f"resume={value} is neither a run directory nor a checkpoint")
    run_dir, checkpoint = run_dir.resolve(), checkpoint.resolve()
    others = [arg for arg in args if not arg.startswith("resume=")]
    return ["--config-dir", str(run_dir), "--config-name", "spec", *others,
            f"resume={checkpoint}", f"hydra.run.dir={run_dir}"]


def run_job(config: DictConfig) -> float:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from runner.job import load_data, prepare_job
    from runner.launch import launch
    from runner.strategy import SingleStrategy
    from runner.train import train

    task = cluster.current_task()  # a task of a submitit job is one rank; every task of the job runs this
    if task is not None:  # started by submitit, not by `run`
        quiet_libraries()
    spec = validate(load_spec(config))
    hydra_config = HydraConfig.get()
    run_dir = Path(hydra_config.runtime.output_dir)
    first = task is None or task.rank == 0
    if first:
        (run_dir / "spec.yaml").write_text(spec_file(spec, hydra_config, run_dir))
        scrub_secrets(run_dir, spec)
    identity = run_identity(hydra_config, run_dir)
    logging.getLogger("runner").info("run directory %s | reading and tokenizing the data", run_dir)
    try:
        loaded = load_data(spec)
    except SpecError as error:
        if first and not spec.resume:  # a new run's directory holds nothing yet: leave nothing behind
            discard_run_dir(run_dir)
        raise LaunchRefused(str(error)) from None
    log_format = OmegaConf.to_container(hydra_config.job_logging.formatters.simple)
    try:
        if isinstance(spec.strategy, SingleStrategy):
            return train(prepare_job(spec, run_dir, identity=identity, loaded=loaded))["eval_loss"]
        if task is not None:
            return cluster.run_task(task, spec, run_dir, log_format, identity)["eval_loss"]
        return launch(spec, run_dir, log_format, identity)["eval_loss"]
    except Exception:
        # Hydra holds a sweep job's error until the whole sweep has run: its log says why it failed now.
        if hydra_config.mode == RunMode.MULTIRUN:
            logging.getLogger("runner").exception("the job failed")
        raise


def run_identity(hydra_config: Any, run_dir: Path) -> Any:
    """A sweep's jobs form one tracker group, the sweep directory, each named by its overrides."""
    from hydra.types import RunMode

    from runner.tracker import RunIdentity

    if hydra_config.mode == RunMode.MULTIRUN:
        overrides = ",".join(hydra_config.overrides.task) or run_dir.name
        return RunIdentity(name=overrides, group=str(Path(hydra_config.sweep.dir)))
    return RunIdentity(name=f"{run_dir.parent.name}/{run_dir.name}")


def scrub_secrets(run_dir: Path, spec: spec_module.RunSpec) -> None:
    """Hydra's files and spec.yaml's header keep the overrides as typed, a secret's value included: hide it."""
    from runner.tracker import REDACTED, secrets

    values = secrets(spec_module.to_plain(spec, hide_secrets=False))
    for path in [run_dir / "spec.yaml", *(run_dir / ".hydra").glob("*.yaml")] if values else []:
        text = path.read_text()
        for value in values:
            text = text.replace(value, REDACTED)
        path.write_text(text)


def discard_run_dir(run_dir: Path) -> None:
    """Removes what Hydra and the runner wrote before training, and the directory if that leaves it empty."""
    import shutil

    logging.shutdown()
    shutil.rmtree(run_dir / ".hydra", ignore_errors=True)
    for name in ("spec.yaml", "run.log"):
        (run_dir / name).unlink(missing_ok=True)
    for directory in (run_dir, run_dir.parent):  # outputs/<date>/<time>: the date too, if nothing else is in it
        if directory.resolve() == Path.cwd().resolve():
            break
        try:
            directory.rmdir()
        except OSError:
            break


hydra_main = hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")(run_job)


class ValidateSpec(Callback):
    """Validates every job's spec before Hydra creates a directory or starts a job."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        spec = self._validated(config)
        if isinstance(spec.task, EstimateTask):
            print(estimate_report(spec), flush=True)
            raise NothingToLaunch()

    @staticmethod
    def _validated(config: DictConfig, prefix: str = "", launcher: DictConfig | None = None) -> spec_module.RunSpec:
        """`launcher`: the submitit launcher that will start the job, on a cluster's nodes; they are checked there,
        and here the spec against the hardware it declares."""
        try:
            if launcher is not None:
                cluster.check_launcher(launcher, config)
            return validate(load_spec(config), on_this_machine=launcher is None)
        except USER_ERRORS as error:
            raise LaunchRefused(f"{prefix}{one_line(error)}") from None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.global_hydra import GlobalHydra
        from hydra.core.override_parser.overrides_parser import OverridesParser

        # The launcher is made once, from the sweep's own config, for all its points.
        launcher = config.hydra.launcher if cluster.submits_to_cluster(config) else None
        if config.hydra.sweeper._target_ != f"{BasicSweeper.__module__}.{BasicSweeper.__name__}":
            # Other sweepers (Optuna) choose their points as they go: the base spec is checked here, each point as
            # its job starts.
            if isinstance(self._validated(config, launcher=launcher).task, EstimateTask):
                raise LaunchRefused("task=estimate prints estimates for the basic sweeper's points (-m a,b), not "
                                    "for a sweeper that chooses its own")
            return
        overrides = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
        loader = GlobalHydra.instance().config_loader()
        specs = {}
        for job_overrides in BasicSweeper.split_arguments(overrides, None)[0]:
            name = " ".join(job_overrides)
            specs[name] = self._validated(loader.load_sweep_config(config, job_overrides), prefix=f"{name}: ",
                                          launcher=launcher)
        estimates = {name: spec for name, spec in specs.items() if isinstance(spec.task, EstimateTask)}
        if estimates and len(estimates) < len(specs):
            raise LaunchRefused("a sweep is either all task=estimate or all training jobs")
        if estimates:
            for name, spec in estimates.items():
                print(f"== {name}\n{estimate_report(spec)}\n", flush=True)
            raise NothingToLaunch()


def estimate_report(spec: spec_module.RunSpec) -> str:
    """What task=estimate prints instead of launching (runner/memory.py)."""
    from runner import memory

    try:
        return memory.report(spec)
    except USER_ERRORS as error:
        raise LaunchRefused(one_line(error)) from None


def spec_file(spec: spec_module.RunSpec, hydra_config: Any, run_dir: Path) -> str:
    """The resolved spec as a primary config that recomposes into the same job."""
    overrides = " ".join(hydra_config.overrides.task)
    choices = [
        f"  - override {group}: {choice}"
        for group, choice in hydra_config.runtime.choices.items()
        if not group.startswith("hydra/") and group in spec_module.SCHEMAS
    ]
    header = [
        "# The resolved run spec of this job, the runner's only input.",
        f"# Made by: run {overrides}".rstrip(),
        f"# Run it again: run --config-dir {run_dir} --config-name spec",
        "defaults:",
        "  - config",
        *choices,
        "  - _self_",
        "",
    ]
    return "\n".join(header) + spec_module.to_yaml(spec)


# Options of Hydra's own groups that its plugins provide, and the package of each plugin.
HYDRA_PLUGINS = {
    "hydra/sweeper/optuna": "hydra-optuna-sweeper",
    "hydra/launcher/submitit_slurm": "hydra-submitit-launcher",
    "hydra/launcher/submitit_local": "hydra-submitit-launcher",
}


def one_line(error: BaseException) -> str:
    """The message a user needs, on one line, without Hydra's and OmegaConf's report layout."""
    if isinstance(error, MissingConfigException) and error.missing_cfg_file in HYDRA_PLUGINS:
        package = HYDRA_PLUGINS[error.missing_cfg_file]
        return f"{error.missing_cfg_file} comes with Hydra's {package} plugin, which is not installed: pip install {package}"
    if isinstance(error, MissingConfigException) and error.missing_cfg_file and error.options is not None:
        group, _, option = error.missing_cfg_file.rpartition("/")
        return f"{group}={option} is not an option; choose one of: {', '.join(sorted(error.options))}"
    if isinstance(error, OverrideParseException):
        return f"cannot parse the override '{error.override}': {str(error).splitlines()[0]}"
    cause = error.__cause__ if isinstance(error, ConfigCompositionException) and error.__cause__ else error
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        message = getattr(cause, "msg", str(cause)).splitlines()[0]
        if message.startswith("Key ") and " not in " in message:
            return f"unknown key {cause.full_key}: {message}"
        return f"{cause.full_key}: {message}"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return " ".join(lines[:2]) if lines else type(error).__name__


def help_text(recipe_dirs: list[Path]) -> str:
    """The groups and their options, read from conf/ and the recipe directories without composing anything."""
    import yaml

    defaults = {}
    for entry in yaml.safe_load((CONF_DIR / "config.yaml").read_text())["defaults"]:
        if isinstance(entry, dict):
            defaults.update(entry)
    groups = [(p.name, sorted(p.glob("*.yaml"))) for p in GROUP_DIRS]
    groups.append(("recipe", [path for _, path in sorted(recipes.find(recipe_dirs).items())]))
    rows = []
    for group, options in groups:
        for i, option in enumerate(options):
            mark = "*" if defaults.get(group) == option.stem else " "
            rows.append(f"  {group if i == 0 else '':<10} {mark}{option.stem:<18} {recipes.first_comment(option)}")
    return "\n".join(
        [
            "run: a declarative experiment runner for PyTorch training.",
            "",
            "Usage:",
            "  run [group=option ...] [key=value ...]   train one job",
            "  run -m group=a,b key=1,2 ...              a sweep: one job per combination",
            "  run --cfg job [overrides]                 print the resolved spec and exit",
            "  run --recipes                             list the recipes, what each is for and what it sets",
            "  run --copy-recipe <name> [<new name>]     copy a recipe into ./recipes to edit it",
            "  run --from-accelerate <file> [<name>]     turn an accelerate config file into ./recipes/<name>.yaml",
            "  run --to-accelerate [overrides]           print the accelerate config file of a spec",
            "  run -m hydra/sweeper=optuna 'optim.lr=interval(1e-4,1e-2)'   search, minimising the eval loss",
            "  run -m hydra/launcher=slurm ...           one SLURM job per sweep point (slurm_local: on this machine)",
            "",
            "Config groups (* marks the default; a recipe sets several groups and values at once):",
            *rows,
            "",
            "Every key of the spec can be set on the command line: train.max_steps=50 optim.lr=3e-4 seed=1.",
            "`run --cfg job` shows them all. Outputs go to outputs/<date>/<time>/. Hydra's flags: run --hydra-help",
        ]
    )


def quiet_libraries() -> None:
    """Keeps the libraries' start-up chatter (progress bars, advisory warnings) out of the user's terminal."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    quiet_loggers()


def quiet_loggers() -> None:
    """torchao, which transformers imports whenever it is installed (validation builds a model on the meta
    device), warns about kernels this machine does not need, and torch about torchao's enum registrations;
    alembic, which the Optuna sweeper imports, lists its plugins. Errors still show."""
    for name in ("torchao", "torch.utils._pytree", "alembic"):
        logging.getLogger(name).setLevel(logging.ERROR)
