"""task=evaluate: the eval loss and perplexity of what was trained (a run directory's model/, one of its
checkpoints, a saved model, or the model group's own) on the composed data, without an optimizer or gradients.
Rows, batches and the sums across ranks are training's own evaluation's: on a run directory it gives that run's
last eval loss."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from runner.config.fields import setting
from runner.config.task import InferenceTaskConfig
from runner.errors import SpecError, require
from runner.memory.breakdown import processes
from runner.memory.inference_report import inference_answer, planned_report
from runner.memory.model_shapes import check_causal_lm

if TYPE_CHECKING:
    from runner.config.spec import RunSpec
    from runner.config.tracker import RunIdentity
    from runner.data.rows import RowSet
    from runner.distributed import Ranks
    from runner.generation.benchmarks import Benchmarks
    from runner.generation.data_parallel import InferenceModel
    from runner.parallel.dims import ParallelDims

log = logging.getLogger("runner")


class EvalSplit(str, Enum):
    # The documents training holds out (data.eval_fraction, split with the run's seed).
    eval = "eval"
    # Every document of the data: a whole file set held out from training.
    all = "all"


@dataclass
class EvaluateTask(InferenceTaskConfig):
    split: EvalSplit = setting(
        EvalSplit.eval,
        "Which rows are evaluated: the held-out ones (eval), or all of them (all).",
    )
    max_batches: Optional[int] = setting(
        None,
        "Batches of train.micro_batch_size rows; unset: train.eval_batches (the rows training evaluates); 0: every "
        "row.",
    )
    benchmarks: list[str] = setting(
        [],
        "lm-evaluation-harness tasks to score the model on besides the loss, as train.benchmarks "
        "(docs/benchmark_scores.md).",
    )
    benchmark_limit: Optional[int] = setting(
        None,
        "Documents of each benchmark scored (lm-eval's `limit`); null: all of them.",
    )

    def before_launch(self, spec: RunSpec) -> Optional[str]:
        require(
            self.max_batches is None or self.max_batches >= 0,
            f"task.max_batches={self.max_batches} must be >= 0 (0: every row)",
        )
        self.check(spec.hardware.world_size)
        require(
            not spec.data.streaming,
            "task=evaluate reads the token store's rows, and data.streaming=true has "
            "none; evaluate with data.streaming=false (the eval split is tokenized once, as training's is)",
        )
        spec = self.with_trained_model(spec)
        check_causal_lm(spec.model)
        if self.benchmarks:
            from runner.components.modeling import build_tokenizer
            from runner.generation.benchmarks import check_lengths

            require(
                self.benchmark_limit is None or self.benchmark_limit > 0,
                f"task.benchmark_limit={self.benchmark_limit} must be a positive number of documents, or null for all",
            )
            check_lengths(self.loaded_benchmarks(), build_tokenizer(spec.model), spec.data.seq_len, "task.benchmarks")
        return inference_answer(spec, self, **self.load(spec))

    def loaded_benchmarks(self) -> Benchmarks:
        from runner.generation.benchmarks import load_benchmarks

        return load_benchmarks(self.benchmarks, "task.benchmarks", self.benchmark_limit)

    def load(self, spec: RunSpec) -> dict[str, Any]:
        """What a forward holds, for the memory estimate: training's eval batches."""
        return {"batch_size": spec.train.micro_batch_size, "tokens": spec.data.seq_len, "kv_cache": False}

    def inputs(self, spec: RunSpec) -> RowSet:
        """The tokenized rows to evaluate, at least one per rank."""
        from runner.components.modeling import build_tokenizer
        from runner.data.rows import RowSet
        from runner.data.splits import token_splits

        spec = self.with_trained_model(spec)
        train_set, eval_set = token_splits(spec.data, build_tokenizer(spec.model), spec.seed)
        # The store holds the eval rows, then the train rows.
        rows = RowSet(eval_set.store, 0, train_set.stop) if self.split is EvalSplit.all else eval_set
        if len(rows) < spec.hardware.world_size:
            raise SpecError(
                f"the {self.split.value} rows are {len(rows)}, fewer than the {spec.hardware.world_size} "
                "processes; raise data.eval_fraction or use task.split=all"
            )
        return rows

    def run(
        self, spec: RunSpec, run_dir: Path, ranks: Ranks, identity: RunIdentity, inputs: Optional[RowSet] = None
    ) -> dict[str, Any]:
        from runner.data.batches import eval_batches
        from runner.engine.metrics import peak_memory_gib
        from runner.engine.step import mean_loss
        from runner.files.atomic import write_json_atomically
        from runner.generation.data_parallel import inference_model

        rows = inputs if inputs is not None else self.inputs(spec)
        spec = self.with_trained_model(spec)
        if ranks.rank == 0:
            log.info("%s", planned_report(spec, self, **self.load(spec)))
        model = inference_model(spec, self, ranks, run_dir)
        for line in model.placement:
            log.info("placed %s", line)
        max_batches = spec.train.eval_batches if self.max_batches is None else self.max_batches or len(rows)
        dims = spec.layout
        batches = eval_batches(
            rows,
            micro_batch_size=spec.train.micro_batch_size,
            max_batches=max_batches,
            dp_rank=dims.dp_rank(ranks.rank),
            dp_size=dims.dp_size,
            pad_token_id=model.tokenizer.pad_token_id,
        )
        started = time.perf_counter()
        try:
            result = mean_loss(model.model, batches, model.device, model.autocast, dims.counted(ranks.rank))
            seconds = time.perf_counter() - started
            scores = self.scores(model, spec, dims, ranks.rank) if self.benchmarks else {}
        finally:
            model.release()
        summary = {
            "model": self.trained or spec.model.pretrained or "the model group's random init",
            "split": self.split.value,
            "eval_loss": result.loss,
            "perplexity": math.exp(min(result.loss, 700.0)),
            "label_tokens": result.label_tokens,
            "tokens": result.tokens,
            "tokens_per_s": result.tokens / seconds,
            "seconds": seconds,
            "processes": ranks.world_size,
            "peak_memory_gib": peak_memory_gib(model.device),
            **scores,
        }
        if ranks.rank == 0:
            write_json_atomically(run_dir / "eval.json", summary)
            write_json_atomically(run_dir / "summary.json", summary)  # what a sweep's report reads of each job
            for line in table(summary):
                log.info("%s", line)
            log.info("outputs: %s", run_dir / "eval.json")
        return {**summary, "objective": result.loss}

    def scores(self, model: InferenceModel, spec: RunSpec, dims: ParallelDims, rank: int) -> dict[str, float]:
        """The benchmarks' scores of the placed model, each rank scoring its share of the documents."""
        from runner.generation.benchmark_model import Shard

        shard = Shard(dims.dp_rank(rank), dims.dp_size, dims.counted(rank))
        return self.loaded_benchmarks().scores(
            model.model,
            model.tokenizer,
            model.device,
            model.autocast,
            spec.data.seq_len,
            spec.train.micro_batch_size,
            shard,
        )


def table(summary: dict[str, Any]) -> list[str]:
    return [
        f"evaluated {summary['model']} on the {summary['split']} rows ({processes(summary['processes'])})",
        f"  eval loss     {summary['eval_loss']:.6f}",
        f"  perplexity    {summary['perplexity']:.3f}",
        f"  label tokens  {summary['label_tokens']:,}",
        f"  tokens/s      {summary['tokens_per_s']:,.0f}",
        f"  peak memory   {summary['peak_memory_gib']:.2f} GiB",
        *(
            f"  {name.removeprefix('bench/')}  {value:.4f}"
            for name, value in summary.items()
            if name.startswith("bench/")
        ),
    ]
