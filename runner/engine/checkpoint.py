"""Checkpoints: what a run needs to continue exactly, written atomically, only the last few kept.

    <run dir>/checkpoints/step_00000050/
        meta.json                   step, tokens seen, first eval loss, world size, layout, strategy, global
                                    batch, scheduler
        rng-rank<N>.safetensors     each rank's random number generator states
        stream-rank<N>.json         a streamed run's: each rank's position in its stream (runner/data/stream.py)
        rows-rank<N>.safetensors    rows the next step trains again (task=grpo's num_iterations), and their counts
        ...                         the model and optimizer, as the strategy's stepper writes them: whole
                                    (FULL), each rank's shards (SHARDED) or DeepSpeed's own (ENGINE)

With train.keep_best, `checkpoints/best.json` names the checkpoint with the best value of its metric so far, which
is kept besides the last few.

A checkpoint is written into `step_<N>.partial/` and renamed once every rank has finished, so that a directory
named `step_<N>` is always complete. On several nodes the run directory must be on a shared filesystem for the
checkpoints to be whole. Tensors go to safetensors and everything else to JSON: loading never unpickles anything
(DeepSpeed's engine checkpoint aside, which DeepSpeed reads with a weights-only loader).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol

from runner.data.batches import GlobalBatch, batch_from_tensors, batch_tensors
from runner.distributed import Ranks, barrier
from runner.errors import require
from runner.files.atomic import move_into_place, write_json, write_json_atomically
from runner.files.checkpoint_dirs import PARTIAL, checkpoints_dir, complete_checkpoints
from runner.files.refused_writes import written_whole
from runner.files.tensor_io import read_tensors, save_tensors
from runner.memory.disk import disk_need
from runner.strategies.strategy_protocol import CheckpointLayout

if TYPE_CHECKING:
    import torch

    from runner.config.spec import RunSpec
    from runner.strategies.strategy_protocol import Stepper

log = logging.getLogger("runner")
BEST = "best.json"


@dataclass(frozen=True)
class KeepBest:
    """train.keep_best: the metric whose best value's checkpoint is kept, and whether higher values are better."""

    metric: str
    higher: bool

    def better(self, value: float, best: float) -> bool:
        if math.isnan(value):
            return False
        return math.isnan(best) or (value > best if self.higher else value < best)


class Checkpointed(Protocol):
    """What a checkpoint is written from and read into: a prepared job (runner/engine/job.py)."""

    spec: RunSpec
    run_dir: Path
    ranks: Ranks
    stepper: Stepper
    scheduler: torch.optim.lr_scheduler.LRScheduler
    global_batch_size: int


def save(
    job: Checkpointed,
    step: int,
    progress: dict[str, Any],
    batch: Optional[GlobalBatch],
    best: Optional[dict[str, Any]] = None,
) -> Path:
    """Writes the checkpoint of `step` (a collective: every rank calls it) and keeps the last K, and the best one.
    Of the step's `batch`, a streamed rank's position in its stream, and rows the next step trains again. `best`:
    the metric and value that make this checkpoint the best so far."""
    rank = job.ranks.rank
    final = checkpoints_dir(job.run_dir) / f"step_{step:08d}"
    partial = final.with_name(final.name + PARTIAL)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
    barrier()
    # Every rank writes into the directory (on several nodes, a shared filesystem makes it one directory).
    with written_whole(
        partial,
        f"the checkpoint of step {step}",
        job.run_dir,
        lambda: disk_need(job.spec).checkpoint,
        shared=job.ranks.world_size > 1,
    ):
        partial.mkdir(parents=True, exist_ok=True)
        job.stepper.save(partial, rank)
        save_tensors(partial / f"rng-rank{rank}.safetensors", _rng_state())
        if batch is not None and batch.stream_position is not None:
            write_json(partial / f"stream-rank{rank}.json", batch.stream_position)
        if batch is not None and batch.trained_again:
            tensors, counts = batch_tensors(batch)
            save_tensors(partial / f"rows-rank{rank}.safetensors", tensors)
            write_json(partial / f"rows-rank{rank}.json", counts)
        if rank == 0:
            write_json(
                partial / "meta.json",
                {
                    "step": step,
                    "world_size": job.ranks.world_size,
                    "mesh": list(job.dims.shape),
                    "layout": job.spec.strategy.checkpoint_layout.value,
                    "strategy": job.spec.strategy.name,
                    "adapter": job.spec.adapter.kind.value,
                    "global_batch": job.global_batch_size,
                    "scheduler": job.scheduler.state_dict(),
                    **progress,
                },
            )
    barrier()
    if rank == 0:
        move_into_place(partial, final)  # replacing an incomplete one of the same step, left by a killed run
        if best is not None:
            write_json_atomically(checkpoints_dir(job.run_dir) / BEST, {"checkpoint": final.name, **best})
        kept = best_checkpoint(job.run_dir)
        for old in complete_checkpoints(job.run_dir)[: -job.spec.train.keep_checkpoints]:
            if old != kept:
                shutil.rmtree(old)
    barrier()
    return final


