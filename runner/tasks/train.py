"""task=train (the default): before launch, check what the spec alone cannot say (the checkpoint to resume, the
model's layers, the fit in the hardware's memory, the trackers' services), then train."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional

from runner.compat import dtensor_flattens_a_sharded_sequence, pipeline_passes_integer_tensors
from runner.components.lora import targets
from runner.components.trackers import check_services
from runner.config.data import DataFormat
from runner.config.task import PostTrainingTaskConfig, TaskConfig, fit_check_setting
from runner.engine.checkpoint import check_resumable
from runner.errors import require
from runner.memory.advice import check_fit
from runner.memory.model_shapes import check_causal_lm, fp8_linears, meta_model
from runner.memory.report import report
from runner.parallel.tensor import block_plan
from runner.planning.time_plan import plan

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from runner.config.spec import RunSpec
    from runner.config.tracker import RunIdentity
    from runner.distributed import Ranks
    from runner.engine.checkpoint import KeepBest
    from runner.engine.job import LoadedData, Objective, PreparedJob
    from runner.generation.benchmarks import Benchmarks


@dataclass
class TrainTask(TaskConfig):
    fit_check: bool = fit_check_setting()

    runs_on_this_machine: ClassVar[bool] = True
    trains: ClassVar[bool] = True

    def before_launch(self, spec: RunSpec) -> Optional[str]:
        require(
            spec.data.format is not DataFormat.preference,
            "data.format=preference holds pairs of responses, which task=dpo trains on; task=train trains on "
            "text, instruction or chat data",
        )
        require(
            spec.data.format is not DataFormat.prompt,
            "data.format=prompt holds prompts, whose completions task=grpo samples and trains on; task=train "
            "trains on text, instruction or chat data",
        )
        check_training(spec, self.fit_check)
        return None

    def inputs(self, spec: RunSpec) -> LoadedData:
        return training_inputs(spec)

    def run(
        self, spec: RunSpec, run_dir: Path, ranks: Ranks, identity: RunIdentity, inputs: Optional[LoadedData] = None
    ) -> dict[str, Any]:
        return run_training(spec, run_dir, ranks, identity, inputs)


def training_inputs(spec: RunSpec) -> LoadedData:
    """The tokenizer and the token store's train and eval rows (a streamed run's: none), read before any worker
    starts."""
    from runner.engine.job import load_data  # the engine, and torch with it, once a job runs

    return load_data(spec)


def run_training(
    spec: RunSpec,
    run_dir: Path,
    ranks: Ranks,
    identity: RunIdentity,
    inputs: Optional[LoadedData],
    objective: Optional[Callable[[PreparedJob], Objective]] = None,
) -> dict[str, Any]:
    """A training task's job on this rank: the prepared job, with the task's objective where it has its own (the
    next-token loss otherwise), trained; its summary, whose eval loss a sweeper minimises."""
    from runner.engine.job import prepare_job
    from runner.engine.loop import train
    from runner.processes.stall_watch import process_watch, stalls_file

    # A rank stuck before the first step (a collective of the model's placement that another rank never joins) says
    # where, as the loop's steps do.
    watch = process_watch(ranks.rank, spec.train.stall_report_s, stalls_file(run_dir, ranks.rank))
    watch.entering("preparing the job: its data, the model's placement")
    try:
        benchmarks = training_benchmarks(spec)
        scores, tokens = (None, None) if benchmarks is None else scoring(benchmarks)
        job = prepare_job(
            spec, run_dir, ranks, identity, inputs, objective, scores, tokens, kept_best(spec, benchmarks)
        )
        summary = train(job)
    finally:
        watch.close()
    return {**summary, "objective": summary["eval_loss"]}


def estimated_or_checked(spec: RunSpec, task: PostTrainingTaskConfig) -> Optional[str]:
    """What a post-training task (dpo, grpo) answers before launch: with task.estimate_only, its run's memory per
    device and time plan; otherwise nothing, once its run is checked."""
    if task.estimate_only:
        return f"{report(spec)}\n\n{plan(spec).line()}"
    check_training(spec, task.fit_check)
    return None


def check_training(spec: RunSpec, fit_check: bool) -> None:
    """What a training task checks before launch that the spec alone cannot say: the checkpoint to resume, the
    model's layers, the fit in the hardware's memory, the trackers' services."""
    if spec.resume:
        check_resumable(spec)
    check_causal_lm(spec.model)
    dims = spec.layout
    if dims.tp > 1:  # the model's plan, and heads that split evenly
        block_plan(meta_model(spec.model), dims.tp)
    check_torch_features(spec, dims.tp, dims.pp)
    if spec.adapter.active:  # the layers to adapt are the model's
        targets(spec.adapter, meta_model(spec.model))
    if spec.precision.fp8:  # an fp8 run without an fp8 layer is an error, not a bf16 run
        fp8_linears(meta_model(spec.model), spec.precision)
    benchmarks = training_benchmarks(spec)
    if benchmarks is not None:
        check_benchmarks(spec, benchmarks)
    kept_best(spec, benchmarks)
    if fit_check:
        check_fit(spec)
    check_services(spec.tracker)


