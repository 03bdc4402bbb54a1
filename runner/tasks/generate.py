"""task=generate: completions of the prompts in a file (one per line, or a JSONL field) by what was trained, in
input order, as JSONL in the run directory. One process; data-parallel ranks (strategy=ddp,
hardware.nproc_per_node=N: each takes whole batches, so greedy output is one process's); pipeline stages over N
processes (task.pipeline_stages=N); or one model placed over GPUs, CPU RAM and disk (task.device_map=auto).
Here: the schema and its checks; reading the prompts, and the job itself, are in runner/generation/completions.py."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, List, Optional

from runner.config.fields import setting
from runner.config.task import InferenceTaskConfig
from runner.errors import require
from runner.files.paths import absolute_path
from runner.memory.inference_report import inference_answer
from runner.memory.model_shapes import check_causal_lm, facts_of

if TYPE_CHECKING:
    from runner.config.spec import RunSpec
    from runner.config.tracker import RunIdentity
    from runner.distributed import Ranks


@dataclass
class GenerateTask(InferenceTaskConfig):
    prompts: Optional[str] = setting(
        None,
        "A text file (a prompt per line) or a .jsonl file (a prompt per line in `prompt_field`).",
    )
    prompt_field: str = setting("prompt", "A .jsonl prompts file: the field holding each prompt.")
    max_new_tokens: int = setting(64, "Tokens generated for each prompt at most.")
    do_sample: bool = setting(
        False,
        "Greedy decoding (false), or sampling with temperature, top_p and top_k, each batch from seed + its index.",
    )
    temperature: float = setting(1.0, "do_sample: the logits are divided by it before sampling.")
    top_p: float = setting(1.0, "do_sample: nucleus sampling's share of the probability mass kept (1: all).")
    top_k: int = setting(0, "do_sample: only the k likeliest tokens are drawn from (0: no top-k).")
    seed: int = setting(0, "do_sample: the seed of the first batch's sampling.")
    stop: Optional[str] = setting(
        None,
        "A completion ends before this text, where it appears (and always at the tokenizer's end-of-sequence token).",
    )
    batch_size: int = setting(8, "Prompts per batch, left-padded.")
    pipeline_stages: int = setting(
        1,
        "Split the model's blocks into this many stages, one per process (torch.distributed.pipelining).",
    )
    split_points: List[int] = setting([], "The blocks where stages 2, 3, ... start; unset: an even split.")
    microbatches: int = setting(2, "Each batch is cut into this many micro-batches, so that the stages work at once.")

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
        require(
            not spec.strategy.shards_inference,
            f"task=generate does not shard a model (strategy={spec.strategy.name}): use strategy=ddp for "
            "data-parallel replicas, task.pipeline_stages=N to split the model over N processes, or "
            "task.device_map=auto",
        )
        if self.pipeline_stages > 1:
            require(
                spec.hardware.world_size == self.pipeline_stages,
                f"task.pipeline_stages={self.pipeline_stages} runs a stage per process, and the hardware gives "
                f"{spec.hardware.world_size}; set hardware.nproc_per_node={self.pipeline_stages} strategy=ddp",
            )
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
        return {
            "batch_size": min(self.batch_size, len(prompts)),
            "tokens": longest + self.max_new_tokens,
            "kv_cache": True,
            "stages": self.pipeline_stages,
            "prompt_tokens": longest,
        }

    def inputs(self, spec: RunSpec) -> list[str]:
        from runner.generation.completions import read_prompts

        return read_prompts(self.prompts, self.prompt_field)

    def run(
        self, spec: RunSpec, run_dir: Path, ranks: Ranks, identity: RunIdentity, inputs: Optional[list[str]] = None
    ) -> dict[str, Any]:
        from runner.generation.completions import generate_completions

        prompts = inputs if inputs is not None else self.inputs(spec)
        return generate_completions(self, spec, run_dir, ranks, prompts)
