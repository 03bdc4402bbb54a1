"""Spec -> prepared training job: the one place where the groups' builders are composed."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Optional, Protocol

from runner.components.lr_schedule import build_scheduler
from runner.components.modeling import build_tokenizer
from runner.components.trackers import Tracker, build_trackers
from runner.config.data import DataFormat
from runner.config.spec import RunSpec, to_plain
from runner.config.tracker import RunIdentity
from runner.data import batches, prompts
from runner.data.chat import chat_template, template_or_none
from runner.data.prefetch import ahead
from runner.data.prompts import prompt_splits, read_prompts
from runner.data.splits import token_splits
from runner.data.stream import StreamedRows, check_stream
from runner.distributed import Ranks
from runner.engine import checkpoint
from runner.engine.placement import device_of, place
from runner.errors import SpecError
from runner.strategies.strategy_protocol import parameter_count

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PreTrainedTokenizerBase

    from runner.components.mixed_precision import PrecisionInEffect
    from runner.data.rows import RowSet
    from runner.engine.checkpoint import KeepBest
    from runner.parallel.dims import ParallelDims
    from runner.parallel.pipeline.schedule import Pipeline
    from runner.parallel.sequence import SequenceSplit, WholeLoss
    from runner.strategies.strategy_protocol import Stepper

log = logging.getLogger("runner")


class Objective(Protocol):
    """What a training step minimises and an evaluation reports: the next-token loss (runner/engine/step.py's
    NextTokenLoss), a preference loss (task=dpo: runner/engine/dpo_loss.py), or a policy loss over sampled
    completions (task=grpo: runner/engine/grpo_loss.py)."""

    def step_batch(self, job: PreparedJob, drawn: batches.GlobalBatch, step: int) -> batches.GlobalBatch:
        """The global batch `step` trains on, from the one drawn from the data: the same rows, or (task=grpo) the
        completions the policy samples for the drawn prompts, scored."""
        ...

    def loss(
        self, job: PreparedJob, micro_batch: batches.MicroBatch, batch: batches.GlobalBatch, whole: WholeLoss
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro batch's share of the global batch's loss, to differentiate, and its shares of the global
        batch's metrics (means over the global batch, once every rank's shares are summed). Under a sequence
        split, `micro_batch` is this rank's slices of the rows, and `whole` makes a sum over them the rows' own."""
        ...

    def evaluate(self, job: PreparedJob) -> dict[str, float]:
        """`eval_loss` (and the objective's own metrics) over the eval rows of every rank."""
        ...

    def line(self, job: PreparedJob) -> str:
        """What it is, for the run's overview."""
        ...


@dataclass
class PreparedJob:
    spec: RunSpec
    run_dir: Path
    ranks: Ranks
    device: torch.device
    model: nn.Module
    tokenizer: PreTrainedTokenizerBase
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    stepper: Stepper
    # This rank's micro batches of each optimizer step after the given one (a streamed rank: from the position its
    # checkpoint saved).
    train_batches: Callable[[int, Optional[dict[str, int]]], Iterator[batches.GlobalBatch]]
    eval_batches: Callable[[], Iterator[batches.MicroBatch]]
    autocast: Callable[[], ContextManager]
    trackers: list[Tracker]
    precision_in_effect: Callable[[], PrecisionInEffect]
    # From the token store: its train rows, their tokens (padding aside) and predicted labels, and the rows'
    # directory in the store (runner/data/store.py); None for a streamed run.
    train_sequences: Optional[int]
    train_tokens: Optional[int]
    train_label_tokens: Optional[int]
    token_store: Optional[Path]
    eval_sequences: int  # this rank's and the others' together
    # Where a resumed run starts: the checkpoint's step, what the loop had counted by then, and a streamed rank's
    # position in its stream.
    start_step: int = 0
    progress: dict[str, Any] = field(default_factory=dict)
    stream_position: Optional[dict[str, int]] = None
    # Rows the checkpoint kept because the step after it trains them again (task=grpo's num_iterations).
    rows_trained_again: Optional[batches.GlobalBatch] = None
    # What the steps minimise and the evaluations report: the task's own, or None, the next-token loss.
    objective: Optional[Objective] = None
    # The benchmarks' scores of the model as placed now, the same on every rank (train.benchmarks, from
    # runner/generation/benchmarks.py); scored every train.benchmark_every steps and after the last.
    benchmarks: Optional[Callable[[PreparedJob], dict[str, float]]] = None
    benchmark_tokens: int = 0  # what one scoring passes forward, for the time plan (rank 0's)
    keep_best: Optional[KeepBest] = None  # train.keep_best's metric and its direction
    # Under pipeline parallelism, the schedule of this rank's stages, which runs the steps' forward and backward and
    # the evaluation; `model` then holds this rank's stages only.
    pipeline: Optional[Pipeline] = None
    # Under context parallelism, how every sequence is split over this rank's group; None without one.
    sequence_split: Optional[SequenceSplit] = None

    @property
    def dims(self) -> ParallelDims:
        """The job's layout (RunSpec.layout, worked out once): its data-parallel ranks split each global batch."""
        return self.spec.layout

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def counted(self) -> bool:
        """Whether this rank's shares count in sums over the ranks (a tensor- or context-parallel group's other
        ranks repeat them)."""
        return self.dims.counted(self.ranks.rank)

    def parameter_count(self) -> int:
        """The whole model's parameters, however they are sharded, or spread over a pipeline's stages (every rank
        of a pipeline takes part)."""
        own = parameter_count(self.model)
        return self.pipeline.parameters(own) if self.pipeline else own

    @property
    def global_batch_size(self) -> int:
        return self.spec.train.micro_batch_size * self.dp_size * self.spec.train.grad_accum_steps


