"""The README's quick start and group table stay true to the project."""

import re

from runner.cli.compose import GROUP_DIRS, RECIPES_DIR
from tests.support import REPO

README = (REPO / "README.md").read_text()


def quick_start() -> list[str]:
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for line in section.splitlines() if line.startswith("    python3 -m venv")]


def test_quick_start_is_two_commands_and_ci_runs_the_test_one():
    train, tests = quick_start()
    assert train.endswith(".venv/bin/run")
    assert tests.endswith("pytest")
    assert tests in (REPO / ".ci" / "run").read_text()


def test_group_table_names_every_option():
    table = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| (.*?) \|", README, re.M)}
    groups = {p.name: p for p in GROUP_DIRS} | {"recipe": RECIPES_DIR}
    for group, directory in groups.items():
        for option in directory.glob("*.yaml"):
            assert f"`{option.stem}`" in table[group], f"{group}={option.stem} is missing from the README's table"
