"""`run --help`: the usage, and every group's options with what each is for."""

from __future__ import annotations

from pathlib import Path

import yaml

from runner.cli import recipes
from runner.cli.compose import CONF_DIR, GROUP_DIRS


def help_text(recipe_dirs: list[Path]) -> str:
    """The groups and their options, read from conf/ and the recipe directories without composing anything."""
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
            "  run --prepare-data [overrides]            tokenize the spec's data into the token store, for later runs",
            "  run --show-data [N] [overrides]           N training rows (default 3), the tokens that train marked",
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