# The tokenizer and the train and eval rows of the token store; a streamed run's rows are read by each rank.
LoadedData = tuple["PreTrainedTokenizerBase", Optional["RowSet"], Optional["RowSet"]]


def load_data(spec: RunSpec) -> LoadedData:
    """The tokenizer and the tokenized splits, checked to hold at least one global and one eval batch.

    The controller calls it before starting workers, so that data problems stop the job early and the workers
    read the token store it wrote. A streamed run's source is checked to stream, with the format's fields.
    """
    train, dp_size = spec.train, spec.layout.dp_size
    tokenizer = build_tokenizer(spec.model)
    if spec.data.format is DataFormat.chat:  # saved with the model: what generation renders prompts with
        tokenizer.chat_template = chat_template(spec.data, tokenizer)
    elif spec.data.format is DataFormat.preference:
        tokenizer.chat_template = template_or_none(spec.data, tokenizer)
    if spec.data.streaming:
        check_stream(spec.data)
        return tokenizer, None, None
    if spec.data.format is DataFormat.prompt:  # task=grpo's, read by every process: no token store
        tokenizer.chat_template = template_or_none(spec.data, tokenizer)
        return (tokenizer, *prompt_splits(read_prompts(spec.data, tokenizer), spec.data.eval_fraction, spec.seed))
    train_set, eval_set = token_splits(spec.data, tokenizer, spec.seed)
    global_batch = train.micro_batch_size * dp_size * train.grad_accum_steps
    if len(train_set) < global_batch:
        raise SpecError(
            f"the training split has {len(train_set)} sequences, fewer than one global batch of {global_batch}; "
            "lower train.micro_batch_size or train.grad_accum_steps, or add data"
        )
    if len(eval_set) < dp_size:
        raise SpecError(
            f"the eval split has {len(eval_set)} sequences, fewer than the {dp_size} data-parallel ranks; "
            "raise data.eval_fraction"
        )
    return tokenizer, train_set, eval_set


def prepare_job(
    spec: RunSpec,
    run_dir: Path,
    ranks: Ranks = Ranks(),
    identity: Optional[RunIdentity] = None,
    loaded: Optional[LoadedData] = None,
    objective: Optional[Callable[[PreparedJob], Objective]] = None,
    benchmarks: Optional[Callable[[PreparedJob], dict[str, float]]] = None,
    benchmark_tokens: Optional[Callable[[PreTrainedTokenizerBase], int]] = None,
    keep_best: Optional[KeepBest] = None,
) -> PreparedJob:
    """The job whole, ready for its first step. `loaded`: what load_data returned for this spec in this process,
    when it has been called already; `objective`: the task's own, built from the job (None: the next-token loss);
    `benchmarks`: train.benchmarks' scores, and `benchmark_tokens` what one scoring passes forward (counted on rank
    0, for the time plan); `keep_best`: train.keep_best's metric and its direction."""

    device = device_of(spec, ranks)
    tokenizer, train_set, eval_set = loaded or load_data(spec)
    placed = place(spec, ranks, device, tokenizer)
    train_batches, eval_batches, eval_sequences = batch_sources(spec, tokenizer, train_set, eval_set, ranks, device)
    rows = None if spec.data.format is DataFormat.prompt else train_set  # (prompts have no token store's rows)
    job = PreparedJob(
        spec=spec,
        run_dir=run_dir,
        ranks=ranks,
        device=device,
        model=placed.model,
        tokenizer=tokenizer,
        optimizer=placed.optimizer,
        scheduler=build_scheduler(placed.optimizer, spec.scheduler, spec.train.max_steps),
        stepper=placed.stepper,
        train_batches=train_batches,
        eval_batches=eval_batches,
        autocast=placed.autocast,
        trackers=[],
        precision_in_effect=placed.precision_in_effect,
        train_sequences=None if train_set is None else len(train_set),
        train_tokens=None if rows is None else int(rows.tokens.sum()),
        train_label_tokens=None if rows is None else int(rows.label_tokens.sum()),
        token_store=None if rows is None else rows.store.path,
        eval_sequences=eval_sequences,
        pipeline=placed.pipeline,
        sequence_split=placed.sequence_split,
        benchmarks=benchmarks,
        benchmark_tokens=benchmark_tokens(tokenizer) if benchmark_tokens and ranks.rank == 0 else 0,
        keep_best=keep_best,
    )
    if spec.resume:
        progress = checkpoint.load(job, Path(spec.resume))
        job.start_step, job.progress = progress.pop("step"), progress
        job.stream_position = checkpoint.stream_position(Path(spec.resume), ranks.rank)
        job.rows_trained_again = checkpoint.rows_trained_again(Path(spec.resume), ranks.rank)
    if ranks.rank == 0:
        identity = identity or RunIdentity(name=run_dir.name)
        config = {**to_plain(spec), "precision_in_effect": job.precision_in_effect().as_dict()}
        job.trackers = build_trackers(spec.tracker, run_dir, config, identity, job.start_step)
    if objective is not None:
        job.objective = objective(job)
    return job


