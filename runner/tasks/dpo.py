"""task=dpo: preference tuning on pairs of responses (data.format=preference), with the losses of TRL's DPOTrainer
and its kin (runner/engine/dpo_loss.py). Before launch, what task=train checks, and the task's own keys."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Optional

from runner.config.data import DataFormat
from runner.config.fields import setting
from runner.config.task import PostTrainingTaskConfig
from runner.errors import require
from runner.planning.time_plan import TimePlan, plan
from runner.tasks.train import estimated_or_checked, run_training, training_inputs

if TYPE_CHECKING:
    from runner.config.spec import RunSpec
    from runner.config.tracker import RunIdentity
    from runner.distributed import Ranks
    from runner.engine.dpo_loss import PreferenceLoss, Reference
    from runner.engine.job import LoadedData, PreparedJob
    from runner.memory.breakdown import Estimate
    from runner.memory.model_shapes import ModelFacts


class PreferenceLossKind(str, Enum):
    sigmoid = "sigmoid"  # DPO; with task.label_smoothing, conservative DPO
    robust = "robust"  # robust DPO, for pairs whose labels may be flipped (task.label_smoothing: how often)
    ipo = "ipo"
    hinge = "hinge"  # SLiC
    simpo = "simpo"  # SimPO: no reference model


SMOOTHED = (PreferenceLossKind.sigmoid, PreferenceLossKind.robust, PreferenceLossKind.simpo)


@dataclass
class DPOTask(PostTrainingTaskConfig):
    beta: float = setting(
        0.1,
        "The strength of the implicit KL to the reference (DPO's beta): higher keeps the policy closer.",
    )
    loss: PreferenceLossKind = setting(
        PreferenceLossKind.sigmoid,
        "The preference loss: sigmoid (DPO), robust (cDPO's label noise), ipo, hinge (SLiC) or simpo (reference-free, "
        "length-normalised).",
    )
    label_smoothing: float = setting(0.0, "The share of pairs taken as mislabelled (sigmoid, robust, simpo).")
    simpo_gamma: float = setting(0.5, "SimPO's target reward margin.")
    precompute_reference: bool = setting(
        False,
        "Compute the reference's log-probs of every pair once, before training, and keep them beside the token store's "
        "rows for later runs: training then holds only the policy.",
    )

    eval_metrics: ClassVar[dict[str, bool]] = {
        "eval_loss": False,
        "eval_rewards/accuracies": True,
        "eval_rewards/margins": True,
    }
    step_kind: ClassVar[str] = "dpo"

    @property
    def has_reference(self) -> bool:
        return self.loss is not PreferenceLossKind.simpo

    @property
    def forward_passes(self) -> float:
        """The reference's log-probs of each pair (precomputed ones too: once, before training)."""
        return 1.0 if self.has_reference else 0.0

    def before_launch(self, spec: RunSpec) -> Optional[str]:
        require(
            spec.data.format is DataFormat.preference,
            f"task=dpo trains on preference pairs, and data.format={spec.data.format.value} has none; set "
            "data.format=preference (records with a prompt, a chosen and a rejected response)",
        )
        dims = spec.layout
        require(
            dims.pp == 1,
            f"task=dpo with {dims.pp} pipeline stages (strategy.pp_size): the preference loss of a "
            "pair's two rows is not computed through a pipeline yet; use strategy.pp_size=1",
        )
        require(self.beta > 0, f"task.beta={self.beta} must be > 0")
        require(0 <= self.label_smoothing < 0.5, f"task.label_smoothing={self.label_smoothing} must be in [0, 0.5)")
        require(
            self.loss in SMOOTHED or not self.label_smoothing,
            f"task.label_smoothing is for the losses {', '.join(kind.value for kind in SMOOTHED)}, not "
            f"task.loss={self.loss.value}",
        )
        return estimated_or_checked(spec, self)

    def planned(self, spec: RunSpec) -> Optional[TimePlan]:
        return plan(spec) if self.estimate_only else None

    def inputs(self, spec: RunSpec) -> LoadedData:
        return training_inputs(spec)

    def run(
        self, spec: RunSpec, run_dir: Path, ranks: Ranks, identity: RunIdentity, inputs: Optional[LoadedData] = None
    ) -> dict[str, Any]:
        return run_training(spec, run_dir, ranks, identity, inputs, self.objective)

    def memory_terms(self, spec: RunSpec, facts: ModelFacts, estimate: Estimate) -> Estimate:
        """Two rows a pair: twice the activations of a micro batch of rows. The reference: a frozen copy of the
        weights in their dtype (sharded as the strategy shards what it trains: FSDP, ZeRO-3), or none (the adapters
        switched off, simpo, or precomputed log-probs)."""
        from runner.memory.breakdown import Part, reference_model

        if not self.has_reference:
            reference = Part(0, "none (task.loss=simpo)")
        elif self.precompute_reference:
            reference = Part(0, "its log-probs precomputed (task.precompute_reference): none while training")
        else:
            reference = reference_model(spec, facts.parameters, facts.buffer_bytes)
        doubled = replace(
            estimate.activations,
            bytes=2 * estimate.activations.bytes,
            note=f"{estimate.activations.note}; x 2: each pair is two rows, chosen and rejected",
        )
        return replace(estimate, activations=doubled, reference=reference)

    def objective(self, job: PreparedJob) -> PreferenceLoss:
        """The loss, and its reference: the policy with its adapters off, else a frozen copy of the initial model;
        with precompute_reference, their log-probs of every pair, computed once (the copy then freed)."""
        from runner.engine.dpo_loss import AdaptersOff, FrozenCopy, PreferenceLoss, precomputed
        from runner.engine.placement import placed_model

        spec = job.spec
        reference: Optional[Reference] = None
        if self.has_reference:
            cached = job.token_store / f"reference-{reference_key(spec)}.npy"
            if spec.adapter.active:
                reference = AdaptersOff()
            elif not (self.precompute_reference and cached.exists()):
                model = placed_model(spec, job.ranks, job.device, job.tokenizer, training=False, frozen=True).model
                model.eval()  # (DeepSpeed's engine returns None)
                reference = FrozenCopy(model)
            if self.precompute_reference:
                reference = precomputed(job, reference, cached)
        return PreferenceLoss(self.beta, self.loss.value, self.label_smoothing, self.simpo_gamma, reference)


def reference_key(spec: RunSpec) -> str:
    """What decides the reference's log-probs of the store's rows: the initial model (its weights' files, or its
    architecture and seed), the adapter's base (QLoRA's NF4), the forward's precision and loss."""
    from runner.config.spec import to_plain
    from runner.data.store import digest

    model = to_plain(spec)["model"]
    if spec.model.pretrained and Path(spec.model.pretrained).is_dir():
        model["files"] = sorted(
            (path.name, path.stat().st_size, path.stat().st_mtime_ns)
            for path in Path(spec.model.pretrained).iterdir()
            if path.is_file()
        )
    return digest(
        {
            "model": model,
            "seed": None if spec.model.pretrained else spec.seed,
            "adapter": spec.adapter.kind.value,
            "precision": to_plain(spec)["precision"],
            "loss": [spec.train.loss.value, spec.train.loss_chunk_tokens],
        }
    )
