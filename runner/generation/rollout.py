"""task=grpo's rollout: the completions the policy samples for a step's prompts, scored by the rewards, and the rows
the step trains on (prompt + completion, the completion's tokens its labels), with each row's advantage and the
rollout's metrics (runner/engine/grpo_loss.py reads them).

Each completion draws from its own generator, seeded by the run's seed, the step and its place among the step's
completions: a resumed run samples the same completions. Which rank samples them does not change the draws, but the
batch a completion is sampled in can change its logits in the last bits (its padding, its rows), and so, rarely, a
draw: task.sampling_batch_size fixes the batches (a prompt's group at a time, say) for the same completions under
any number of processes. The policy samples with its weights of that step, through the strategy's own forward (FSDP2 and
ZeRO-3 gather each layer's weights as they go): every rank runs as many forwards, until every rank's completions
have ended."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Optional

from runner.compat import cache_keyword
from runner.components.rewards import Reward, rewards_of
from runner.data.batches import GlobalBatch, collate
from runner.data.rows import columns, row_inputs
from runner.distributed import all_ranks_maxima, all_ranks_sums, process_group_up
from runner.engine.attention import own_attention
from runner.engine.grpo_loss import group_advantages, token_logps
from runner.errors import RewardFailed
from runner.generation.decoding import Decoding, completion, next_tokens, prompt_batches
from runner.strategies.strategy_protocol import unwrapped

if TYPE_CHECKING:
    import torch
    from torch import nn

    from runner.data.batches import MicroBatch
    from runner.data.prompts import Prompt, PromptBatch
    from runner.engine.job import PreparedJob


@dataclass
class Rollout:
    generations: int  # completions per prompt
    decoding: Decoding  # sampled, up to task.max_completion_length tokens (each batch's stop token ends them)
    sampling_batch: int  # completions sampled together; 0: all of a rank's
    scale: str  # task.scale_rewards
    rewards: list[tuple[str, Reward, float]]  # each reward's name, function and weight
    # The reference's log-probs of a micro batch's rows (task.beta > 0), or None.
    reference: Optional[Callable[[PreparedJob, MicroBatch], torch.Tensor]] = None
    # Whether the rows keep the sampling policy's log-probs (task.num_iterations > 1: later steps train them again).
    keep_old_logps: bool = False
    shown_completions: int = 4  # how many of a logging step's completions completions.jsonl keeps

    def __call__(self, job: PreparedJob, drawn: PromptBatch, step: int) -> GlobalBatch:
        """The global batch of `step`: this rank's prompts' completions, scored, as rows with their advantages."""
        import torch

        decoding = replace(self.decoding, eos_token_id=drawn.stop_token)
        prompts = [prompt for prompt in drawn.prompts for _ in range(self.generations)]
        seeds = [completion_seed(job.spec.seed, step, drawn.first * self.generations + i) for i in range(len(prompts))]
        job.model.eval()  # no dropout in the policy that samples
        size = self.sampling_batch or len(prompts)
        batches = [
            sample(
                unwrapped(job.model),
                [prompt.ids for prompt in prompts[start : start + size]],
                seeds[start : start + size],
                decoding,
                job.device,
                job.autocast,
            )
            for start in range(0, len(prompts), size)
        ]
        job.model.train()
        new_tokens = [tokens for sampled in batches for tokens in sampled.tokens]
        sampled_logps = [
            sampled.logps[row, : len(tokens)] for sampled in batches for row, tokens in enumerate(sampled.tokens)
        ]
        scores, texts = score(self.rewards, prompts, new_tokens, job.tokenizer, decoding.eos_token_id)
        combined = combined_rewards(scores, [weight for _, _, weight in self.rewards])
        batch_std = None
        if self.scale == "batch":  # the std of every rank's rewards
            scored = ~combined.isnan()
            total, squares, count = all_ranks_sums(
                [combined[scored].sum().item(), (combined[scored] ** 2).sum().item(), scored.sum().item()]
            )
            batch_std = torch.tensor(math.sqrt(max(0.0, squares - total**2 / count) / max(1.0, count - 1)))
        advantages, group_std = group_advantages(combined, self.generations, self.scale, batch_std)
        lengths = torch.tensor([float(len(tokens)) for tokens in new_tokens])
        # every row carries the global batch's extremes: their mean over the global batch is the extreme itself
        longest, minus_shortest = all_ranks_maxima([lengths.max().item(), -lengths.min().item()])
        values = {
            "advantages": advantages,
            "reward": combined.nan_to_num(0.0),
            "reward_std": group_std.nan_to_num(0.0),
            "frac_reward_zero_std": (group_std.nan_to_num(0.0) < 1e-6).float(),
            "completions/mean_length": lengths,
            "completions/min_length": torch.full_like(lengths, -minus_shortest),
            "completions/max_length": torch.full_like(lengths, longest),
            "completions/clipped_ratio": torch.tensor(
                [float(not tokens or tokens[-1] != decoding.eos_token_id) for tokens in new_tokens]
            ),
            **{
                f"rewards/{name}/mean": torch.tensor(row).nan_to_num(0.0)
                for (name, _, _), row in zip(self.rewards, scores)
            },
        }
        if job.ranks.rank == 0 and step % job.spec.train.log_every == 0:
            self.keep_sample(job, step, prompts, texts, combined)
        return self.rows(job, prompts, new_tokens, sampled_logps, values)

    def rows(
        self,
        job: PreparedJob,
        prompts: list[Prompt],
        new_tokens: list[list[int]],
        sampled_logps: list[torch.Tensor],
        values: dict[str, torch.Tensor],
    ) -> GlobalBatch:
        """This rank's rows in micro batches of train.micro_batch_size, with their values, the log-probs their
        tokens were sampled with (`sample_logps`, at the positions that predict them; on the device) and the
        reference's (beta > 0); the counts are this rank's, which the step sums over the ranks."""
        import numpy as np
        import torch

        rows = [
            row_inputs(
                np.array(prompt.ids + tokens),
                np.array([0] * len(prompt.ids) + [1] * len(tokens)),
                [0],
                [0],
                len(tokens),
                packed=False,
            )
            for prompt, tokens in zip(prompts, new_tokens)
        ]
        size = job.spec.train.micro_batch_size
        micro_batches = []
        for start in range(0, len(rows), size):
            micro_batch = collate(columns(rows[start : start + size]), job.tokenizer.pad_token_id)
            micro_batch.row_values = {name: value[start : start + size] for name, value in values.items()}
            micro_batch.row_values["sample_logps"] = at_predicting_positions(
                sampled_logps[start : start + size],
                [len(prompt.ids) for prompt in prompts[start : start + size]],
                micro_batch.labels.shape,
                job.device,
            )
            with torch.no_grad(), job.autocast():
                if self.reference is not None:
                    micro_batch.row_values["ref_logps"] = self.reference(job, micro_batch.to(job.device)).cpu()
                if self.keep_old_logps:
                    micro_batch.row_values["old_logps"] = token_logps(
                        job.model, micro_batch.to(job.device), self.decoding.temperature
                    ).cpu()
            micro_batches.append(micro_batch)
        return GlobalBatch(
            micro_batches,
            tokens=sum(row["tokens"] for row in rows),
            label_tokens=sum(row["label_tokens"] for row in rows),
            rank_counts=True,
        )

    def keep_sample(
        self, job: PreparedJob, step: int, prompts: list[Prompt], texts: list[str], rewards: torch.Tensor
    ) -> None:
        """The first completions of the step, with their prompts and rewards, added to completions.jsonl."""
        with open(job.run_dir / "completions.jsonl", "a") as file:
            for prompt, text, reward in list(zip(prompts, texts, rewards.tolist()))[: self.shown_completions]:
                file.write(
                    json.dumps(
                        {
                            "step": step,
                            "prompt": prompt.shown,
                            "completion": text,
                            "reward": None if math.isnan(reward) else reward,
                        }
                    )
                    + "\n"
                )

    def evaluate(self, job: PreparedJob) -> dict[str, float]:
        """The mean reward of the eval prompts' greedy completions, every rank's (`eval_reward`, and each reward's);
        `eval_loss` is minus it, which a sweeper minimises."""
        sums = [0.0] * (len(self.rewards) + 1)
        count = 0
        for drawn in job.eval_batches():
            greedy = Decoding(
                self.decoding.max_new_tokens, eos_token_id=drawn.stop_token, pad_token_id=self.decoding.pad_token_id
            )
            new_tokens = sample(
                unwrapped(job.model),
                [prompt.ids for prompt in drawn.prompts],
                [None] * len(drawn.prompts),
                greedy,
                job.device,
                job.autocast,
            ).tokens
            scores, _ = score(self.rewards, drawn.prompts, new_tokens, job.tokenizer, greedy.eos_token_id)
            combined = combined_rewards(scores, [weight for _, _, weight in self.rewards]).nan_to_num(0.0)
            sums = [
                total + value
                for total, value in zip(
                    sums, [combined.sum().item(), *(sum(0.0 if math.isnan(v) else v for v in row) for row in scores)]
                )
            ]
            count += len(drawn.prompts)
        *totals, count = all_ranks_sums([*sums, count], job.counted)
        reward = totals[0] / count
        return {
            "eval_loss": -reward,
            "eval_reward": reward,
            **{f"eval_rewards/{name}/mean": total / count for (name, _, _), total in zip(self.rewards, totals[1:])},
        }


def at_predicting_positions(
    completion_values: list[torch.Tensor], prompt_lengths: list[int], shape: torch.Size, device: torch.device
) -> torch.Tensor:
    """Each completion token's value laid at the position of its row that predicts it (the prompt's last token for
    the first), 0 elsewhere: a row's tokens' log-probs as the loss's forward lays them."""
    import torch

    laid = torch.zeros(shape, device=device)
    for row, (values, length) in enumerate(zip(completion_values, prompt_lengths)):
        laid[row, length - 1 : length - 1 + len(values)] = values
    return laid


