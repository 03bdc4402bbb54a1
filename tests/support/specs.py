"""The specs of the tests' runs: the overrides of a quick run, and a spec composed, or validated as `run` launches
it."""

from __future__ import annotations

import sysconfig

from runner.cli.compose import RECIPES_DIR, compose_config, register
from runner.config.spec import RunSpec, load_spec, validate

register(RECIPES_DIR)

# A small slice of the default corpus keeps test runs to seconds: 20 documents, 2 held out, in steps of two rows
# of 128 tokens (a step of four took 44 ms here, one of two 25 ms: the same code, half the arithmetic).
SMALL_CORPUS = f"{sysconfig.get_paths()['stdlib']}/email/*.py"
# Two of the default model's four blocks: a strategy's work goes block by block, and two blocks show it in two thirds
# of the time (a step's time is its arithmetic's here).
TWO_BLOCKS = ["model.architecture.num_hidden_layers=2"]
# The data and steps of a quick run, for the tests that bring their own model (model=pretrained).
QUICK_STEPS = [
    f"data.files={SMALL_CORPUS}",
    "data.eval_fraction=0.1",
    "data.seq_len=128",
    "train.micro_batch_size=2",
    "train.max_steps=30",
    "train.log_every=10",
    "train.eval_every=15",
    "train.eval_batches=2",
]
QUICK = [*QUICK_STEPS, *TWO_BLOCKS]


def composed(overrides: list[str]) -> RunSpec:
    """The typed spec, not validated: its hardware is as declared, not this machine's."""
    return load_spec(compose_config(overrides))


def resolved_spec(overrides: list[str]) -> RunSpec:
    """The spec as `run` launches it: validated on this machine, its task's pre-launch checks passed."""
    spec = validate(composed(overrides))
    spec.task.before_launch(spec)
    return spec
