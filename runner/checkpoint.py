"""Checkpoints: what a run needs to continue exactly, written atomically, only the last few kept.

    <run dir>/checkpoints/step_00000050/
        meta.json                   step, tokens seen, first eval loss, world size, layout, scheduler and loss scale
        model.safetensors           FULL: the whole model, written by rank 0
        optimizer.safetensors       FULL: the whole optimizer state's tensors; optimizer.json its param groups
        model-rank<N>.safetensors   SHARDED: each rank's own shards (and optimizer-rank<N>.*)
        rng-rank<N>.safetensors     each rank's random number generator states
        deepspeed/                  DeepSpeed: its engine's own checkpoint

A checkpoint is written into `step_<N>.partial/` and renamed once every rank has finished, so that a directory
named `step_<N>` is always complete. On several nodes the run directory must be on a shared filesystem for the
checkpoints to be whole. Tensors go to safetensors and everything else to JSON: loading never
unpickles anything (DeepSpeed's engine checkpoint aside, which DeepSpeed itself reads).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from runner.job import PreparedJob

log = logging.getLogger("runner")
PARTIAL = ".partial"


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoints of a run, oldest first; half-written ones are left out with a warning."""
    found = []
    for path in sorted(checkpoints_dir(run_dir).glob("step_*")):
        if path.name.endswith(PARTIAL) or not (path / "meta.json").is_file():
            log.warning("skipping %s: it was not completely written", path)
            continue
        found.append(path)
    return found


def layout(job: PreparedJob) -> str:
    from runner.strategy import DeepSpeedStrategy, FSDPStrategy, StateDictType

    strategy = job.spec.strategy
    if isinstance(strategy, DeepSpeedStrategy):
        return "deepspeed"
    if isinstance(strategy, FSDPStrategy) and strategy.state_dict_type is StateDictType.SHARDED:
        return "sharded"
    return "full"


def save(job: PreparedJob, step: int, progress: dict[str, Any]) -> Path:
    """Writes the checkpoint of `step` (a collective: every rank calls it) and keeps the last K."""
    rank = job.ranks.rank
    final = checkpoints_dir(job.run_dir) / f"step_{step:08d}"
    partial = final.with_name(final.name + PARTIAL)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
    _barrier()
    # Every rank writes into the directory (on several nodes, a shared filesystem makes it one directory).
    partial.mkdir(parents=True, exist_ok=True)
    kind = layout(job)
    if kind == "deepspeed":
        job.model.save_checkpoint(str(partial / "deepspeed"), tag="engine")
    else:
        _save_model_and_optimizer(job, partial, sharded=kind == "sharded")
    _save_tensors(partial / f"rng-rank{rank}.safetensors", _rng_state())
    if rank == 0:
        meta = {
            "step": step,
            "world_size": job.ranks.world_size,
            "layout": kind,
            "strategy": type(job.spec.strategy).__name__,
            "scheduler": job.scheduler.state_dict(),
            "stepper": job.stepper.state_dict(),
            **progress,
        }
        (partial / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    _barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)  # an incomplete one of the same step, left by a killed run
        os.replace(partial, final)
        for old in complete_checkpoints(job.run_dir)[: -job.spec.train.keep_checkpoints]:
            shutil.rmtree(old)
    _barrier()
    return final


def load(job: PreparedJob, path: Path) -> dict[str, Any]:
    """Restores model, optimizer, scheduler and RNG states from a checkpoint; returns its meta data."""
    from safetensors.torch import load_file

    meta = json.loads((path / "meta.json").read_text())
    if meta["layout"] == "deepspeed":
        job.model.load_checkpoint(str(path / "deepspeed"), tag="engine", load_lr_scheduler_states=False)
    else:
        _load_model_and_optimizer(job, path, sharded=meta["layout"] == "sharded")
    job.scheduler.load_state_dict(meta["scheduler"])
    job.stepper.load_state_dict(meta.get("stepper", {}))
    rng = path / f"rng-rank{job.ranks.rank}.safetensors"
    if rng.exists():
        _set_rng_state(load_file(rng))
    return meta


def _save_model_and_optimizer(job: PreparedJob, directory: Path, sharded: bool) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    # Both calls are collectives; with full_state_dict, only rank 0 gets the (CPU) result.
    options = StateDictOptions(full_state_dict=not sharded, cpu_offload=not sharded)
    model_state = get_model_state_dict(job.model, options=options)
    optimizer_state = get_optimizer_state_dict(job.model, job.optimizer, options=options)
    rank = job.ranks.rank
    files = (f"model-rank{rank}", f"optimizer-rank{rank}") if sharded else ("model", "optimizer")
    if sharded or rank == 0:
        tensors = _flatten_optimizer(optimizer_state["state"])
        _save_tensors(directory / f"{files[0]}.safetensors", {k: _local(v) for k, v in model_state.items()})
        _save_tensors(directory / f"{files[1]}.safetensors", {k: _local(v) for k, v in tensors.items()})
    if rank == 0:
        (directory / "optimizer.json").write_text(json.dumps(optimizer_state["param_groups"], indent=2) + "\n")


def _load_model_and_optimizer(job: PreparedJob, directory: Path, sharded: bool) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    groups = json.loads((directory / "optimizer.json").read_text())
    if sharded:
        # The current state dicts give the shards' layout; the files fill in their values.
        rank = job.ranks.rank
        model_state = get_model_state_dict(job.model)
        optimizer_state = get_optimizer_state_dict(job.model, job.optimizer)
        with torch.no_grad():
            for name, value in load_file(directory / f"model-rank{rank}.safetensors").items():
                _local(model_state[name]).copy_(value)
            flat = _flatten_optimizer(optimizer_state["state"])
            for name, value in load_file(directory / f"optimizer-rank{rank}.safetensors").items():
                _local(flat[name]).copy_(value)
        optimizer_state["param_groups"] = groups
        set_model_state_dict(job.model, model_state)
        set_optimizer_state_dict(job.model, job.optimizer, optimizer_state)
        return
    distributed = dist.is_available() and dist.is_initialized()
    # Rank 0 reads the whole state and broadcasts it into whatever sharding this run uses.
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=distributed)
    reads = job.ranks.rank == 0 or not distributed
    model_state = load_file(directory / "model.safetensors") if reads else {}
    optimizer_state = {
        "state": _unflatten_optimizer(load_file(directory / "optimizer.safetensors")) if reads else {},
        "param_groups": groups,
    }
    set_model_state_dict(job.model, model_state, options=options)
    set_optimizer_state_dict(job.model, job.optimizer, optimizer_state, options=options)


def _flatten_optimizer(state: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {f"state/{name}/{key}": value for name, values in state.items() for key, value in values.items()}


def _unflatten_optimizer(flat: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        name, item = key.removeprefix("state/").rsplit("/", 1)
        state.setdefault(name, {})[item] = value
    return state


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({name: cpu_copy(t) for name, t in tensors.items()}, path)


def cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A plain, contiguous CPU copy: safetensors stores each tensor once (tied weights and views get their own
    copies), and a tensor subclass (torchao's float8 all-gather weights) becomes the plain tensor it wraps."""
    import torch

    return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor.detach())


def _rng_state() -> dict[str, torch.Tensor]:
    import torch

    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    import torch

    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()

