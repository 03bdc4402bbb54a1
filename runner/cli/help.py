"""`run --help`: the usage, and every group's options with what each is for."""

from __future__ import annotations

import textwrap
from dataclasses import MISSING, fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Optional, get_args, get_origin, get_type_hints

import yaml

from runner.cli import recipes
from runner.cli.compose import CONF_DIR, GROUP_DIRS, SCHEMAS
from runner.cli.recipes import first_comment
from runner.config.fields import help_of
from runner.errors import SpecError, did_you_mean


def help_text(recipe_dirs: list[Path]) -> str:
    """The groups and their options, read from conf/ and the recipe directories without composing anything."""
    defaults = default_options()
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
            "  run --help <group>                        a group's keys (or train's): each default and what it does",
            "  run --recipes                             list the recipes, what each is for and what it sets",
            "  run --copy-recipe <name> [<new name>]     copy a recipe into ./recipes to edit it",
            "  run --from-accelerate <file> [<name>]     turn an accelerate config file into ./recipes/<name>.yaml",
            "  run --to-accelerate [overrides]           print the accelerate config file of a spec",
            "  run --prepare-data [overrides]            tokenize the spec's data into the token store, for later runs",
            "  run --show-data [N] [overrides]           N training rows (default 3), the tokens that train marked",
            "  run -m hydra/sweeper=optuna 'optim.lr=interval(1e-4,1e-2)'   search, minimising the eval loss",
            "  run -m hydra/launcher=slurm ...           one SLURM job per sweep point (slurm_local: on this machine)",
            "",
            "Config groups (* marks the default; a recipe sets several groups and values at once):",
            *rows,
            "",
            "Every key of the spec can be set on the command line: train.max_steps=50 optim.lr=3e-4 seed=1.",
            "`run --help <group>` shows a group's keys (or train's), each with its default and what it does.",
            "`run --cfg job` shows the whole spec. Outputs go to outputs/<date>/<time>/.",
            "Hydra's flags: run --hydra-help",
        ]
    )


def key_help(name: str) -> str:
    """`run --help <group>`: each key of a config group (or of the train section), its default and its whole help;
    the group's options, and what each sets over the schema it starts from."""
    from runner.config.spec import RunSpec

    sections = [path.name for path in GROUP_DIRS] + ["train"]
    if name not in sections:
        raise SpecError(
            f"no config group {name}: run --help <group> knows {', '.join(sections)}{did_you_mean(name, sections)}"
        )
    lines = textwrap.wrap(f"{name}: {help_of(next(f for f in fields(RunSpec) if f.name == name))}", 116)
    options = sorted((CONF_DIR / name).glob("*.yaml"))
    schemas = SCHEMAS.get(name) or {"base": hints(RunSpec)[name]}
    default = default_options().get(name)
    if len(schemas) == 1:
        lines += ["", "Options (* the default), and the keys each sets:"] if options else []
        for path in options:
            lines.append(f"  {path.stem:<20}{'*' if path.stem == default else ' '} {first_comment(path)}")
            sets = " ".join(f"{key}={shown(value)}" for key, value in option_values(path))
            lines += textwrap.wrap(f"sets {sets}", 116, initial_indent=" " * 6, subsequent_indent=" " * 11)
        lines += ["", "Keys:", *key_lines(next(iter(schemas.values())), "", {})]
    for option, schema in schemas.items() if len(schemas) > 1 else ():
        path = CONF_DIR / name / f"{option}.yaml"
        mark = " (the default)" if option == default else ""
        lines += ["", f"{name}={option}{mark}: {first_comment(path)}"]
        lines += key_lines(schema, "", dict(option_values(path)))
    return "\n".join(lines)


def key_lines(schema: type, prefix: str, values: dict[str, Any]) -> list[str]:
    """A schema's keys with their defaults (an option's own values where it sets them) and help; a nested schema's
    keys dotted below its own."""
    lines = []
    for key, kind in hints(schema).items():
        field_ = next(f for f in fields(schema) if f.name == key)
        default = field_.default if field_.default is not MISSING else field_.default_factory()
        value = values.get(f"{prefix}{key}", default)
        lines.append(f"  {prefix}{key}: {'' if is_dataclass(value) else shown(value)}{choices(kind)}")
        lines += [f"      {line}" for line in textwrap.wrap(help_of(field_), 110)]
        inner = [
            t for t in (kind, *get_args(kind), *(a for t in get_args(kind) for a in get_args(t))) if is_dataclass(t)
        ]
        if inner:
            listed = get_origin(kind) is list
            lines += key_lines(inner[0], f"{prefix}{key}{'[].' if listed else '.'}", values)
    return lines


def hints(schema: type) -> dict[str, Any]:
    """The types of a schema's fields (its class variables aside), resolved."""
    known = [f.name for f in fields(schema)]
    return {key: kind for key, kind in get_type_hints(schema).items() if key in known}


def choices(kind: Any) -> str:
    enum = next((t for t in (kind, *get_args(kind)) if isinstance(t, type) and issubclass(t, Enum)), None)
    return f"   ({' | '.join(member.value for member in enum)})" if enum else ""


def shown(value: Any) -> str:
    """A value as `run --cfg job` writes it."""
    if isinstance(value, list):
        return "[" + ", ".join(shown(item) for item in value) + "]"
    if isinstance(value, dict) or is_dataclass(value):
        pairs = value.items() if isinstance(value, dict) else ((f.name, getattr(value, f.name)) for f in fields(value))
        return "{" + ", ".join(f"{key}: {shown(item)}" for key, item in pairs) + "}"
    if isinstance(value, Enum):
        return str(value.value)
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value)


def option_values(path: Path) -> list[tuple[str, Any]]:
    """What an option sets over its schema's defaults, with dotted keys."""
    body = {key: value for key, value in (yaml.safe_load(path.read_text()) or {}).items() if key != "defaults"}
    return flattened(body, "")


def flattened(node: dict, prefix: str) -> list[tuple[str, Any]]:
    pairs = []
    for key, value in node.items():
        if isinstance(value, dict) and value:
            pairs += flattened(value, f"{prefix}{key}.")
        else:
            pairs.append((f"{prefix}{key}", value))
    return pairs


def default_options() -> dict[str, Optional[str]]:
    """Each group's default option, from the primary config's defaults list."""
    entries = yaml.safe_load((CONF_DIR / "config.yaml").read_text())["defaults"]
    return {group: option for entry in entries if isinstance(entry, dict) for group, option in entry.items()}