def batch_sources(
    spec: RunSpec,
    tokenizer: PreTrainedTokenizerBase,
    train_set: Optional[RowSet],
    eval_set: Optional[RowSet],
    ranks: Ranks,
    device: torch.device,
):
    """This rank's train batches (a function of the step and stream position it starts from), its eval batches,
    and the eval sequences of all ranks together. The data-parallel ranks split each global batch (single has
    one); the ranks of a tensor-parallel group run the same rows. The next global batch is built on a thread
    while the step runs."""
    import torch

    dims, train, pad = spec.layout, spec.train, tokenizer.pad_token_id
    dp_rank, dp_size = dims.dp_rank(ranks.rank), dims.dp_size
    # On CUDA, batches are built in pinned memory: their copies to the device need not wait.
    pin = device.type == "cuda" and torch.cuda.is_available()
    if spec.data.format is DataFormat.prompt:  # each step's prompts, whose completions make its rows
        return _prompt_sources(spec, train_set, eval_set, dp_rank, dp_size)
    if spec.data.streaming:
        train_batches, eval_set = _streamed_sources(spec, tokenizer, dp_rank, dp_size, pin)
        eval_rank, eval_size, eval_sequences = 0, 1, len(eval_set) * dp_size
    else:

        def train_batches(start_step: int, position: Optional[dict[str, int]]) -> Iterator[batches.GlobalBatch]:
            return ahead(
                batches.train_batches(
                    train_set,
                    micro_batch_size=train.micro_batch_size,
                    grad_accum_steps=train.grad_accum_steps,
                    dp_rank=dp_rank,
                    dp_size=dp_size,
                    seed=spec.seed,
                    pad_token_id=pad,
                    start_step=start_step,
                    pin=pin,
                )
            )

        eval_rank, eval_size, eval_sequences = dp_rank, dp_size, len(eval_set)

    def eval_batches() -> Iterator[batches.MicroBatch]:
        return batches.eval_batches(
            eval_set,
            micro_batch_size=train.micro_batch_size,
            max_batches=train.eval_batches,
            dp_rank=eval_rank,
            dp_size=eval_size,
            pad_token_id=pad,
            pin=pin,
        )

    return train_batches, eval_batches, eval_sequences


def _prompt_sources(spec: RunSpec, train_set: Optional[RowSet], eval_set: Optional[RowSet], dp_rank: int, dp_size: int):
    """task=grpo's: each step's prompts, whose completions make its rows, and the held-out prompts."""
    train = spec.train
    per_step = train.micro_batch_size * dp_size * train.grad_accum_steps // spec.task.rows_per_prompt

    def train_batches(start_step: int, position: Optional[dict[str, int]]) -> Iterator[prompts.PromptBatch]:
        return prompts.prompt_steps(
            train_set,
            per_step=per_step,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=spec.seed,
            start_step=start_step,
            steps_per_draw=spec.task.steps_per_draw,
        )

    def eval_prompts() -> Iterator[prompts.PromptBatch]:
        return prompts.eval_prompt_batches(
            eval_set,
            batch_size=train.micro_batch_size,
            max_batches=train.eval_batches,
            dp_rank=dp_rank,
            dp_size=dp_size,
        )

    return train_batches, eval_prompts, len(eval_set)


def _streamed_sources(spec: RunSpec, tokenizer: PreTrainedTokenizerBase, dp_rank: int, dp_size: int, pin: bool):
    """A streamed corpus's train batches, and this rank's eval rows from its own held-out documents."""
    train, pad = spec.train, tokenizer.pad_token_id
    stream = StreamedRows(spec.data, tokenizer, spec.seed, dp_rank, dp_size)
    # Each rank evaluates its share of the eval rows from its own held-out documents.
    eval_set = stream.eval_rows(max(1, train.eval_batches * train.micro_batch_size // dp_size))

    def train_batches(start_step: int, position: Optional[dict[str, int]]) -> Iterator[batches.GlobalBatch]:
        return ahead(
            batches.streamed_batches(
                stream,
                micro_batch_size=train.micro_batch_size,
                grad_accum_steps=train.grad_accum_steps,
                pad_token_id=pad,
                position=position,
                pin=pin,
            )
        )

    return train_batches, eval_set
