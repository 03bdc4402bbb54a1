"""What `run` asks of a task. Each option of the `task` group is one file here (train, estimate, evaluate,
generate) whose schema, the dataclass conf/task/<name>.yaml fills, implements `Task`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol

if TYPE_CHECKING:
    from runner.config.spec import RunSpec
    from runner.config.tracker import RunIdentity
    from runner.distributed import Ranks


class Task(Protocol):
    # Whether the job runs on this machine's hardware; a task that plans (the estimate, or an inference task's
    # estimate_only) checks the spec against the hardware it declares instead.
    runs_on_this_machine: bool
    # Whether the job writes checkpoints and a trained model, whose room `run` checks before launch.
    trains: bool

    def before_launch(self, spec: RunSpec) -> Optional[str]:
        """Runs in the `run` process once the spec is valid, before anything is written or started: raises
        SpecError for a job that cannot run. A task that answers without launching returns its answer, which `run`
        prints; None launches the job (a task that always answers has no `inputs` or `run`)."""
        ...

    def inputs(self, spec: RunSpec) -> Any:
        """What the job reads (the tokenized data, the prompts), read in the `run` process before any worker starts
        so that unreadable input stops the job at once (SpecError); a job of one process gets it back in `run`."""
        ...

    def run(
        self, spec: RunSpec, run_dir: Path, ranks: Ranks, identity: RunIdentity, inputs: Any = None
    ) -> dict[str, Any]:
        """The job, on each of its ranks (in a process group when there are several); its summary, whose
        `objective` (a loss, or None) a sweeper reads. `inputs`: what `inputs` returned in this process, if it ran
        here."""
        ...
