"""task=generate's job: the prompts read from their file, the trained model placed (device_map=auto's big-model
placement, a data-parallel replica per rank, or a pipeline stage per rank), the completions generated in input
order, and completions.jsonl and summary.json written in the run directory. The task's schema and checks are in
runner/tasks/generate.py."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol

from runner.config.data import DataFormat
from runner.data.chat import ChatRenderer, chat_template
from runner.errors import SpecError, require
from runner.files.atomic import move_into_place, write_json_atomically
from runner.generation.data_parallel import InferenceModel, gathered, generate, inference_model, my_batches
from runner.generation.decoding import Batch, Decoding, completion, prompt_batches
from runner.memory.breakdown import processes
from runner.memory.inference_report import planned_report

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from runner.config.spec import RunSpec
    from runner.distributed import Ranks

log = logging.getLogger("runner")


class GenerateSettings(Protocol):
    """What generation reads of task=generate's schema: runner/tasks/generate.py's GenerateTask, an
    InferenceTaskConfig, which this part (below runner/tasks/) cannot name."""

    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: Optional[str]
    batch_size: int
    pipeline_stages: int
    split_points: list[int]
    microbatches: int

    def with_trained_model(self, spec: RunSpec) -> RunSpec: ...

    def load(self, prompts: list[str]) -> dict[str, Any]: ...


def generate_completions(
    task: GenerateSettings, spec: RunSpec, run_dir: Path, ranks: Ranks, prompts: list[str]
) -> dict[str, Any]:
    """The job on each rank: the prompts' completions by the trained model, written by rank 0; the summary."""
    spec = task.with_trained_model(spec)
    if ranks.rank == 0:
        log.info("%s", planned_report(spec, task, **task.load(prompts)))
    started = time.perf_counter()
    # A pipeline stage builds the whole model on the CPU and takes its own blocks to the device.
    model = inference_model(spec, task, ranks, run_dir, on_cpu=task.pipeline_stages > 1)
    for line in model.placement:
        log.info("placed %s", line)
    batches, decoding = prompt_batches_and_decoding(task, spec, model.tokenizer, prompts)
    log.info(
        "generating %d prompts in %d batch%s of up to %d, on %s%s",
        len(prompts),
        len(batches),
        "es" if len(batches) > 1 else "",
        task.batch_size,
        processes(ranks.world_size),
        " (pipeline stages)" if task.pipeline_stages > 1 else "",
    )
    loaded = time.perf_counter()
    try:
        new_tokens = generated_tokens(task, spec, model, batches, decoding, ranks)
    finally:
        model.release()
    seconds = time.perf_counter() - loaded
    records = completion_records(prompts, new_tokens, model.tokenizer, decoding.eos_token_id, task.stop)
    summary = generation_summary(records, seconds, loaded - started, ranks.world_size, run_dir)
    if ranks.rank == 0:
        write_outputs(run_dir, records, summary)
        log.info(
            "done: %d completions, %s new tokens in %.1f s | %.2f prompts/s | %s tokens/s",
            len(records),
            f"{summary['new_tokens']:,}",
            seconds,
            summary["prompts_per_s"],
            f"{summary['tokens_per_s']:,.0f}",
        )
        log.info("outputs: %s", run_dir / "completions.jsonl")
    return {**summary, "objective": None}


def prompt_batches_and_decoding(
    task: GenerateSettings, spec: RunSpec, tokenizer: PreTrainedTokenizerBase, prompts: list[str]
) -> tuple[list[Batch], Decoding]:
    """The prompts tokenized in left-padded batches, and the decoding that ends them. Chat data's prompts go
    through its template, as the model was trained, and end at its end of turn; others at end-of-sequence."""
    texts, end = prompts, tokenizer.eos_token_id
    if spec.data.format is DataFormat.chat:
        renderer = ChatRenderer(tokenizer, chat_template(spec.data, tokenizer), spec.data.train_on.value)
        texts = [renderer.prompt(prompt, f"prompt {index}") for index, prompt in enumerate(prompts)]
        end = renderer.end_of_turn
    decoding = Decoding(
        task.max_new_tokens, task.do_sample, task.temperature, task.top_p, task.top_k, end, tokenizer.pad_token_id
    )
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return prompt_batches(ids, task.batch_size, tokenizer.pad_token_id), decoding


