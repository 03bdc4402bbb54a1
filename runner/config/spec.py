"""The run spec: Hydra composes the config groups into one typed RunSpec, and `validate` checks it.

Each group's schema lives in the group's own module (runner/config/<group>.py; the strategy and task options in
runner/strategies/ and runner/tasks/); every option in conf/ starts from one of them, so an unknown key or a value
of the wrong type fails while Hydra composes. `validate` asks each group to check its part, then the strategy to
check the whole spec as it applies to it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from runner.config import adapter, data, hardware, model, precision, scheduler, tracker, training
from runner.config.adapter import AdapterConfig
from runner.config.data import DataConfig
from runner.config.fields import setting
from runner.config.hardware import HardwareConfig
from runner.config.model import ModelConfig
from runner.config.optim import OptimConfig
from runner.config.precision import PrecisionConfig
from runner.config.scheduler import SchedulerConfig
from runner.config.strategy import StrategyConfig
from runner.config.task import TaskConfig
from runner.config.tracker import TrackerConfig
from runner.config.training import TrainConfig
from runner.errors import SpecError, did_you_mean, require


@dataclass
class RunSpec:
    hardware: HardwareConfig = setting(
        MISSING,
        "The machine the run is for (hardware=auto detects this one): accelerator, processes, nodes, memory.",
    )
    strategy: StrategyConfig = setting(
        MISSING,
        "How the model, its gradients and optimizer states are spread over the processes: single, ddp, fsdp, deepspeed "
        "(runner/strategies/, each behind the Strategy protocol).",
    )
    precision: PrecisionConfig = setting(
        MISSING,
        "The dtypes of the forward, the weights and the gradients' reduction, and fp8 matmuls.",
    )
    tracker: TrackerConfig = setting(
        MISSING,
        "Where metrics go besides <run dir>/metrics.jsonl: wandb, tensorboard, mlflow (several at once: "
        "tracker=[wandb,mlflow]).",
    )
    model: ModelConfig = setting(
        MISSING,
        "The model trained: a pretrained name or directory, or a transformers architecture initialised at random.",
    )
    adapter: AdapterConfig = setting(
        MISSING,
        "What trains: every parameter (none), or LoRA or QLoRA adapters on a frozen base.",
    )
    data: DataConfig = setting(
        MISSING,
        "The documents, how they become rows of data.seq_len tokens, and the share held out for evaluation.",
    )
    optim: OptimConfig = setting(MISSING, "The optimizer: adamw or sgd, with its learning rate and weight decay.")
    scheduler: SchedulerConfig = setting(
        MISSING,
        "The learning rate over the steps: linear warmup, then cosine, linear or constant.",
    )
    task: TaskConfig = setting(
        MISSING,
        "What `run` does with the spec: train, dpo, grpo, evaluate, generate or estimate (runner/tasks/, each behind "
        "the Task protocol).",
    )
    train: TrainConfig = setting(
        factory=TrainConfig,
        help="Steps, batch sizes, clipping, and how often the loop logs, evaluates, checkpoints and scores benchmarks.",
    )
    seed: int = setting(
        0,
        "Seeds the model's initialisation, the data's shuffle and split, dropout and sampling: the same seed and "
        "global batch give the same losses under any strategy.",
    )
    resume: Optional[str] = setting(
        None,
        "The checkpoint to continue from; the command line's resume=auto or resume=<run dir> is resolved to it.",
    )

    @cached_property
    def layout(self):
        """The job's parallel layout (runner/parallel/dims.py's ParallelDims), worked out once from the strategy
        and the hardware: the prepared job holds it and every other part asks it. A changed spec (dataclasses'
        replace) is a new RunSpec, which works out its own."""
        return self.strategy.dims(self.hardware)


# Groups and keys of lightning-hydra-template (and Lightning), and where the same thing is here.
FROM_OTHER_TOOLS = {
    "experiment": "experiments are recipes here: recipe=<name> (run --recipes lists them)",
    "logger": "loggers are trackers here: tracker=wandb, tensorboard, mlflow or none",
    "trainer": "the Trainer's settings are the hardware, strategy and precision groups (hardware=, strategy=, "
    "precision=) and train.* (train.max_steps, train.micro_batch_size, ...)",
    "debug": "for a short debugging run: recipe=cpu_quick, or train.max_steps=<a few>",
    "callbacks": "checkpoints and evaluation are train.checkpoint_every, train.eval_every, train.keep_checkpoints",
    "paths": "a run's directory is hydra.run.dir; data and model paths are data.files, model.pretrained",
}


def load_spec(config: DictConfig) -> RunSpec:
    """The typed spec of a composed config (Hydra's own `hydra` node, when present, is left out)."""
    _reject_unknown_keys(config, "")
    sections = {f.name: config[f.name] for f in fields(RunSpec)}
    return RunSpec(
        **{name: OmegaConf.to_object(node) if isinstance(node, DictConfig) else node for name, node in sections.items()}
    )


def _reject_unknown_keys(node: DictConfig, prefix: str) -> None:
    """Hydra's `+key=value` adds keys that no schema has; they would be silently ignored, so they are errors."""
    schema = OmegaConf.get_type(node)
    if is_dataclass(schema):
        known = [f.name for f in fields(schema)]
        for key in node.keys():
            if key not in known and not (prefix == "" and key == "hydra"):
                if not prefix and key in FROM_OTHER_TOOLS:
                    raise SpecError(f"unknown key {key}: {FROM_OTHER_TOOLS[key]}")
                has = f"the keys {', '.join(known)}" if known else "no keys"
                raise SpecError(
                    f"unknown key {prefix}{key}: {schema.__name__} has {has}{did_you_mean(str(key), known, prefix)}"
                )
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig) and key != "hydra" and not child._is_missing() and not child._is_none():
            _reject_unknown_keys(child, f"{prefix}{key}.")


