"""task=generate: completions of the prompts in a file (one per line, or a JSONL field) by what was trained, in
input order, as JSONL in the run directory. One process; data-parallel ranks (strategy=ddp,
hardware.nproc_per_node=N: each takes whole batches, so greedy output is one process's); pipeline stages over N
processes (task.pipeline_stages=N); or one model placed over GPUs, CPU RAM and disk (task.device_map=auto)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, List, Optional

from runner.config.data import DataFormat
from runner.config.task import InferenceTaskConfig
from runner.data.chat import ChatRenderer, chat_template
from runner.errors import SpecError, require
from runner.files import absolute_path, move_into_place, write_json_atomically
from runner.memory.facts import check_causal_lm, facts_of
from runner.memory.inference_report import inference_answer, planned_report
from runner.memory.terms import processes

if TYPE_CHECKING:
    from runner.config.spec import RunSpec
    from runner.config.tracker import RunIdentity
    from runner.distributed import Ranks

log = logging.getLogger("runner")


@dataclass
class GenerateTask(InferenceTaskConfig):
    # A text file (a prompt per line) or a .jsonl file (a prompt per line in `prompt_field`).
    prompts: Optional[str] = None
    prompt_field: str = "prompt"
    max_new_tokens: int = 64
    # Greedy (false), or sampling with temperature, top_p and top_k (0: no top-k), each batch from seed + its index.
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    # A completion ends before this text, where it appears (and always at the tokenizer's end-of-sequence token).
    stop: Optional[str] = None
    # Prompts per batch, left-padded.
    batch_size: int = 8
    # Split the model's blocks into this many stages, one per process (torch.distributed.pipelining).
    pipeline_stages: int = 1
    # The blocks where stages 2, 3, ... start; unset: an even split.
    split_points: List[int] = field(default_factory=list)
    # Each batch is cut into this many micro-batches, so that the stages work at once.
    microbatches: int = 2


    def with_absolute_paths(self, base: Path) -> GenerateTask:
        return replace(super().with_absolute_paths(base), prompts=absolute_path(self.prompts, base))

    def before_launch(self, spec: RunSpec) -> Optional[str]:
        require(self.max_new_tokens >= 1, f"task.max_new_tokens={self.max_new_tokens} must be at least 1")
        require(self.batch_size >= 1, f"task.batch_size={self.batch_size} must be at least 1")
        require(self.temperature > 0, f"task.temperature={self.temperature} must be > 0")
        require(0 < self.top_p <= 1, f"task.top_p={self.top_p} must be in (0, 1]")
        require(self.top_k >= 0, f"task.top_k={self.top_k} must be >= 0 (0: no top-k)")
        require(self.microbatches >= 1, f"task.microbatches={self.microbatches} must be at least 1")
        self.check(spec.hardware.world_size)
        require(not spec.strategy.shards_inference,
                f"task=generate does not shard a model (strategy={spec.strategy.name}): use strategy=ddp for "
                "data-parallel replicas, task.pipeline_stages=N to split the model over N processes, or "
                "task.device_map=auto")
        if self.pipeline_stages > 1:
            require(spec.hardware.world_size == self.pipeline_stages,
                    f"task.pipeline_stages={self.pipeline_stages} runs a stage per process, and the hardware gives "
                    f"{spec.hardware.world_size}; set hardware.nproc_per_node={self.pipeline_stages} strategy=ddp")
        else:
            require(not self.split_points, "task.split_points needs task.pipeline_stages of 2 or more")
        prompts = self.inputs(spec)
        spec = self.with_trained_model(spec)
        check_causal_lm(spec.model)
        if self.pipeline_stages > 1:
            from runner.parallel.pipeline.layout import stage_bounds

            stage_bounds(facts_of(spec.model).layers, self.pipeline_stages, self.split_points or None)
        return inference_answer(spec, self, **self.load(prompts))

    def load(self, prompts: list[str]) -> dict[str, Any]:
        """What a forward holds, for the memory estimate: a batch of the longest prompt and its new tokens."""
        longest = max(len(prompt.encode()) for prompt in prompts)  # UTF-8 bytes: a bound on any tokenizer's tokens
        return {"batch_size": min(self.batch_size, len(prompts)), "tokens": longest + self.max_new_tokens,
                "kv_cache": True, "stages": self.pipeline_stages, "prompt_tokens": longest}

    def inputs(self, spec: RunSpec) -> list[str]:
        return read_prompts(self.prompts, self.prompt_field)

    def run(self, spec: RunSpec, run_dir: Path, ranks: Ranks, identity: RunIdentity,
            inputs: Optional[list[str]] = None) -> dict[str, Any]:
        import sys

        from runner.generation.data_parallel import gathered, generate, inference_model, my_batches
        from runner.generation.decoding import Decoding, completion, prompt_batches

        prompts = inputs if inputs is not None else self.inputs(spec)
        spec = self.with_trained_model(spec)
        if ranks.rank == 0:
            log.info("%s", planned_report(spec, self, **self.load(prompts)))
        started = time.perf_counter()
        # A pipeline stage builds the whole model on the CPU and takes its own blocks to the device.
        model = inference_model(spec, self, ranks, run_dir, on_cpu=self.pipeline_stages > 1)
        for line in model.placement:
            log.info("placed %s", line)
        tokenizer = model.tokenizer
        texts, end = prompts, tokenizer.eos_token_id
        if spec.data.format is DataFormat.chat:  # as the model was trained: the template, and its end of turn
            renderer = ChatRenderer(tokenizer, chat_template(spec.data, tokenizer), spec.data.train_on.value)
            texts = [renderer.prompt(prompt, f"prompt {index}") for index, prompt in enumerate(prompts)]
            end = renderer.end_of_turn
        decoding = Decoding(self.max_new_tokens, self.do_sample, self.temperature, self.top_p, self.top_k,
                            end, tokenizer.pad_token_id)
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        batches = prompt_batches(ids, self.batch_size, tokenizer.pad_token_id)
        log.info("generating %d prompts in %d batch%s of up to %d, on %s%s", len(prompts), len(batches),
                 "es" if len(batches) > 1 else "", self.batch_size, processes(ranks.world_size),
                 " (pipeline stages)" if self.pipeline_stages > 1 else "")
        loaded = time.perf_counter()
        try:
            if self.pipeline_stages > 1:
                from runner.engine.placement import device_of
                from runner.generation.pipelined import pipeline_generate
                from runner.parallel.pipeline.layout import stage_bounds

                bounds = stage_bounds(model.model.config.num_hidden_layers, self.pipeline_stages,
                                      self.split_points or None)
                new_tokens = pipeline_generate(model.model, batches, decoding, ranks, bounds, self.microbatches,
                                               self.seed, device_of(spec, ranks), model.autocast)
            else:
                mine = my_batches(len(batches), ranks)
                by_batch = gathered(generate(model, batches, mine, decoding, self.seed,
                                             progress=ranks.rank == 0 and sys.stdout.isatty()))
                new_tokens = [row for index in range(len(batches)) for row in by_batch[index]]
        finally:
            model.release()
        seconds = time.perf_counter() - loaded
        records = []
        for index, (prompt, tokens) in enumerate(zip(prompts, new_tokens)):
            text, count = completion(tokens, tokenizer, decoding.eos_token_id, self.stop)
            records.append({"index": index, "prompt": prompt, "completion": text, "new_tokens": count})
        generated = sum(record["new_tokens"] for record in records)
        summary = {
            "prompts": len(records), "new_tokens": generated, "seconds": seconds,
            "prompts_per_s": len(records) / seconds, "tokens_per_s": generated / seconds,
            "processes": ranks.world_size, "load_seconds": loaded - started,
            "completions": str(run_dir / "completions.jsonl"),
        }
        if ranks.rank == 0:
            write_outputs(run_dir, records, summary)
            log.info("done: %d completions, %s new tokens in %.1f s | %.2f prompts/s | %s tokens/s",
                     len(records), f"{generated:,}", seconds, summary["prompts_per_s"],
                     f"{summary['tokens_per_s']:,.0f}")
            log.info("outputs: %s", run_dir / "completions.jsonl")
        return {**summary, "objective": None}


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
            raise SpecError(f"task.prompts={path}: line {number} has no field '{field_name}' (it has: {keys}); "
                            "set task.prompt_field")
        prompts.append(str(record[field_name]))
    return prompts
