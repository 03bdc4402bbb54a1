"""task=estimate: print the run's memory per device (runner/memory/) and exit, starting no process and writing
nothing. The hardware is the one the spec declares, which need not be this machine's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Optional

from runner.components.lora import targets
from runner.config.fields import setting
from runner.config.task import TaskConfig
from runner.memory.model_shapes import meta_model
from runner.memory.report import report

if TYPE_CHECKING:
    from runner.config.spec import RunSpec
    from runner.planning.time_plan import TimePlan


@dataclass
class EstimateTask(TaskConfig):
    accelerate_view: bool = setting(
        True,
        "Also print accelerate's `estimate-memory` table for the model (Adam, batch size 1, no activations).",
    )

    runs_on_this_machine: ClassVar[bool] = False

    def before_launch(self, spec: RunSpec) -> Optional[str]:
        if spec.adapter.active:
            targets(spec.adapter, meta_model(spec.model))
        return f"{report(spec, accelerate_view=self.accelerate_view)}\n\n{self.planned(spec).line()}"

    def planned(self, spec: RunSpec) -> TimePlan:
        from runner.planning.time_plan import plan

        return plan(spec)
