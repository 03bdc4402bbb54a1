"""The `task` group's base schemas: what `run` does with the composed spec. Its options (train, estimate,
evaluate, generate) are in runner/tasks/, one file each behind the Task protocol (runner/tasks/task_protocol.py).

The inference tasks (evaluate, generate) share where their model comes from (`trained`) and how it is placed
(`device_map`, `max_memory`, `offload_dir`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar, Optional, TypeVar

from runner.config.fields import setting
from runner.config.model import BYTES, ModelConfig
from runner.errors import SpecError, require
from runner.files.paths import absolute_path

Spec = TypeVar("Spec")  # a RunSpec: runner/config/spec.py imports this module, so it cannot be imported here


def fit_check_setting() -> Any:
    """`fit_check`, the same key of every task that places a model."""
    return setting(
        True,
        "Before launch, refuse a job whose estimated peak memory per device exceeds the hardware's (false: launch "
        "anyway).",
    )


def estimate_only_setting() -> Any:
    """`estimate_only`, the same key of the tasks that task=estimate does not plan (dpo, grpo, evaluate, generate)."""
    return setting(
        False,
        "Print the job's memory estimate per device (a post-training task's reference model and own terms counted) "
        "and stop.",
    )


@dataclass
class TaskConfig:
    """What every task option shares; each option's schema adds its own keys."""

    # Whether the job writes checkpoints and a trained model, whose room `run` checks before launch.
    trains: ClassVar[bool] = False
    # The rows a step trains on for each prompt it draws (task=grpo: its completions of each), and the steps that
    # train on one draw's rows (task=grpo's num_iterations).
    rows_per_prompt: ClassVar[int] = 1
    steps_per_draw: ClassVar[int] = 1
    # The metrics its evaluations log, and whether higher is better: what train.keep_best may name.
    eval_metrics: ClassVar[dict[str, bool]] = {"eval_loss": False}
    # What a step of its training does, for the time plan: a past run's measured rate stands for another run of the
    # same kind only (next-token training: train, and task=estimate's plan of it).
    step_kind: ClassVar[str] = "train"
    # The forward passes a step makes over its rows besides the trained one (a reference's log-probs, sampling), which
    # the time plan counts at a third of a trained row's work each.
    forward_passes: ClassVar[float] = 0.0

    def with_absolute_paths(self, base: Path) -> TaskConfig:
        """The task's local paths absolute from `base` (the directory `run` started in); none by default."""
        return self

    def planned(self, spec: Spec) -> Any:
        """The time plan (runner/planning/time_plan.py's TimePlan) of the training run this task's answer
        estimates, which a sweep of estimates sums; None for a task that answers nothing of the kind."""
        return None

    def memory_terms(self, spec: Spec, facts: Any, estimate: Any) -> Any:
        """The memory estimate (runner/memory/breakdown.py's Estimate, which this layer cannot name) of a training
        run of this task, from the strategy's terms: those of next-token training by default."""
        return estimate


@dataclass
class PostTrainingTaskConfig(TaskConfig):
    """What the tasks that train a policy against its initial model share (dpo, grpo)."""

    fit_check: bool = fit_check_setting()
    estimate_only: bool = estimate_only_setting()

    @property
    def trains(self) -> bool:
        return not self.estimate_only

    @property
    def runs_on_this_machine(self) -> bool:
        """An estimate alone is checked against the hardware the spec declares, as task=estimate is."""
        return not self.estimate_only


class DeviceMap(str, Enum):
    # Where the strategy puts the model: one device per process.
    none = "none"
    # accelerate's big-model placement: layers over the GPUs, then CPU RAM, then an offload folder on disk.
    auto = "auto"


@dataclass
class MaxMemory:
    """The GiB device_map=auto may fill on each GPU and in CPU RAM (accelerate's max_memory); unset: the hardware
    group's device_memory_gib and host_memory_gib."""

    gpu: Optional[float] = setting(None, "GiB device_map=auto may fill on each GPU; unset: hardware.device_memory_gib.")
    cpu: Optional[float] = setting(None, "GiB device_map=auto may fill in CPU RAM; unset: hardware.host_memory_gib.")


