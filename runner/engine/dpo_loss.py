"""task=dpo's objective: a preference loss over pairs of rows (runner/data/preference.py), each micro batch its
chosen rows then its rejected rows, with the metrics TRL's DPOTrainer logs.

A response's log-probability is the sum over its trained tokens, as TRL sums it. The reference model is the policy
with its adapters off (adapter=lora, qlora: no second copy), a frozen copy of the initial model placed as the
strategy places an inference model (FSDP shards it), their log-probs precomputed once, or none (simpo). With c and
r the chosen and rejected responses' log-ratios (policy - reference), n their trained tokens, m = c - r and eps the
label smoothing (the formulas of TRL 1.16's DPOTrainer, and of its CPOTrainer for simpo):

    sigmoid   -(1 - eps) log sigmoid(beta m) - eps log sigmoid(-beta m)   (eps > 0: conservative DPO)
    robust    (-(1 - eps) log sigmoid(beta m) + eps log sigmoid(-beta m)) / (1 - 2 eps)
    ipo       (c / n_c - r / n_r - 1 / (2 beta))^2
    hinge     relu(1 - beta m)
    simpo     the sigmoid loss of beta (mean log-prob margin) - gamma, without a reference

The rewards are beta c and beta r (simpo: beta times the mean log-probs); the loss of a step is the mean over the
global batch's pairs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Protocol

from runner.data.batches import shifted
from runner.data.rows import IGNORE
from runner.distributed import all_ranks_sums
from runner.engine.loss import loss_arguments, loss_line
from runner.parallel.sequence import split_sequences
from runner.strategies.strategy_protocol import unwrapped

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torch import nn

    from runner.data.batches import GlobalBatch, MicroBatch
    from runner.engine.job import PreparedJob
    from runner.parallel.sequence import WholeLoss

log = logging.getLogger("runner")
LOSSES = ("sigmoid", "robust", "ipo", "hinge", "simpo")
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


class Reference(Protocol):
    def logps(self, job: PreparedJob, micro_batch: MicroBatch, whole: WholeLoss) -> torch.Tensor:
        """Each row's summed log-probability of its labels under the reference model, without gradients (`whole`:
        the rows' sums from this rank's slices of them, under a sequence split)."""
        ...

    def line(self) -> str:
        """What it is, for the run's overview."""
        ...


class AdaptersOff:
    """The policy with its adapters switched off: the frozen base, which is the initial model."""

    def logps(self, job: PreparedJob, micro_batch: MicroBatch, whole: WholeLoss) -> torch.Tensor:
        from runner.components.lora import adapters_off

        with adapters_off(unwrapped(job.model)):
            return whole(row_logps(job.model, micro_batch))

    def line(self) -> str:
        return "the policy with its adapters off (no second copy)"


@dataclass
class FrozenCopy:
    """A copy of the initial model, never trained, sharded as the strategy shards the trained one (Strategy.frozen)."""

    model: nn.Module

    def logps(self, job: PreparedJob, micro_batch: MicroBatch, whole: WholeLoss) -> torch.Tensor:
        return whole(row_logps(self.model, micro_batch))

    def line(self) -> str:
        return "a frozen copy of the initial model, sharded as the strategy shards the trained one"


@dataclass
class Precomputed:
    """The reference's log-probability of every row of the token store, computed once and kept beside the rows
    (task.precompute_reference): training holds only the policy."""

    table: np.ndarray

    def logps(self, job: PreparedJob, micro_batch: MicroBatch, whole: WholeLoss) -> torch.Tensor:
        import torch

        return torch.from_numpy(self.table[micro_batch.store_rows]).to(job.device)  # the whole rows' already

    def line(self) -> str:
        return "its log-probs precomputed once for the token store's pairs (task.precompute_reference)"


