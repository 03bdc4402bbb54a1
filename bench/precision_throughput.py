"""bf16 against fp8 on one GPU machine: tokens/s and MFU of the same model, strategy and batch (not a test).

    python bench/precision_throughput.py                      # a 1.3B Llama, strategy=single, 40 steps
    python bench/precision_throughput.py strategy=fsdp hardware.nproc_per_node=8

Each precision is a real `run` of the runner in its own process; the figures come from its metrics.jsonl
(the steady state: the first logged window, which holds the warm-up, is left out). MFU is against the GPU's
dense bf16 peak for both rows, so the fp8 row shows how much more of that peak the same work reaches.
Prints a Markdown table to paste into docs/benchmarks.md with the date and the GPU.
"""

import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# About 1.3B parameters with widths fp8 pays off at (torchao: both matmul dimensions of 2048 and more).
MODEL = [
    "model.architecture.hidden_size=2048",
    "model.architecture.intermediate_size=8192",
    "model.architecture.num_hidden_layers=24",
    "model.architecture.num_attention_heads=16",
    "model.architecture.num_key_value_heads=8",
    "model.architecture.max_position_embeddings=2048",
]
RUN = ["data.seq_len=2048", "train.micro_batch_size=4", "train.max_steps=40", "train.log_every=10",
       "train.eval_every=0", "train.eval_batches=1", "train.save_model=false"]
PRECISIONS = {"bf16": ["precision=bf16"], "fp8 tensorwise": ["precision=fp8"],
              "fp8 rowwise": ["precision=fp8", "precision.fp8.recipe=rowwise"]}


def measure(overrides: list[str], workdir: Path) -> dict:
    result = subprocess.run([sys.executable, "-m", "runner", *overrides, f"hydra.run.dir={workdir}"],
                            capture_output=True, text=True)
    if result.returncode != 0:
        return {"error": result.stderr.strip().splitlines()[-1]}
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if "tokens_per_s" in r][1:]
    return {
        "tokens_per_s": sum(r["tokens_per_s"] for r in steady) / len(steady),
        "mfu": sum(r.get("mfu", 0.0) for r in steady) / len(steady),
        "peak_memory_gib": max(r["peak_memory_gib"] for r in steady),
        "precision": json.loads((workdir / "summary.json").read_text())["precision"],
    }


def main() -> None:
    import torch

    if not torch.cuda.is_available():
        sys.exit("precision_throughput: needs a CUDA GPU (fp8 needs compute capability 8.9+)")
    extra = sys.argv[1:]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, precision in PRECISIONS.items():
            rows[name] = measure([*MODEL, *RUN, *precision, *extra], Path(tmp) / name.replace(" ", "_"))
    print(f"{datetime.date.today()} | {torch.cuda.get_device_name()} | torch {torch.__version__} | "
          f"overrides: {' '.join(extra) or '(none)'}\n")
    print("| precision | tokens/s | vs bf16 | MFU | peak memory GiB | fp8 linear layers |")
    print("|---|---|---|---|---|---|")
    base = rows["bf16"].get("tokens_per_s")
    for name, row in rows.items():
        if "error" in row:
            print(f"| {name} | failed: {row['error']} | | | | |")
            continue
        ratio = f"{row['tokens_per_s'] / base:.2f}x" if base else "-"
        print(f"| {name} | {row['tokens_per_s']:.0f} | {ratio} | {row['mfu']:.1%} | {row['peak_memory_gib']:.1f} | "
              f"{row['precision'].get('fp8_linear_layers', 0)} |")


if __name__ == "__main__":
    main()
