"""How close the memory estimate comes to what a GPU really allocates: a script for a CUDA machine, not a test.

For each config of a grid it trains a few steps with the `run` command (task.fit_check=false, so that the
estimate does not decide what runs), reads rank 0's peak `torch.cuda.max_memory_allocated` from the run's
summary.json, and compares it with the estimated peak per device of the same spec (runner/memory/). The goal
is within +-10%. Configs that need more GPUs than the machine has are skipped.

    python bench/memory_accuracy.py                        # the whole grid, a table on stdout
    python bench/memory_accuracy.py --only fsdp --steps 4  # the configs whose name contains "fsdp"
    python bench/memory_accuracy.py --out docs/memory_accuracy_gpu.md

A config that runs out of memory is reported as such (the estimate said so, or it was wrong).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Llama-3.2-1B's architecture, random init: large enough that fixed overheads (the CUDA context is not counted by
# max_memory_allocated anyway, but kernels' workspaces are) stay small, small enough for one 80 GB GPU.
MODEL = ["model=llama3_2_1b"]
GRID: dict[str, list[str]] = {
    "single fp32, 2 x 512": ["strategy=single", "precision=fp32", "train.micro_batch_size=2", "data.seq_len=512"],
    "single bf16, 2 x 512": ["strategy=single", "precision=bf16", "train.micro_batch_size=2", "data.seq_len=512"],
    "single bf16, 4 x 2048": ["strategy=single", "precision=bf16", "train.micro_batch_size=4", "data.seq_len=2048"],
    "single bf16, SGD momentum, 2 x 1024": [
        "strategy=single",
        "precision=bf16",
        "optim=sgd",
        "train.micro_batch_size=2",
        "data.seq_len=1024",
    ],
    "single bf16, 2 x 1024, 4 accumulation steps": [
        "strategy=single",
        "precision=bf16",
        "train.micro_batch_size=2",
        "data.seq_len=1024",
        "train.grad_accum_steps=4",
    ],
    "single pure bf16, 2 x 1024": [
        "strategy=single",
        "precision=pure_bf16",
        "train.micro_batch_size=2",
        "data.seq_len=1024",
    ],
    "fsdp FULL_SHARD bf16, 1 GPU, 4 x 1024": [
        "strategy=fsdp",
        "precision=bf16",
        "train.micro_batch_size=4",
        "data.seq_len=1024",
    ],
    "fsdp bf16 + activation checkpointing, 1 GPU, 8 x 2048": [
        "strategy=fsdp",
        "precision=bf16",
        "strategy.activation_checkpointing=true",
        "train.micro_batch_size=8",
        "data.seq_len=2048",
    ],
    "fsdp bf16 + offload_params, 1 GPU, 2 x 1024": [
        "strategy=fsdp",
        "precision=bf16",
        "strategy.offload_params=true",
        "train.micro_batch_size=2",
        "data.seq_len=1024",
    ],
    "deepspeed ZeRO-2 bf16, 1 GPU, 2 x 1024": [
        "strategy=deepspeed",
        "strategy.zero_stage=2",
        "precision=bf16",
        "train.micro_batch_size=2",
        "data.seq_len=1024",
    ],
    "deepspeed ZeRO-3 bf16, 1 GPU, 2 x 1024": [
        "strategy=deepspeed",
        "strategy.zero_stage=3",
        "precision=bf16",
        "train.micro_batch_size=2",
        "data.seq_len=1024",
    ],
    "ddp bf16, 2 GPUs, 2 x 1024": [
        "strategy=ddp",
        "precision=bf16",
        "hardware.nproc_per_node=2",
        "train.micro_batch_size=2",
        "data.seq_len=1024",
    ],
    "fsdp FULL_SHARD bf16, 2 GPUs, 2 x 1024": [
        "strategy=fsdp",
        "precision=bf16",
        "hardware.nproc_per_node=2",
        "train.micro_batch_size=2",
        "data.seq_len=1024",
    ],
    "fsdp SHARD_GRAD_OP bf16, 2 GPUs, 2 x 1024": [
        "strategy=fsdp",
        "strategy.sharding_strategy=SHARD_GRAD_OP",
        "precision=bf16",
        "hardware.nproc_per_node=2",
        "train.micro_batch_size=2",
        "data.seq_len=1024",
    ],
    "deepspeed ZeRO-3 bf16, 2 GPUs, 2 x 1024": [
        "strategy=deepspeed",
        "strategy.zero_stage=3",
        "precision=bf16",
        "hardware.nproc_per_node=2",
        "train.micro_batch_size=2",
        "data.seq_len=1024",
    ],
}
SHORT_RUN = [
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.save_model=false",
    "task.fit_check=false",
]


def processes(grid_overrides: list[str]) -> int:
    """The GPUs a config of the grid runs on."""
    return next((int(o.split("=")[1]) for o in grid_overrides if o.startswith("hardware.nproc_per_node=")), 1)


def config_overrides(grid_overrides: list[str], steps: int) -> list[str]:
    """`run`'s overrides for a config of the grid: the model, the config on this machine's GPUs, a short run."""
    return [
        *MODEL,
        "hardware=auto",
        f"hardware.nproc_per_node={processes(grid_overrides)}",
        *grid_overrides,
        *SHORT_RUN,
        f"train.max_steps={steps}",
    ]


def estimated(overrides: list[str]):
    from runner.cli.compose import compose_config
    from runner.config.spec import load_spec, validate
    from runner.memory.breakdown import estimate
    from runner.memory.model_shapes import facts_of

    spec = validate(load_spec(compose_config(overrides)))
    result = estimate(spec, facts_of(spec.model))
    return result.peak / 1024**3, result.peak_phase.value


def measured(overrides: list[str], timeout: int) -> tuple[Optional[float], str]:
    """Rank 0's peak allocated GiB over a short run, or None and why not."""
    with tempfile.TemporaryDirectory() as workdir:
        try:
            done = subprocess.run(
                [sys.executable, "-m", "runner", *overrides],
                cwd=workdir,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return None, "timed out"
        summaries = list(Path(workdir).glob("outputs/*/*/summary.json"))
        if done.returncode != 0 or not summaries:
            error = (done.stderr.strip().splitlines() or ["failed"])[-1]
            return None, "out of memory" if "out of memory" in done.stderr.lower() else error[:120]
        return json.loads(summaries[0].read_text())["peak_memory_gib"], ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run only the configs whose name contains this")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per config")
    parser.add_argument("--out", type=Path, help="also write the table (markdown) to this file")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("memory_accuracy.py needs a CUDA GPU: it compares the estimate with torch.cuda.max_memory_allocated")
    gpus = torch.cuda.device_count()
    device = torch.cuda.get_device_name(0)
    rows = ["| config | estimated peak (GiB) | when | measured peak (GiB) | error |", "|---|---|---|---|---|"]
    print(f"{device}, {gpus} GPU(s), torch {torch.__version__}; {' '.join(MODEL)}, {args.steps} steps per config")
    for name, grid_overrides in GRID.items():
        if args.only not in name:
            continue
        nproc = processes(grid_overrides)
        if nproc > gpus:
            print(f"skipped {name}: needs {nproc} GPUs")
            continue
        overrides = config_overrides(grid_overrides, args.steps)
        estimate, phase = estimated(overrides)
        started = time.perf_counter()
        peak, problem = measured(overrides, args.timeout)
        error = f"{(estimate - peak) / peak:+.1%}" if peak else problem
        rows.append(f"| {name} | {estimate:.2f} | {phase} | {f'{peak:.2f}' if peak else '-'} | {error} |")
        print(rows[-1], f"({time.perf_counter() - started:.0f} s)", flush=True)
    table = "\n".join(rows)
    print()
    print(table)
    if args.out:
        args.out.write_text(
            f"Measured on {device} x {gpus}, torch {torch.__version__}, {' '.join(MODEL)}, "
            f"{args.steps} steps per config (bench/memory_accuracy.py).\n\n{table}\n"
        )


if __name__ == "__main__":
    main()
