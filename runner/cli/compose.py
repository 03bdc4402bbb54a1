"""What Hydra composes from: conf/, the recipes, and the schemas of every group's options in Hydra's ConfigStore
(`schema/<group>/<name>`, which each option in conf/ starts from)."""

from __future__ import annotations

import functools
import os
import sysconfig
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from runner.cli import recipes
from runner.config.adapter import AdapterConfig
from runner.config.data import DataConfig
from runner.config.hardware import Accelerator, HardwareConfig
from runner.config.model import ModelConfig
from runner.config.optim import AdamWConfig, SGDConfig
from runner.config.precision import PrecisionConfig
from runner.config.scheduler import SchedulerConfig
from runner.config.spec import RunSpec, load_spec, validate
from runner.files.paths import bundled
from runner.strategies import STRATEGIES
from runner.tasks import TASKS

CONF_DIR = bundled("conf")
RECIPES_DIR = bundled("recipes")
# The spec's config groups: conf/'s directories but hydra/, which holds options of Hydra's own groups (launchers).
GROUP_DIRS = [path for path in sorted(CONF_DIR.iterdir()) if path.is_dir() and path.name != "hydra"]

# Each group's schemas by option; the tracker group's options combine, and start from the RunSpec field's type.
SCHEMAS = {
    "hardware": {"base": HardwareConfig},
    "strategy": STRATEGIES,
    "precision": {"base": PrecisionConfig},
    "model": {"base": ModelConfig},
    "adapter": {"base": AdapterConfig},
    "data": {"base": DataConfig},
    "optim": {"adamw": AdamWConfig, "sgd": SGDConfig},
    "scheduler": {"base": SchedulerConfig},
    "task": TASKS,
}
# Flags that name another primary config, whose defaults list may choose a recipe.
PRIMARY_CONFIG_FLAGS = ("--config-name", "-cn", "--config-dir", "-cd", "--config-path", "-cp")


def register(*recipe_dirs: Path) -> None:
    """Puts the schemas, the recipes of these directories (later ones shadowing earlier ones) in Hydra's
    ConfigStore and the `${stdlib:}` and `${gpus_per_node:}` resolvers in OmegaConf."""
    store_schemas()
    # <recipe dir>/<name>.yaml is the option `recipe=<name>`: a global overlay on the whole spec.
    for name, path in recipes.find(list(recipe_dirs)).items():
        ConfigStore.instance().store(group="recipe", name=name, node=recipes.load(path), package="_global_")


@functools.cache
def store_schemas() -> None:
    """The schemas and resolvers, once a process: they never change, and storing a schema builds its config."""
    share_the_store()
    store = ConfigStore.instance()
    store.store(name="run_spec", node=RunSpec)
    for group, schemas in SCHEMAS.items():
        for name, node in schemas.items():
            store.store(group=f"schema/{group}", name=name, node=node)
    OmegaConf.register_new_resolver("stdlib", lambda: sysconfig.get_paths()["stdlib"])
    # conf/hydra/launcher/: a SLURM job's GPUs, none for CPUs
    OmegaConf.register_new_resolver(
        "gpus_per_node", lambda accelerator, nproc: nproc if accelerator == "cuda" else None
    )


def share_the_store() -> None:
    """Hydra deep-copies its config repository each time it composes (three times a `run`), and the repository
    holds the ConfigStore: every schema and recipe stored, copied each time, half of a composition's 0.1 s. Nothing
    changes the store while composing (its load copies what it returns), so a copy of the singleton is itself."""
    ConfigStore.__deepcopy__ = lambda store, memo: store


def choosable_recipes(recipe_dirs: list[Path], args: list[str]) -> list[Path]:
    """The recipe directories, when these arguments can choose a recipe: one of them names the group (`recipe=`, a
    sweep over it, a sweeper's parameter) or another primary config. Otherwise none: Hydra copies every config
    stored for it each time it composes, and reading and copying the recipes would slow every `run`."""
    return recipe_dirs if may_choose_a_recipe(args) else []


def may_choose_a_recipe(args: list[str]) -> bool:
    typed = list(args)
    if any(arg.startswith(("-sc", "--shell-completion")) for arg in args):  # completion reads the line being typed
        typed += os.environ.get("COMP_LINE", "").split()
    return any("recipe" in arg or arg.startswith(PRIMARY_CONFIG_FLAGS) for arg in typed)


def mode_from_the_command_line(args: list[str]) -> None:
    """Before it runs, Hydra composes the whole config once more only to read `hydra.mode` (`get_mode`), and runs
    as `-m` says when nothing sets it. Nothing in conf/ sets it: unless an argument names it, or may choose a
    recipe or another primary config (which could), the answer is known without that composition, a third of the
    start of a short run."""
    from hydra._internal.hydra import Hydra

    hydras = _hydras_get_mode()
    may_set_it = any("hydra.mode" in arg for arg in args) or may_choose_a_recipe(args)
    Hydra.get_mode = hydras if may_set_it else lambda hydra, config_name, overrides: None


@functools.cache
def _hydras_get_mode() -> Callable[..., Any]:
    """Hydra's own, kept for the commands that need it after one that did not, in the same process."""
    from hydra._internal.hydra import Hydra

    return Hydra.get_mode


def compose_config(overrides: list[str]) -> DictConfig:
    """The config `run <overrides>` composes, outside a run (the schemas and the recipes it can choose registered)."""
    from hydra import compose, initialize_config_dir

    register(*choosable_recipes(recipes.search_path(RECIPES_DIR), overrides))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


# What a CUDA machine gives a recipe that leaves it to the machine, for checking a recipe before it is written.
STAND_IN_GPU = {"nproc_per_node": 8, "device_memory_gib": 80.0, "compute_capability": 9.0, "device_name": "a GPU"}


def checked_recipe(text: str) -> RunSpec:
    """The spec of a recipe not yet written, validated as `run task=estimate recipe=<it>` would validate it, with
    a GPU's values standing in where the recipe leaves them to the machine (not a CPU's)."""
    import yaml

    register()
    ConfigStore.instance().store(
        group="recipe", name="_unwritten", node=OmegaConf.create(yaml.safe_load(text)), package="_global_"
    )
    spec = load_spec(compose_config(["recipe=_unwritten", "task=estimate"]))
    machine = spec.hardware
    if machine.accelerator is not Accelerator.cpu:
        given = {key: getattr(machine, key) or value for key, value in STAND_IN_GPU.items()}
        spec = replace(spec, hardware=replace(machine, accelerator=Accelerator.cuda, **given))
    return validate(spec, on_this_machine=False)
