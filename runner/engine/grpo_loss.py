"""task=grpo's objective: a clipped policy-gradient loss over completions the policy sampled, each weighted by its
group-relative advantage (runner/generation/rollout.py samples and scores them), with the metrics TRL's
GRPOTrainer logs.

With r the rewards of a prompt's G completions, the advantage of each is (r - mean(r)) / (std(r) + 1e-4), its
std that of its group (task.scale_rewards=group), of the whole global batch (batch), or none (then r - mean(r)).
With w a completion token's log-ratio (policy - the policy that sampled it; task.importance_sampling_level=sequence:
its completion's mean; every log-prob of the logits over task.temperature, as TRL's), A its advantage and eps, eps_high
the clip range (the formulas of TRL 1.16's GRPOTrainer):

    token loss   -min(exp(w) A, clip(exp(w), 1 - eps, 1 + eps_high) A) + beta exp(w) (exp(q) - q - 1)

where q = ref - policy is the token's log-ratio to the reference (task.beta > 0), its KL estimate weighted by the
importance ratio as TRL weights it by default (use_bias_correction_kl). A step's loss (task.loss):

    grpo         the mean over completions of each completion's mean token loss
    dapo         the sum of the token losses over the global batch's completion tokens
    dr_grpo      the sum of the token losses over completions x task.max_completion_length

Every normalisation is the global batch's, so that the loss of a step is the same however it is split over ranks
and micro batches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional, Protocol

from runner.data.batches import shifted
from runner.data.rows import IGNORE
from runner.engine.loss import loss_arguments, loss_line
from runner.strategies.strategy_protocol import unwrapped

if TYPE_CHECKING:
    import torch
    from torch import nn

    from runner.data.batches import GlobalBatch, MicroBatch
    from runner.data.prompts import PromptBatch
    from runner.engine.job import PreparedJob
    from runner.parallel.sequence import WholeLoss

LOSSES = ("grpo", "dapo", "dr_grpo")
SCALES = ("group", "batch", "none")
LEVELS = ("token", "sequence")


def group_advantages(
    rewards: torch.Tensor, generations: int, scale: str, batch_std: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion's advantage from the rewards of its group (consecutive runs of `generations`), and each
    group's std (unbiased, as TRL's), repeated for its completions. A completion no reward scored (NaN) is left
    out of its group's figures and gets no advantage. `batch_std`: the whole global batch's, which scale=batch
    divides by (its completions span every rank)."""
    grouped = rewards.view(-1, generations)
    mean = grouped.nanmean(1, keepdim=True)
    scored = (~grouped.isnan()).sum(1, keepdim=True)
    variance = ((grouped - mean) ** 2).nansum(1, keepdim=True) / (scored - 1).clamp(min=1)
    mean, group_std = mean.expand_as(grouped).flatten(), variance.sqrt().expand_as(grouped).flatten()
    advantages = rewards - mean
    if scale == "group":
        advantages = advantages / (group_std + 1e-4)
    elif scale == "batch":
        advantages = advantages / (batch_std + 1e-4)
    return advantages.nan_to_num(0.0), group_std


@dataclass(frozen=True)
class PolicyLoss:
    """The settings of the clipped objective (task=grpo's keys)."""

    kind: str = "dapo"  # one of LOSSES
    level: str = "token"  # one of LEVELS
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    max_completion_length: int = 256
    temperature: float = 1.0  # the sampling temperature, which the log-probs' logits are divided by

    def token_losses(
        self,
        logps: torch.Tensor,
        old_logps: Optional[torch.Tensor],
        ref_logps: Optional[torch.Tensor],
        advantages: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Each token's loss [rows, positions] (0 off the completions) from the policy's log-probs of the sampled
        tokens, the sampling policy's (None: the policy's own, detached: one optimizer step per rollout), the
        reference's (beta > 0) and each row's advantage; per-token metrics (detached, 0 off the completions)."""
        import torch

        mask = mask.to(logps.dtype)
        old_logps = logps.detach() if old_logps is None else old_logps
        log_ratio = (logps - old_logps) * mask
        if self.level == "sequence":
            log_ratio = (log_ratio.sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        ratio = torch.exp(log_ratio)
        clipped = torch.clamp(ratio, 1 - self.epsilon, 1 + self.epsilon_high)
        advantage = advantages.unsqueeze(1)
        losses = -torch.min(ratio * advantage, clipped * advantage)
        metrics = {
            "clip_ratio/low_mean": ((ratio < 1 - self.epsilon) & (advantage < 0)).to(logps.dtype).detach(),
            "clip_ratio/high_mean": ((ratio > 1 + self.epsilon_high) & (advantage > 0)).to(logps.dtype).detach(),
        }
        metrics["clip_ratio/region_mean"] = metrics["clip_ratio/low_mean"] + metrics["clip_ratio/high_mean"]
        if self.beta:
            q = ref_logps - logps
            kl = torch.exp(q) - q - 1
            losses = losses + self.beta * kl * ratio  # the sampled tokens' KL, weighted back to the policy's
            metrics["kl"] = kl.detach()
        return losses * mask, {name: value.expand_as(mask) * mask for name, value in metrics.items()}

    def normalised(self, token_losses: torch.Tensor, mask: torch.Tensor, rows: int, tokens: int) -> torch.Tensor:
        """This micro batch's share of the global batch's loss, of `rows` completions and `tokens` completion
        tokens in all."""
        if self.kind == "grpo":
            return (token_losses.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / rows
        if self.kind == "dr_grpo":
            return token_losses.sum() / (rows * self.max_completion_length)
        return token_losses.sum() / tokens


def token_logps(model: nn.Module, micro_batch: MicroBatch, temperature: float = 1.0) -> torch.Tensor:
    """Each position's log-probability of its target [rows, positions] (0 where it has none), under the logits over
    `temperature` (the sampling temperature: TRL's GRPOTrainer's log-probs)."""
    return -model(**micro_batch.inputs, **loss_arguments(micro_batch), per_token=True, temperature=temperature)


def completion_mask(micro_batch: MicroBatch) -> torch.Tensor:
    """Where a position's target is a completion token (the prompt's labels are IGNORE)."""
    return shifted(micro_batch.labels) != IGNORE


class Sampler(Protocol):
    """runner/generation/rollout.py's Rollout, which this layer cannot name."""

    def __call__(self, job: PreparedJob, drawn: PromptBatch, step: int) -> GlobalBatch:
        """The rows of `step`: completions sampled for the drawn prompts, scored, with their advantages."""
        ...

    def evaluate(self, job: PreparedJob) -> dict[str, float]:
        """The eval prompts' mean reward (and `eval_loss`, minus it)."""
        ...


