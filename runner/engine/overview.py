"""What a run is, printed as a compact tree when it starts: what a user checks at a glance before waiting hours."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from runner.config.data import DataFormat, resolve_files
from runner.config.scheduler import Decay, warmup_steps
from runner.data.store import size_on_disk
from runner.engine.step import objective_of
from runner.strategies.strategy_protocol import model_class_name

if TYPE_CHECKING:
    from runner.engine.job import PreparedJob


def overview(job: PreparedJob, parameters: int) -> list[str]:
    """`parameters`: the whole model's."""
    spec, train = job.spec, job.spec.train
    rows = {
        "model": f"{model_class_name(job.model)}, {parameters / 1e6:,.2f}M parameters, {model_source(job)}",
        "data": data_source(job),
        "optimizer": f"{type(spec.optim).__name__.removesuffix('Config')} lr {spec.optim.lr:g}, weight decay "
        f"{spec.optim.weight_decay:g}; {schedule(job)}",
        "batch": f"global batch {job.global_batch_size} = micro batch {train.micro_batch_size} x {job.dp_size} "
        f"data-parallel ranks x {train.grad_accum_steps} accumulation steps; {train.max_steps} steps of "
        f"{'' if rows_are_full(job) else 'up to '}"
        f"{job.global_batch_size * spec.data.seq_len:,} tokens",
        "loss": objective_of(job).line(job),
        "strategy": spec.strategy.describe(spec),
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
    source = (
        f"from {model.pretrained}"
        if model.pretrained
        else f"random init (model.architecture: {model.architecture.get('model_type')})"
    )
    return f"{source}; tokenizer {model.tokenizer or model.pretrained}"


def data_source(job: PreparedJob) -> str:
    data = job.spec.data
    where = (
        f"{data.hub_dataset} (hub)" if data.hub_dataset else f"{data.files} ({len(resolve_files(data.files))} files)"
    )
    if data.format is DataFormat.prompt:
        task = job.spec.task
        steps = f"each of {task.steps_per_draw} steps trains on" if task.steps_per_draw > 1 else "a step trains on"
        return (
            f"{where}: {job.train_sequences:,} train prompts, {job.eval_sequences:,} eval prompts; {steps} "
            f"{task.rows_per_prompt} completions of each of {job.global_batch_size // task.rows_per_prompt} "
            "prompts, sampled by the policy"
        )
    if job.token_store is None:
        return (
            f"{where}, streamed: each of the {job.dp_size} data-parallel ranks reads its own shard and tokenizes "
            f"it as training goes, into {'packed ' if data.packing else ''}rows of up to {data.seq_len} tokens; "
            f"{job.eval_sequences:,} eval sequences from held-out documents"
        )
    pairs = data.format is DataFormat.preference
    unit = "pairs" if pairs else "packed rows" if data.packing else "sequences"
    rows = f"{job.train_sequences:,} train {unit} of "
    if rows_are_full(job):
        rows += f"{data.seq_len} tokens ({job.train_tokens:,} tokens)"
    else:  # rows of varied lengths: what share of the rows' room they fill, before a batch pads them
        room = job.train_sequences * (2 if pairs else 1) * data.seq_len
        rows = (
            f"{rows}{'two rows ' if pairs else ''}up to {data.seq_len} tokens ({job.train_tokens:,} tokens, "
            f"{job.train_tokens / room:.0%} of the rows' room; "
            f"{job.train_label_tokens / job.train_tokens:.0%} of them trained)"
        )
    dropped = json.loads((job.token_store / "meta.json").read_text()).get("dropped_pairs")
    if dropped:
        rows += f" ({dropped:,} pairs whose prompt fills data.seq_len left out: data.drop_long_prompts)"
    store = job.token_store.parent  # the documents' tokens and this layout's rows
    return (
        f"{where}: {rows}, {job.eval_sequences:,} eval {'pairs' if pairs else 'sequences'}; token store {store} "
        f"({size_on_disk(store) / 2**20:,.1f} MiB)"
    )


def rows_are_full(job: PreparedJob) -> bool:
    """Every train row holds data.seq_len tokens (cut from a stream of text), as far as the store tells."""
    if job.train_sequences is None:
        return False
    return job.train_tokens == job.train_sequences * job.spec.data.seq_len


def schedule(job: PreparedJob) -> str:
    scheduler, steps = job.spec.scheduler, job.spec.train.max_steps
    warmup = f"{warmup_steps(scheduler, steps)} warmup steps"
    if scheduler.decay is Decay.constant:
        return f"{warmup}, then constant"
    return f"{warmup}, then {scheduler.decay.value} decay to {scheduler.min_lr_ratio:g} x lr"
