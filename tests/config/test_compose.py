"""Every option of every group composes into a typed spec and validates (or says why not on this machine);
the recipes have their own tests, in tests/cli/test_recipes.py."""

import copy
from pathlib import Path

import pytest
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from runner.cli.compose import GROUP_DIRS
from runner.config.hardware import Accelerator
from runner.config.spec import RunSpec, to_yaml, validate
from runner.errors import SpecError
from tests.support import DATA
from tests.support.specs import composed


def config_dir(tmp: Path) -> Path:
    """A directory with nothing but a transformers config.json: what validation reads of a pretrained model."""
    (tmp / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, '
        '"num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 300}'
    )
    return tmp


# Options whose `???` keys the user must give, with a value that exists on any machine.
REQUIRED = {
    ("model", "pretrained"): lambda tmp: [f"model.pretrained={config_dir(tmp)}"],
    ("data", "text_files"): lambda tmp: [f"data.files={Path(__file__)}"],
    ("data", "instruction_files"): lambda tmp: [f"data.files={Path(__file__)}"],
    ("data", "chat_files"): lambda tmp: [f"data.files={Path(__file__)}"],
    ("data", "preference_files"): lambda tmp: [f"data.files={DATA / 'trl' / 'preference_standard.jsonl'}"],
    ("data", "prompt_files"): lambda tmp: [f"data.files={DATA / 'gsm8k' / 'test_head.jsonl'}"],
    ("data", "hub"): lambda tmp: ["data.hub_dataset=stanfordnlp/imdb"],
    # This machine has no fp8: the emulation is what runs here, on the default tiny model's small layers.
    ("precision", "fp8"): lambda tmp: ["precision.fp8.emulate=true", "precision.fp8.min_features=16"],
}
OPTIONS = [(group.name, option.stem) for group in GROUP_DIRS for option in sorted(group.glob("*.yaml"))]


def test_every_group_has_options():
    groups = {group for group, _ in OPTIONS}
    assert {"hardware", "strategy", "precision", "tracker", "model", "data", "optim", "scheduler", "task"} <= groups


@pytest.mark.parametrize("group,option", OPTIONS)
def test_option_composes_and_validates(group, option, tmp_path):
    overrides = [f"{group}={option}", *REQUIRED.get((group, option), lambda tmp: [])(tmp_path)]
    spec = composed(overrides)
    assert isinstance(spec, RunSpec)
    needs_gpu = group == "hardware" and spec.hardware.accelerator is Accelerator.cuda
    if needs_gpu and not _has_cuda():
        with pytest.raises(SpecError, match="CUDA"):
            validate(spec)
        return
    if group == "model" and spec.model.architecture.get("vocab_size"):
        # Published architectures, there for memory estimates: training one needs a machine it fits (or a decoder).
        try:
            validate(spec)
        except SpecError as error:
            assert str(error).startswith(("the run does not fit", "bert is not a causal language model")), error
        spec = composed([*overrides, "task=estimate"])
    resolved = validate(spec)
    assert resolved.hardware.accelerator is not Accelerator.auto
    assert resolved.hardware.nproc_per_node >= 1


def test_composing_leaves_the_config_store_whole_and_does_not_copy_it():
    """Hydra copies its repository, the ConfigStore within, each time it composes: the runner shares the store
    instead (runner/cli/compose.py's share_the_store), and two compositions of different options leave it as it
    was."""
    store = ConfigStore.instance()
    composed(["strategy=fsdp"])
    assert copy.deepcopy(store) is store
    before = OmegaConf.to_yaml(store.load("schema/strategy/fsdp.yaml").node)
    assert (
        composed(["strategy=fsdp", "strategy.sharding_strategy=NO_SHARD"]).strategy.sharding_strategy.value
        == "NO_SHARD"
    )
    assert OmegaConf.to_yaml(store.load("schema/strategy/fsdp.yaml").node) == before


def test_default_spec_is_resolved_and_typed():
    spec = validate(composed([]))
    assert spec.hardware.device_memory_gib > 0
    assert "${" not in to_yaml(spec)
    assert OmegaConf.to_object(OmegaConf.create(to_yaml(spec)))["train"]["max_steps"] == 200


def test_recipe_values_win_over_defaults_and_lose_to_the_command_line():
    assert composed(["recipe=cpu_quick"]).train.max_steps == 30
    assert composed(["recipe=cpu_quick", "train.max_steps=7"]).train.max_steps == 7


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
