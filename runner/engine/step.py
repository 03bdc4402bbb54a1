"""One optimizer step of the training loop (forward and backward over this rank's micro batches, then the
strategy's step), and the evaluation (the loop's, and task=evaluate's)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, ContextManager, Iterable, Optional

from runner.data.batches import MeanLoss
from runner.distributed import all_ranks_sums, summed_on_device
from runner.engine.loss import loss_arguments, loss_line
from runner.engine.router import router_of
from runner.parallel.sequence import split_sequences
from runner.strategies.strategy_protocol import unwrapped

if TYPE_CHECKING:
    import torch
    from torch import nn

    from runner.data.batches import GlobalBatch, MicroBatch
    from runner.engine.job import Objective, PreparedJob
    from runner.parallel.sequence import SequenceSplit, WholeLoss
    from runner.strategies.strategy_protocol import StepOutcome

log = logging.getLogger("runner")
# The objective's metrics that the log lines show (metrics.jsonl and the trackers have them all).
SHOWN_METRICS = (
    "rewards/accuracies",
    "rewards/margins",
    "reward",
    "reward_std",
    "router/aux_loss",
    "router/load_max_over_mean",
)


class NextTokenLoss:
    """The mean next-token cross entropy over every label token of the global batch, whatever way it is split: the
    rows carry their counts, so every rank knows the global batch's without a collective before the forward."""

    def step_batch(self, job: PreparedJob, drawn: GlobalBatch, step: int) -> GlobalBatch:
        return drawn

    def loss(
        self, job: PreparedJob, micro_batch: MicroBatch, batch: GlobalBatch, whole: WholeLoss
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return whole(job.model(**micro_batch.inputs, **loss_arguments(micro_batch)) / batch.label_tokens), {}

    def evaluate(self, job: PreparedJob) -> dict[str, float]:
        if job.pipeline:
            return {"eval_loss": job.pipeline.mean_loss(job.eval_batches(), job.autocast, job.counted).loss}
        return {
            "eval_loss": mean_loss(
                job.model, job.eval_batches(), job.device, job.autocast, job.counted, job.sequence_split
            ).loss
        }

    def line(self, job: PreparedJob) -> str:
        return f"next-token cross entropy, {loss_line(job.spec.train, unwrapped(job.model).config)}"


def objective_of(job: PreparedJob) -> Objective:
    """The job's objective: its task's own, else (None) the next-token loss."""
    return job.objective or NextTokenLoss()


@dataclass
class StepResult:
    loss: torch.Tensor  # this rank's share of the global batch's mean loss, on the device
    tokens: int | torch.Tensor  # the global batch's tokens, padding aside, all ranks' (streamed: on the device)
    outcome: StepOutcome
    metrics: dict[str, torch.Tensor]  # this rank's shares of the objective's metrics, on the device


def train_step(job: PreparedJob, batch: GlobalBatch) -> StepResult:
    import torch

    if batch.rank_counts:  # a streamed rank's: the global batch's are every rank's summed
        tokens, label_tokens = summed_on_device([batch.tokens, batch.label_tokens], job.device, job.counted)
        batch = replace(batch, tokens=tokens, label_tokens=label_tokens, rank_counts=False)
    micro_batches = [micro_batch.to(job.device) for micro_batch in batch.micro_batches]
    if job.pipeline:  # its schedule runs every micro batch through the stages at once
        loss = job.pipeline.train(replace(batch, micro_batches=micro_batches), job.dp_size, job.autocast)
        return StepResult(loss, batch.tokens, job.stepper.step(), {})
    # Data-parallel strategies average gradients over the data-parallel ranks, so each rank's share is scaled by
    # dp_size to make that a sum. Under context parallelism a rank runs slices of its rows, whose losses its group
    # sums (runner/parallel/sequence.py).
    # A MoE model's router terms are each micro batch's, added to the backward's loss as a share of the global
    # batch's mean (the logged loss stays the objective's own).
    step_loss = torch.zeros((), device=job.device)
    metrics: dict[str, torch.Tensor] = {}
    router = router_of(unwrapped(job.model))
    for i, whole_micro_batch in enumerate(micro_batches):
        with (
            job.stepper.micro_batch(last=i == len(micro_batches) - 1),
            split_sequences(job.sequence_split, whole_micro_batch) as (micro_batch, whole_loss),
        ):
            with job.autocast():
                loss, shares = objective_of(job).loss(job, micro_batch, batch, whole_loss)
            routed = 0.0
            if router is not None:
                routed, router_shares = router.taken(1 / (job.dp_size * len(micro_batches)))
                shares = {**shares, **router_shares}
            job.stepper.backward((loss + routed) * job.dp_size)
        step_loss += loss.detach()
        for name, share in shares.items():
            metrics[name] = metrics.get(name, 0) + share
    outcome = job.stepper.step()
    return StepResult(step_loss, batch.tokens, outcome, metrics)


def evaluate(job: PreparedJob, step: int) -> dict[str, float]:
    """The objective's eval loss (and metrics) over the eval rows, summed exactly across ranks; logged at `step`."""
    job.model.eval()
    record = objective_of(job).evaluate(job)
    for tracker in job.trackers:
        tracker.log(record, step)
    shown = "".join(f" | {name} {record[f'eval_{name}']:.4f}" for name in SHOWN_METRICS if f"eval_{name}" in record)
    log.info("step %d/%d | eval loss %.4f%s", step, job.spec.train.max_steps, record["eval_loss"], shown)
    job.model.train()
    return record


def benchmark(job: PreparedJob, step: int, tokens_seen: float) -> dict[str, float]:
    """The benchmarks' scores (job.benchmarks), logged at `step` with the tokens trained so far."""
    job.model.eval()
    started = time.perf_counter()
    scores = job.benchmarks(job)
    job.model.train()
    for tracker in job.trackers:
        tracker.log({**scores, "tokens_seen": tokens_seen}, step)
    shown = " | ".join(f"{name.removeprefix('bench/')} {value:.4f}" for name, value in scores.items())
    log.info(
        "step %d/%d | benchmarks: %s | %.1f s", step, job.spec.train.max_steps, shown, time.perf_counter() - started
    )
    return scores


def mean_loss(
    model: nn.Module,
    batches: Iterable[MicroBatch],
    device: torch.device,
    autocast: Callable[[], ContextManager],
    counted: bool = True,
    sequence_split: Optional[SequenceSplit] = None,
) -> MeanLoss:
    """The model's mean next-token loss over this rank's batches and every other data-parallel rank's, without
    gradients (`counted`: whether this rank's batches count, or its tensor- or context-parallel group's first
    rank's)."""
    import torch

    loss_sum = torch.zeros((), device=device)
    label_tokens = tokens = 0
    with torch.no_grad():
        for batch in batches:
            batch = batch.to(device)
            with split_sequences(sequence_split, batch) as (sliced, whole_loss), autocast():
                # (to `device`: under a device map the head may sit on another device than the inputs)
                loss_sum += whole_loss(model(**sliced.inputs, **loss_arguments(sliced))).to(device)
            label_tokens += batch.label_tokens
            tokens += batch.tokens
    total_loss, total_labels, total_tokens = all_ranks_sums([loss_sum.item(), label_tokens, tokens], counted)
    return MeanLoss(total_loss / total_labels, int(total_labels), int(total_tokens))
