"""bf16 against fp8 on one GPU: tokens/s and MFU of Llama-3.2-1B's architecture, single and FSDP (not a test).

    python bench/precision_throughput.py                      # one GPU: strategy=single and fsdp, 40 steps each
    python bench/precision_throughput.py --strategies fsdp hardware.nproc_per_node=8   # all GPUs of the machine
    python bench/precision_throughput.py --compile            # each precision eager and with train.compile=true

Each row is a real `run` of the runner in its own process; the figures come from its metrics.jsonl
(the steady state: the first logged window, which holds the warm-up, is left out). MFU is against the GPU's
dense bf16 peak for every row, so the fp8 rows show how much more of that peak the same work reaches. FSDP on
one GPU shards nothing; it measures what FSDP2's wrapping and mixed-precision policy cost against a plain model.
With --compile, each precision also runs with its transformer blocks compiled; the compile time is the run's
summary.json `compile_time_s`, left out of its step times and so of its tokens/s.
Prints a Markdown table to paste into docs/benchmarks.md with the date and the GPU.
"""

import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# Llama-3.2-1B's shapes (1.24B parameters; fp8 converts the blocks' linear layers, all 2048 wide and more).
MODEL = ["model=llama3_2_1b"]
RUN = [
    "data.seq_len=2048",
    "train.micro_batch_size=4",
    "train.max_steps=40",
    "train.log_every=10",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.save_model=false",
]
STRATEGIES = {"single": ["strategy=single"], "fsdp": ["strategy=fsdp"]}
PRECISIONS = {
    "bf16": ["precision=bf16"],
    "fp8 tensorwise": ["precision=fp8"],
    "fp8 rowwise": ["precision=fp8", "precision.fp8.recipe=rowwise"],
}


def measure(overrides: list[str], workdir: Path) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "runner", *overrides, f"hydra.run.dir={workdir}"], capture_output=True, text=True
    )
    if result.returncode != 0:
        return {"error": result.stderr.strip().splitlines()[-1]}
    return steady_state(workdir)


def steady_state(workdir: Path) -> dict:
    """A finished run's figures, from its run directory: tokens/s and MFU of the steady state, the peak memory."""
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((workdir / "summary.json").read_text())
    steady = [r for r in records if "tokens_per_s" in r][1:]
    return {
        "tokens_per_s": sum(r["tokens_per_s"] for r in steady) / len(steady),
        "mfu": sum(r.get("mfu", 0.0) for r in steady) / len(steady),
        "peak_memory_gib": max(r["peak_memory_gib"] for r in steady),
        "precision": summary["precision"],
        "compile_time_s": summary.get("compile_time_s", 0.0),
    }


def main() -> None:
    import torch

    if not torch.cuda.is_available():
        sys.exit("precision_throughput: needs a CUDA GPU (fp8 needs compute capability 8.9+)")
    args = sys.argv[1:]
    strategies = list(STRATEGIES)
    compile_modes = {"eager": []}
    if "--compile" in args:
        args.remove("--compile")
        compile_modes["compiled"] = ["train.compile=true"]
    if "--strategies" in args:
        at = args.index("--strategies")
        strategies = args[at + 1].split(",")
        del args[at : at + 2]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in strategies:
            for name, precision in PRECISIONS.items():
                for mode, compiling in compile_modes.items():
                    workdir = Path(tmp) / f"{strategy}_{name.replace(' ', '_')}_{mode}"
                    rows[strategy, name, mode] = measure(
                        [*MODEL, *RUN, *STRATEGIES[strategy], *precision, *compiling, *args], workdir
                    )
    print(
        f"{datetime.date.today()} | {torch.cuda.get_device_name()} | torch {torch.__version__} | "
        f"overrides: {' '.join(args) or '(none)'}\n"
    )
    print(
        "| strategy | precision | blocks | tokens/s | vs bf16 eager | MFU | peak memory GiB | compile s | "
        "fp8 linear layers |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for (strategy, name, mode), row in rows.items():
        if "error" in row:
            print(f"| {strategy} | {name} | {mode} | failed: {row['error']} | | | | | |")
            continue
        base = rows[strategy, "bf16", "eager"].get("tokens_per_s")
        ratio = f"{row['tokens_per_s'] / base:.2f}x" if base else "-"
        print(
            f"| {strategy} | {name} | {mode} | {row['tokens_per_s']:.0f} | {ratio} | {row['mfu']:.1%} | "
            f"{row['peak_memory_gib']:.1f} | {row['compile_time_s']:.0f} | "
            f"{row['precision'].get('fp8_linear_layers', 0)} |"
        )


if __name__ == "__main__":
    main()
