"""The `train` section: steps, batch sizes, clipping, and how often the loop logs, evaluates and checkpoints."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from runner.config.fields import setting
from runner.errors import require


class LossKind(str, Enum):
    """How the summed next-token loss is computed (runner/engine/loss.py)."""

    # chunked where it is exact for the model type (Llama, Mistral, Qwen 2 and 3) and the vocabulary is large enough
    # for the logits to matter, else full
    auto = "auto"
    # the head on the label positions only, chunk by chunk: the whole batch's fp32 logits never exist
    chunked = "chunked"
    # the model's own forward and its logits
    full = "full"


# Model types whose causal-LM forward is exactly `lm_head(last_hidden_state)`: no logit soft-capping or scaling and
# no auxiliary loss, so the chunked sum equals the full one. Others keep the full loss under train.loss=auto.
PLAIN_HEADS = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# Below this vocabulary the logits cost about what the hidden states do (a byte-level model's 259 against 128), and
# chunking, which runs the head again in backward, saves no memory worth that time.
CHUNKED_FROM_VOCAB = 16_384


def loss_kind_in_effect(requested: LossKind, model_type: str, vocab_size: int) -> LossKind:
    if requested is LossKind.auto:
        chunked = model_type in PLAIN_HEADS and vocab_size >= CHUNKED_FROM_VOCAB
        return LossKind.chunked if chunked else LossKind.full
    return requested


@dataclass
class TrainConfig:
    max_steps: int = setting(200, "Optimizer steps the run trains for.")
    micro_batch_size: int = setting(
        8,
        "Rows per process in one forward and backward; the global batch is micro_batch_size x data-parallel ranks x "
        "grad_accum_steps.",
    )
    grad_accum_steps: int = setting(1, "Micro batches whose gradients add up before each optimizer step.")
    max_grad_norm: float = setting(1.0, "Clip the global gradient norm to this; 0 turns clipping off.")
    log_every: int = setting(
        20,
        "Log the loss, learning rate, throughput and memory every N optimizer steps, and after the last.",
    )
    eval_every: int = setting(
        50,
        "Evaluate every N optimizer steps, and always before the first and after the last; 0: only those two.",
    )
    eval_batches: int = setting(16, "Micro batches of held-out rows each evaluation computes the loss on.")
    checkpoint_every: int = setting(
        0,
        "Write a checkpoint every N optimizer steps (and after the last); 0: only after the last.",
    )
    keep_checkpoints: int = setting(
        2,
        "How many of the newest checkpoints are kept; older ones are deleted once a newer one is complete.",
    )
    save_model: bool = setting(
        True,
        "Save the trained model (save_pretrained, with its tokenizer) to <run dir>/model at the end.",
    )
    stall_report_s: float = setting(
        300.0,
        "A rank that spends this many seconds in one step, evaluation or checkpoint says where it waits (0: never).",
    )
    collective_timeout_s: Optional[float] = setting(
        None,
        "How long a collective waits for every rank of its group before it ends the job (torch's process group "
        "timeout, transformers' ddp_timeout); null: three stall reports, and at least 10 minutes.",
    )
    loss: LossKind = setting(
        LossKind.auto,
        "How the summed next-token loss is computed: chunked (the head on the label positions only, chunk by chunk: "
        "the whole batch's fp32 logits never exist), full (the model's own logits), or auto: chunked where it is exact "
        "(Llama, Mistral, Qwen 2 and 3) and the vocabulary large enough to matter.",
    )
    loss_chunk_tokens: int = setting(
        1024,
        "Label positions per chunk of the chunked loss: its logits are the largest transient of a step.",
    )
    compile: bool = setting(
        False,
        "torch.compile each transformer block (torchtitan's way: compile time does not grow with depth).",
    )
    benchmarks: list[str] = setting(
        [],
        "lm-evaluation-harness tasks scored on the model as it is placed for training: lm-eval task names, the "
        "runner's own (recipes/benchmarks/: local_arc_easy, ...) or task YAML files (docs/benchmark_scores.md).",
    )
    benchmark_every: int = setting(
        0,
        "Score train.benchmarks every N optimizer steps, and always after the last; 0: only after the last.",
    )
    benchmark_limit: Optional[int] = setting(
        None,
        "Documents of each benchmark scored (lm-eval's `limit`); null: all of them.",
    )
    keep_best: Optional[str] = setting(
        None,
        "Keep, besides the last checkpoints, the one with the best value of this metric: eval_loss (lowest), a "
        "benchmark's (bench/<task>/<metric>, as lm-eval ranks it) or the task's own eval metric.",
    )


def check(train: TrainConfig) -> None:
    for key in ("max_steps", "micro_batch_size", "grad_accum_steps", "log_every", "eval_batches", "loss_chunk_tokens"):
        value = getattr(train, key)
        require(value > 0, f"train.{key}={value} must be a positive integer")
    require(train.checkpoint_every >= 0, f"train.checkpoint_every={train.checkpoint_every} must be >= 0")
    require(train.keep_checkpoints >= 1, f"train.keep_checkpoints={train.keep_checkpoints} must be >= 1")
    require(train.eval_every >= 0, f"train.eval_every={train.eval_every} must be >= 0 (0 evaluates only at the end)")
    require(train.stall_report_s >= 0, f"train.stall_report_s={train.stall_report_s} must be >= 0 (0: no reports)")
    require(
        train.collective_timeout_s is None or train.collective_timeout_s > 0,
        f"train.collective_timeout_s={train.collective_timeout_s} must be > 0 seconds, or null: three stall "
        "reports (train.stall_report_s), and at least 600",
    )
    require(
        train.benchmark_every >= 0,
        f"train.benchmark_every={train.benchmark_every} must be >= 0 (0 scores the "
        "benchmarks only after the last step)",
    )
    require(
        train.benchmark_limit is None or train.benchmark_limit > 0,
        f"train.benchmark_limit={train.benchmark_limit} must be a positive number of documents, or null for all",
    )
    require(train.max_grad_norm >= 0, f"train.max_grad_norm={train.max_grad_norm} must be >= 0 (0 turns clipping off)")
