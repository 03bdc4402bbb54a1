"""strategy=deepspeed's DeepSpeed config: `deepspeed_config`, the JSON the spec implies (ZeRO stage, offload,
accumulation, clipping, precision), and strategy.config_file: a DeepSpeed JSON as Hugging Face users write them,
full of "auto".

Its ZeRO stage, offload devices and NVMe paths, precision blocks and scheduler type are read into the spec where
the spec leaves them at their defaults; every "auto" is filled from the spec as the Trainer and accelerate fill it
(the bucket sizes and thresholds from the model's hidden size); its optimizer and scheduler blocks must describe
the runner's own optimizer and schedule, which then run; any other value that contradicts the spec is an error
naming both.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from runner.config.precision import Dtype, PrecisionConfig
from runner.config.scheduler import Decay, SchedulerConfig
from runner.errors import SpecError
from runner.memory.model_shapes import facts_of

if TYPE_CHECKING:
    from runner.config.spec import RunSpec


class OffloadDevice(str, Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


AUTO = "auto"
# (JSON key, strategy field, the field's value from the JSON's): the JSON says them when the spec does not.
STRATEGY_KEYS: list[tuple[str, str, Callable[[Any], Any]]] = [
    ("zero_optimization.stage", "zero_stage", int),
    ("zero_optimization.offload_optimizer.device", "offload_optimizer", str),
    ("zero_optimization.offload_param.device", "offload_param", str),
    ("zero_optimization.offload_optimizer.nvme_path", "nvme_path", str),
    ("zero_optimization.offload_param.nvme_path", "nvme_path", str),
]
PRECISION_KEYS: list[tuple[str, str, Callable[[Any], Any]]] = [
    ("fp16.loss_scale_window", "loss_scale_growth_interval", int),
    ("fp16.initial_scale_power", "initial_loss_scale", lambda power: 2.0 ** int(power)),
    ("communication_data_type", "reduce_dtype", Dtype),
]
# DeepSpeed's schedules and the runner's decay after the linear warmup.
SCHEDULES = {"WarmupLR": Decay.constant, "WarmupDecayLR": Decay.linear, "WarmupCosineLR": Decay.cosine}
OPTIMIZERS = {"adam": "adamw", "adamw": "adamw", "sgd": "sgd"}
# The spec keys behind the generated config's, for naming both sides of a contradiction.
SPEC_KEYS = {
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum_steps",
    "train_batch_size": "train.micro_batch_size x train.grad_accum_steps x processes",
    "gradient_clipping": "train.max_grad_norm",
    "communication_data_type": "precision.reduce_dtype",
    "bf16.enabled": "precision",
    "fp16.enabled": "precision",
    "fp16.loss_scale": "the dynamic loss scale (0)",
    "zero_force_ds_cpu_optimizer": "the runner's own optimizer stepping offloaded states (false)",
}
# Generated keys the file may set otherwise: DeepSpeed's own logging.
FILE_DECIDES = {"steps_per_print"}


def deepspeed_config(spec: RunSpec) -> dict[str, Any]:
    """The DeepSpeed config the spec implies, with the user's config file's other keys added."""
    strategy, train, precision = spec.strategy, spec.train, spec.precision
    zero: dict[str, Any] = {"stage": strategy.zero_stage}
    for key in ("offload_optimizer", "offload_param"):
        device = getattr(strategy, key)
        if device is not OffloadDevice.none:
            zero[key] = {
                "device": device.value,
                **({"nvme_path": strategy.nvme_path} if device.value == "nvme" else {}),
            }
    generated = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.grad_accum_steps,
        "train_batch_size": train.micro_batch_size * train.grad_accum_steps * spec.layout.dp_size,
        "gradient_clipping": train.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": precision.compute_dtype is Dtype.bf16},
        "fp16": {
            "enabled": precision.compute_dtype is Dtype.fp16,
            "loss_scale": 0,  # dynamic
            "initial_scale_power": int(math.log2(precision.initial_loss_scale)),
            "loss_scale_window": precision.loss_scale_growth_interval,
        },
        "communication_data_type": precision.reduce_dtype.value,
        # What DeepSpeed reduces the gradients in instead, under sequence parallelism.
        **({"seq_parallel_communication_data_type": precision.reduce_dtype.value} if strategy.sp_size > 1 else {}),
        # The runner's own torch optimizer also steps offloaded states (DeepSpeed would insist on its CPU Adam), and
        # ZeRO partitions any torch optimizer's states (DeepSpeed lists Adam's variants as tested, not SGD).
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
    }
    if not strategy.config_file:
        return generated
    return config_with_file(spec, generated, lambda: facts_of(spec.model).layer.hidden)


def load(path: str) -> dict:
    if not Path(path).is_file():
        raise SpecError(f"strategy.config_file={path} does not exist")
    try:
        user = json.loads(Path(path).read_text())
    except OSError as error:
        raise SpecError(f"strategy.config_file={path} cannot be read: {error.strerror}") from None
    except ValueError as error:
        raise SpecError(f"strategy.config_file={path} is not valid JSON: {error}") from None
    if not isinstance(user, dict):
        raise SpecError(f"strategy.config_file={path} must hold a JSON object")
    return user


def at(config: dict, path: str) -> Any:
    node: Any = config
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def adopted(
    section: Any, defaults: Any, keys: list[tuple[str, str, Callable[[Any], Any]]], user: dict, source: str, prefix: str
) -> Any:
    """The section with the file's values for the fields the spec leaves at their defaults; a field the spec sets
    to another value contradicts the file."""
    changes: dict[str, Any] = {}
    for path, name, convert in keys:
        given = at(user, path)
        if given is None or given == AUTO:
            continue
        try:
            value = convert(given)
            kind = type(getattr(defaults, name))
            value = kind(value) if issubclass(kind, Enum) else value
        except (TypeError, ValueError):
            raise SpecError(f"{source} sets {path}={given!r}, which {prefix}.{name} cannot take") from None
        current = changes.get(name, getattr(section, name))
        if current == value:
            continue
        if name in changes or current != getattr(defaults, name):
            raise contradiction(source, path, given, f"{prefix}.{name}", current)
        changes[name] = value
    return replace(section, **changes)


def contradiction(source: str, path: str, given: Any, spec_key: str, spec_value: Any) -> SpecError:
    shown = spec_value.value if hasattr(spec_value, "value") else spec_value
    return SpecError(
        f"{source} sets {path}={given!r} but the spec gives {spec_key}={shown!r}; change one of them, "
        f'or write "auto" in the file'
    )


def read_into_spec(spec: RunSpec) -> RunSpec:
    """The spec with what the file decides where the spec does not."""
    source = spec.strategy.config_file
    user = load(source)
    strategy = adopted(spec.strategy, type(spec.strategy)(), STRATEGY_KEYS, user, source, "strategy")
    precision = adopted(spec.precision, PrecisionConfig(), PRECISION_KEYS, user, source, "precision")
    for block, dtype in (("fp16", Dtype.fp16), ("bf16", Dtype.bf16)):
        enabled = at(user, f"{block}.enabled")
        if enabled is True and precision.compute_dtype is not dtype:
            if precision.compute_dtype is not PrecisionConfig().compute_dtype:
                raise contradiction(
                    source, f"{block}.enabled", True, "precision.compute_dtype", precision.compute_dtype
                )
            precision = replace(precision, compute_dtype=dtype)
        elif enabled is False and precision.compute_dtype is dtype:
            raise contradiction(source, f"{block}.enabled", False, "precision.compute_dtype", dtype)
    return replace(spec, strategy=strategy, precision=precision, scheduler=_schedule(spec, user, source))


def _schedule(spec: RunSpec, user: dict, source: str) -> SchedulerConfig:
    scheduler = spec.scheduler
    kind = at(user, "scheduler.type")
    if kind is None:
        return scheduler
    if kind not in SCHEDULES:
        raise SpecError(
            f"{source} sets scheduler.type={kind!r}: the runner's schedules are a linear warmup, then "
            f"constant, linear or cosine decay ({', '.join(SCHEDULES)}); choose one or remove the block"
        )
    decay = SCHEDULES[kind]
    if scheduler.decay is not decay:
        if scheduler.decay is not SchedulerConfig().decay:
            raise contradiction(source, "scheduler.type", kind, "scheduler.decay", scheduler.decay)
        scheduler = replace(scheduler, decay=decay)
    # WarmupDecayLR decays to 0; WarmupCosineLR to cos_min_ratio of the peak.
    ends = [("scheduler.params.cos_min_ratio", "min_lr_ratio", float)] if kind == "WarmupCosineLR" else []
    scheduler = adopted(
        scheduler,
        SchedulerConfig(),
        [("scheduler.params.warmup_num_steps", "warmup_steps", int), *ends],
        user,
        source,
        "scheduler",
    )
    if kind == "WarmupDecayLR" and scheduler.min_lr_ratio == SchedulerConfig().min_lr_ratio:
        scheduler = replace(scheduler, min_lr_ratio=0.0)
    expected = {  # the file's key: what the runner's schedule has there, and the spec key that sets it
        "warmup_min_lr": (0, "the warmup's start"),
        "warmup_min_ratio": (0, "the warmup's start"),
        "warmup_max_lr": (spec.optim.lr, "optim.lr"),
        "total_num_steps": (spec.train.max_steps, "train.max_steps"),
        "warmup_type": ("linear", "the runner's warmup"),
    }
    for key, value in (at(user, "scheduler.params") or {}).items():
        if value == AUTO or key in ("warmup_num_steps", "cos_min_ratio"):
            continue
        if key not in expected:
            raise SpecError(
                f"{source} sets scheduler.params.{key}={value!r}, which the runner's schedule has no "
                'place for; remove it or write "auto"'
            )
        if value != expected[key][0]:
            raise contradiction(source, f"scheduler.params.{key}", value, expected[key][1], expected[key][0])
    return scheduler


def check_optimizer(spec: RunSpec, user: dict, source: str) -> None:
    """The file's optimizer block must describe the spec's optimizer, which the runner builds and passes to
    DeepSpeed."""
    kind = at(user, "optimizer.type")
    if kind is None:
        return
    mine = type(spec.optim).__name__.removesuffix("Config").lower()
    if OPTIMIZERS.get(str(kind).lower()) != mine:
        raise SpecError(
            f"{source} sets optimizer.type={kind!r} but the spec's optimizer is optim={mine}; change one of them"
        )
    for key, value in (at(user, "optimizer.params") or {}).items():
        if value == AUTO or not hasattr(spec.optim, key):
            continue
        if value != getattr(spec.optim, key):
            raise contradiction(source, f"optimizer.params.{key}", value, f"optim.{key}", getattr(spec.optim, key))


def filled(user: dict, generated: dict, hidden_size: Callable[[], int], source: str) -> dict:
    """The file with every "auto" given its value, as the Trainer and accelerate give it: the spec's for what the
    generated config has, the model's hidden size for the bucket sizes and thresholds."""
    by_hidden_size = {
        "zero_optimization.reduce_bucket_size": lambda h: h * h,
        "zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
        "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h,
    }
    as_false = {
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "zero_optimization.stage3_gather_fp16_weights_on_model_save",
    }

    def fill(node: Any, full: str) -> Any:
        if isinstance(node, dict):
            return {key: fill(value, f"{full}.{key}" if full else key) for key, value in node.items()}
        if node != AUTO:
            return node
        if at(generated, full) is not None:
            return at(generated, full)
        if full in by_hidden_size:
            return by_hidden_size[full](hidden_size())
        if full in as_false:
            return False
        if full.endswith(".device") and full.startswith(
            ("zero_optimization.offload_optimizer", "zero_optimization.offload_param")
        ):
            return "none"  # the spec offloads nothing there
        raise SpecError(f'{source} sets {full}="auto", which nothing in the spec fills; give it a value')

    return fill(user, "")


def merged(user: dict, generated: dict, source: str, path: str = "") -> dict:
    """The generated config with the file's other keys added; a key both set must agree."""
    result = dict(generated)
    for key, value in user.items():
        full = f"{path}{key}"
        if isinstance(value, dict) and isinstance(generated.get(key), dict):
            result[key] = merged(value, generated[key], source, f"{full}.")
        elif key in generated and generated[key] != value and full not in FILE_DECIDES:
            raise contradiction(source, full, value, SPEC_KEYS.get(full, "the generated config"), generated[key])
        else:
            result[key] = value
    return result


def config_with_file(spec: RunSpec, generated: dict, hidden_size: Callable[[], int]) -> dict:
    """The DeepSpeed config of a spec with a config file: the file read (optimizer and scheduler blocks checked
    against the spec's, then left to the runner's own), "auto" filled, merged with the generated config."""
    source = spec.strategy.config_file
    user = load(source)
    check_optimizer(spec, user, source)
    user = {key: value for key, value in user.items() if key not in ("optimizer", "scheduler")}
    return merged(filled(user, generated, hidden_size, source), generated, source)
