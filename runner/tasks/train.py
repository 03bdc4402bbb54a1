"""task=train (the default): before launch, check what the spec alone cannot say (the checkpoint to resume, the
model's layers, the fit in the hardware's memory, the trackers' services), then train."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Optional

from runner.config.adapter import targets
from runner.config.task import TaskConfig
from runner.config.tracker import check_services
from runner.engine.checkpoint import check_resumable
from runner.memory.advice import check_fit
from runner.memory.facts import check_causal_lm, fp8_linears, meta_model

if TYPE_CHECKING:
    from runner.config.spec import RunSpec
    from runner.config.tracker import RunIdentity
    from runner.distributed import Ranks
    from runner.engine.job import LoadedData


@dataclass
class TrainTask(TaskConfig):
    # Before launch, refuse a run whose estimated peak memory exceeds the hardware's (false: launch anyway).
    fit_check: bool = True

    runs_on_this_machine: ClassVar[bool] = True

    def before_launch(self, spec: RunSpec) -> Optional[str]:
        if spec.resume:
            check_resumable(spec)
        check_causal_lm(spec.model)
        if spec.adapter.active:  # the layers to adapt are the model's
            targets(spec.adapter, meta_model(spec.model))
        if spec.precision.fp8:  # an fp8 run without an fp8 layer is an error, not a bf16 run
            fp8_linears(meta_model(spec.model), spec.precision)
        if self.fit_check:
            check_fit(spec)
        check_services(spec.tracker)
        return None

    def inputs(self, spec: RunSpec) -> LoadedData:
        from runner.engine.job import load_data  # the engine, and torch with it, once a job runs

        return load_data(spec)

    def run(self, spec: RunSpec, run_dir: Path, ranks: Ranks, identity: RunIdentity,
            inputs: Optional[LoadedData] = None) -> dict[str, Any]:
        from runner.engine.job import prepare_job
        from runner.engine.loop import train

        summary = train(prepare_job(spec, run_dir, ranks, identity, inputs))
        return {**summary, "objective": summary["eval_loss"]}
