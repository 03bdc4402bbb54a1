"""What the peer scripts share with the harness: the plan it writes, the token rows, and the timestamped log.

The plan holds the runner's own settings (resolved by bench/compare_loops.py from the runner's spec), so every
contender trains the same model from the same seed on the same rows with the same optimizer.
"""

import argparse
import json
import sys
import time
from pathlib import Path


def arguments() -> tuple[argparse.Namespace, dict]:
    """A peer script's command line (what the harness passes every contender) and the plan it names."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", required=True)
    parser.add_argument("--records", required=True)
    parser.add_argument("--strategy", choices=["single", "ddp", "fsdp"], default="single")
    args = parser.parse_args()
    return args, json.loads(Path(args.plan).read_text())


def token_rows(plan: dict):
    """Every global batch's rows, in training order: global batch k is rows [k * G, (k + 1) * G).

    Throughput runs read the file the harness wrote. Start-up runs read and tokenize the text here, as a script of
    one's own would, with the runner's tokenizer and packing (runner.data) so that the rows are the runner's."""
    import torch

    if plan["rows"]:
        return torch.load(plan["rows"])
    return runner_rows(plan["text_files"], plan["seq_len"], plan["seed"], plan["global_batch"], plan["max_steps"])


def runner_rows(text_files: str, seq_len: int, seed: int, global_batch: int, steps: int):
    """The rows the runner trains on in its first `steps` steps, whatever its processes: runner.data cuts each
    global batch into the ranks' contiguous slices, so one rank taking the whole global batch sees them all."""
    import torch

    from runner.data import DataConfig, build_datasets, train_batches
    from runner.model import byte_tokenizer

    tokenizer = byte_tokenizer()
    train_set, _ = build_datasets(DataConfig(files=text_files, seq_len=seq_len), tokenizer, seed)
    batches = train_batches(train_set, micro_batch_size=global_batch, grad_accum_steps=1, dp_rank=0, dp_size=1,
                            seed=seed, pad_token_id=tokenizer.pad_token_id)
    return torch.cat([next(batches)[0]["input_ids"] for _ in range(steps)])


class StepLog:
    """The window-mean loss at each logged step and the wall-clock time it was logged at, written as JSON lines
    like the runner's metrics.jsonl."""

    def __init__(self, path: str):
        self._path = Path(path)
        self._records: list[dict] = []

    def record(self, step: int, loss: float) -> None:
        self._records.append({"step": step, "loss": loss, "time": time.time()})

    def save(self) -> None:
        self._path.write_text("".join(json.dumps(record) + "\n" for record in self._records))


def unsupported(reason: str) -> None:
    """Stops a contender that cannot run this config here; the harness shows the reason instead of a figure."""
    print(f"unsupported: {reason}", flush=True)
    sys.exit(4)