def completion_seed(seed: int, step: int, index: int) -> int:
    """The seed of the step's `index`-th completion."""
    import numpy as np

    return int(np.random.SeedSequence([seed, step, index]).generate_state(1)[0])


@dataclass
class Sampled:
    tokens: list[list[int]]  # each prompt's new tokens
    # The log-probability of each new token under the distribution it was drawn from (the logits over
    # decoding.temperature) [prompts, steps], on the device; a row's entries past its last token are meaningless.
    logps: torch.Tensor


def sample(
    model: nn.Module,
    prompts: list[list[int]],
    seeds: list[Optional[int]],
    decoding: Decoding,
    device: torch.device,
    autocast: Callable[[], ContextManager],
    stopped: Optional[Callable[[int, list[int]], bool]] = None,
) -> Sampled:
    """Each prompt's new tokens, up to and including the stop token (decoding.eos_token_id) or the token after
    which `stopped(row, its new tokens)` says the row has ended, at most decoding.max_new_tokens, and their
    log-probs: one forward per token over the left-padded prompts and a KV cache, each row drawing from its own
    generator (seed None: the argmax). The padding is masked: the model's own attention kernel runs, whatever the
    runner gave it for training. Under several processes every rank runs forwards until every rank's rows have
    ended: sharded weights are gathered in each forward, by every rank."""
    import torch
    import torch.distributed as dist
    from transformers import DynamicCache

    [batch] = prompt_batches(prompts, len(prompts), decoding.pad_token_id)
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    # On the device: the logits stay there, and only the chosen tokens come to the host.
    generators = [None if seed is None else torch.Generator(device).manual_seed(seed) for seed in seeds]
    new_tokens: list[list[int]] = [[] for _ in prompts]
    ended = [False] * len(prompts)
    cache = {cache_keyword(type(model)): DynamicCache(config=model.config)}
    inputs, synced, logps = ids, process_group_up(), []
    with torch.no_grad(), autocast(), own_attention(model):
        for _ in range(decoding.max_new_tokens):
            logits = (
                model(input_ids=inputs, attention_mask=mask, position_ids=positions, use_cache=True, **cache)
                .logits[:, -1]
                .float()
            )
            drawn = torch.stack([_drawn(logits[i], decoding, generator) for i, generator in enumerate(generators)])
            logps.append(torch.log_softmax(logits / decoding.temperature, -1).gather(1, drawn[:, None]).squeeze(1))
            chosen = [decoding.pad_token_id if done else token for done, token in zip(ended, drawn.tolist())]
            for i, token in enumerate(chosen):
                if not ended[i]:
                    new_tokens[i].append(token)
                    ended[i] = token == decoding.eos_token_id or (stopped is not None and stopped(i, new_tokens[i]))
            running = torch.tensor([float(not all(ended))], device=device)
            if synced:
                dist.all_reduce(running)
            if not running.item():
                break
            inputs = torch.tensor(chosen, device=device).unsqueeze(1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
    return Sampled(new_tokens, torch.stack(logps, 1))


def _drawn(logits: torch.Tensor, decoding: Decoding, generator: Optional[torch.Generator]) -> torch.Tensor:
    """A row's next token from its last position's logits: the argmax without a generator, else a draw."""
    if generator is None:
        return logits.argmax()
    return next_tokens(logits.unsqueeze(0), logits.new_zeros((1, 1), dtype=int), decoding, generator)[0]


def score(
    rewards: list[tuple[str, Reward, float]],
    prompts: list[Prompt],
    new_tokens: list[list[int]],
    tokenizer: Any,
    stop_token: Optional[int],
) -> tuple[list[list[float]], list[str]]:
    """Each reward's score of each completion ([rewards][completions], NaN where it gave None), and the completions'
    texts. A reward that fails fails on every rank at once: the ranks agree before any goes on to a collective."""
    texts = [completion(tokens, tokenizer, stop_token, None)[0] for tokens in new_tokens]
    given = [
        [{"role": "assistant", "content": text}] if prompt.conversational else text
        for prompt, text in zip(prompts, texts)
    ]
    names = sorted({key for prompt in prompts for key in prompt.fields})
    fields = {key: [prompt.fields.get(key) for prompt in prompts] for key in names}
    failure = None
    try:
        scores = rewards_of(
            [(name, function) for name, function, _ in rewards], [p.shown for p in prompts], given, new_tokens, fields
        )
    except RewardFailed as error:
        failure, scores = error, []
    if all_ranks_sums([float(failure is not None)])[0]:
        raise failure or RewardFailed("a reward failed on another rank (its log says which)")
    return scores, texts


def combined_rewards(scores: list[list[float]], weights: list[float]) -> torch.Tensor:
    """Each completion's reward: the weighted sum of the rewards that scored it; NaN where none did."""
    import torch

    table = torch.tensor(scores, dtype=torch.float32)  # [rewards, completions]
    combined = (table * torch.tensor(weights).unsqueeze(1)).nansum(0)
    combined[table.isnan().all(0)] = math.nan
    return combined
