"""accelerate config files to recipes: `run --from-accelerate <file> [<name>]` turns an `accelerate config` YAML
into a recipe in ./recipes and prints, for every key of the file, the spec keys it became or why it has no meaning
here; a key the runner cannot honour is an error and nothing is written.

Key names and values are those `accelerate config` writes and `accelerate launch` reads (keys.py, sections.py).
"""

from __future__ import annotations

from dataclasses import fields
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import yaml

from runner.config.hardware import HardwareConfig
from runner.config.precision import PrecisionConfig
from runner.config.training import TrainConfig
from runner.errors import SpecError
from runner.strategies import STRATEGIES
from runner.tools.accelerate.keys import DISTRIBUTED_TYPES, KEYS
from runner.tools.accelerate.sections import SECTIONS
from runner.tools.accelerate.values import Handler, Settings, shown

SECTION_ORDER = ["hardware", "strategy", "precision", "train"]


def read(path: Path) -> dict:
    try:
        file = yaml.safe_load(path.read_text())
    except OSError as error:
        raise SpecError(f"cannot read the accelerate config {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise SpecError(f"{path} is not valid YAML: {' '.join(str(error).split())}") from None
    if not isinstance(file, dict):
        raise SpecError(f"{path} is not an accelerate config: it must be a mapping of keys")
    return file


def convert(file: dict) -> tuple[Settings, list[str]]:
    """What the file's keys set, and one line per key on how it was mapped (a section's keys indented below it)."""
    # YAML 1.1 reads an unquoted NO or no as false.
    for key, word in (("distributed_type", "NO"), ("mixed_precision", "no")):
        if file.get(key) is False:
            file[key] = word
    if "distributed_type" not in file:
        raise SpecError("no distributed_type: an accelerate config names one (NO, MULTI_GPU, FSDP, ...)")
    if file["distributed_type"] not in DISTRIBUTED_TYPES:
        raise SpecError(
            f"distributed_type: {shown(file['distributed_type'])} cannot be expressed here: the "
            f"runner has {', '.join(DISTRIBUTED_TYPES)} (one process, CPU processes, CUDA GPUs, FSDP and "
            "DeepSpeed)"
        )
    # accelerate reads `min_num_params` in fsdp_config as `fsdp_min_num_params`: the handlers look keys up so.
    as_read = {
        key: full_names(value, SECTIONS[key][2]) if key in SECTIONS and isinstance(value, dict) else value
        for key, value in file.items()
    }
    settings: Settings = {}
    origins: dict[str, str] = {}
    lines: list[str] = []
    for key, value in file.items():
        if key not in SECTIONS:
            lines.append(mapped(key, key, value, KEYS, as_read, settings, origins))
            continue
        table, unread, _ = SECTIONS[key]
        if value is not None and not isinstance(value, dict):
            raise SpecError(f"{key}: {shown(value)} must be a mapping of keys")
        if not value:
            lines.append(f"{key}: {shown(value)} -> no meaning here: empty")
            continue
        if unread(file):
            lines.append(f"{key}:")
            lines += [f"  {inner}: {shown(v)} -> no meaning here: {unread(file)}" for inner, v in value.items()]
            continue
        lines.append(f"{key}:")
        lines += [
            "  " + mapped(inner, f"{key}.{inner}", v, table, as_read, settings, origins, full_name)
            for (inner, v), full_name in zip(value.items(), as_read[key])
        ]
    strategy = STRATEGIES[settings["strategy"]]()
    unset = [
        f"strategy.{f.name}={shown(plain(getattr(strategy, f.name)))}"
        for f in fields(strategy)
        if f"strategy.{f.name}" not in settings
    ]
    if unset:
        lines.append(f"not in the file, the runner's defaults: {', '.join(unset)}")
    return settings, lines


def full_names(section: dict, prefix: str) -> dict:
    return {key if str(key).startswith(prefix) else f"{prefix}{key}": value for key, value in section.items()}


def plain(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


def mapped(
    key: str,
    full_key: str,
    value: Any,
    table: dict[str, Handler],
    file: dict,
    settings: Settings,
    origins: dict[str, str],
    looked_up: Optional[str] = None,
) -> str:
    """Applies one key of the file (`looked_up` in the table under accelerate's full name) to the settings; its
    line."""
    looked_up = looked_up or key
    if looked_up not in table:
        raise SpecError(f"unknown key {full_key}: not a key of accelerate's config files that the runner knows")
    try:
        assigned, note = table[looked_up](value, file)
    except ValueError as why:
        raise SpecError(f"{full_key}: {shown(value)} cannot be converted: {why}") from None
    for spec_key, spec_value in assigned.items():
        if settings.get(spec_key, spec_value) != spec_value:
            raise SpecError(
                f"{origins[spec_key]} and {full_key} disagree: one means "
                f"{spec_key}={shown(settings[spec_key])}, the other {spec_key}={shown(spec_value)}"
            )
        settings[spec_key] = spec_value
        origins.setdefault(spec_key, full_key)
    if not assigned:
        return f"{key}: {shown(value)} -> {note}"
    assignments = ", ".join(f"{k}={shown(v)}" for k, v in assigned.items())
    return f"{key}: {shown(value)} -> {assignments}" + (f" ({note})" if note else "")


def recipe_text(settings: Settings, source: Path, name: str) -> str:
    choices = {
        group: settings.get(group, default)
        for group, default in (("hardware", "auto"), ("strategy", "single"), ("precision", "fp32"))
    }
    header = [
        "# @package _global_",
        f"# {description(settings, choices)}, converted from the accelerate config {source.name}",
        "#",
        f"#   run recipe={name} model=pretrained model.pretrained=<hub name or directory> data=text_files "
        "data.files=<files>",
        "#",
        "# The accelerate file says how the run is spread over processes and devices; the model, data, optimizer",
        "# and steps are the runner's defaults until they are set here or on the command line.",
    ]
    if settings.get("hardware.accelerator") == "cuda":
        header += [
            "# The GPUs' model and memory are read from the machine the run starts on. Elsewhere,",
            f"# `run task=estimate recipe={name}` checks the fit once hardware.device_memory_gib=<GiB per GPU> is set",
            "# (or choose a hardware option such as 8xh100_80gb instead of auto).",
        ]
    header += ["defaults:", *[f"  - override /{group}: {option}" for group, option in choices.items()]]
    schemas = {
        "hardware": HardwareConfig,
        "strategy": STRATEGIES[choices["strategy"]],
        "precision": PrecisionConfig,
        "train": TrainConfig,
    }
    sections = []
    for section in SECTION_ORDER:
        values = {key.split(".", 1)[1]: value for key, value in settings.items() if key.startswith(f"{section}.")}
        if values:
            order = [f.name for f in fields(schemas[section])]
            ordered = sorted(values.items(), key=lambda item: order.index(item[0].split(".")[0]))
            sections.append(yaml.safe_dump({section: nested(ordered)}, sort_keys=False))
    return "\n".join(header) + "\n\n" + "\n".join(sections)


def nested(items: list[tuple[str, Any]]) -> dict:
    """{"fp8.backend": x} as {"fp8": {"backend": x}}."""
    tree: dict = {}
    for key, value in items:
        *parents, leaf = key.split(".")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return tree


def description(settings: Settings, choices: dict[str, str]) -> str:
    strategy = {
        "single": "One process",
        "ddp": "DDP",
        "fsdp": f"FSDP {settings.get('strategy.sharding_strategy', STRATEGIES['fsdp']().sharding_strategy.value)}",
        "deepspeed": f"DeepSpeed ZeRO-{settings.get('strategy.zero_stage', STRATEGIES['deepspeed']().zero_stage)}",
    }[choices["strategy"]]
    if choices["strategy"] == "single":
        where = " on the CPU" if choices["hardware"] == "cpu" else ""
    else:
        devices = "CUDA GPUs" if settings.get("hardware.accelerator") == "cuda" else "CPU processes"
        nodes = settings.get("hardware.nnodes", 1)
        per_node = settings.get("hardware.nproc_per_node", "all the")
        where = f" on {f'{nodes} nodes x ' if nodes > 1 else ''}{per_node} {devices}"
    return f"{strategy}{where} in {choices['precision']}"


def recipe_of(source: Path, name: str) -> tuple[str, list[str]]:
    """`run --from-accelerate`: the text of recipe `name` made from the file, and the mapping's lines."""
    file = read(source)
    try:
        settings, lines = convert(file)
    except SpecError as error:
        raise SpecError(f"{source}: {error}") from None
    return recipe_text(settings, source, name), lines
