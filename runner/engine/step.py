"""One optimizer step of the training loop (forward and backward over this rank's micro batches, then the
strategy's step), and the evaluation (the loop's, and task=evaluate's)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ContextManager, Iterable

from runner.distributed import all_ranks_sums

if TYPE_CHECKING:
    import torch
    from torch import nn

    from runner.data.batches import GlobalBatch, MicroBatch
    from runner.engine.job import PreparedJob
    from runner.strategies.protocol import StepOutcome

log = logging.getLogger("runner")


@dataclass
class StepResult:
    loss: torch.Tensor  # this rank's share of the global batch's mean loss, on the device
    tokens: int  # the global batch's tokens, padding aside, on all ranks together
    outcome: StepOutcome


def train_step(job: PreparedJob, batch: GlobalBatch) -> StepResult:
    import torch

    # The loss is the mean over every label token of the global batch, whatever way it is split: the rows carry
    # their counts, so every rank knows the global batch's without a collective before the forward. Data-parallel
    # strategies average gradients over ranks, so each rank's share is scaled by dp_size to make that a sum.
    micro_batches = [micro_batch.to(job.device) for micro_batch in batch.micro_batches]
    step_loss = torch.zeros((), device=job.device)
    for i, micro_batch in enumerate(micro_batches):
        with job.stepper.micro_batch(last=i == len(micro_batches) - 1):
            with job.autocast():
                loss = job.model(**micro_batch.inputs, loss_labels=micro_batch.labels) / batch.label_tokens
            job.stepper.backward(loss * job.dp_size)
        step_loss += loss.detach()
    return StepResult(step_loss, batch.tokens, job.stepper.step())


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


def mean_loss(model: nn.Module, batches: Iterable[MicroBatch], device: torch.device,
              autocast: Callable[[], ContextManager]) -> MeanLoss:
    """The model's mean next-token loss over this rank's batches and every other rank's, without gradients."""
    import torch

    loss_sum = torch.zeros((), device=device)
    label_tokens = tokens = 0
    with torch.no_grad():
        for batch in batches:
            batch = batch.to(device)
            with autocast():
                # (to `device`: under a device map the head may sit on another device than the inputs)
                loss_sum += model(**batch.inputs, loss_labels=batch.labels).to(device)
            label_tokens += batch.label_tokens
            tokens += batch.tokens
    total_loss, total_labels, total_tokens = all_ranks_sums([loss_sum.item(), label_tokens, tokens])
    return MeanLoss(total_loss / total_labels, int(total_labels), int(total_tokens))
