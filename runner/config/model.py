"""The `model` group: a transformers causal LM, from pretrained weights or initialised from an architecture config.

The schema and its checks; runner/components/modeling.py builds what it names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, Optional

from runner.config.fields import setting
from runner.errors import require
from runner.files.paths import absolute_path

BYTES = "bytes"
# The config keys that count a MoE model's routed experts, by architecture: Qwen-MoE and OLMoE, Mixtral and gpt-oss,
# DeepSeek-V3 and its descendants.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass
class ModelConfig:
    pretrained: Optional[str] = setting(
        None,
        "A hub name or local directory passed to from_pretrained; unset means random init from `architecture`.",
    )
    architecture: Dict[str, Any] = setting({}, "transformers config keys (with `model_type`) for random init.")
    tokenizer: Optional[str] = setting(
        None,
        "`bytes` (built in, needs no download), a hub name or a local directory; unset means the pretrained model's "
        "own.",
    )


def check(model: ModelConfig) -> None:
    require(
        bool(model.pretrained) != bool(model.architecture),
        "set exactly one of model.pretrained (a name or directory) and model.architecture (random init)",
    )
    if model.pretrained and _looks_like_path(model.pretrained):
        require(
            Path(model.pretrained).expanduser().is_dir(),
            f"model.pretrained={model.pretrained} is not a directory; give a saved model's directory or a hub name",
        )
    if model.architecture:
        require(
            "model_type" in model.architecture,
            "model.architecture needs a model_type (for example llama); add model.architecture.model_type=llama",
        )
        require(
            model.tokenizer is not None,
            f"model.tokenizer is needed with model.architecture: set model.tokenizer={BYTES} or a tokenizer's name",
        )
    if model.tokenizer and model.tokenizer != BYTES and _looks_like_path(model.tokenizer):
        require(Path(model.tokenizer).expanduser().is_dir(), f"model.tokenizer={model.tokenizer} is not a directory")


def expert_count(model: ModelConfig) -> Optional[int]:
    """A MoE model's routed experts in each MoE layer, from its architecture or a local pretrained directory's
    config.json; None for a dense model, or a hub model whose config is not on this machine."""
    config = model.architecture
    if model.pretrained and _looks_like_path(model.pretrained):
        file = Path(model.pretrained).expanduser() / "config.json"
        config = json.loads(file.read_text()) if file.is_file() else {}
    return next((int(config[key]) for key in EXPERT_COUNT_KEYS if config.get(key)), None)


def _looks_like_path(name: str, base: Path = Path(".")) -> bool:
    return name.startswith(("/", "./", "../", "~")) or (base / name).exists()


def with_absolute_paths(model: ModelConfig, base: Path) -> ModelConfig:
    """The model's local directories as absolute paths from `base` (hub names as they are): the spec then means
    the same from any directory."""

    def absolute(name: Optional[str]) -> Optional[str]:
        if not name or name == BYTES or not _looks_like_path(name, base):
            return name
        return absolute_path(name, base)

    return replace(model, pretrained=absolute(model.pretrained), tokenizer=absolute(model.tokenizer))
