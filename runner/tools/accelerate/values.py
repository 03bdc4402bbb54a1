"""Reading the values of an accelerate config file: as accelerate reads them, or a ValueError saying why not."""

from __future__ import annotations

from typing import Any, Callable

import yaml

# Spec keys ("strategy.zero_stage") and chosen options ("strategy": "deepspeed") that keys of the file set.
Settings = dict[str, Any]
# A key's handler: (its value, the whole file) -> (what it sets, a note); ValueError when it cannot be converted.
Handler = Callable[[Any, dict], tuple[Settings, str]]


def shown(value: Any) -> str:
    """A value as the YAML file has it."""
    if isinstance(value, (bool, type(None), dict, list)):
        return yaml.safe_dump(value, default_flow_style=True, width=float("inf")).removesuffix("\n...\n").strip()
    return str(value)


def flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


def count(value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"must be a whole number >= {minimum}")
    return value


def parallel_sizes(file: dict) -> dict[str, Any]:
    """parallelism_config's sizes by their short names (dp_shard_size, sp_size, ...)."""
    section = file.get("parallelism_config") or {}
    return {key.removeprefix("parallelism_config_"): size for key, size in section.items() if key.endswith("_size")}


def fsdp2_sharding(file: dict, reshards_after_forward: bool) -> str:
    """The sharding strategy FSDP2's fsdp_reshard_after_forward means: across all data-parallel processes, or
    within each shard group when parallelism_config gives replicate groups (accelerate's HSDP)."""
    sizes = file.get("parallelism_config") or {}
    hybrid = isinstance(sizes, dict) and count(sizes.get("parallelism_config_dp_replicate_size", 1), 1) > 1
    if hybrid:
        return "HYBRID_SHARD" if reshards_after_forward else "HYBRID_SHARD_ZERO2"
    return "FULL_SHARD" if reshards_after_forward else "SHARD_GRAD_OP"


def named(value: Any, names: list[str]) -> str:
    """A value given by name (any case) or by its 1-based position in accelerate's list of names."""
    if isinstance(value, str) and value.upper() in names:
        return value.upper()
    if not isinstance(value, bool) and str(value).isdigit() and 1 <= int(value) <= len(names):
        return names[int(value) - 1]
    raise ValueError(f"choose one of {', '.join(names)} (or 1 to {len(names)})")


def mixed_precision(file: dict) -> str:
    value = file.get("mixed_precision")
    if value is None:
        return "fp16" if file.get("fp16") is True else "no"
    return str(value).lower()


def accelerator(file: dict) -> str:
    if file.get("use_cpu") is True or file["distributed_type"] == "MULTI_CPU":
        return "cpu"
    return "auto" if file["distributed_type"] == "NO" else "cuda"


def no_meaning(reason: str) -> Handler:
    return lambda value, file: ({}, f"no meaning here: {reason}")


def setting(key: str) -> Handler:
    return lambda value, file: ({key: flag(value)}, "")


def transformer_engine(file: dict) -> bool:
    """Whether the file's fp8 backend is Transformer Engine (accelerate picks AO first when none is named)."""
    return str((file.get("fp8_config") or {}).get("fp8_backend", "")).upper() == "TE"
