"""The stepper of the strategies torch runs itself (single, ddp, fsdp): backward, clipping, the optimizer step,
fp16's loss scale, and checkpoints through torch.distributed.checkpoint's state dicts.

A checkpoint holds tensors in safetensors and everything else in JSON: loading unpickles nothing. Of a model
with a frozen base (adapter=lora, qlora) it holds the trained parameters only: the base is rebuilt as it was.

    FULL      model.safetensors, optimizer.safetensors (the whole state, written by rank 0)
    SHARDED   model/, optimizer/ (each rank's own shards, written by torch.distributed.checkpoint in safetensors
              with their offsets: read back into any other sharding, which DCP reshards on load)
    both      optimizer.json (the param groups), stepper.json (fp16's loss scale)
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Optional

from runner.distributed import cpu_copy, gradient_norm, local, process_group_up, whole_on_cpu
from runner.files.atomic import write_json
from runner.files.tensor_io import read_shards, read_tensors, save_tensors, write_shards
from runner.strategies.strategy_protocol import (
    CheckpointLayout,
    PipelineStages,
    StepOutcome,
    has_frozen_parameters,
    trained_state,
)

if TYPE_CHECKING:
    import torch
    from torch import nn


def no_sync_needed(last: bool) -> ContextManager:
    return contextlib.nullcontext()


@dataclass
class TorchStepper:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    max_grad_norm: float
    layout: CheckpointLayout
    scaler: Optional[torch.amp.GradScaler] = None
    # Around each micro batch: the strategy's way of skipping the gradient sync before the last one.
    sync: Callable[[bool], ContextManager] = no_sync_needed
    # The pipeline stages the model is spread over, if it is: this rank's model holds its stages' parameters.
    stages: Optional[PipelineStages] = None

    def micro_batch(self, last: bool) -> ContextManager:
        return self.sync(last)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self) -> StepOutcome:
        import torch

        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        if self.stages:
            norm = self.stages.grad_norm([p.grad for p in params])
        else:
            norm = gradient_norm([p.grad for p in params])
        if self.max_grad_norm > 0 and params:
            # torch's clip_grads_with_norm_ multiplied DTensor gradients as DTensors, which DTensor plans anew at
            # every step (fsdp x tp 2 on two CPU ranks: 9% of the step). A scalar scales each rank's shard alike.
            clip = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_([local(p.grad) for p in params], clip)
        if self.scaler:
            # The scaler skips the update when a gradient overflowed, and then lowers the scale.
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            outcome = StepOutcome(norm.detach(), self.scaler.get_scale() >= scale, self.scaler.get_scale())
        else:
            self.optimizer.step()
            outcome = StepOutcome(norm.detach())
        self.optimizer.zero_grad(set_to_none=True)
        return outcome

    def options(self, **choices: bool):
        """torch's state-dict options; a frozen base is left out of what is written, read and exported."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        frozen = has_frozen_parameters(self.model)
        return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen, **choices)

    def trained(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """torch's ignore_frozen_params keeps the second name of a tied frozen parameter (an LM head tied to the
        embeddings): the trained parameters' entries only."""
        return trained_state(self.model, state)

    def save(self, directory: Path, rank: int) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        if self.layout is CheckpointLayout.SHARDED:
            options = self.options()
            optimizer_state = get_optimizer_state_dict(self.model, self.optimizer, options=options)
            model_state = self.trained(get_model_state_dict(self.model, options=options))
            write_shards(directory / "model", self._as_whole_model(model_state))
            write_shards(directory / "optimizer", self._as_whole_model(_flatten_optimizer(optimizer_state["state"])))
        else:
            if self.stages:
                model_state, optimizer_state = self._whole_across_stages(optimizer=True)
            else:
                # Both calls are collectives; with full_state_dict, only rank 0 gets the (CPU) result.
                options = self.options(full_state_dict=True, cpu_offload=True)
                model_state = self.trained(get_model_state_dict(self.model, options=options))
                optimizer_state = get_optimizer_state_dict(self.model, self.optimizer, options=options)
            if rank == 0:
                save_tensors(directory / "model.safetensors", {k: local(v) for k, v in model_state.items()})
                flat = _flatten_optimizer(optimizer_state["state"])
                save_tensors(directory / "optimizer.safetensors", {k: local(v) for k, v in flat.items()})
        if rank == 0:
            write_json(directory / "optimizer.json", optimizer_state["param_groups"])
            write_json(directory / "stepper.json", {"loss_scaler": self.scaler.state_dict()} if self.scaler else {})

    def load(self, directory: Path, rank: int, written: CheckpointLayout) -> None:
        if written is CheckpointLayout.SHARDED:
            self._load_shards(directory)
        else:
            self._load_whole(directory, rank)
        own = json.loads((directory / "stepper.json").read_text())
        if self.scaler and "loss_scaler" in own:
            self.scaler.load_state_dict(own["loss_scaler"])

    def _load_shards(self, directory: Path) -> None:
        """The current state dicts give this run's sharding; DCP reads each rank's part of them from whichever
        shards of the written ones hold it."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = self.options()
        model_state = self.trained(get_model_state_dict(self.model, options=options))
        optimizer_state = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        read_shards(directory / "model", self._as_whole_model(model_state))
        read_shards(directory / "optimizer", self._as_whole_model(_flatten_optimizer(optimizer_state["state"])))
        optimizer_state["param_groups"] = _saved_settings(optimizer_state["param_groups"], directory)
        set_model_state_dict(self.model, model_state, options=options)
        set_optimizer_state_dict(self.model, self.optimizer, optimizer_state, options=options)

    def _as_whole_model(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The entries of this rank's stages under the whole model's names (a tied head: the embeddings'), so that
        shards move between pipeline layouts and one process."""
        names = self.stages.whole_model_names() if self.stages else {}
        renamed = {}
        for key, tensor in state.items():
            name = _parameter_name(key) if key.startswith("state/") else key
            renamed[key.replace(name, names.get(name, name), 1)] = tensor
        return renamed

    def _load_whole(self, directory: Path, rank: int) -> None:
        """Rank 0 reads the whole state and broadcasts it into whatever sharding this run uses; under a pipeline,
        each rank reads its own stages' entries."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        distributed = process_group_up()
        options = self.options(full_state_dict=True, broadcast_from_rank0=distributed and not self.stages)
        own = set(self.trained(get_model_state_dict(self.model, options=self.options()))) if self.stages else None
        local_names = {whole: here for here, whole in self.stages.whole_model_names().items()} if self.stages else {}
        reads = rank == 0 or not distributed or self.stages
        model_state = read_tensors(directory / "model.safetensors", own) if reads else {}
        wanted = own | set(local_names) if self.stages else None
        optimizer_state = {
            "state": {
                local_names.get(name, name): values
                for name, values in _unflatten_optimizer(
                    read_tensors(directory / "optimizer.safetensors", wanted, _parameter_name)
                ).items()
            }
            if reads
            else {},
            "param_groups": [
                {**group, "params": [local_names.get(name, name) for name in group["params"]]}
                for group in json.loads((directory / "optimizer.json").read_text())
            ],
        }
        set_model_state_dict(self.model, model_state, options=options)
        set_optimizer_state_dict(self.model, self.optimizer, optimizer_state, options=options)

    def full_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        if not process_group_up():
            return None  # one process: the model's own weights are whole
        if self.stages:
            return self._whole_across_stages(optimizer=False)[0]
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = self.trained(
            get_model_state_dict(self.model, options=self.options(full_state_dict=True, cpu_offload=True))
        )
        return {name: cpu_copy(tensor) for name, tensor in state.items()}

    def _whole_across_stages(self, optimizer: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The whole model (and optimizer) state of every pipeline stage, on rank 0 (empty elsewhere): each tensor's
        shards gathered one at a time and kept on the CPU by one rank of each stage, which passes them on."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        keep, elsewhere = self.stages.keeps_whole(), self.stages.whole_model_names()
        model_state = whole_on_cpu(self.trained(get_model_state_dict(self.model, options=self.options())), keep)
        optimizer_state = {"state": {}, "param_groups": []}
        if not optimizer:  # an export names a tied parameter once, as save_pretrained does
            model_state = {name: tensor for name, tensor in model_state.items() if name not in elsewhere}
        else:  # (a parameter the whole model names otherwise has its state from the stage that names it)
            sharded = get_optimizer_state_dict(self.model, self.optimizer, options=self.options())
            optimizer_state = {
                "state": {
                    name: values
                    for name, values in _unflatten_optimizer(
                        whole_on_cpu(_flatten_optimizer(sharded["state"]), keep)
                    ).items()
                    if name not in elsewhere
                },
                "param_groups": [
                    {**group, "params": [name for name in group["params"] if name not in elsewhere]}
                    for group in sharded["param_groups"]
                ],
            }
        every_stage = self.stages.to_rank0((model_state, optimizer_state))
        if every_stage is None:
            return {}, optimizer_state
        merged_model, merged_optimizer = {}, {"state": {}, "param_groups": []}
        for stage_model, stage_optimizer in every_stage:
            merged_model.update(stage_model)
            merged_optimizer["state"].update(stage_optimizer["state"])
            groups = merged_optimizer["param_groups"] or [
                {**group, "params": []} for group in stage_optimizer["param_groups"]
            ]
            for group, stage_group in zip(groups, stage_optimizer["param_groups"]):
                group["params"] += stage_group["params"]
            merged_optimizer["param_groups"] = groups
        return merged_model, merged_optimizer


def _saved_settings(groups: list[dict[str, Any]], directory: Path) -> list[dict[str, Any]]:
    """This run's param groups (its own parameters) with the settings the checkpoint's groups had."""
    saved = json.loads((directory / "optimizer.json").read_text())
    return [
        {**group, **{key: value for key, value in settings.items() if key != "params"}}
        for group, settings in zip(groups, saved)
    ]


def _parameter_name(key: str) -> str:
    """The parameter a flat optimizer-state key belongs to (state/<parameter>/<name>)."""
    return key.removeprefix("state/").rsplit("/", 1)[0]


def _flatten_optimizer(state: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {f"state/{name}/{key}": value for name, values in state.items() for key, value in values.items()}


def _unflatten_optimizer(flat: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        name, item = key.removeprefix("state/").rsplit("/", 1)
        state.setdefault(name, {})[item] = value
    return state
