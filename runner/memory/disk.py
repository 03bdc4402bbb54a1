"""What a training run writes to its run directory, known before it writes it: the bytes of one checkpoint, how
many are on disk at once, and the exported model's, against the free space of the filesystem that holds the run
directory. `run` checks it before launch (runner/cli/app.py); a write that fails names these figures
(runner/files/refused_writes.py)."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runner.errors import require
from runner.files.refused_writes import existing_parent
from runner.memory.breakdown import FP32, readable
from runner.memory.model_shapes import facts_of
from runner.memory.parameters import parameters_of

if TYPE_CHECKING:
    from runner.config.spec import RunSpec


@dataclass(frozen=True)
class DiskNeed:
    checkpoint: int  # bytes of one checkpoint
    at_once: int  # checkpoints on disk at once at most: those kept, and the one being written
    kept: int  # checkpoints left at the end
    export: int  # bytes of the exported model (0: train.save_model=false)

    @property
    def peak(self) -> int:
        """The most the run holds on disk at one time: while a checkpoint is written beside those kept, or at the
        end, the kept ones and the exported model."""
        return max(self.at_once * self.checkpoint, self.left)

    @property
    def left(self) -> int:
        """What the run leaves on disk: the kept checkpoints and the model."""
        return self.kept * self.checkpoint + self.export

    def line(self) -> str:
        export = f", the model about {readable(self.export)}" if self.export else ""
        return (
            f"disk: a checkpoint about {readable(self.checkpoint)} ({self.at_once} at once at most){export}: "
            f"{readable(self.peak)} at most"
        )


def disk_need(spec: RunSpec) -> DiskNeed:
    """A training run's checkpoints and export, in bytes: the trained weights and their optimizer states (an
    adapter's alone; DeepSpeed's own checkpoint adds its 16-bit module weights or its fp32 master copy), and the
    model saved at the end."""
    facts = facts_of(spec.model)
    adapted = spec.adapter.active
    trained = parameters_of(spec, facts).trained * spec.layout.tp if adapted else facts.parameters
    weight = spec.precision.param_dtype.bytes
    states, _ = spec.optim.states()
    if spec.strategy.checkpoint_layout.value == "engine":
        checkpoint = trained * (spec.precision.compute_dtype.bytes + FP32 + states * FP32)
    else:
        checkpoint = trained * weight * (1 + states)
    train = spec.train
    every = train.checkpoint_every or train.max_steps  # the last step's checkpoint is always written
    written = len({*range(every, train.max_steps + 1, every), train.max_steps})
    best = 1 if train.keep_best else 0  # train.keep_best's checkpoint, besides the last ones
    kept = min(train.keep_checkpoints, written) + best
    return DiskNeed(
        checkpoint=checkpoint,
        at_once=min(kept + 1, written + best),
        kept=kept,
        export=_export_bytes(spec, facts.parameters, trained) if train.save_model else 0,
    )


def _export_bytes(spec: RunSpec, parameters: int, trained: int) -> int:
    """save_pretrained's weights: the whole model in its master dtype, or the adapter, with the base beside it
    when it was initialised here and the merged model with adapter.merge (both in the compute dtype)."""
    if not spec.adapter.active:
        return parameters * spec.precision.param_dtype.bytes
    whole = parameters * spec.precision.compute_dtype.bytes
    return (
        trained * spec.precision.param_dtype.bytes
        + (0 if spec.model.pretrained else whole)
        + (whole if spec.adapter.merge else 0)
    )


def writable_parent(directory: Path, kind: str, key: str) -> Path:
    """The directory, or its closest existing parent, which the run will write in; SpecError when it cannot."""
    existing = existing_parent(directory)
    require(
        os.access(existing, os.W_OK),
        f"the {kind} directory {directory} cannot be written ({existing} is not writable); choose another with "
        f"{key}=<a directory>",
    )
    return existing


def check_disk(spec: RunSpec, run_dir: Path) -> None:
    """SpecError when the run directory cannot be written or its filesystem cannot hold the run (what the run
    directory holds already, a resumed run's, counts as room)."""
    run_dir = run_dir.absolute()
    existing = writable_parent(run_dir, "run", "hydra.run.dir")
    need = disk_need(spec)
    held = sum(
        path.stat().st_size
        for folder in (run_dir / "checkpoints", run_dir / "model")
        if folder.is_dir()
        for path in folder.rglob("*")
        if path.is_file()
    )
    free = shutil.disk_usage(existing).free
    require(
        need.peak <= free + held,
        f"the run directory's filesystem ({existing}) has {readable(free)} free and the run needs "
        f"{readable(need.peak - held)} more: a checkpoint about {readable(need.checkpoint)}, {need.at_once} on "
        f"disk at once ("
        + (
            f"train.keep_checkpoints={spec.train.keep_checkpoints}, and the one being written)"
            if need.at_once > 1
            else "the last step's alone)"
        )
        + (f", the model about {readable(need.export)}" if need.export else "")
        + "; "
        + ("keep fewer (train.keep_checkpoints=1), " if need.at_once > 2 else "")
        + ("write fewer (train.checkpoint_every=0: the last step's alone), " if need.at_once > 1 else "")
        + "train.save_model=false, or a run directory with room (hydra.run.dir=...)",
    )


def check_sweep_disk(specs: list[RunSpec], sweep_dir: Path) -> None:
    """SpecError when the sweep directory's filesystem cannot hold the sweep's training jobs, which run one after
    another and each leave their kept checkpoints and model: all of that, and the largest job's excess while it
    runs."""
    sweep_dir = sweep_dir.absolute()
    existing = writable_parent(sweep_dir, "sweep", "hydra.sweep.dir")
    needs = [disk_need(spec) for spec in specs]
    total = sum(need.left for need in needs) + max((need.peak - need.left for need in needs), default=0)
    free = shutil.disk_usage(existing).free
    require(
        total <= free,
        f"the sweep directory's filesystem ({existing}) has {readable(free)} free and the sweep's "
        f"{len(needs)} training jobs need {readable(total)}: each keeps its checkpoints (about "
        f"{readable(max(need.checkpoint for need in needs))} each at most) and its model; keep fewer "
        "(train.keep_checkpoints=1), train.save_model=false, or a sweep directory with room "
        "(hydra.sweep.dir=...)",
    )
