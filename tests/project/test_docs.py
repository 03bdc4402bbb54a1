"""Docs that cannot rot: every `run ...` command shown in README.md and docs/*.md composes as `run` composes it (its
keys known, its values of their types), and is checked as its task is checked against the hardware it declares,
unless it needs files or hardware this test has none of, which is said below. A renamed key then fails here, not in
a user's hands.
"""

from __future__ import annotations

import os
import re
import shlex

import pytest
from omegaconf.errors import MissingMandatoryValue

from runner.config.spec import validate
from runner.errors import SpecError
from tests.support import REPO
from tests.support.specs import composed

ROOT = REPO
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The checks that a command shown with a user's own files, or GPUs, cannot pass here; composing it still must.
NEEDS_WHAT_THIS_TEST_HAS_NOT = ("matches no file", "is not a directory", "is not a file", "needs CUDA GPUs")
# Commands of the user's own recipes and accelerate files, or of Hydra's launcher and sweeper, whose keys and search
# spaces are the plugins' to read (tests/processes/test_slurm.py and tests/cli/test_sweeps.py run them).
NOT_COMPOSED_HERE = ("recipe=my_", "recipe=fsdp_config", "--from-accelerate", "--to-accelerate", "hydra/", "hydra.")
STAND_INS = ("...", "<", ">")  # for what the user fills in: left out, and the keys they leave unset may stay unset


def shown_commands() -> list[tuple[str, str]]:
    """(page:line, command) for each command of a code block that starts `run` (continued lines joined; of two
    commands side by side, the left one)."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines):
            if not re.match(r"^ {4}(\.venv/bin/)?run( |$)", line):
                continue
            command, following = _left_column(line), number
            while command.endswith("\\"):
                following += 1
                command = command[:-1] + " " + _left_column(lines[following]).strip()
            found.append((f"{page.name}:{number + 1}", command.split(" #", 1)[0].strip()))
    return found


def _left_column(line: str) -> str:
    return re.split(r"(?<=\\)\s{2,}", line, maxsplit=1)[0]


COMMANDS = shown_commands()


def test_the_pages_show_commands():
    assert len(COMMANDS) > 50


@pytest.mark.parametrize("where, command", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_a_shown_command_composes_and_passes_its_checks(where, command):
    if any(mark in command for mark in NOT_COMPOSED_HERE):
        pytest.skip("a user's own recipe or file, or the launcher's and sweeper's own keys")
    words = [os.path.expandvars(word) for word in shlex.split(command)[1:]]
    stand_ins = [word for word in words if any(mark in word for mark in STAND_INS)]
    sweep = "-m" in words
    # A sweep's first point: the values before each comma (a file list's commas are data.files' own).
    overrides = [
        re.sub(r"=([^,]*),.*$", r"=\1", word) if sweep and not word.startswith("data.files") else word
        for word in words
        if "=" in word and not word.startswith("-") and word not in stand_ins
    ]
    try:
        spec = composed(overrides)
    except MissingMandatoryValue:
        if stand_ins:
            return  # what the user fills in stands for a key the spec must have
        raise
    try:
        validate(spec, on_this_machine=False)
    except SpecError as error:
        if not any(
            reason in str(error)
            for reason in NEEDS_WHAT_THIS_TEST_HAS_NOT + (("set exactly one",) if stand_ins else ())
        ):
            raise
