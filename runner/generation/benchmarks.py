"""Benchmarks: lm-evaluation-harness tasks scored on the model as the runner placed it, during training
(train.benchmarks, every train.benchmark_every steps) and by task=evaluate (task.benchmarks). lm-eval owns the tasks,
their prompts and their metrics; the runner answers its requests (runner/generation/benchmark_model.py).

A benchmark is named by a task YAML file in lm-eval's format, by one of the runner's own (recipes/benchmarks/:
local_arc_easy, local_copa, local_piqa, local_boolq), or by a task of lm-eval's registry (whose data come from the
Hugging Face hub). A file's `data_files` are read relative to the file. The scores are flattened to
`bench/<task>/<metric>` (and `/<filter>` where the task filters its answers)."""

from __future__ import annotations

import contextlib
import functools
import io
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Optional

from runner.errors import SpecError, require
from runner.files.paths import bundled

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PreTrainedTokenizerBase

    from runner.generation.benchmark_model import Shard

PREFIX = "bench/"
SHIPPED = bundled("recipes") / "benchmarks"
INSTALL = "pip install 'runner[benchmarks]' (lm-eval 0.4.13)"


@dataclass
class Benchmarks:
    # lm-eval's tasks, groups and group map (TaskManager.load's), loaded once: their documents are read then
    tasks: dict[str, dict[str, Any]]
    limit: Optional[int]  # documents per task; None: all
    higher_is_better: dict[str, bool]  # by flattened metric name

    def scores(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        device: torch.device,
        autocast: Callable[[], ContextManager],
        max_length: int,
        batch_size: int,
        shard: Shard,
    ) -> dict[str, float]:
        """Every benchmark's scores of the model as it is now, the same on every rank (a collective: all call it)."""
        import torch
        from lm_eval import evaluator

        from runner.distributed import process_group_up
        from runner.generation.benchmark_model import PlacedModelLM

        lm = PlacedModelLM(model, tokenizer, device, autocast, max_length, batch_size, shard)
        with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):  # lm-eval's progress bars
            results = evaluator.evaluate(lm, self.tasks, limit=self.limit, bootstrap_iters=0)
        scores = flattened(results["results"]) if results is not None else {}
        if process_group_up():  # the first rank's results, on every rank
            import torch.distributed as dist

            shared = [scores]
            dist.broadcast_object_list(shared, src=0)
            scores = shared[0]
        return scores