def training_benchmarks(spec: RunSpec) -> Optional[Benchmarks]:
    """train.benchmarks, loaded (lm-eval reads their documents), or None."""
    if not spec.train.benchmarks:
        return None
    from runner.generation.benchmarks import load_benchmarks

    return load_benchmarks(spec.train.benchmarks, "train.benchmarks", spec.train.benchmark_limit)


def check_benchmarks(spec: RunSpec, benchmarks: Benchmarks) -> None:
    """What a run with benchmarks checks before launch: a layout whose ranks each run whole forwards, and prompts
    within data.seq_len."""
    from runner.components.modeling import build_tokenizer
    from runner.generation.benchmarks import check_lengths

    dims = spec.layout
    require(
        dims.pp == 1 and dims.cp == 1,
        f"train.benchmarks with strategy.pp_size={dims.pp} and strategy.cp_size="
        f"{dims.cp}: the benchmarks run whole forwards of the model on each rank; score them with pp_size and "
        "cp_size 1, or on the trained model (task=evaluate task.benchmarks=...)",
    )
    check_lengths(benchmarks, build_tokenizer(spec.model), spec.data.seq_len, "train.benchmarks")


def scoring(
    benchmarks: Benchmarks,
) -> tuple[Callable[[PreparedJob], dict[str, float]], Callable[[PreTrainedTokenizerBase], int]]:
    """The benchmarks' scores of a job's model as the strategy placed it, each data-parallel rank answering its
    share of the requests; and what one scoring passes forward, counted with the job's tokenizer."""
    from runner.generation.benchmark_model import Shard
    from runner.generation.benchmarks import forward_tokens

    def scores(job: PreparedJob) -> dict[str, float]:
        shard = Shard(job.dims.dp_rank(job.ranks.rank), job.dims.dp_size, job.counted)
        return benchmarks.scores(
            job.model,
            job.tokenizer,
            job.device,
            job.autocast,
            job.spec.data.seq_len,
            job.spec.train.micro_batch_size,
            shard,
        )

    return scores, partial(forward_tokens, benchmarks)


def kept_best(spec: RunSpec, benchmarks: Optional[Benchmarks]) -> Optional[KeepBest]:
    """train.keep_best's metric and its direction: one of the task's eval metrics or of the benchmarks' scores."""
    from runner.engine.checkpoint import KeepBest

    name = spec.train.keep_best
    if name is None:
        return None
    directions = {**spec.task.eval_metrics, **(benchmarks.higher_is_better if benchmarks is not None else {})}
    require(
        name in directions,
        f"train.keep_best={name} is not a metric this run logs; it logs {', '.join(sorted(directions))}",
    )
    return KeepBest(name, directions[name])


def check_torch_features(spec: RunSpec, tp: int, pp: int) -> None:
    """What the installed torch cannot do of what the spec asks (torch 2.11 and 2.12, which pyproject accepts)."""
    import torch

    require(
        tp == 1 or not spec.adapter.active or dtensor_flattens_a_sharded_sequence(),
        f"adapter=lora with strategy.tp_size={tp}: torch {torch.__version__}'s DTensor cannot apply LoRA's B to "
        "the sequence-split output of an A split by rows (torch 2.13's can); use strategy.tp_size=1, or torch "
        ">= 2.13",
    )
    require(
        pp == 1 or pipeline_passes_integer_tensors(),
        f"strategy.pp_size={pp}: torch {torch.__version__}'s pipeline stages cannot pass on the labels and "
        "positions from stage to stage (torch 2.13's can); use strategy.pp_size=1, or torch >= 2.13",
    )
