"""The run directory: resuming a run in its own, the spec file that recomposes into the same job, the tracker
identity of a job, secrets kept out of Hydra's files, and a new run's directory removed when it is refused."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from runner.cli.compose import PRIMARY_CONFIG_FLAGS, SCHEMAS
from runner.config.spec import RunSpec, to_plain
from runner.config.tracker import REDACTED, RunIdentity, secrets
from runner.errors import SpecError
from runner.files.checkpoint_dirs import complete_checkpoints


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
    run_dir, checkpoint = _resumed(given[-1])
    others = [arg for arg in args if not arg.startswith("resume=")]
    return [
        "--config-dir",
        str(run_dir.resolve()),
        "--config-name",
        "spec",
        *others,
        f"resume={checkpoint.resolve()}",
        f"hydra.run.dir={run_dir.resolve()}",
    ]


def trained_arguments(args: list[str]) -> list[str]:
    """`task.trained=<run dir|checkpoint>` evaluates or generates with that run's spec: its spec.yaml becomes the
    primary config (unless the command names another), the user's overrides on top, so that the data, precision
    and eval rows are the run's."""
    given = [arg.split("=", 1)[1] for arg in args if arg.startswith("task.trained=")]
    if not given or any(arg.split("=", 1)[0] in PRIMARY_CONFIG_FLAGS for arg in args):
        return args
    path = Path(given[-1]).expanduser()
    run_dir = path.parent.parent if (path / "meta.json").is_file() else path
    if not (run_dir / "spec.yaml").is_file():
        return args  # a saved model's directory: the command line's spec
    return ["--config-dir", str(run_dir.resolve()), "--config-name", "spec", *args]


def _resumed(value: str) -> tuple[Path, Path]:
    """The run directory and the checkpoint that `resume=<value>` names."""
    if value == "auto":
        runs = [run for run in Path("outputs").glob("*/*") if complete_checkpoints(run)]
        if not runs:
            raise SpecError("resume=auto found no run with a complete checkpoint under outputs/")
        run_dir = max(runs, key=lambda run: complete_checkpoints(run)[-1].stat().st_mtime)
        return run_dir, complete_checkpoints(run_dir)[-1]
    if (Path(value) / "meta.json").is_file():
        return Path(value).parent.parent, Path(value)
    if (Path(value) / "spec.yaml").is_file():
        found = complete_checkpoints(Path(value))
        if not found:
            raise SpecError(f"resume={value}: that run has no complete checkpoint")
        return Path(value), found[-1]
    raise SpecError(f"resume={value} is neither a run directory nor a checkpoint")


def spec_file(spec: RunSpec, hydra_config: Any, run_dir: Path) -> str:
    """The resolved spec as a primary config that recomposes into the same job: each group's option, then the
    values. A group's section holds only what differs from its option, so that the file composes with another
    option of that group (`task=estimate`, `strategy=fsdp`) as the command line's defaults do."""
    overrides = " ".join(hydra_config.overrides.task)
    choices = {
        group: choice for group, choice in chosen_options(hydra_config.runtime.choices).items() if group in SCHEMAS
    }
    header = [
        "# The resolved run spec of this job, the runner's only input: its options, then its values (a group's",
        "# section only where it differs from the option). The whole spec: add --cfg job to the command below.",
        f"# Made by: run {overrides}".rstrip(),
        f"# Run it again: run --config-dir {run_dir} --config-name spec",
        "defaults:",
        "  - config",
        *[f"  - override {group}: {choice}" for group, choice in choices.items()],
        "  - _self_",
        "",
    ]
    values = to_plain(spec)
    options = option_values(choices)
    for group in choices:
        changed = differences(values[group], options[group])
        if changed:
            values[group] = changed
        else:
            del values[group]
    return "\n".join(header) + OmegaConf.to_yaml(OmegaConf.create(values))


def chosen_options(choices: Any) -> dict[str, str]:
    """The option of each of the spec's groups that Hydra composed (its own groups and the schemas left out), in
    the defaults list's order."""
    return {
        group: choice
        for group, choice in reversed(choices.items())
        if not group.startswith(("hydra/", "schema/")) and choice is not None
    }


def option_values(choices: dict[str, str]) -> dict[str, Any]:
    """Each group's section as its option alone composes it, with Hydra's loader of the running app."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    composed = (
        GlobalHydra.instance()
        .config_loader()
        .load_configuration("config", [f"{group}={choice}" for group, choice in choices.items()], RunMode.RUN)
    )
    return {group: OmegaConf.to_container(composed[group], resolve=True, enum_to_str=True) for group in choices}


def differences(values: dict[str, Any], option: dict[str, Any]) -> dict[str, Any]:
    """What `values` sets otherwise than `option`, nested sections key by key."""
    changed = {}
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(option.get(key), dict):
            value = differences(value, option[key])
            if value:
                changed[key] = value
        elif key not in option or option[key] != value:
            changed[key] = value
    return changed


def run_identity(hydra_config: Any, run_dir: Path) -> RunIdentity:
    """A sweep's jobs form one tracker group, the sweep directory, each named by its overrides."""
    from hydra.types import RunMode

    if hydra_config.mode == RunMode.MULTIRUN:
        overrides = ",".join(hydra_config.overrides.task) or run_dir.name
        return RunIdentity(name=overrides, group=str(Path(hydra_config.sweep.dir)))
    return RunIdentity(name=f"{run_dir.parent.name}/{run_dir.name}")


def scrub_secrets(run_dir: Path, spec: RunSpec) -> None:
    """Hydra's files and spec.yaml's header keep the overrides as typed, a secret's value included: hide it."""
    values = secrets(to_plain(spec, hide_secrets=False))
    for path in [run_dir / "spec.yaml", *(run_dir / ".hydra").glob("*.yaml")] if values else []:
        text = path.read_text()
        for value in values:
            text = text.replace(value, REDACTED)
        path.write_text(text)


def discard_run_dir(run_dir: Path) -> None:
    """Removes what Hydra and the runner wrote before training, and the directory if that leaves it empty."""
    logging.shutdown()
    shutil.rmtree(run_dir / ".hydra", ignore_errors=True)
    for name in ("spec.yaml", "run.log"):
        (run_dir / name).unlink(missing_ok=True)
    # outputs/<date>/<time>, then the date and outputs/ if nothing else is in them; never the working directory
    # or what is above it.
    cwd, run_dir = Path.cwd().resolve(), run_dir.resolve()
    for directory in [run_dir, run_dir.parent, *(d for d in run_dir.parents[1:] if cwd in d.parents)]:
        if directory == cwd:
            break
        try:
            directory.rmdir()
        except OSError:
            break
