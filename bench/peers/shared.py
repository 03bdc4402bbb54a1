"""What the peer scripts share with the harness: the plan it writes, the token rows, and the timestamped log.

The plan holds the runner's own settings (resolved by bench/compare_loops.py from the runner's spec), so every
contender trains the same model from the runner's initial weights (`initial_model`: its seed, and its way of
drawing them) on the same rows with the same optimizer.

Two workloads: text, rows of seq_len tokens (one tensor, a row per line); and instruction, one prompt/response
example per row, of its own length (a list of (input_ids, labels) pairs, the prompt's labels IGNORE), which each
peer pads per micro batch itself.
"""

import argparse
import json
import sys
import time
from pathlib import Path

IGNORE = -100  # the label of prompt and padding positions, as in the runner and transformers


def arguments() -> tuple[argparse.Namespace, dict]:
    """A peer script's command line (what the harness passes every contender) and the plan it names."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", required=True)
    parser.add_argument("--records", required=True)
    parser.add_argument("--strategy", choices=["single", "ddp", "fsdp"], default="single")
    parser.add_argument(
        "--collator",
        choices=["padding", "flattening"],
        default="padding",
        help="instruction rows, the Trainer only: its padding collator (DataCollatorForSeq2Seq), or "
        "the padding-free DataCollatorWithFlattening",
    )
    args = parser.parse_args()
    return args, json.loads(Path(args.plan).read_text())


def initial_model(plan: dict):
    """The plan's model in fp32 on the CPU with the runner's initial weights: seeded with its seed and built as
    runner/components/modeling.py builds it, each weight drawn once by transformers' own init (torch's per-layer init
    skipped). A plain `torch.manual_seed(seed); AutoModelForCausalLM.from_config(config)` draws torch's init first
    and then transformers', so the same seed gives other weights: on the default tiny model its step-1 loss is
    5.4557 where the runner's is 5.4107, on the same rows, before any update."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights  # transformers 5
    except ImportError:
        from transformers.modeling_utils import no_init_weights  # transformers 4

    torch.manual_seed(plan["seed"])
    with torch.device("cpu"), no_init_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(plan["model_config"]), dtype=torch.float32)
    model.init_weights()
    return model


def token_rows(plan: dict):
    """Every global batch's rows, in training order: global batch k is rows [k * G, (k + 1) * G) (text blocks, or
    instruction examples); then the rows of the runner's evaluation before its first step, when the plan asks for it
    (else None).

    Throughput runs read the file the harness wrote. Start-up runs (text) read and tokenize the text here, as a
    script of one's own would, with the runner's tokenizer and blocks (runner/data/pack.py) so that the rows are
    the runner's."""
    import torch

    if plan["rows"]:
        return torch.load(plan["rows"]), None
    return runner_rows(
        plan["text_files"],
        plan["seq_len"],
        plan["seed"],
        plan["global_batch"],
        plan["max_steps"],
        plan["eval_batches"] * plan["micro_batch_size"],
    )


