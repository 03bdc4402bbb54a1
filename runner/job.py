"""Spec -> prepared training job: the one place where the groups' builders are composed."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Optional

from runner import checkpoint, data, model as model_module, optim, precision, scheduler, strategy, tracker
from runner.hardware import Accelerator
from runner.launch import Ranks
from runner.spec import RunSpec, SpecError, to_plain
from runner.strategy import DeepSpeedStrategy, DeepSpeedStepper, FSDPStrategy, Stepper, TorchStepper

log = logging.getLogger("runner")

if TYPE_CHECKING:
    import datasets
    import torch
    from torch import nn
    from transformers import PreTrainedTokenizerBase


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
    # This rank's micro batches of each optimizer step after the given one.
    train_batches: Callable[[int], Iterator[list[data.Batch]]]
    eval_batches: Callable[[], Iterator[data.Batch]]
    autocast: Callable[[], ContextManager]
    gradient_sync: Callable[[bool], ContextManager]
    trackers: list[tracker.Tracker]
    dp_size: int
    # The dtypes really in use (forward, weights, master weights, optimizer states, fp8 layers), read from the tensors.
    precision_in_effect: Callable[[], dict[str, Any]]
    # Where a resumed run starts: the checkpoint's step and what the loop had counted by then.
    start_step: int = 0
    progress: dict = field(default_factory=dict)

    @property
    def global_batch_size(self) -> int:
        return self.spec.train.micro_batch_size * self.dp_size * self.spec.train.grad_accum_steps


LoadedData = tuple["PreTrainedTokenizerBase", "datasets.Dataset", "datasets.Dataset"]


def load_data(spec: RunSpec) -> LoadedData:
    """The tokenizer and the tokenized splits, checked to hold at least one global and one eval batch.

    The controller calls it before starting workers, so that data problems stop the job early and the workers
    find the tokenized splits in the datasets cache.
    """
    train = spec.train
    dp_size = strategy.data_parallel_size(spec.strategy, spec.hardware.world_size)
    tokenizer = model_module.build_tokenizer(spec.model)
    train_set, eval_set = data.build_datasets(spec.data, tokenizer, spec.seed)
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
    spec: RunSpec, run_dir: Path, ranks: Ranks = Ranks(), identity: Optional[tracker.RunIdentity] = None,
    loaded: Optional[LoadedData] = None,
) -> PreparedJob:
    """`loaded`: what load_data returned for this spec in this process, when it has been called already."""
    import torch

    cuda = spec.hardware.accelerator is Accelerator.cuda
    device = torch.device("cuda", ranks.local_rank) if cuda else torch.device("cpu")
    dp_size = strategy.data_parallel_size(spec.strategy, ranks.world_size)
    train = spec.train
    tokenizer, train_set, eval_set = loaded or load_data(spec)

    torch.manual_seed(spec.seed)
    model = model_module.build_model(spec.model, tokenizer, weights=strategy.loads_weights(spec.strategy, ranks.rank))
    # In this order: fp8 layers, the weights' dtype, then the strategy's wrapping and sharding.
    fp8_layers = precision.convert_to_fp8(model, spec.precision.fp8) if spec.precision.fp8 else []
    if fp8_layers:
        log.info("fp8: %d linear layers converted: %s", len(fp8_layers), precision.summarize_names(fp8_layers))
    model = precision.cast_weights(model, spec.precision)
    low_precision = spec.precision.compute_dtype is not precision.Dtype.fp32
    if isinstance(spec.strategy, DeepSpeedStrategy):
        # DeepSpeed wraps model and optimizer together, and casts through its own precision blocks.
        optimizer = optim.build_optimizer(model, spec.optim)
        model = strategy.deepspeed_engine(model, optimizer, spec)
        stepper: Stepper = DeepSpeedStepper(model)
        autocast: Callable[[], ContextManager] = contextlib.nullcontext
        cast_by = "DeepSpeed engine" if low_precision else ""
    else:
        # FSDP casts through its mixed-precision policy; the other strategies autocast the forward.
        sharded = isinstance(spec.strategy, FSDPStrategy)
        model = strategy.apply_strategy(model, spec.strategy, spec.hardware, device, spec.precision)
        optimizer = optim.build_optimizer(model, spec.optim)
        scaler = precision.grad_scaler(spec.precision, device, sharded)
        stepper = TorchStepper(model, optimizer, train.max_grad_norm, scaler)
        autocast = lambda: precision.autocast(spec.precision, device, compute_dtype=not sharded)  # noqa: E731
        cast_by = ("FSDP mixed-precision policy" if sharded else "autocast") if low_precision else ""
    lr_schedule = scheduler.build_scheduler(optimizer, spec.scheduler, train.max_steps)

    pad = tokenizer.pad_token_id
    job = PreparedJob(
        spec=spec,
        run_dir=run_dir,
        ranks=ranks,
        device=device,
        model=model,
        tokenizer=tokenizer,
        optimizer=optimizer,
        scheduler=lr_schedule,
        stepper=stepper,
        train_batches=lambda start_step: data.train_batches(
            train_set, micro_batch_size=train.micro_batch_size, grad_accum_steps=train.grad_accum_steps,
            dp_rank=ranks.rank, dp_size=dp_size, seed=spec.seed, pad_token_id=pad, start_step=start_step,
        ),
        eval_batches=lambda: data.eval_batches(
            eval_set, micro_batch_size=train.micro_batch_size, max_batches=train.eval_batches,
            dp_rank=ranks.rank, dp_size=dp_size, pad_token_id=pad,
        ),
        autocast=autocast,
        gradient_sync=lambda enabled: strategy.gradient_sync(model, spec.strategy, enabled),
        trackers=[],
        dp_size=dp_size,
        precision_in_effect=lambda: precision.in_effect(
            model, optimizer, spec.precision, cast_by, len(fp8_layers), gradient_reduce=dp_size > 1,
        ),
    )
    if spec.resume:
        progress = checkpoint.load(job, Path(spec.resume))
        job.start_step, job.progress = progress.pop("step"), progress
    if ranks.rank == 0:
        identity = identity or tracker.RunIdentity(name=run_dir.name)
        config = {**to_plain(spec), "precision_in_effect": job.precision_in_effect()}
        job.trackers = tracker.build_trackers(spec.tracker, run_dir, config, identity, job.start_step)
    return job
