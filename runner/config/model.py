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
# transformers 5's implementations of a MoE layer's experts (transformers/integrations/moe.py), and `auto`.
EXPERTS_KERNELS = ("auto", "eager", "grouped_mm", "batched_mm")


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
    router_aux_loss_coef: Optional[float] = setting(
        None,
        "A MoE model's load-balancing loss (Switch Transformer's, as transformers computes it: per micro batch, "
        "padding left out) times this is added to the objective of task=train, dpo and grpo; unset: the model "
        "config's own router_aux_loss_coef (0.001 for Qwen3-MoE, Mixtral and gpt-oss; DeepSeek-V3 has none and "
        "balances its experts without a loss); 0: logged only.",
    )
    router_z_loss_coef: float = setting(
        0.0,
        "ST-MoE's router z-loss (the mean over tokens and MoE layers of logsumexp(router logits)^2) times this is "
        "added to the objective; 0: off.",
    )
    experts_kernel: str = setting(
        "auto",
        "How transformers runs a MoE layer's experts: eager (a loop over the experts hit), grouped_mm (one grouped "
        "GEMM), batched_mm (each token's experts' weights gathered); auto: grouped_mm on CUDA GPUs, eager "
        "elsewhere (run --cfg job shows the choice).",
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
    _check_router(model)


def _check_router(model: ModelConfig) -> None:
    require(
        model.experts_kernel in EXPERTS_KERNELS,
        f"model.experts_kernel={model.experts_kernel} is not one of {', '.join(EXPERTS_KERNELS)}",
    )
    for key in ("router_aux_loss_coef", "router_z_loss_coef"):
        value = getattr(model, key)
        require(value is None or value >= 0, f"model.{key}={value} must be >= 0")
    chosen = {
        "router_aux_loss_coef": model.router_aux_loss_coef is not None,
        "router_z_loss_coef": model.router_z_loss_coef != 0,
        "experts_kernel": model.experts_kernel != "auto",
    }
    named = [f"model.{key}" for key, is_set in chosen.items() if is_set]
    require(
        not named or has_experts(model),
        f"{', '.join(named)} set for a dense model (its architecture counts no experts); the router's keys apply to "
        "MoE models only (docs/moe.md)",
    )


def has_experts(model: ModelConfig) -> bool:
    """Whether the model may be a MoE model: its config counts experts, or is a hub model's, not on this machine."""
    hub = bool(model.pretrained) and not _looks_like_path(model.pretrained)
    return hub or expert_count(model) is not None


def resolved(model: ModelConfig, accelerator: str) -> ModelConfig:
    """A MoE model's experts_kernel=auto as it runs on `accelerator` (cpu, cuda): grouped_mm where torch has a
    grouped GEMM, on CUDA GPUs; eager elsewhere, where torch's grouped_mm falls back to a loop."""
    if model.experts_kernel != "auto" or not has_experts(model):
        return model
    return replace(model, experts_kernel="grouped_mm" if accelerator == "cuda" else "eager")


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
