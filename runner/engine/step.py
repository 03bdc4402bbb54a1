"""One optimizer step of the training loop (forward and backward over this rank's micro batches, then the
strategy's step), the evaluation (the loop's, and task=evaluate's), and the loss both share."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ContextManager, Iterable

from runner.config.data import IGNORE
from runner.distributed import all_ranks_sums

if TYPE_CHECKING:
    import torch
    from torch import nn

    from runner.config.data import Batch
    from runner.engine.job import PreparedJob
    from runner.strategies.protocol import StepOutcome

log = logging.getLogger("runner")


@dataclass
class StepResult:
    loss: torch.Tensor  # this rank's share of the global batch's mean loss, on the device
    tokens: float  # the global batch's tokens, padding aside, on all ranks together
    outcome: StepOutcome


def train_step(job: PreparedJob, host_batches: list[Batch]) -> StepResult:
    import torch

    # The loss is the mean over every label token of the global batch, whatever way it is split. Data-parallel
    # strategies average gradients over ranks, so each rank's share is scaled by dp_size to make that a sum.
    # Each collective is a point where every rank waits for the slowest: a step has two (this one, and the loop's
    # sum of the loss).
    label_tokens, tokens = all_ranks_sums([sum(count_label_tokens(batch) for batch in host_batches),
                                           sum(int(batch["attention_mask"].sum()) for batch in host_batches)])
    micro_batches = [{k: v.to(job.device) for k, v in batch.items()} for batch in host_batches]
    step_loss = torch.zeros((), device=job.device)
    for i, batch in enumerate(micro_batches):
        with job.stepper.micro_batch(last=i == len(micro_batches) - 1):
            with job.autocast():
                logits = job.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss = causal_lm_loss_sum(logits, batch["labels"]) / label_tokens
            job.stepper.backward(loss * job.dp_size)
        step_loss += loss.detach()
    return StepResult(step_loss, tokens, job.stepper.step())


def evaluate(job: PreparedJob, step: int) -> float:
    """The mean loss over the eval rows, summed exactly across ranks; logged at `step`."""
    job.model.eval()
    eval_loss = mean_loss(job.model, job.eval_batches(), job.device, job.autocast).loss
    for tracker in job.trackers:
        tracker.log({"eval_loss": eval_loss}, step)
    log.info("step %d/%d | eval loss %.4f", step, job.spec.train.max_steps, eval_loss)
    job.model.train()
    return eval_loss


@dataclass
class MeanLoss:
    loss: float  # over every label token of every rank's rows
    label_tokens: int
    tokens: int  # the rows' tokens, padding aside


def mean_loss(model: nn.Module, batches: Iterable[Batch], device: torch.device,
              autocast: Callable[[], ContextManager]) -> MeanLoss:
    """The model's mean next-token loss over this rank's batches and every other rank's, without gradients."""
    import torch

    loss_sum = torch.zeros((), device=device)
    label_tokens = tokens = 0
    with torch.no_grad():
        for batch in batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            with autocast():
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                               use_cache=False).logits
            loss_sum += causal_lm_loss_sum(logits, batch["labels"])
            label_tokens += count_label_tokens(batch)
            tokens += int(batch["attention_mask"].sum())
    total_loss, total_labels, total_tokens = all_ranks_sums([loss_sum.item(), label_tokens, tokens])
    return MeanLoss(total_loss / total_labels, int(total_labels), int(total_tokens))


def count_label_tokens(batch: Batch) -> int:
    """Label positions that are predicted: every label but the first of each row, and not IGNORE."""
    return int((batch["labels"][:, 1:] != IGNORE).sum())


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross entropy, computed in fp32 whatever dtype the forward ran in. The labels are shifted
    (the last position gets IGNORE) rather than the logits, whose slice would be a copy of the largest activation."""
    import torch.nn.functional as F

    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")