def _runner_global_batches(data, seed: int, global_batch: int):
    """The runner's tokenizer, and its global batches of unpacked rows: one rank taking each whole global batch in
    one micro batch (runner/data/batches.py cuts each global batch into the ranks' contiguous slices, so that rank
    sees every rank's rows); and its eval split."""
    from runner.components.modeling import byte_tokenizer
    from runner.data.batches import train_batches
    from runner.data.splits import token_splits

    tokenizer = byte_tokenizer()
    train_set, eval_set = token_splits(data, tokenizer, seed)
    batches = train_batches(
        train_set,
        micro_batch_size=global_batch,
        grad_accum_steps=1,
        dp_rank=0,
        dp_size=1,
        seed=seed,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer, (batch.micro_batches[0] for batch in batches), eval_set


def runner_rows(text_files: str, seq_len: int, seed: int, global_batch: int, steps: int, eval_rows: int = 0):
    """The rows the runner trains on in its first `steps` steps, whatever its processes, as one tensor. And the
    first `eval_rows` rows of its eval split, which its evaluations read (None for none)."""
    import torch

    from runner.config.data import DataConfig
    from runner.data.batches import eval_batches

    tokenizer, batches, eval_set = _runner_global_batches(
        DataConfig(files=text_files, seq_len=seq_len), seed, global_batch
    )
    train_rows = torch.cat([next(batches).inputs["input_ids"] for _ in range(steps)])
    if not eval_rows:
        return train_rows, None
    evaluated = eval_batches(
        eval_set, micro_batch_size=eval_rows, max_batches=1, dp_rank=0, dp_size=1, pad_token_id=tokenizer.pad_token_id
    )
    return train_rows, next(evaluated).inputs["input_ids"]


def instruction_rows(files: str, seq_len: int, seed: int, global_batch: int, steps: int) -> list[tuple]:
    """The runner's instruction rows of its first `steps` steps (one example per row, truncated to seq_len, not
    packed), in its global-batch order, unpadded: (input_ids, labels) tensors of each row's own length."""
    import torch

    from runner.config.data import DataConfig, DataFormat

    _, batches, _ = _runner_global_batches(
        DataConfig(files=files, format=DataFormat.instruction, seq_len=seq_len), seed, global_batch
    )
    rows = []
    for _ in range(steps):
        batch = next(batches)
        masks = batch.inputs.get("attention_mask", torch.ones_like(batch.inputs["input_ids"]))  # none: unpadded
        for ids, mask, labels in zip(batch.inputs["input_ids"], masks, batch.labels):
            length = int(mask.sum())  # right-padded
            rows.append((ids[:length].clone(), labels[:length].clone()))
    return rows


def padded(rows: list[tuple], pad_token_id: int) -> dict:
    """A micro batch of instruction rows, right-padded to its longest: input_ids, attention_mask, and labels with
    IGNORE on the padding (and, as in the rows, on the prompt)."""
    import torch

    length = max(len(ids) for ids, _ in rows)
    batch = {
        "input_ids": torch.full((len(rows), length), pad_token_id),
        "attention_mask": torch.zeros((len(rows), length), dtype=torch.long),
        "labels": torch.full((len(rows), length), IGNORE),
    }
    for i, (ids, labels) in enumerate(rows):
        batch["input_ids"][i, : len(ids)] = ids
        batch["attention_mask"][i, : len(ids)] = 1
        batch["labels"][i, : len(ids)] = labels
    return batch


def real_tokens(rows) -> int:
    """The tokens of some rows, padding aside: a text block's are all real; an instruction row's, its length."""
    if isinstance(rows, list):
        return sum(len(ids) for ids, _ in rows)
    return rows.numel()


def evaluate_first(model, rows, micro_batch_size: int, device, log: "StepLog") -> None:
    """Evaluates the runner's eval rows, when there are any, before the first step, as the default run does: the
    mean next-token loss over them, logged at step 0 like the runner's."""
    import torch

    if rows is None:
        return
    model.eval()
    with torch.no_grad():
        losses = [
            model(input_ids=batch.to(device), labels=batch.to(device)).loss for batch in rows.split(micro_batch_size)
        ]
    log.record(0, eval_loss=torch.stack(losses).mean().item())  # every row is a whole block: the batches weigh the same
    model.train()


def peak_memory_gib() -> float:
    """This process's peak resident memory, read as the runner reads its own on the CPU."""
    from runner.engine.metrics import peak_resident_kib

    return peak_resident_kib() / 1024**2


class StepLog:
    """The window-mean loss at each logged step (or an eval loss), the real tokens trained on so far (all processes
    together; padding aside, like the runner's tokens_seen), this process's peak memory, and the wall-clock time
    it was logged at, written as JSON lines like the runner's metrics.jsonl."""

    def __init__(self, path: str):
        self._path = Path(path)
        self._records: list[dict] = []

    def record(self, step: int, **values: float) -> None:
        self._records.append({"step": step, **values, "peak_memory_gib": peak_memory_gib(), "time": time.time()})

    def save(self) -> None:
        self._path.write_text("".join(json.dumps(record) + "\n" for record in self._records))


def unsupported(reason: str) -> None:
    """Stops a contender that cannot run this config here; the harness shows the reason instead of a figure."""
    print(f"unsupported: {reason}", flush=True)
    sys.exit(4)
