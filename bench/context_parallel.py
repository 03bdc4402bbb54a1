"""Context, sequence and tensor parallelism on two GPUs or more (not a test): the same losses as one GPU, and what
each layout costs and holds at long sequences.

    python bench/context_parallel.py                 # 2 GPUs: losses, then tokens/s and peak memory at 16k tokens
    python bench/context_parallel.py --gpus 4        # cp 4 and tp 4 too
    python bench/context_parallel.py --seq-len 32768

torch's ring attention runs on CUDA's kernels only, so the CPU tests (tests/parallel/test_context_parallel.py) check
what surrounds it; this is where the ring itself is checked:

1. Losses. Llama-3.2-1B's shapes in fp32 (SDPA's memory-efficient kernel, which the ring splits), 10 steps at
   the same seed and global batch: one GPU, then cp = 2 (and 4), then tp = 2 (and 4). Each layout's per-step
   losses against one GPU's, as the largest relative difference: the CPU tests hold tp to 1e-5.
2. Cost. The same model in bf16 with activation checkpointing at --seq-len tokens: FSDP over the GPUs, FSDP x cp,
   FSDP x tp (eager, compiled, and async: strategy.async_tp, the compiled blocks overlapping each split layer's
   collectives with its matmul), and DeepSpeed ZeRO-3 x sp (Ulysses, whose losses the CPU tests hold to 1e-5).
   Tokens/s and MFU of the steady state, and the peak memory, which cp, sp and tp should divide (the estimate's
   figure beside it, from `run task=estimate`).

Each row is a real `run` of the runner in its own process, read from its metrics.jsonl and summary.json. Prints
Markdown to paste into docs/benchmarks.md with the date and the GPUs.
"""

import argparse
import datetime
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = [
    "model=llama3_2_1b",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.save_model=false",
    "train.log_every=1",
]
LOSSES = [
    "precision=fp32",
    "data.seq_len=4096",
    "train.micro_batch_size=1",
    "train.grad_accum_steps=2",
    "train.max_steps=10",
]
COST = ["precision=bf16", "strategy.activation_checkpointing=true", "train.micro_batch_size=1", "train.max_steps=20"]


def run(overrides: list[str], workdir: Path) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "runner", *overrides, f"hydra.run.dir={workdir}"], capture_output=True, text=True
    )
    if result.returncode != 0:
        return {"error": (result.stderr.strip().splitlines() or ["(no output)"])[-1]}
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and "tokens_per_s" in r]
    steady = steps[len(steps) // 4 :]
    return {
        "losses": [r["loss"] for r in steps],
        "tokens_per_s": sum(r["tokens_per_s"] for r in steady) / len(steady),
        "mfu": sum(r.get("mfu", 0.0) for r in steady) / len(steady),
        "peak_memory_gib": max(r["peak_memory_gib"] for r in steps),
    }


def estimated_peak(overrides: list[str]) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "runner", "task=estimate", *overrides], capture_output=True, text=True
    )
    found = re.search(r"^\s+peak\s+([\d.]+) GiB", result.stdout, re.MULTILINE)
    return found.group(1) if found else "-"


def sizes(gpus: int) -> list[int]:
    return [size for size in (2, 4, 8) if size <= gpus and gpus % size == 0]


def splits(size: int) -> dict[str, list[str]]:
    """The layouts whose `size` ranks all run the same rows (one data-parallel rank), each split its own way: their
    losses are one GPU's. (Ulysses's are held on the CPU.)"""
    return {
        f"fsdp x cp {size}": ["strategy=fsdp", f"strategy.cp_size={size}"],
        f"fsdp x tp {size}": ["strategy=fsdp", f"strategy.tp_size={size}"],
    }


def layouts(gpus: int) -> dict[str, list[str]]:
    """Each layout's overrides on `gpus` processes: the strategy, then the split."""
    found = {"fsdp": ["strategy=fsdp"]}
    for size in sizes(gpus):
        found.update(splits(size))
        compiled = [*found[f"fsdp x tp {size}"], "train.compile=true"]
        found[f"fsdp x tp {size}, compiled"] = compiled
        found[f"fsdp x tp {size}, async"] = [*compiled, "strategy.async_tp=true"]
        found[f"zero-3 x sp {size}"] = ["strategy=deepspeed", "strategy.zero_stage=3", f"strategy.sp_size={size}"]
    return {name: [f"hardware.nproc_per_node={gpus}", *overrides] for name, overrides in found.items()}


def main() -> None:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=16384)
    args = parser.parse_args()
    if torch.cuda.device_count() < max(2, args.gpus):
        sys.exit(f"context_parallel: needs {max(2, args.gpus)} CUDA GPUs; this machine has {torch.cuda.device_count()}")
    print(f"{datetime.date.today()} | {args.gpus} x {torch.cuda.get_device_name()} | torch {torch.__version__}\n")
    with tempfile.TemporaryDirectory() as tmp:
        # The global batch is micro batch x data-parallel ranks x accumulation: cp and tp ranks run the same rows,
        # so each layout keeps one data-parallel rank and the one-GPU run's batch.
        one = run([*MODEL, *LOSSES, "strategy=fsdp"], Path(tmp) / "one")
        print("| layout (fp32, 10 steps) | largest relative loss difference from one GPU |\n|---|---|")
        for size in sizes(args.gpus):
            for name, overrides in splits(size).items():
                row = run(
                    [*MODEL, *LOSSES, f"hardware.nproc_per_node={size}", *overrides], Path(tmp) / f"losses {name}"
                )
                if "error" in row or "error" in one:
                    print(f"| {name} | failed: {row.get('error') or one.get('error')} |")
                    continue
                worst = max(abs(a - b) / abs(b) for a, b in zip(row["losses"], one["losses"]))
                print(f"| {name.removeprefix('fsdp x ')} | {worst:.1e} |")
        print(
            f"\n| layout (bf16, {args.seq_len} tokens, checkpointed) | tokens/s | MFU | peak GiB | estimated "
            "peak GiB |\n|---|---|---|---|---|"
        )
        for name, overrides in layouts(args.gpus).items():
            settings = [*MODEL, *COST, f"data.seq_len={args.seq_len}", *overrides]
            row = run(settings, Path(tmp) / f"cost {name}")
            if "error" in row:
                print(f"| {name} | failed: {row['error']} | | | |")
                continue
            print(
                f"| {name} | {row['tokens_per_s']:.0f} | {row['mfu']:.1%} | {row['peak_memory_gib']:.1f} | "
                f"{estimated_peak([*settings, 'hardware=auto'])} |"
            )


if __name__ == "__main__":
    main()