def precomputed(job: PreparedJob, reference: Reference, path: Path) -> Precomputed:
    """The reference's log-probs of every row of the job's token store, read from `path`, else computed with
    `reference` (every rank a share of the pairs, the same number of batches on each) and written there by rank 0."""
    import numpy as np
    import torch

    from runner.data.batches import collate
    from runner.data.preference import PairSet
    from runner.data.rows import RowSet, RowStore

    if path.exists():
        log.info("reference model: its log-probs of the token store's pairs read from %s", path)
        return Precomputed(np.load(path))
    store = RowStore(job.token_store)
    pairs = PairSet(RowSet(store, 0, len(store.row_lengths)))
    log.info("reference model: computing its log-probs of the %s pairs once, into %s", f"{len(pairs):,}", path)
    size, dp_rank = job.spec.train.micro_batch_size, job.dims.dp_rank(job.ranks.rank)
    share = -(-len(pairs) // job.dp_size)
    table = np.zeros(len(store.row_lengths))
    job.model.eval()
    with torch.no_grad():
        for start in range(dp_rank * share, (dp_rank + 1) * share, size):
            # past the last pair, the last pair again: every rank runs as many forwards (FSDP's all-gathers)
            indices = [min(i, len(pairs) - 1) for i in range(start, min(start + size, (dp_rank + 1) * share))]
            micro_batch = collate(pairs.batch(indices), job.tokenizer.pad_token_id).to(job.device)
            with split_sequences(job.sequence_split, micro_batch) as (sliced, whole), job.autocast():
                logps = reference.logps(job, sliced, whole).double().cpu().numpy()
            table[micro_batch.store_rows] = logps
    job.model.train()
    mine = np.zeros(len(table))
    owned = slice(2 * dp_rank * share, 2 * min((dp_rank + 1) * share, len(pairs)))
    mine[owned] = table[owned]
    table = np.array(all_ranks_sums(mine.tolist(), job.counted), dtype=np.float32)
    if job.ranks.rank == 0:
        partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
        with open(partial, "wb") as file:
            np.save(file, table)
        os.replace(partial, path)
    return Precomputed(table)


@dataclass
class PreferenceLoss:
    beta: float
    kind: str  # one of LOSSES
    label_smoothing: float
    simpo_gamma: float
    reference: Optional[Reference]  # None: simpo's, which has none
    # The reference's log-probs of each eval micro batch, kept from the first evaluation: the eval rows, the frozen
    # reference and the order are the same at every evaluation, so its forward on them would give the same values.
    eval_reference: list[torch.Tensor] = field(default_factory=list, repr=False)

    def step_batch(self, job: PreparedJob, drawn: GlobalBatch, step: int) -> GlobalBatch:
        return drawn

    def loss(
        self, job: PreparedJob, micro_batch: MicroBatch, batch: GlobalBatch, whole: WholeLoss
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The mean over the global batch's pairs: each micro batch adds its pairs' losses over their number."""
        losses, metrics = self.pair_losses(job, micro_batch, whole)
        pairs = job.global_batch_size
        return losses.sum() / pairs, {name: value.sum() / pairs for name, value in metrics.items()}

    def pair_losses(
        self, job: PreparedJob, micro_batch: MicroBatch, whole: WholeLoss, reference: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Each pair's loss, and each pair's metrics (detached). Under a sequence split, the loss of the whole rows'
        log-probs, on every rank of the group. `reference`: the reference's log-probs of these rows, when known."""
        import torch

        logps = whole(row_logps(job.model, micro_batch))
        if reference is None and self.reference is not None:
            with torch.no_grad():
                reference = self.reference.logps(job, micro_batch, whole)
        targets = micro_batch.labels if micro_batch.labels_shifted else shifted(micro_batch.labels)
        tokens = whole((targets != IGNORE).sum(1).to(logps.device))
        return preference_losses(logps, reference, tokens, self.kind, self.beta, self.label_smoothing, self.simpo_gamma)

    def line(self, job: PreparedJob) -> str:
        smoothing = f", label smoothing {self.label_smoothing:g}" if self.label_smoothing else ""
        gamma = f", gamma {self.simpo_gamma:g}" if self.kind == "simpo" else ""
        reference = self.reference.line() if self.reference is not None else "none"
        return (
            f"{self.kind} preference loss, beta {self.beta:g}{smoothing}{gamma}; reference model: {reference}; "
            f"log-probs {loss_line(job.spec.train, unwrapped(job.model).config)}"
        )

    def evaluate(self, job: PreparedJob) -> dict[str, float]:
        """The mean loss and metrics over every rank's eval pairs, as `eval_loss` and `eval_<metric>`."""
        import torch

        sums = torch.zeros(len(METRICS) + 1, dtype=torch.float64, device=job.device)
        pairs = 0
        with torch.no_grad():
            for index, micro_batch in enumerate(job.eval_batches()):
                with split_sequences(job.sequence_split, micro_batch.to(job.device)) as (sliced, whole), job.autocast():
                    if self.reference is not None and index == len(self.eval_reference):
                        self.eval_reference.append(self.reference.logps(job, sliced, whole))
                    reference = self.eval_reference[index] if self.reference is not None else None
                    losses, metrics = self.pair_losses(job, sliced, whole, reference)
                sums += torch.stack([losses.sum(), *(metrics[name].sum() for name in METRICS)]).double()
                pairs += len(losses)
        total, *metric_sums, counted = all_ranks_sums([*sums.tolist(), pairs], job.counted)
        return {
            "eval_loss": total / counted,
            **{f"eval_{name}": value / counted for name, value in zip(METRICS, metric_sums)},
        }


def row_logps(model: nn.Module, micro_batch: MicroBatch) -> torch.Tensor:
    """Each row's summed log-probability of its labels (of its slice's, under a sequence split)."""
    return -model(**micro_batch.inputs, **loss_arguments(micro_batch), per_row=True)


def preference_losses(
    logps: torch.Tensor,
    reference: Optional[torch.Tensor],
    tokens: torch.Tensor,
    kind: str,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each pair's loss from its rows' summed log-probabilities (the chosen rows, then the rejected rows), the
    reference's (None: simpo, which has none) and the rows' trained tokens; each pair's metrics, detached."""
    import torch.nn.functional as F

    ls = label_smoothing
    chosen, rejected = logps.chunk(2)
    chosen_tokens, rejected_tokens = tokens.chunk(2)
    if reference is None:
        chosen_ratio, rejected_ratio = chosen, rejected
    else:
        ref_chosen, ref_rejected = reference.chunk(2)
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    margin = chosen_ratio - rejected_ratio
    if kind == "sigmoid":
        losses = -(1 - ls) * F.logsigmoid(beta * margin) - ls * F.logsigmoid(-beta * margin)
    elif kind == "robust":
        losses = (-(1 - ls) * F.logsigmoid(beta * margin) + ls * F.logsigmoid(-beta * margin)) / (1 - 2 * ls)
    elif kind == "ipo":
        losses = (chosen_ratio / chosen_tokens - rejected_ratio / rejected_tokens - 1 / (2 * beta)) ** 2
    elif kind == "hinge":
        losses = F.relu(1 - beta * margin)
    elif kind == "simpo":
        chosen_ratio, rejected_ratio = chosen / chosen_tokens, rejected / rejected_tokens
        shifted = beta * (chosen_ratio - rejected_ratio) - simpo_gamma
        losses = -(1 - ls) * F.logsigmoid(shifted) - ls * F.logsigmoid(-shifted)
    else:
        raise ValueError(f"unknown preference loss {kind}; the losses are {', '.join(LOSSES)}")
    chosen_rewards, rejected_rewards = (beta * chosen_ratio).detach(), (beta * rejected_ratio).detach()
    return losses, {
        "rewards/chosen": chosen_rewards,
        "rewards/rejected": rejected_rewards,
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
        "rewards/margins": chosen_rewards - rejected_rewards,
        "logps/chosen": chosen.detach(),
        "logps/rejected": rejected.detach(),
    }