def with_absolute_paths(spec: RunSpec, base: Path) -> RunSpec:
    """The spec's local paths (data files, model and tokenizer directories) absolute from `base`, the directory
    `run` was started in, and the task's (a model to evaluate, a prompts file): spec.yaml then reruns from
    anywhere, and a job that changes directory (hydra.job.chdir=true) still finds them."""
    return replace(
        spec,
        data=data.with_absolute_paths(spec.data, base),
        model=model.with_absolute_paths(spec.model, base),
        task=spec.task.with_absolute_paths(base),
    )


def validate(spec: RunSpec, on_this_machine: bool = True) -> RunSpec:
    """Checks the spec; returns it with the hardware detected.

    A spec whose task plans rather than runs (task=estimate), or a job submitted to a cluster, is checked against
    the hardware it declares instead of this machine's. What needs more than the spec (the model's layers, the fit
    in memory, a checkpoint to resume) is the task's to check before launch (runner/tasks/).
    """
    spec = spec.strategy.resolved(spec)
    require(spec.seed >= 0, f"seed={spec.seed} must be >= 0")
    training.check(spec.train)
    spec.optim.check()
    scheduler.check(spec.scheduler, spec.train.max_steps)
    model.check(spec.model)
    adapter.check(spec.adapter)
    data.check(spec.data)
    here = on_this_machine and spec.task.runs_on_this_machine
    spec = replace(spec, hardware=hardware.on_this_machine(spec.hardware) if here else hardware.planned(spec.hardware))
    spec = replace(spec, model=model.resolved(spec.model, spec.hardware.accelerator.value))
    check_combination(spec)
    tracker.check(spec.tracker)
    return spec


def check_combination(spec: RunSpec) -> None:
    """The rules between the strategy, the precision and the hardware: what a change to any of them must keep."""
    spec.strategy.check(spec)
    precision.check(spec.precision, spec.hardware, spec.strategy.float8_all_gather)
    require(
        not (spec.adapter.active and spec.precision.fp8),
        f"adapter={spec.adapter.kind.value} with precision.fp8: fp8 training of a frozen base is not supported; "
        "use precision=bf16",
    )


def to_plain(spec: RunSpec, hide_secrets: bool = True) -> dict:
    """The resolved spec as plain data, secrets hidden unless asked: what trackers record and spec.yaml shows."""
    plain = OmegaConf.to_container(OmegaConf.structured(spec), resolve=True, enum_to_str=True)
    return tracker.redacted(plain) if hide_secrets else plain


def to_yaml(spec: RunSpec) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(to_plain(spec)))