def best_checkpoint(run_dir: Path) -> Optional[Path]:
    """The checkpoint train.keep_best kept, if any."""
    record = checkpoints_dir(run_dir) / BEST
    return checkpoints_dir(run_dir) / json.loads(record.read_text())["checkpoint"] if record.is_file() else None


def load(job: Checkpointed, path: Path) -> dict[str, Any]:
    """Restores model, optimizer, scheduler and RNG states from a checkpoint; returns its meta data."""
    meta = json.loads((path / "meta.json").read_text())
    job.stepper.load(path, job.ranks.rank, CheckpointLayout(meta["layout"]))
    job.scheduler.load_state_dict(meta["scheduler"])
    rng = path / f"rng-rank{job.ranks.rank}.safetensors"
    if rng.exists():
        _set_rng_state(read_tensors(rng))
    return meta


def stream_position(path: Path, rank: int) -> Optional[dict[str, int]]:
    saved = path / f"stream-rank{rank}.json"
    return json.loads(saved.read_text()) if saved.exists() else None


def rows_trained_again(path: Path, rank: int) -> Optional[GlobalBatch]:
    """The rows the step after the checkpoint trains again (task=grpo's num_iterations), where it kept them."""
    counts = path / f"rows-rank{rank}.json"
    if not counts.exists():
        return None
    return batch_from_tensors(read_tensors(path / f"rows-rank{rank}.safetensors"), json.loads(counts.read_text()))


def check_resumable(spec: RunSpec) -> None:
    """Refuses, before launch, a checkpoint this run cannot continue from."""
    meta_file = Path(spec.resume) / "meta.json"
    require(meta_file.is_file(), f"resume={spec.resume} is not a complete checkpoint")
    written = json.loads(meta_file.read_text())
    layout, strategy = CheckpointLayout(written["layout"]), spec.strategy
    require(
        not (Path(spec.resume) / "model-rank0.safetensors").is_file(),
        f"the checkpoint {spec.resume} holds SHARDED files of an earlier runner (model-rank<N>.safetensors), "
        "which this one does not read; continue it with the runner that wrote it",
    )
    if not layout.portable:
        require(
            written["world_size"] == spec.hardware.world_size,
            f"the checkpoint {spec.resume} holds {written['world_size']} ranks' shards ({layout.value}) and this "
            f"run has {spec.hardware.world_size} processes; resume on {written['world_size']}, or write FULL "
            "or SHARDED checkpoints (strategy.state_dict_type), which resume on any number",
        )
    require(
        written["strategy"] == strategy.name or strategy.checkpoint_layout.reads(layout),
        f"the checkpoint {spec.resume} was written by strategy={written['strategy']}, this run uses "
        f"strategy={strategy.name}; only FULL and SHARDED checkpoints move between strategies, to those that "
        "read them",
    )
    streamed = (Path(spec.resume) / "stream-rank0.json").exists()
    require(
        streamed == spec.data.streaming,
        f"the checkpoint {spec.resume} was written by a run {'with' if streamed else 'without'} data.streaming, "
        f"this run has data.streaming={str(spec.data.streaming).lower()}; resume as it was written",
    )
    if streamed:
        require(
            written["world_size"] == spec.hardware.world_size,
            f"the checkpoint {spec.resume} holds the stream positions of {written['world_size']} ranks, each "
            f"reading its own shard, and this run has {spec.hardware.world_size} processes; resume on "
            f"{written['world_size']}",
        )
    adapter = written.get("adapter", "none")
    require(
        adapter == spec.adapter.kind.value,
        f"the checkpoint {spec.resume} was written with adapter={adapter}, this run has "
        f"adapter={spec.adapter.kind.value}; resume with adapter={adapter}",
    )
    require(
        written["step"] < spec.train.max_steps,
        f"the checkpoint {spec.resume} is at step {written['step']}, the end of train.max_steps="
        f"{spec.train.max_steps}; raise train.max_steps to train further",
    )


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
