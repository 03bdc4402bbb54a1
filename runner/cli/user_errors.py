"""The errors that are the user's to fix, and how each becomes the one line `run` prints for it."""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Optional

from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException, OverrideParseException
from omegaconf.errors import OmegaConfBaseException

from runner.cli.compose import SCHEMAS
from runner.cli.recipes import RecipeError
from runner.config.spec import FROM_OTHER_TOOLS
from runner.errors import SpecError, did_you_mean

USER_ERRORS = (HydraException, OmegaConfBaseException, SpecError, RecipeError)

# Options of Hydra's own groups that its plugins provide, and the package of each plugin.
HYDRA_PLUGINS = {
    "hydra/sweeper/optuna": "hydra-optuna-sweeper",
    "hydra/launcher/submitit_slurm": "hydra-submitit-launcher",
    "hydra/launcher/submitit_local": "hydra-submitit-launcher",
}


def unknown_key(cause: OmegaConfBaseException, message: str) -> str:
    full_key = cause.full_key
    if full_key in FROM_OTHER_TOOLS:
        return f"unknown key {full_key}: {FROM_OTHER_TOOLS[full_key]}"
    parent = getattr(cause, "parent_node", None)
    prefix = full_key.rpartition(".")[0]
    schema = re.search(r"not in '(\w+)'", message)
    chosen = option_of(schema[1]) if schema else None
    if chosen and chosen[0] == prefix:
        group, option = chosen
        takers = [
            other
            for other, options_schema in SCHEMAS[group].items()
            if cause.key in {field.name for field in fields(options_schema)}
        ]
        if takers:
            return (
                f"{full_key} is a key of {' and '.join(f'{group}={taker}' for taker in takers)}, not of "
                f"{group}={option}"
            )
    known = list(parent.keys()) if parent is not None and hasattr(parent, "keys") else []
    return f"unknown key {full_key}: {message}{did_you_mean(str(cause.key), known, f'{prefix}.' if prefix else '')}"


def one_line(error: BaseException) -> str:
    """The message a user needs, on one line, without Hydra's and OmegaConf's report layout."""
    if isinstance(error, MissingConfigException) and error.missing_cfg_file in HYDRA_PLUGINS:
        package = HYDRA_PLUGINS[error.missing_cfg_file]
        return (
            f"{error.missing_cfg_file} comes with Hydra's {package} plugin, which is not installed: "
            f"pip install {package}"
        )
    if isinstance(error, MissingConfigException) and error.missing_cfg_file and error.options is not None:
        group, _, option = error.missing_cfg_file.rpartition("/")
        return (
            f"{group}={option} is not an option; choose one of: {', '.join(sorted(error.options))}"
            f"{did_you_mean(option, error.options)}"
        )
    if isinstance(error, OverrideParseException):
        return f"cannot parse the override '{error.override}': {str(error).splitlines()[0]}"
    cause = error.__cause__ if isinstance(error, ConfigCompositionException) and error.__cause__ else error
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        message = getattr(cause, "msg", str(cause)).splitlines()[0]
        if message.startswith("Key ") and " not in " in message:
            return unknown_key(cause, message)
        return f"{cause.full_key}: {message}"
    swapped = re.match(
        r"In '([^']+)': ConfigKeyError raised while composing config:\s+Key '(\w+)' not in '(\w+)'", str(error)
    )
    chosen = option_of(swapped[3]) if swapped else None
    if chosen:
        (config, key), (group, option) = swapped.group(1, 2), chosen
        return (
            f"{config}.yaml sets {group}.{key}, which {group}={option} does not take: remove that line from "
            f"{config}.yaml, or keep the {group} option it was written for"
        )
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return " ".join(lines[:2]) if lines else type(error).__name__


def option_of(schema_name: str) -> Optional[tuple[str, str]]:
    """The group and option whose schema is the class of this name."""
    return next(
        (
            (group, option)
            for group, options in SCHEMAS.items()
            for option, schema in options.items()
            if schema.__name__ == schema_name
        ),
        None,
    )
