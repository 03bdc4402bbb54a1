"""What a run is, printed as a compact tree when it starts: what a user checks at a glance before waiting hours."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.config.data import resolve_files
from runner.config.scheduler import Decay, warmup_steps
from runner.config.train import LossKind, loss_kind_in_effect
from runner.data.store import size_on_disk
from runner.strategies.protocol import model_class_name, parameter_count, unwrapped

if TYPE_CHECKING:
    from runner.engine.job import PreparedJob


def overview(job: PreparedJob) -> list[str]:
    spec, train = job.spec, job.spec.train
    rows = {
        "model": f"{model_class_name(job.model)}, {parameter_count(job.model) / 1e6:,.2f}M parameters, "
                 f"{model_source(job)}",
        "data": data_source(job),
        "optimizer": f"{type(spec.optim).__name__.removesuffix('Config')} lr {spec.optim.lr:g}, weight decay "
                     f"{spec.optim.weight_decay:g}; {schedule(job)}",
        "batch": f"global batch {job.global_batch_size} = micro batch {train.micro_batch_size} x {job.dp_size} "
                 f"data-parallel ranks x {train.grad_accum_steps} accumulation steps; {train.max_steps} steps of "
                 f"{'' if rows_are_full(job) else 'up to '}"
                 f"{job.global_batch_size * spec.data.seq_len:,} tokens",
        "loss": loss_line(job),
        "strategy": spec.strategy.describe(spec.hardware),
        "precision": job.precision_in_effect().line(),
        "trackers": ", ".join(["metrics.jsonl", *(name for name, _ in spec.tracker.chosen())]),
    }
    width = max(map(len, rows))
    lines = [f"run {job.run_dir}"]
    for i, (name, text) in enumerate(rows.items()):
        lines.append(f"{'└─' if i == len(rows) - 1 else '├─'} {name:<{width}}  {text}")
    return lines


def model_source(job: PreparedJob) -> str:
    model = job.spec.model
    source = f"from {model.pretrained}" if model.pretrained else \
        f"random init (model.architecture: {model.architecture.get('model_type')})"
    return f"{source}; tokenizer {model.tokenizer or model.pretrained}"


def data_source(job: PreparedJob) -> str:
    data = job.spec.data
    where = f"{data.hub_dataset} (hub)" if data.hub_dataset else \
        f"{data.files} ({len(resolve_files(data.files))} files)"
    if job.token_store is None:
        return (f"{where}, streamed: each of the {job.dp_size} data-parallel ranks reads its own shard and tokenizes "
                f"it as training goes, into {'packed ' if data.packing else ''}rows of up to {data.seq_len} tokens; "
                f"{job.eval_sequences:,} eval sequences from held-out documents")
    rows = f"{job.train_sequences:,} train {'packed rows' if data.packing else 'sequences'} of "
    if rows_are_full(job):
        rows += f"{data.seq_len} tokens ({job.train_tokens:,} tokens)"
    else:  # rows of varied lengths: what share of the rows' room they fill, before a batch pads them
        rows += (f"up to {data.seq_len} tokens ({job.train_tokens:,} tokens, "
                 f"{job.train_tokens / (job.train_sequences * data.seq_len):.0%} of the rows' room; "
                 f"{job.train_label_tokens / job.train_tokens:.0%} of them trained)")
    store = job.token_store.parent  # the documents' tokens and this layout's rows
    return (f"{where}: {rows}, {job.eval_sequences:,} eval sequences; token store {store} "
            f"({size_on_disk(store) / 2**20:,.1f} MiB)")


def rows_are_full(job: PreparedJob) -> bool:
    """Every train row holds data.seq_len tokens (cut from a stream of text), as far as the store tells."""
    if job.train_sequences is None:
        return False
    return job.train_tokens == job.train_sequences * job.spec.data.seq_len


def loss_line(job: PreparedJob) -> str:
    train = job.spec.train
    kind = loss_kind_in_effect(train.loss, unwrapped(job.model).config.model_type)
    how = (f"chunked ({train.loss_chunk_tokens:,} label tokens a chunk; no whole-batch logits)"
           if kind is LossKind.chunked else "full logits")
    compiled = "; transformer blocks compiled (train.compile)" if train.compile else ""
    return f"next-token cross entropy, {how} (train.loss={train.loss.value}){compiled}"


def schedule(job: PreparedJob) -> str:
    scheduler, steps = job.spec.scheduler, job.spec.train.max_steps
    warmup = f"{warmup_steps(scheduler, steps)} warmup steps"
    if scheduler.decay is Decay.constant:
        return f"{warmup}, then constant"
    return f"{warmup}, then {scheduler.decay.value} decay to {scheduler.min_lr_ratio:g} x lr"
