"""Spec -> prepared training job: the one place where the groups' builders are composed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ContextManager, Iterator

from runner import data, model as model_module, optim, precision, scheduler, strategy, tracker
from runner.hardware import Accelerator
from runner.spec import RunSpec, SpecError

if TYPE_CHECKING:
    import datasets
    import torch
    from torch import nn
    from transformers import PreTrainedTokenizerBase


@dataclass
class PreparedJob:
    spec: RunSpec
    run_dir: Path
    device: torch.device
    model: nn.Module
    tokenizer: PreTrainedTokenizerBase
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_batches: Iterator[list[data.Batch]]
    eval_batches: Callable[[], Iterator[data.Batch]]
    autocast: Callable[[], ContextManager]
    trackers: list[tracker.Tracker]
    dp_size: int

    @property
    def global_batch_size(self) -> int:
        return self.spec.train.micro_batch_size * self.dp_size * self.spec.train.grad_accum_steps


def prepare_job(spec: RunSpec, run_dir: Path, rank: int = 0) -> PreparedJob:
    import torch

    device = torch.device("cuda", rank) if spec.hardware.accelerator is Accelerator.cuda else torch.device("cpu")
    dp_size = strategy.data_parallel_size(spec.strategy)
    dp_rank = rank
    train = spec.train

    tokenizer = model_module.build_tokenizer(spec.model)
    train_set, eval_set = data.build_datasets(spec.data, tokenizer, spec.seed)
    _check_split_sizes(train_set, eval_set, train.micro_batch_size * dp_size * train.grad_accum_steps,
                       train.micro_batch_size * dp_size)

    torch.manual_seed(spec.seed)
    model = model_module.build_model(spec.model, tokenizer)
    model = strategy.apply_strategy(model, spec.strategy, device)
    optimizer = optim.build_optimizer(model, spec.optim)
    lr_schedule = scheduler.build_scheduler(optimizer, spec.scheduler, train.max_steps)

    pad = tokenizer.pad_token_id
    return PreparedJob(
        spec=spec,
        run_dir=run_dir,
        device=device,
        model=model,
        tokenizer=tokenizer,
        optimizer=optimizer,
        scheduler=lr_schedule,
        train_batches=data.train_batches(
            train_set, micro_batch_size=train.micro_batch_size, grad_accum_steps=train.grad_accum_steps,
            dp_rank=dp_rank, dp_size=dp_size, seed=spec.seed, pad_token_id=pad,
        ),
        eval_batches=lambda: data.eval_batches(
            eval_set, micro_batch_size=train.micro_batch_size, max_batches=train.eval_batches,
            dp_rank=dp_rank, dp_size=dp_size, pad_token_id=pad,
        ),
        autocast=lambda: precision.autocast(spec.precision, device),
        trackers=tracker.build_trackers(spec.tracker, run_dir) if rank == 0 else [],
        dp_size=dp_size,
    )


def _check_split_sizes(train_set: datasets.Dataset, eval_set: datasets.Dataset, global_batch: int,
                       eval_batch: int) -> None:
    if len(train_set) < global_batch:
        raise SpecError(
            f"the training split has {len(train_set)} sequences, fewer than one global batch of {global_batch}; "
            "lower train.micro_batch_size or train.grad_accum_steps, or add data"
        )
    if len(eval_set) < eval_batch:
        raise SpecError(
            f"the eval split has {len(eval_set)} sequences, fewer than one eval batch of {eval_batch}; "
            "raise data.eval_fraction or lower train.micro_batch_size"
        )
