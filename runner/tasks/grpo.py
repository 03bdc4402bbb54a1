"""task=grpo: online reinforcement learning with group-relative advantages (GRPO and its kin, as TRL's
GRPOTrainer computes them: runner/engine/grpo_loss.py) on prompt data (data.format=prompt). Each step, the policy
samples task.num_generations completions of each of its prompts (runner/generation/rollout.py), the rewards
declared in task.rewards score them, and one optimizer step follows the clipped objective. Before launch, what
task=train checks, the task's own keys, and the prompts against the rewards and the lengths."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Optional

from runner.components.rewards import RewardSpec, load_reward
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
    from runner.engine.grpo_loss import GroupPolicyLoss
    from runner.engine.job import LoadedData, PreparedJob
    from runner.memory.breakdown import Estimate
    from runner.memory.model_shapes import ModelFacts


class PolicyLossKind(str, Enum):
    grpo = "grpo"  # each completion's mean token loss, averaged over completions
    dapo = "dapo"  # the mean over every completion token of the global batch (TRL's default)
    dr_grpo = "dr_grpo"  # the token losses' sum over completions x max_completion_length


class RewardScale(str, Enum):
    group = "group"
    batch = "batch"
    none = "none"


class ImportanceSampling(str, Enum):
    token = "token"
    sequence = "sequence"  # GSPO: each completion's mean log-ratio


# What a reward function receives besides the records' fields (TRL's signature).
GIVEN = {"prompts", "completions", "completion_ids"}


@dataclass
class GRPOTask(PostTrainingTaskConfig):
    num_generations: int = setting(
        4,
        "Completions sampled for each prompt: a group, whose rewards' mean and std make each one's advantage.",
    )
    max_completion_length: int = setting(64, "Tokens sampled for each completion at most.")
    sampling_batch_size: int = setting(
        0,
        "Completions sampled together, a multiple of num_generations (0: each rank's whole share of a step). Fewer "
        "hold a smaller KV cache; a fixed number samples the same completions under any number of processes.",
    )
    temperature: float = setting(
        1.0,
        "The sampling temperature; the loss divides the logits by it too, as the sampler did.",
    )
    top_p: float = setting(1.0, "Nucleus sampling's share of the probability mass kept (1: all).")
    rewards: list[RewardSpec] = setting(
        [RewardSpec()],
        "The reward functions a completion is scored by, each with its weight; their weighted sum is its reward.",
    )
    scale_rewards: RewardScale = setting(
        RewardScale.group,
        "The advantage is the reward minus its group's mean, divided by the group's std (group), the batch's std "
        "(batch), or not divided (none: Dr. GRPO).",
    )
    loss: PolicyLossKind = setting(
        PolicyLossKind.dapo,
        "How token losses are averaged: grpo (per completion, then over completions), dapo (over the batch's tokens) "
        "or dr_grpo (over completions x max_completion_length).",
    )
    importance_sampling_level: ImportanceSampling = setting(
        ImportanceSampling.token,
        "The policy ratio per token (GRPO), or one per completion, the geometric mean of its tokens' (GSPO).",
    )
    epsilon: float = setting(0.2, "The clip range of the ratio is [1 - epsilon, 1 + epsilon_high].")
    epsilon_high: Optional[float] = setting(
        None,
        "The ratio's upper clip bound above 1; unset: epsilon (DAPO's clip-higher: 0.28).",
    )
    num_iterations: int = setting(
        1,
        "Optimizer steps on each rollout's completions: the later ones weight each token by its ratio to the policy "
        "that sampled it, clipped (TRL's num_iterations, GRPO's mu).",
    )
    beta: float = setting(
        0.0,
        "The weight of the KL to the reference (the initial model; adapters off under LoRA). 0: no reference held.",
    )

    eval_metrics: ClassVar[dict[str, bool]] = {"eval_loss": False, "eval_reward": True}
    step_kind: ClassVar[str] = "grpo"

    @property
    def rows_per_prompt(self) -> int:
        return self.num_generations

    @property
    def steps_per_draw(self) -> int:
        return self.num_iterations

    @property
    def forward_passes(self) -> float:
        """Each draw samples its rows (prompt and completion, each token once through the KV cache, at most the full
        length), and takes the sampling policy's log-probs (num_iterations > 1) and the reference's (beta > 0); its
        num_iterations steps share them."""
        return (1 + (self.num_iterations > 1) + (self.beta > 0)) / self.num_iterations

    def with_absolute_paths(self, base: Path) -> GRPOTask:
        """A reward in a file (`path/to/file.py:function`) named from `base`."""

        def absolute(reward: RewardSpec) -> RewardSpec:
            where, _, name = reward.function.rpartition(":")
            if not where.endswith(".py"):
                return reward
            return replace(reward, function=f"{Path(base, where).expanduser().absolute()}:{name}")

        return replace(self, rewards=[absolute(reward) for reward in self.rewards])

    def before_launch(self, spec: RunSpec) -> Optional[str]:
        require(
            spec.data.format is DataFormat.prompt,
            f"task=grpo samples completions of prompts, and data.format={spec.data.format.value} has none; set "
            "data.format=prompt (records with a prompt, a text or a conversation, and the fields the rewards read)",
        )
        require(
            self.num_generations >= 2,
            f"task.num_generations={self.num_generations} must be at least 2: a "
            "completion's advantage is measured against its group's",
        )
        train, dims = spec.train, spec.layout
        per_rank = train.micro_batch_size * train.grad_accum_steps
        require(
            per_rank % self.num_generations == 0,
            f"each rank's {per_rank} completions a step (train.micro_batch_size {train.micro_batch_size} x "
            f"train.grad_accum_steps {train.grad_accum_steps}) do not divide into groups of "
            f"task.num_generations={self.num_generations}; make them a multiple of it",
        )
        require(
            self.sampling_batch_size >= 0
            and self.sampling_batch_size % self.num_generations == 0
            and per_rank % max(1, self.sampling_batch_size) == 0,
            f"task.sampling_batch_size={self.sampling_batch_size} must be 0 or a multiple of task.num_generations="
            f"{self.num_generations} that divides each rank's {per_rank} completions a step",
        )
        require(
            dims.pp == 1 and dims.tp == 1 and dims.cp == 1,
            "task=grpo samples with the whole policy on each rank or sharded by FSDP or ZeRO: set "
            "strategy.pp_size, strategy.tp_size and strategy.cp_size to 1",
        )
        require(
            self.max_completion_length >= 1,
            f"task.max_completion_length={self.max_completion_length} must be at least 1",
        )
        require(self.temperature > 0, f"task.temperature={self.temperature} must be > 0")
        require(0 < self.top_p <= 1, f"task.top_p={self.top_p} must be in (0, 1]")
        require(
            self.epsilon >= 0 and (self.epsilon_high is None or self.epsilon_high >= 0),
            "task.epsilon and task.epsilon_high must be >= 0",
        )
        require(self.beta >= 0, f"task.beta={self.beta} must be >= 0")
        require(self.num_iterations >= 1, f"task.num_iterations={self.num_iterations} must be at least 1")
        require(bool(self.rewards), "task.rewards is empty: name at least one reward (module:function)")
        for reward in self.rewards:
            load_reward(reward)
        names = [reward_name(reward) for reward in self.rewards]
        twice = sorted({name for name in names if names.count(name) > 1})
        require(not twice, f"task.rewards: two rewards are called {', '.join(twice)}; give each its own `name`")
        return estimated_or_checked(spec, self)

    def planned(self, spec: RunSpec) -> Optional[TimePlan]:
        return plan(spec) if self.estimate_only else None

    def inputs(self, spec: RunSpec) -> LoadedData:
        """The prompts, checked: enough of them for a step and for every rank's evaluation, each with the fields the
        rewards read, each short enough to leave room for a whole completion in data.seq_len."""
        loaded = training_inputs(spec)
        _, train_set, eval_set = loaded
        train, dims = spec.train, spec.layout
        per_step = train.micro_batch_size * dims.dp_size * train.grad_accum_steps // self.num_generations
        require(
            len(train_set) >= per_step,
            f"the training split has {len(train_set)} prompts, fewer than the {per_step} of one step (the "
            f"global batch's completions over task.num_generations={self.num_generations}); add prompts or "
            "lower train.micro_batch_size or train.grad_accum_steps",
        )
        require(
            len(eval_set) >= dims.dp_size,
            f"the eval split has {len(eval_set)} prompts, fewer than the {dims.dp_size} data-parallel ranks; "
            "raise data.eval_fraction",
        )
        needed = {name for reward in self.rewards for name in fields_read(reward)}
        for prompt in train_set.prompts + eval_set.prompts:
            missing = sorted(needed - set(prompt.fields))
            require(
                not missing, f"data.files: {prompt.where} has no field {', '.join(missing)}, which task.rewards read"
            )
            require(
                len(prompt.ids) + self.max_completion_length <= spec.data.seq_len,
                f"data.files: {prompt.where} has a prompt of {len(prompt.ids)} tokens, which leaves no room in "
                f"data.seq_len={spec.data.seq_len} for a completion of task.max_completion_length="
                f"{self.max_completion_length}; raise data.seq_len or shorten it",
            )
        return loaded

    def run(
        self, spec: RunSpec, run_dir: Path, ranks: Ranks, identity: RunIdentity, inputs: Optional[LoadedData] = None
    ) -> dict[str, Any]:
        return run_training(spec, run_dir, ranks, identity, inputs, self.objective)

    def memory_terms(self, spec: RunSpec, facts: ModelFacts, estimate: Estimate) -> Estimate:
        """The reference (beta > 0): a frozen copy of the weights in their dtype, sharded as the strategy shards
        what it trains, or none (the adapters switched off). Sampling: the KV cache of each rank's completions of a
        step, its prompts and completions at their longest (data.seq_len)."""
        from runner.memory.breakdown import Part, dtype_name, reference_model

        reference = (
            reference_model(spec, facts.parameters, facts.buffer_bytes) if self.beta else Part(0, "none (task.beta=0)")
        )
        rows = self.sampling_batch_size or spec.train.micro_batch_size * spec.train.grad_accum_steps
        length = spec.data.seq_len
        compute = spec.precision.compute_dtype.bytes
        cache = 2 * facts.layers * rows * length * facts.layer.kv_heads * facts.layer.head_dim * compute
        logits = rows * facts.vocab * (compute + 4)  # the last position's, and their fp32 copy
        sampling = Part(
            cache + logits,
            f"the KV cache of the {rows} completions sampled at once, {length} tokens "
            f"each, {dtype_name(compute)}, and their next token's logits",
        )
        return replace(estimate, reference=reference, sampling=sampling)

    def objective(self, job: PreparedJob) -> GroupPolicyLoss:
        """The policy loss and its rollout: the rewards loaded, the reference where beta > 0."""
        from runner.engine.grpo_loss import GroupPolicyLoss, PolicyLoss
        from runner.generation.decoding import Decoding
        from runner.generation.rollout import Rollout

        settings = PolicyLoss(
            self.loss.value,
            self.importance_sampling_level.value,
            self.epsilon,
            self.epsilon if self.epsilon_high is None else self.epsilon_high,
            self.beta,
            self.max_completion_length,
            self.temperature,
        )
        decoding = Decoding(
            self.max_completion_length,
            do_sample=True,
            temperature=self.temperature,
            top_p=self.top_p,
            pad_token_id=job.tokenizer.pad_token_id,
        )
        rewards = [(reward_name(reward), load_reward(reward), reward.weight) for reward in self.rewards]
        reference = reference_logps(job, self.temperature) if self.beta else None
        rollout = Rollout(
            self.num_generations,
            decoding,
            self.sampling_batch_size,
            self.scale_rewards.value,
            rewards,
            reference,
            keep_old_logps=self.num_iterations > 1,
        )
        return GroupPolicyLoss(settings, rollout, self.num_iterations)


def reward_name(reward: RewardSpec) -> str:
    return reward.name or reward.function.rpartition(":")[2]


def fields_read(reward: RewardSpec) -> list[str]:
    """The record fields a reward function requires: its parameters without a default, other than those every
    reward receives and the arguments the config binds."""
    function = load_reward(replace(reward, args={}))
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return []
    return [
        parameter.name
        for parameter in parameters
        if parameter.default is inspect.Parameter.empty
        and parameter.name not in GIVEN
        and parameter.name not in reward.args
        and parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]


def reference_logps(job: PreparedJob, temperature: float):
    """The reference's log-probs of a micro batch's positions, of its logits over `temperature`: the policy with its
    adapters off, else a frozen copy of the initial model placed as the strategy places an inference model."""
    from runner.components.lora import adapters_off
    from runner.engine.grpo_loss import token_logps
    from runner.engine.placement import placed_model
    from runner.strategies.strategy_protocol import unwrapped

    if job.spec.adapter.active:

        def with_adapters_off(job: PreparedJob, micro_batch) -> Any:
            with adapters_off(unwrapped(job.model)):
                return token_logps(job.model, micro_batch, temperature)

        return with_adapters_off
    model = placed_model(job.spec, job.ranks, job.device, job.tokenizer, training=False, frozen=True).model
    model.eval()
    return lambda job, micro_batch: token_logps(model, micro_batch, temperature)