@dataclass
class GroupPolicyLoss:
    """task=grpo's Objective. Its micro batches are the rows its rollout made: each a prompt and one completion,
    with the row values `advantages`, the rollout's metrics, the log-probs the sampler drew each completion token
    with (`sample_logps`), and where they are needed the sampling policy's and the reference's log-probs of every
    position (`old_logps`, `ref_logps`)."""

    settings: PolicyLoss
    rollout: Optional[Sampler] = None
    iterations: int = 1  # the steps that train on one rollout's rows (task.num_iterations)
    rows: Optional[GlobalBatch] = None  # the last rollout's, while later steps train on them again
    sampling_s: float = 0.0  # this step's rollout's seconds on this rank (0: it trains a rollout's rows again)

    def step_batch(self, job: PreparedJob, drawn: PromptBatch, step: int) -> GlobalBatch:
        """A rollout's rows, sampled at the first of its task.num_iterations steps; the later ones train on them
        again (a run resumed between them, on the rows its checkpoint kept)."""
        started, rows = time.perf_counter(), self.rows
        if (step - 1) % self.iterations == 0:
            self.rows = self.rollout(job, drawn, step)
        elif self.rows is None:
            self.rows = job.rows_trained_again or self.rollout(job, drawn, step)
        self.sampling_s = time.perf_counter() - started if self.rows is not rows else 0.0
        return replace(self.rows, trained_again=step % self.iterations != 0)

    def loss(
        self, job: PreparedJob, micro_batch: MicroBatch, batch: GlobalBatch, whole: WholeLoss
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        values = micro_batch.row_values
        mask = completion_mask(micro_batch)
        logps = token_logps(job.model, micro_batch, self.settings.temperature)
        losses, token_metrics = self.settings.token_losses(
            logps, values.get("old_logps"), values.get("ref_logps"), values["advantages"], mask
        )
        rows, tokens = job.global_batch_size, batch.label_tokens
        metrics = {name: value.sum() / tokens for name, value in token_metrics.items()}
        if "sample_logps" in values:  # the sampler's log-probs against the trained policy's at sampling (TRL's name)
            difference = (values.get("old_logps", logps.detach()) - values["sample_logps"]).abs() * mask
            metrics["sampling/sampling_logp_difference/mean"] = difference.sum() / tokens
        for name, value in values.items():  # the rollout's metrics of each row: their means over the global batch
            if value.dim() == 1 and name != "advantages":
                metrics[name] = value.sum() / rows
        # the ranks' mean seconds of sampling and scoring, a share from each micro batch
        metrics["time/sampling_s"] = logps.new_tensor(self.sampling_s / (job.dp_size * len(batch.micro_batches)))
        return self.settings.normalised(losses, mask, rows, tokens), metrics

    def evaluate(self, job: PreparedJob) -> dict[str, float]:
        return self.rollout.evaluate(job)

    def line(self, job: PreparedJob) -> str:
        settings = self.settings
        kl = f", KL to the reference x {settings.beta:g}" if settings.beta else ""
        clip = f"[{1 - settings.epsilon:g}, {1 + settings.epsilon_high:g}]"
        return (
            f"{settings.kind} policy loss ({settings.level}-level ratios clipped to {clip}{kl}); log-probs "
            f"{loss_line(job.spec.train, unwrapped(job.model).config)}"
        )
