"""Expert parallelism and the expert kernels, measured (not a test): tokens/s of a small Qwen3-MoE.

    python bench/moe_throughput.py                  # CPU: 4 processes, fsdp 2 x ep 2 against fsdp 4 (experts
                                                    # gathered whole at every layer by FSDP), and 2: ep 2 against fsdp 2
    python bench/moe_throughput.py --kernels        # one GPU: model.experts_kernel=grouped_mm against eager
    python bench/moe_throughput.py --repeats 3

Under FSDP alone every rank all-gathers every expert of a layer before its forward and reduce-scatters their
gradients after; under expert parallelism a rank holds its experts whole and sends tokens instead (two all-to-alls
a layer). Which costs less depends on the experts' size against the tokens a step: this prints the ratio measured
here, repeat by repeat (each layout runs first in turn: bench/harness.py's rotated order), with the peak memory.

Each row is a real `run` in its own process; tokens/s is the median of its logging windows after the first.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from harness import (
    child_env,
    header,
    median,
    paired_ratios,
    ratio_spread,
    read_records,
    real_tokens_seen,
    rotated,
    run_command,
    steady_throughput,
)

# Qwen3-MoE's layout at a size where the experts hold most of the weights: 16 experts of width 256, top-2.
MODEL = [
    "model=tiny_qwen3_moe",
    "model.architecture.hidden_size=256",
    "model.architecture.moe_intermediate_size=256",
    "model.architecture.num_experts=16",
    "model.architecture.num_hidden_layers=4",
    "model.architecture.head_dim=64",
    "data.seq_len=256",
]
# On a GPU, a Qwen3-MoE with 3 B parameters' shapes in fewer layers: 64 experts of width 768, top-8.
GPU_MODEL = [
    "model=tiny_qwen3_moe",
    "model.architecture.hidden_size=2048",
    "model.architecture.moe_intermediate_size=768",
    "model.architecture.num_experts=64",
    "model.architecture.num_experts_per_tok=8",
    "model.architecture.num_hidden_layers=4",
    "model.architecture.num_attention_heads=32",
    "model.architecture.num_key_value_heads=4",
    "model.architecture.head_dim=128",
    "data.seq_len=2048",
]
RUN = [
    "train.micro_batch_size=4",
    "train.max_steps=30",
    "train.log_every=5",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.save_model=false",
    "train.checkpoint_every=0",
]
CPU_LAYOUTS = {
    "fsdp 4": ["strategy=fsdp", "hardware.nproc_per_node=4"],
    "fsdp 2 x ep 2": ["strategy=fsdp", "hardware.nproc_per_node=4", "strategy.ep_size=2"],
    "fsdp 2": ["strategy=fsdp", "hardware.nproc_per_node=2"],
    "ep 2": ["strategy=fsdp", "hardware.nproc_per_node=2", "strategy.ep_size=2"],
}
CPU_PAIRS = [("fsdp 2 x ep 2", "fsdp 4"), ("ep 2", "fsdp 2")]
GPU_KERNELS = {
    "eager": ["hardware=auto", "precision=bf16", "model.experts_kernel=eager"],
    "grouped_mm": ["hardware=auto", "precision=bf16", "model.experts_kernel=grouped_mm"],
}
GPU_PAIRS = [("grouped_mm", "eager")]


def measure(overrides: list[str], workdir: Path, threads: int) -> dict:
    """One run's tokens/s (steady state) and peak memory, or its error."""
    result = subprocess.run(
        [*run_command(), *RUN, *overrides, f"hydra.run.dir={workdir}"],
        capture_output=True,
        text=True,
        env=child_env(threads),
    )
    if result.returncode != 0:
        return {"error": (result.stderr.strip().splitlines() or ["no output"])[-1]}
    records = read_records("runner", workdir, workdir)
    summary = json.loads((workdir / "summary.json").read_text())
    return {
        "tokens_per_s": steady_throughput(records, 6, real_tokens_seen),
        "peak_memory_gib": summary["peak_memory_gib"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", action="store_true", help="one GPU: the expert kernels, not the layouts")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="threads per process (CPU)")
    args = parser.parse_args()
    layouts, pairs = (GPU_KERNELS, GPU_PAIRS) if args.kernels else (CPU_LAYOUTS, CPU_PAIRS)
    model = GPU_MODEL if args.kernels else MODEL
    results: dict[str, dict[int, dict]] = {name: {} for name in layouts}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for name in rotated(layouts, repeat):
                workdir = Path(scratch) / f"{name.replace(' ', '_')}-{repeat}"
                results[name][repeat] = measure([*model, *layouts[name]], workdir, args.threads)
    print(header())
    print("| layout | tokens/s (median) | peak memory GiB | errors |\n|---|---|---|---|")
    for name, runs in results.items():
        rates = [r["tokens_per_s"] for r in runs.values() if "tokens_per_s" in r]
        peaks = [r["peak_memory_gib"] for r in runs.values() if "peak_memory_gib" in r]
        errors = "; ".join(sorted({r["error"] for r in runs.values() if "error" in r}))
        shown_rate = f"{median(rates):,.0f}" if rates else "-"
        shown_peak = f"{max(peaks):.2f}" if peaks else "-"
        print(f"| {name} | {shown_rate} | {shown_peak} | {errors or '-'} |")
    for base, other in pairs:
        figures = {
            name: {k: r["tokens_per_s"] for k, r in results[name].items() if "tokens_per_s" in r}
            for name in (base, other)
        }
        ratios = paired_ratios(figures[base], figures[other])
        print(f"\n{base} against {other}: " + (ratio_spread(ratios) if ratios else "no repeat finished both"))


if __name__ == "__main__":
    main()