@dataclass
class InferenceTaskConfig(TaskConfig):
    trained: Optional[str] = setting(
        None,
        "What was trained: a run directory (its model/), one of its checkpoints, or a saved model's directory. Unset: "
        "the model group's own (model=pretrained, or random init). A run directory or checkpoint also brings its run's "
        "spec (data, precision, eval rows), which the command line's overrides change.",
    )
    device_map: DeviceMap = setting(
        DeviceMap.none,
        "Where the model goes: none (as the strategy places it, one device per process) or auto (accelerate's "
        "big-model placement: layers over the GPUs, then CPU RAM, then offload_dir on disk).",
    )
    max_memory: MaxMemory = setting(
        MaxMemory(),
        "The GiB device_map=auto may fill on each GPU and in CPU RAM (accelerate's max_memory).",
    )
    offload_dir: Optional[str] = setting(
        None,
        "Where device_map=auto puts the layers that fit nowhere else; unset: <run dir>/offload, removed at the end.",
    )
    fit_check: bool = fit_check_setting()
    estimate_only: bool = estimate_only_setting()

    @property
    def runs_on_this_machine(self) -> bool:
        """An estimate alone is checked against the hardware the spec declares, as task=estimate is."""
        return not self.estimate_only

    def with_absolute_paths(self, base: Path) -> InferenceTaskConfig:
        return replace(
            self, trained=absolute_path(self.trained, base), offload_dir=absolute_path(self.offload_dir, base)
        )

    def trained_model_config(self, model: ModelConfig) -> ModelConfig:
        """The model group as `trained` changes it: a saved model's directory replaces it (with its own tokenizer,
        the built-in byte tokenizer aside); a checkpoint keeps the run's model and loads into it."""
        trained = trained_model(self.trained) if self.trained else TrainedModel()
        if trained.model_dir is None:
            return model
        return ModelConfig(pretrained=str(trained.model_dir), tokenizer=BYTES if model.tokenizer == BYTES else None)

    def with_trained_model(self, spec: Spec) -> Spec:
        """The spec with its model group as `trained` changes it (trained_model_config)."""
        return replace(spec, model=self.trained_model_config(spec.model))

    def check(self, processes: int) -> None:
        """The keys this schema shares, and the job's processes as they place the model."""
        for device in ("gpu", "cpu"):
            limit = getattr(self.max_memory, device)
            require(limit is None or limit > 0, f"task.max_memory.{device}={limit} must be > 0 (GiB)")
        if self.trained:
            require(
                not (trained_model(self.trained).checkpoint and self.device_map is DeviceMap.auto),
                "task.device_map=auto reads a saved model's directory; give the run directory (its model/) "
                "rather than one of its checkpoints",
            )
        if self.device_map is DeviceMap.auto:
            require(
                processes == 1,
                "task.device_map=auto places one model over this machine's devices from one process; set "
                "hardware.nproc_per_node=1 (strategy=single), or leave task.device_map=none",
            )


@dataclass(frozen=True)
class TrainedModel:
    """Where an inference task's weights are: a saved model's directory (save_pretrained, with its tokenizer), or
    a checkpoint's model.safetensors (FULL) or model/ (SHARDED); the run whose spec.yaml they come with."""

    model_dir: Optional[Path] = None
    checkpoint: Optional[Path] = None
    run_dir: Optional[Path] = None


def trained_model(value: str) -> TrainedModel:
    """What `task.trained=<value>` names, or a one-line SpecError."""
    path = Path(value).expanduser()
    key = f"task.trained={value}"
    if (path / "meta.json").is_file():
        meta = json.loads((path / "meta.json").read_text())
        layout = meta.get("layout")
        require(
            meta.get("adapter", "none") == "none",
            f"{key} is a checkpoint of an adapter={meta.get('adapter')} run, which holds the adapters only: "
            "give the run directory, whose model/merged/ is saved with adapter.merge=true",
        )
        require(
            layout in ("full", "sharded"),
            f"{key} is a checkpoint in {layout} layout (DeepSpeed's own): evaluate its run's model/ instead, or "
            "write FULL or SHARDED checkpoints (strategy=fsdp strategy.state_dict_type)",
        )
        require(
            (path / "model.safetensors").is_file() or (path / "model").is_dir(),
            f"{key} is a checkpoint without model.safetensors or model/ (shards)",
        )
        return TrainedModel(checkpoint=path, run_dir=path.parent.parent)
    if (path / "spec.yaml").is_file():
        if (path / "model" / "adapter_config.json").is_file():
            require(
                (path / "model" / "merged" / "config.json").is_file(),
                f"{key} trained an adapter, saved in peft's format (model/) without the merged model: load it "
                "with peft's PeftModel.from_pretrained, or train with adapter.merge=true to evaluate it here",
            )
            return TrainedModel(model_dir=path / "model" / "merged", run_dir=path)
        require(
            (path / "model" / "config.json").is_file(),
            f"{key} is a run directory without a saved model (model/): the run has not finished, or it set "
            "train.save_model=false; give one of its checkpoints (<run dir>/checkpoints/step_<N>) instead",
        )
        return TrainedModel(model_dir=path / "model", run_dir=path)
    if (path / "config.json").is_file():
        return TrainedModel(model_dir=path)
    if not path.exists():
        raise SpecError(f"{key} does not exist; give a run directory, one of its checkpoints or a model directory")
    raise SpecError(
        f"{key} is neither a run directory (spec.yaml), a checkpoint (meta.json) nor a saved model (config.json)"
    )
