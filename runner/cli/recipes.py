"""Recipes: YAML files that set several groups and values at once for a known scenario (Hydra's experiment
pattern: `# @package _global_`, `override /<group>: <option>` lines, then values), chosen with
`run recipe=<name>` and still overridable on the command line.

They are found on a search path, later directories shadowing earlier ones of the same name: the runner's own
recipes/, then ./recipes in the working directory (a project's own, where `run --copy-recipe` puts copies),
then the directories listed in $RUNNER_RECIPES.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
from pathlib import Path
from typing import Optional

import yaml
from omegaconf import DictConfig, OmegaConf

from runner.errors import SpecError

SEARCH_PATH_VARIABLE = "RUNNER_RECIPES"


class RecipeError(Exception):
    """A recipe that cannot be found, read or copied."""


def search_path(bundled: Path) -> list[Path]:
    """The recipe directories that exist, in the order they are searched (later ones win)."""
    listed = [Path(p).expanduser() for p in os.environ.get(SEARCH_PATH_VARIABLE, "").split(os.pathsep) if p]
    directories: list[Path] = []
    for directory in [bundled, Path("recipes"), *listed]:
        if directory.is_dir() and all(directory.resolve() != d.resolve() for d in directories):
            directories.append(directory)
    return directories


def find(directories: list[Path]) -> dict[str, Path]:
    """Each recipe name and the file that defines it."""
    return {path.stem: path for directory in directories for path in sorted(directory.glob("*.yaml"))}


def load(path: Path) -> DictConfig:
    """A recipe's content (not to be changed: it is read once for each version of the file)."""
    stat = path.stat()
    return parsed(path, path.resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=256)
def parsed(path: Path, resolved: Path, mtime_ns: int, size: int) -> DictConfig:
    try:
        content = OmegaConf.load(path)
    except yaml.YAMLError as error:
        raise RecipeError(f"recipe {path} is not valid YAML: {' '.join(str(error).split())}") from None
    if not isinstance(content, DictConfig):
        raise RecipeError(f"recipe {path} must be a mapping of groups and keys, not a list")
    return content


def first_comment(path: Path) -> str:
    """A config file's first comment line, Hydra's `# @package` header aside: what the file is for."""
    for line in path.read_text().splitlines():
        if line.startswith("#") and not line.startswith("# @package"):
            return line.lstrip("# ").strip()
    return ""


def chosen_options(path: Path) -> list[str]:
    """The `override /group: option` lines of a recipe's defaults list, as `group=option`."""
    options = []
    for entry in load(path).get("defaults", []):
        for key, value in entry.items() if isinstance(entry, DictConfig) else []:
            options.append(f"{key.removeprefix('override ').lstrip('/')}={value}")
    return options


def listing(directories: list[Path], bundled: Path) -> str:
    """`run --recipes`: every recipe, what it is for, the groups it chooses, and where it is when not bundled."""
    lines = ["Recipes (run recipe=<name> [overrides]; run --copy-recipe <name> [<new name>] copies one to edit):"]
    for name, path in sorted(find(directories).items()):
        where = "" if path.parent.resolve() == bundled.resolve() else f"  [{path}]"
        lines.append(f"  {name:<32} {first_comment(path)}{where}")
        options = chosen_options(path)
        if options:
            lines.append(f"  {'':<32}   {' '.join(options)}")
    return "\n".join(lines)


def copy(directories: list[Path], name: str, new_name: Optional[str]) -> Path:
    """Copies recipe `name` to ./recipes/<new name>.yaml, where `run recipe=<new name>` finds it; never overwrites."""
    recipes = find(directories)
    if name not in recipes:
        raise RecipeError(f"no recipe named {name}; `run --recipes` lists them: {', '.join(sorted(recipes))}")
    target = new_recipe(new_name or name, f"run --copy-recipe {name} <new name>")
    target.parent.mkdir(exist_ok=True)
    shutil.copyfile(recipes[name], target)
    return target


def new_recipe(name: str, retry: str) -> Path:
    """./recipes/<name>.yaml, where `run recipe=<name>` finds it: a plain name (no path) that no recipe there has.
    `retry` is the command to give another name with."""
    if not re.fullmatch(r"\w[\w-]*", name):
        raise SpecError(f"{name} cannot name a recipe: use letters, digits, _ and -; {retry}")
    target = Path("recipes") / f"{name}.yaml"
    if target.exists():
        raise SpecError(f"{target} exists already; give the recipe another name: {retry}")
    return target