def flattened(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """lm-eval's results ({task: {"acc,none": 0.3, "acc_stderr,none": "N/A", "alias": ...}}) as named scores."""
    scores = {}
    for task, values in results.items():
        for key, value in values.items():
            metric, _, kept = key.partition(",")
            if kept and not metric.endswith("_stderr") and isinstance(value, (int, float)):
                scores[metric_name(task, metric, kept)] = float(value)
    return scores


def metric_name(task: str, metric: str, kept: str) -> str:
    return f"{PREFIX}{task}/{metric}" + ("" if kept == "none" else f"/{kept}")


def load_benchmarks(names: list[str], key: str, limit: Optional[int]) -> Benchmarks:
    """The named benchmarks, loaded, or a one-line SpecError naming the one that cannot be (`key`: the spec's key
    that names them). Loaded once a process: a job of one process runs where `run` checked them."""
    try:
        import lm_eval.tasks  # noqa: F401
    except ImportError:
        raise SpecError(f"{key} needs lm-evaluation-harness, which is not installed: {INSTALL}") from None
    return _loaded(tuple(names), key, limit)


@functools.lru_cache(maxsize=4)
def _loaded(names: tuple[str, ...], key: str, limit: Optional[int]) -> Benchmarks:
    from lm_eval.tasks import TaskManager

    sources = [source(name, key) for name in names]
    registry = TaskManager() if any(isinstance(s, str) for s in sources) else TaskManager(include_defaults=False)
    tasks: dict[str, dict[str, Any]] = {"tasks": {}, "groups": {}, "group_map": {}}
    for name, found in zip(names, sources):
        require(
            not isinstance(found, str) or found in registry.all_tasks,
            f"{key}: {name} is neither a task YAML file nor a task lm-eval knows (the runner's own: "
            f"{', '.join(sorted(p.stem for p in SHIPPED.glob('*.yaml')))})",
        )
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                loaded = registry.load([found if isinstance(found, str) else task_config(found)])
        except Exception as error:
            raise SpecError(
                f"{key}: lm-eval cannot load {name}: {type(error).__name__}: {' '.join(str(error).split())[:300]}"
            ) from None
        for part, named in tasks.items():
            named.update(loaded.get(part, {}))
    return Benchmarks(tasks, limit, higher_is_better(tasks))


def source(name: str, key: str) -> Path | str:
    """A task YAML file, the runner's own task of that name, or else the name, for lm-eval's registry."""
    if name.endswith((".yaml", ".yml")):
        path = Path(name).expanduser()
        require(path.is_file(), f"{key}: {name}: no such task file")
        return path
    shipped = SHIPPED / f"{name}.yaml"
    return shipped if shipped.is_file() else name


def task_config(path: Path) -> dict[str, Any]:
    """A task file's config, as lm-eval reads it (its includes and !function tags), with its data files found
    beside it."""
    from runner.compat import lm_eval_yaml

    config = lm_eval_yaml(path)
    data_files = (config.get("dataset_kwargs") or {}).get("data_files")
    if isinstance(data_files, dict):
        config["dataset_kwargs"]["data_files"] = {split: _beside(path, files) for split, files in data_files.items()}
    elif data_files is not None:
        config["dataset_kwargs"]["data_files"] = _beside(path, data_files)
    return config


def _beside(path: Path, files: str | list[str]) -> str | list[str]:
    if isinstance(files, list):
        return [str(path.parent / file) for file in files]
    return str(path.parent / files)


def higher_is_better(tasks: dict[str, dict[str, Any]]) -> dict[str, bool]:
    """Whether each metric the tasks report is better higher, as each task declares it, for every filter."""
    directions = {}
    for task_name, task in tasks["tasks"].items():
        filters = [f["name"] for f in task.config.filter_list or []] or ["none"]
        for metric, higher in task.higher_is_better().items():
            for kept in filters:
                directions[metric_name(task_name, metric, kept)] = bool(higher)
    return directions


def check_lengths(benchmarks: Benchmarks, tokenizer: PreTrainedTokenizerBase, seq_len: int, key: str) -> None:
    """Refuses, in one line, a benchmark whose prompt and answer (or prompt and the tokens it may generate) take
    more than data.seq_len tokens: the model was not trained on positions that far."""
    for name, task in benchmarks.tasks["tasks"].items():
        longest, document = 0, None
        for instance, length in request_lengths(task, benchmarks.limit, tokenizer):
            if instance.request_type != "loglikelihood_rolling" and length > longest:  # rolling: in windows
                longest, document = length, instance.doc_id
        require(
            longest <= seq_len,
            f"{key}: {name}'s document {document} takes {longest} tokens, more than "
            f"data.seq_len={seq_len}; raise data.seq_len, or limit the documents (train.benchmark_limit)",
        )


def forward_tokens(benchmarks: Benchmarks, tokenizer: PreTrainedTokenizerBase) -> int:
    """The tokens one scoring of the benchmarks passes forward, every generation at its longest: what the time plan
    counts."""
    return sum(
        length
        for task in benchmarks.tasks["tasks"].values()
        for _, length in request_lengths(task, benchmarks.limit, tokenizer)
    )


def request_lengths(task: Any, limit: Optional[int], tokenizer: PreTrainedTokenizerBase) -> Iterator[tuple[Any, int]]:
    """Each of a task's requests (lm-eval's instances) and its tokens: a prompt and answer, a prompt and the tokens
    it may generate, or a whole document (scored in windows)."""
    from runner.generation.benchmark_model import DEFAULT_GENERATED

    with contextlib.redirect_stderr(io.StringIO()):
        task.build_all_requests(limit=limit, rank=0, world_size=1)
    for instance in task.instances:
        if instance.request_type == "generate_until":
            context, settings = instance.args
            yield instance, len(tokenizer.encode(context)) + settings.get("max_gen_toks", DEFAULT_GENERATED)
        else:
            yield instance, len(tokenizer.encode("".join(instance.args)))