def generated_tokens(
    task: GenerateSettings, spec: RunSpec, model: InferenceModel, batches: list[Batch], decoding: Decoding, ranks: Ranks
) -> list[list[int]]:
    """The new tokens of every prompt, in input order, on every rank: through the pipeline's stages
    (task.pipeline_stages > 1), or each rank's share of the batches, gathered."""
    if task.pipeline_stages > 1:
        from runner.engine.placement import device_of
        from runner.generation.pipelined import pipeline_generate
        from runner.parallel.pipeline.layout import stage_bounds

        bounds = stage_bounds(model.model.config.num_hidden_layers, task.pipeline_stages, task.split_points or None)
        return pipeline_generate(
            model.model,
            batches,
            decoding,
            ranks,
            bounds,
            task.microbatches,
            task.seed,
            device_of(spec, ranks),
            model.autocast,
        )
    mine = my_batches(len(batches), ranks)
    by_batch = gathered(
        generate(model, batches, mine, decoding, task.seed, progress=ranks.rank == 0 and sys.stdout.isatty())
    )
    return [row for index in range(len(batches)) for row in by_batch[index]]


def completion_records(
    prompts: list[str],
    new_tokens: list[list[int]],
    tokenizer: PreTrainedTokenizerBase,
    eos_token_id: Optional[int],
    stop: Optional[str],
) -> list[dict[str, Any]]:
    """completions.jsonl's records: each prompt with its completion text and new-token count, in input order."""
    records = []
    for index, (prompt, tokens) in enumerate(zip(prompts, new_tokens)):
        text, count = completion(tokens, tokenizer, eos_token_id, stop)
        records.append({"index": index, "prompt": prompt, "completion": text, "new_tokens": count})
    return records


def generation_summary(
    records: list[dict[str, Any]], seconds: float, load_seconds: float, world_size: int, run_dir: Path
) -> dict[str, Any]:
    """summary.json: the completions' counts and rates over the `seconds` generation took."""
    generated = sum(record["new_tokens"] for record in records)
    return {
        "prompts": len(records),
        "new_tokens": generated,
        "seconds": seconds,
        "prompts_per_s": len(records) / seconds,
        "tokens_per_s": generated / seconds,
        "processes": world_size,
        "load_seconds": load_seconds,
        "completions": str(run_dir / "completions.jsonl"),
    }


def write_outputs(run_dir: Path, records: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    """completions.jsonl, a record per line, moved into place once complete; then summary.json."""
    partial = run_dir / "completions.jsonl.partial"
    partial.write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))
    move_into_place(partial, run_dir / "completions.jsonl")
    write_json_atomically(run_dir / "summary.json", summary)


def read_prompts(path: Optional[str], field_name: str) -> list[str]:
    """The prompts of a text file (a line each, blank lines skipped) or a .jsonl file (`field_name` of each
    line's object), or a one-line SpecError naming the file and line."""
    require(bool(path), "task.prompts is not set: give a text file (a prompt per line) or a .jsonl file")
    file = Path(path)
    require(file.is_file(), f"task.prompts={path} is not a file")
    lines = [(number, line) for number, line in enumerate(file.read_text().splitlines(), 1) if line.strip()]
    require(bool(lines), f"task.prompts={path} holds no prompt")
    if file.suffix.lower() != ".jsonl":
        return [line for _, line in lines]
    prompts = []
    for number, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise SpecError(f"task.prompts={path}: line {number} is not JSON ({error.msg})") from None
        if not isinstance(record, dict) or field_name not in record:
            keys = ", ".join(record) if isinstance(record, dict) else "not an object"
            raise SpecError(
                f"task.prompts={path}: line {number} has no field '{field_name}' (it has: {keys}); "
                "set task.prompt_field"
            )
        prompts.append(str(record[field_name]))
    return prompts
