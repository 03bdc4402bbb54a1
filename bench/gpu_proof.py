"""One GPU proof, one command (issue 45): what the runner does on a GPU, in at most 8 minutes, written to docs/gpu.md.

    python3 bench/gpu_proof.py                  # on a GPU machine: every section, then docs/gpu.md
    python3 bench/gpu_proof.py --dry-run        # on any machine: composes and checks every command, trains nothing
    python3 bench/gpu_proof.py --only strategies,losses --out /tmp/gpu.md --keep /tmp/proof

On the lent GPU machines, which have no network and lack Hydra, DeepSpeed and torchao, the wheels made here by
bench/gpu_wheels.sh travel in .whl/ and the runner runs from the checkout (docs/gpu.md has the one command).

Every row is a real `run` in its own process (`python -m runner ...`, or the `run` script beside this Python),
read from its metrics.jsonl and summary.json; the hand-written loop is bench/peers/hand_loop.py on the runner's own
rows (bench/compare_loops.py's plan). The sections, in the order they run (the budget cuts the last first):

    default      the default job, `run hardware=auto precision=bf16`: its eval loss before and after
    strategies   single, ddp, fsdp, DeepSpeed ZeRO-2 and ZeRO-3, each on one process, the tiny model in fp32, 60
                 steps at the same seed: each exits 0 with finite losses, and its per-step losses are single's
                 (within 1e-3 over the first 30 steps: later, a loss spike amplifies rounding, on the CPU too)
    losses       the runner ended 60 steps at 2.7757 and the hand loop at 2.7572 on a GPU: the hand loop then drew
                 other initial weights than the runner (step 1: 5.4557 against 5.4107, on the CPU too); it now
                 builds the runner's (bench/peers/shared.py's initial_model). Both loops' step-1 and final losses,
                 the hand loop's run-to-run spread (two runs), and the runner with train.loss=full (the hand loop's
                 maths: on the CPU the two agree at every step, the chunked loss within 2e-6 to step 30); the
                 runner's run is strategies' single, the hand loop's plan the same steps, rows and log_every
    host         the runner against the hand loop on the tiny default model, where the host's cost shows: tokens/s
    precision    Llama-3.2-1B's shapes, 4 x 2048 tokens a step: bf16 eager and compiled, fp8 tensorwise and rowwise
                 compiled (bench/precision_throughput.py's runs): tokens/s and MFU. The bf16 MFU go to the plan's
                 table of measured figures, runner/planning/measured_mfu.yaml, in place of this GPU's earlier ones
    memory       the memory estimate (bench/memory_accuracy.py's) against the measured peak
                 (torch.cuda.max_memory_allocated): single bf16 4 x 2048 (precision's eager run), fsdp, ZeRO-2 and
                 ZeRO-3 on one GPU, and single fp32
    gpu          the runner against the hand loop on the 1B model, both compiled in bf16: the GPU's cost
    moe          a Qwen3-MoE (bench/moe_throughput.py's GPU model) in bf16 with the experts' grouped GEMM against
                 transformers' eager loop over the experts (model.experts_kernel): tokens/s
    multi        two GPUs or more: NCCL equivalence of ddp, fsdp and ZeRO-2/3 on 2 processes, tensor and context
                 parallelism (bench/context_parallel.py's layouts) and async TP, and a collective that a stopped rank
                 never joins (NCCL's watchdog, then the job's one line); each skipped in one line on one GPU

The runs whose figures are not timings (the default job, strategies, losses, memory) run side by side, up to
--jobs at a time (the memory runs as many at once as their estimates say the GPU holds); the timed ones alone.
Each run has a timeout, and none starts without the time it needs left of --budget; what did not run is listed.
Each target prints as MET or MISSED with its figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import context_parallel
import memory_accuracy
import moe_throughput
import precision_throughput
from compare_loops import RATIO_TARGET, Workload, prepare_configs, real_tokens_seen, runner_spec, steady_throughput
from harness import ROOT, Config, child_env, contender_command, read_records, run_command, run_contender

DOC = ROOT / "docs" / "gpu.md"
FIGURES_MARK = "<!-- figures: bench/gpu_proof.py writes everything below this line -->"
BUDGET_S = 465  # the whole proof stops before 8 minutes, with time to write its page
RESERVE_S = 5  # what each run's timeout leaves of the budget for the report
SECTIONS = ("default", "strategies", "losses", "host", "precision", "memory", "gpu", "moe", "multi")
# loops: host and gpu
REPORT_ORDER = ("default", "strategies", "losses", "loops", "precision", "memory", "moe", "multi")

LOSS_TOLERANCE = 1e-3  # the largest relative difference of a step's loss from the reference run's
AGREE_STEPS = 30  # the steps the strategies' losses are held to it over (later, rounding is amplified)
MEMORY_TOLERANCE = 0.10

# The tiny default model, as bench/compare_loops.py runs it: no evaluation but the one before the first step.
TINY = [
    "hardware=auto",
    "hardware.nproc_per_node=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.save_model=false",
]
LOSS_STEPS = 60
STRATEGIES = {
    "single": ["strategy=single"],
    "ddp": ["strategy=ddp"],
    "fsdp": ["strategy=fsdp"],
    "zero-2": ["strategy=deepspeed", "strategy.zero_stage=2"],
    "zero-3": ["strategy=deepspeed", "strategy.zero_stage=3"],
}
HOST_STEPS, HOST_LOG_EVERY, HOST_WARMUP = 300, 10, 50
# Llama-3.2-1B's shapes, as bench/precision_throughput.py runs them, with fewer steps.
ONE_B_STEPS, ONE_B_LOG_EVERY, ONE_B_WARMUP = 30, 5, 10
COMPILED = ["train.compile=true"]
PRECISION_RUNS = {
    "bf16 eager": precision_throughput.PRECISIONS["bf16"],
    "bf16 compiled": [*precision_throughput.PRECISIONS["bf16"], *COMPILED],
    "fp8 tensorwise compiled": [*precision_throughput.PRECISIONS["fp8 tensorwise"], *COMPILED],
    "fp8 rowwise compiled": [*precision_throughput.PRECISIONS["fp8 rowwise"], *COMPILED],
}
MEMORY_STEPS = 3
# bench/memory_accuracy.py's single-GPU configs: side by side, as many at once as the GPU holds by their estimates.
MEMORY_CONFIGS = [
    "deepspeed ZeRO-2 bf16, 1 GPU, 2 x 1024",
    "deepspeed ZeRO-3 bf16, 1 GPU, 2 x 1024",
    "fsdp FULL_SHARD bf16, 1 GPU, 4 x 1024",
    "single fp32, 2 x 512",
]
MEMORY_MARGIN = 1.25  # x the estimate, + 2 GiB each, that side-by-side memory runs leave room for on the GPU
EQUIVALENCE_STEPS = 30
# Two GPUs: async TP at a sequence short enough for the budget.
ASYNC_TP_SEQ_LEN, ASYNC_TP_STEPS = 8192, 10
# Two GPUs: rank 1 stopped (SIGSTOP) once it has logged this step; rank 0's collective then waits this long.
STOPPED_AT_STEP, COLLECTIVE_TIMEOUT_S = 5, 30

# A stand-in for the GPU when --dry-run composes on a machine without one: an H100, as a user's GPU machine.
STAND_IN_GPU = {
    "device_name": "NVIDIA H100 80GB HBM3",
    "device_memory_gib": 79.2,
    "host_memory_gib": 128.0,
    "compute_capability": 9.0,
    "peak_bf16_tflops": 989.0,
}


def merged(*parts: list[str]) -> list[str]:
    """Overrides in order, a later value of a key replacing an earlier one in its place."""
    found: dict[str, str] = {}
    for override in (o for part in parts for o in part):
        found[override.split("=", 1)[0]] = override
    return list(found.values())


@dataclass
class Run:
    """One process of the proof: a `run` with these overrides, or the hand loop on the plan these overrides make."""

    key: str
    section: str
    overrides: list[str]
    needs_s: int  # about what it takes on an H100; it does not start with less left of the budget
    timeout_s: int
    gpus: int = 1
    hand: bool = False
    plan_extra: dict = field(default_factory=dict)  # the hand loop's plan beyond the runner's settings
    group: Optional[str] = None  # adjacent runs of a group run side by side; None: alone (a timed run)
    stop_rank_1_at: Optional[int] = None  # rank 1 stopped (SIGSTOP) once its log shows this step

    @property
    def slug(self) -> str:
        return "".join(c if c.isalnum() or c in "-_" else "_" for c in self.key)

    def steps(self) -> int:
        return int(next(o for o in reversed(self.overrides) if o.startswith("train.max_steps=")).split("=")[1])

    def log_every(self) -> int:
        return int(next(o for o in reversed(self.overrides) if o.startswith("train.log_every=")).split("=")[1])


@dataclass
class Outcome:
    error: Optional[str] = None  # failed, timed out, or skipped (then `skipped` is set)
    skipped: bool = False
    wall_s: float = 0.0
    records: list[dict] = field(default_factory=list)
    summary: Optional[dict] = None
    run_dir: Optional[Path] = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def losses(self) -> list[float]:
        return [r["loss"] for r in sorted((r for r in self.records if "loss" in r), key=lambda r: r["step"])]


def strategy_run(name: str, section: str = "strategies") -> Run:
    return Run(
        f"strategy {name}",
        section,
        merged(STRATEGIES[name], TINY, [f"train.max_steps={LOSS_STEPS}", "train.log_every=1"]),
        needs_s=25,
        timeout_s=150,
        group="tiny",
    )


def one_b(precision: str) -> list[str]:
    return merged(
        precision_throughput.MODEL,
        precision_throughput.RUN,
        precision_throughput.STRATEGIES["single"],
        [
            "hardware=auto",
            "hardware.nproc_per_node=1",
            f"train.max_steps={ONE_B_STEPS}",
            f"train.log_every={ONE_B_LOG_EVERY}",
        ],
        PRECISION_RUNS[precision],
    )


def plan() -> list[Run]:
    """Every run of the proof, in the order they run."""
    single = strategy_run("single")
    tiny_host = merged(
        STRATEGIES["single"], TINY, [f"train.max_steps={HOST_STEPS}", f"train.log_every={HOST_LOG_EVERY}"]
    )
    runs = [
        Run("default job", "default", ["hardware=auto", "precision=bf16"], needs_s=40, timeout_s=240, group="tiny"),
        single,
        *(strategy_run(name) for name in STRATEGIES if name != "single"),
        Run("hand losses 1", "losses", single.overrides, needs_s=20, timeout_s=120, hand=True, group="tiny"),
        Run("hand losses 2", "losses", single.overrides, needs_s=20, timeout_s=120, hand=True, group="tiny"),
        Run(
            "runner loss=full",
            "losses",
            merged(single.overrides, ["train.loss=full"]),
            needs_s=25,
            timeout_s=150,
            group="tiny",
        ),
        Run("runner tiny", "host", tiny_host, needs_s=25, timeout_s=150),
        Run("hand tiny", "host", tiny_host, needs_s=20, timeout_s=120, hand=True),
        Run("1B bf16 eager", "precision", one_b("bf16 eager"), needs_s=45, timeout_s=180),
    ]
    runs += [
        Run(
            f"memory {name}",
            "memory",
            memory_accuracy.config_overrides(memory_accuracy.GRID[name], MEMORY_STEPS),
            needs_s=45,
            timeout_s=180,
            group="memory",
        )
        for name in MEMORY_CONFIGS
    ]
    runs += [
        Run("1B bf16 compiled", "precision", one_b("bf16 compiled"), needs_s=80, timeout_s=300),
        Run(
            "hand 1B bf16 compiled",
            "gpu",
            one_b("bf16 compiled"),
            needs_s=70,
            timeout_s=300,
            hand=True,
            plan_extra={"compile": True, "autocast": "bf16"},
        ),
        Run("1B fp8 tensorwise compiled", "precision", one_b("fp8 tensorwise compiled"), needs_s=80, timeout_s=300),
        Run("1B fp8 rowwise compiled", "precision", one_b("fp8 rowwise compiled"), needs_s=80, timeout_s=300),
    ]
    runs += [
        Run(
            f"moe {kernel}",
            "moe",
            merged(moe_throughput.GPU_MODEL, moe_throughput.RUN, overrides, ["hardware.nproc_per_node=1"]),
            needs_s=40,
            timeout_s=180,
        )
        for kernel, overrides in moe_throughput.GPU_KERNELS.items()
    ]
    return runs + multi_gpu_runs()


def multi_gpu_runs() -> list[Run]:
    """What needs two GPUs: every strategy on 2 processes against one process with the same global batch, tp and cp
    against one GPU (bench/context_parallel.py's layouts and loss settings), and async TP."""
    equivalence = [
        "hardware=auto",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.save_model=false",
        f"train.max_steps={EQUIVALENCE_STEPS}",
        "train.log_every=1",
    ]
    runs = [
        Run(
            "2 GPUs: single, 2 accumulation steps",
            "multi",
            merged(STRATEGIES["single"], equivalence, ["hardware.nproc_per_node=1", "train.grad_accum_steps=2"]),
            needs_s=25,
            timeout_s=150,
            group="equivalence",
        )
    ]
    runs += [
        Run(
            f"2 GPUs: {name}",
            "multi",
            merged(STRATEGIES[name], equivalence, ["hardware.nproc_per_node=2"]),
            needs_s=35,
            timeout_s=180,
            gpus=2,
            group="equivalence",
        )
        for name in STRATEGIES
        if name != "single"
    ]
    losses = [*context_parallel.MODEL, *context_parallel.LOSSES, "hardware=auto"]
    runs.append(
        Run(
            "2 GPUs: one GPU, fsdp (tp and cp's reference)",
            "multi",
            merged(losses, ["hardware.nproc_per_node=1", "strategy=fsdp"]),
            needs_s=45,
            timeout_s=180,
        )
    )
    for name, overrides in context_parallel.splits(2).items():
        runs.append(
            Run(
                f"2 GPUs: {name}",
                "multi",
                merged(losses, ["hardware.nproc_per_node=2"], overrides),
                needs_s=50,
                timeout_s=200,
                gpus=2,
            )
        )
    layouts = context_parallel.layouts(2)
    for name in ("fsdp x tp 2, compiled", "fsdp x tp 2, async"):
        runs.append(
            Run(
                f"2 GPUs: {name}",
                "multi",
                merged(
                    context_parallel.MODEL,
                    context_parallel.COST,
                    ["hardware=auto"],
                    layouts[name],
                    [f"data.seq_len={ASYNC_TP_SEQ_LEN}", f"train.max_steps={ASYNC_TP_STEPS}"],
                ),
                needs_s=80,
                timeout_s=300,
                gpus=2,
            )
        )
    timeout = COLLECTIVE_TIMEOUT_S
    stopped = [
        "hardware.nproc_per_node=2",
        "train.max_steps=1000",
        f"train.collective_timeout_s={timeout}",
        f"train.stall_report_s={timeout // 3}",
    ]
    runs.append(
        Run(
            "2 GPUs: ddp, rank 1 stopped",
            "multi",
            merged(STRATEGIES["ddp"], equivalence, stopped),
            needs_s=timeout + 60,
            timeout_s=timeout + 120,
            gpus=2,
            stop_rank_1_at=STOPPED_AT_STEP,
        )
    )
    return runs


# What each line of the multi section needs, and what it says when the machine has one GPU.
MULTI_ITEMS = {
    "NCCL equivalence of ddp, fsdp, ZeRO-2 and ZeRO-3 on 2 processes": [
        "2 GPUs: single, 2 accumulation steps",
        "2 GPUs: ddp",
        "2 GPUs: fsdp",
        "2 GPUs: zero-2",
        "2 GPUs: zero-3",
    ],
    "tensor parallelism (fsdp x tp 2) against one GPU": [
        "2 GPUs: one GPU, fsdp (tp and cp's reference)",
        "2 GPUs: fsdp x tp 2",
    ],
    "context parallelism (fsdp x cp 2, bench/context_parallel.py's) against one GPU": [
        "2 GPUs: one GPU, fsdp (tp and cp's reference)",
        "2 GPUs: fsdp x cp 2",
    ],
    "async TP (strategy.async_tp) against compiled tp": ["2 GPUs: fsdp x tp 2, compiled", "2 GPUs: fsdp x tp 2, async"],
    "a collective that a stopped rank never joins ends the job in one line": ["2 GPUs: ddp, rank 1 stopped"],
}
# The line that job should end with: the rank that waited (its process ended by NCCL's watchdog, or its error
# raised), the step, and NCCL's collective.
COLLECTIVE_TIMED_OUT = (
    rf"run: error: rank (\d+ failed: .*, after it|\d+) waited {COLLECTIVE_TIMEOUT_S} s in a "
    r"collective that another rank did not join, in step \d+: nccl:\w+ #\d+ .*"
)


def needed(runs: list[Run], sections: list[str]) -> list[Run]:
    """The runs the chosen sections read, in the proof's order."""
    keys = {run.key for run in runs if run.section in sections}
    if "losses" in sections:
        keys.add("strategy single")
    if "memory" in sections:
        keys.add("1B bf16 eager")
    if "gpu" in sections:
        keys.add("1B bf16 compiled")
    return [run for run in runs if run.key in keys]


# ---------------------------------------------------------------------------------------------------- dry run


def composed(overrides: list[str], gpus: int):
    """The spec of `run <overrides>` as a user's GPU machine would check it: composed by Hydra from conf/ (unknown
    keys and options refused), then validated against a stand-in GPU machine with `gpus` GPUs where this one has
    none."""
    from runner.cli.compose import compose_config
    from runner.config.hardware import Accelerator, cuda_device_count
    from runner.config.spec import load_spec, validate

    spec = load_spec(compose_config([o for o in overrides if not o.startswith("hydra.")]))
    if cuda_device_count() >= gpus:
        return validate(spec)
    machine = spec.hardware
    filled = {key: getattr(machine, key) or value for key, value in STAND_IN_GPU.items()}
    machine = replace(machine, accelerator=Accelerator.cuda, nproc_per_node=machine.nproc_per_node or gpus, **filled)
    return validate(replace(spec, hardware=machine), on_this_machine=False)


def dry_run(runs: list[Run], workdir: Path) -> list[tuple[Run, str, Optional[str]]]:
    """Every run's command line, its overrides composed and checked as `run` would check them (and, for the hand
    loop, the plan made from them), and each memory config's estimate: (run, command, why it was refused or None)."""
    from harness import peer_plan

    from runner.memory.breakdown import estimate
    from runner.memory.model_shapes import facts_of

    checked, specs = [], {}
    for run in runs:
        try:
            key = (tuple(run.overrides), run.gpus)  # a hand run's overrides are a runner run's
            spec = specs[key] = specs[key] if key in specs else composed(run.overrides, run.gpus)
            if spec.hardware.world_size != run.gpus:
                raise ValueError(f"it asks for {spec.hardware.world_size} GPUs; the proof gives it {run.gpus}")
            if run.hand:
                peer_plan(spec, workdir, None, spec.train.micro_batch_size, run.steps(), run.log_every())
            if run.section == "memory" or run.key == "1B bf16 eager":
                estimate(spec, facts_of(spec.model))
            refusal = None
        except Exception as error:  # what `run` would refuse, in its words
            refusal = f"{type(error).__name__}: {error}"
        checked.append((run, " ".join(command(run, workdir, workdir / "plan" / "plan_text_single.json")), refusal))
    return checked


def command(run: Run, workdir: Path, plan_path: Optional[Path]) -> list[str]:
    """The command line of a run: `run` with its overrides, or the hand loop on its plan."""
    out = workdir / run.slug
    if run.hand:
        return contender_command("hand", Config("single", 1, plan_path), out / "records.jsonl", out, [])
    return [*run_command(), *run.overrides, f"hydra.run.dir={out}"]


# ---------------------------------------------------------------------------------------------------- running


class Budget:
    def __init__(self, seconds: float):
        self.seconds = seconds
        self.started = time.monotonic()

    def used(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float:
        return self.seconds - self.used()


class Proof:
    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args = args
        self.workdir = workdir
        self.budget = Budget(args.budget)
        self.outcomes: dict[str, Outcome] = {}
        self.estimates: dict[str, tuple[float, str] | str] = {}  # the estimated peak GiB and when, or why none
        self.plans: dict[str, Path] = {}
        import torch

        self.gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        properties = torch.cuda.get_device_properties(0) if self.gpus else None
        self.device_name = properties.name if properties else None
        self.device_memory_gib = properties.total_memory / 1024**3 if properties else 0.0

    def run_all(self, runs: list[Run]) -> None:
        batches: list[list[Run]] = []
        for run in runs:
            if run.section == "multi" and self.gpus < 2:
                continue  # the report's multi section says so, a line for each of its items
            if batches and run.group and batches[-1][0].group == run.group:
                batches[-1].append(run)
            else:
                batches.append([run])
        for batch in batches:
            if batch[0].section == "memory" or batch[0].key == "1B bf16 eager":
                for run in batch:
                    self.estimate(run)
            for part in self.side_by_side(batch):
                self.run_batch(part)

    def side_by_side(self, batch: list[Run]) -> list[list[Run]]:
        """The batch in parts that run at once: at most --jobs runs; memory runs as many as the GPU holds by their
        estimated peaks, with room to spare (one without an estimate alone)."""
        jobs = max(1, self.args.jobs)
        if batch[0].section != "memory":
            return [batch[i : i + jobs] for i in range(0, len(batch), jobs)]
        parts, part, held = [], [], 0.0
        for run in batch:
            estimate = self.estimates.get(run.key)
            need = estimate[0] * MEMORY_MARGIN + 2 if isinstance(estimate, tuple) else math.inf
            if part and (held + need > self.device_memory_gib or len(part) >= jobs):
                parts.append(part)
                part, held = [], 0.0
            part.append(run)
            held += need
        return [*parts, part] if part else parts

    def estimate(self, run: Run) -> None:
        try:
            self.estimates[run.key] = memory_accuracy.estimated(run.overrides)
        except Exception as error:
            self.estimates[run.key] = f"no estimate: {type(error).__name__}: {error}"

    def run_batch(self, batch: list[Run]) -> None:
        left = self.budget.left()
        need = max(run.needs_s for run in batch)
        if left - RESERVE_S < need:
            for run in batch:
                self.outcomes[run.key] = Outcome(
                    error=f"{max(left, 0):.0f} s were left of the {self.args.budget:.0f} s budget; it needs about "
                    f"{run.needs_s} s",
                    skipped=True,
                )
                self.say(run, self.outcomes[run.key])
            return
        commands = {}
        for run in batch:
            try:
                commands[run.key] = command(run, self.workdir, self.hand_plan(run) if run.hand else None)
            except Exception as error:
                self.outcomes[run.key] = Outcome(error=f"its plan could not be made: {type(error).__name__}: {error}")
        started = [run for run in batch if run.key in commands]
        with ThreadPoolExecutor(max_workers=max(1, len(started))) as pool:
            done = list(pool.map(lambda run: self.execute(run, commands[run.key]), started))
        for run, outcome in zip(started, done):
            self.outcomes[run.key] = outcome
        for run in batch:
            self.say(run, self.outcomes[run.key])

    def execute(self, run: Run, argv: list[str]) -> Outcome:
        out = self.workdir / run.slug
        out.mkdir(parents=True, exist_ok=True)
        timeout = max(1.0, min(run.timeout_s, self.budget.left() - RESERVE_S))
        began = time.monotonic()
        if run.stop_rank_1_at is not None:
            error = with_rank_1_stopped(argv, child_env(self.args.threads), out, run.stop_rank_1_at, timeout)
            return Outcome(error=error, wall_s=time.monotonic() - began, run_dir=out)
        _, error = run_contender(argv, child_env(self.args.threads), out / "output.txt", timeout)
        outcome = Outcome(error=error, wall_s=time.monotonic() - began, run_dir=out)
        if error is None:
            try:
                outcome.records = read_records("hand" if run.hand else "runner", out / "records.jsonl", out)
                summary = out / "summary.json"
                outcome.summary = json.loads(summary.read_text()) if summary.exists() else None
            except (OSError, ValueError) as problem:
                outcome.error = f"exit 0, but its records could not be read: {problem}"
        return outcome

    def hand_plan(self, run: Run) -> Path:
        """bench/compare_loops.py's plan and rows for the hand loop, from the runner's spec of the same overrides."""
        name = json.dumps([run.overrides, run.plan_extra], sort_keys=True)
        if name not in self.plans:
            folder = self.workdir / f"plan-{len(self.plans)}"
            folder.mkdir(parents=True, exist_ok=True)
            steps, log_every = run.steps(), run.log_every()
            spec = runner_spec(steps, run.overrides)
            workload = Workload("text", spec, run.overrides, ["runner", "hand"])
            configs, skipped = prepare_configs(
                workload, argparse.Namespace(configs="single", steps=steps, log_every=log_every), folder
            )
            if not configs:
                raise RuntimeError("; ".join(skipped.values()))
            path = configs[0].plan
            if run.plan_extra:
                path.write_text(json.dumps({**json.loads(path.read_text()), **run.plan_extra}))
            self.plans[name] = path
        return self.plans[name]

    def say(self, run: Run, outcome: Outcome) -> None:
        if outcome.skipped:
            shown = f"skipped: {outcome.error}"
        elif outcome.error:
            shown = f"FAILED after {outcome.wall_s:.0f} s: {outcome.error}"
        else:
            losses = outcome.losses()
            shown = f"done in {outcome.wall_s:.0f} s" + (f", last loss {losses[-1]:.4f}" if losses else "")
        print(f"[{self.budget.used():4.0f} s] {run.key}: {shown}", flush=True)


# ---------------------------------------------------------------------------------------------------- the report


def verdict(met: bool, text: str) -> str:
    return f"- {'MET' if met else 'MISSED'}: {text}"


def failed(outcome: Optional[Outcome]) -> str:
    if outcome is None:
        return "not run"
    return ("skipped: " if outcome.skipped else "failed: ") + (outcome.error or "")


def finite(outcome: Outcome) -> bool:
    losses = outcome.losses()
    return bool(losses) and all(math.isfinite(loss) for loss in losses)


def worst_difference(losses: list[float], reference: list[float]) -> tuple[float, int]:
    """The largest relative difference of a run's per-step losses from the reference's, and its step."""
    if len(losses) != len(reference) or not losses:
        return math.inf, 0
    return max((abs(a - b) / abs(b), step) for step, (a, b) in enumerate(zip(losses, reference), start=1))


class Report:
    def __init__(self, proof: Proof, sections: list[str]):
        self.proof = proof
        self.outcomes = proof.outcomes
        self.sections = sections
        self.targets: list[str] = []
        self.lines: list[str] = []
        self.bf16_mfu: dict[bool, float] = {}  # compiled or eager: the 1B run's MFU, for the plan's table

    def get(self, key: str) -> Optional[Outcome]:
        return self.outcomes.get(key)

    def build(self) -> str:
        for name in REPORT_ORDER:
            if name in self.sections or (name == "loops" and {"host", "gpu"} & set(self.sections)):
                getattr(self, f"section_{name}")()
        skipped = [f"- {key}: {failed(o)}" for key, o in self.outcomes.items() if not o.ok]
        return "\n".join(
            [
                *self.header(),
                "",
                "### Targets",
                "",
                *self.targets,
                *self.lines,
                "",
                "### What did not run, or failed",
                "",
                *(skipped or ["- nothing"]),
                "",
            ]
        )

    def header(self) -> list[str]:
        import importlib.metadata

        import torch

        def version(name: str) -> str:
            try:
                return importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                return "not installed"

        device = (
            f"{self.proof.device_name} x {self.proof.gpus}"
            if self.proof.device_name
            else "no GPU (--allow-cpu: the figures are the CPU's, not a proof)"
        )
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        return [
            "## Figures",
            "",
            f"{datetime.date.today()} | {device} | Python {platform.python_version()} | torch {torch.__version__} | "
            f"transformers {version('transformers')} | deepspeed {version('deepspeed')} | torchao {version('torchao')}"
            f" | checkout {head.stdout.strip() or 'unknown'}",
            "",
            f"`{' '.join(['python3 bench/gpu_proof.py', *sys.argv[1:]])}`: {self.proof.budget.used():.0f} s of its "
            f"{self.proof.args.budget:.0f} s budget",
        ]

    def table(self, title: str, rows: list[str]) -> None:
        self.lines += ["", f"### {title}", "", *rows]

    # -- sections

    def section_default(self) -> None:
        outcome = self.get("default job")
        if outcome and outcome.ok and outcome.summary:
            before, after = outcome.summary["first_eval_loss"], outcome.summary["eval_loss"]
            figure = f"eval loss {before:.4f} -> {after:.4f}"
            self.targets.append(
                verdict(
                    after < before and math.isfinite(after),
                    f"the default job (`run hardware=auto precision=bf16`) trains: {figure}",
                )
            )
            self.table(
                "The default job",
                [
                    f"`run hardware=auto precision=bf16`: {figure}, "
                    f"{outcome.summary['tokens_per_s']:,.0f} tokens/s (mean "
                    f"of the training steps), peak memory {outcome.summary['peak_memory_gib']:.2f} GiB, "
                    f"{outcome.summary['wall_time_s']:.0f} s of training and evaluation, {outcome.wall_s:.0f} s in all"
                ],
            )
        else:
            self.targets.append(verdict(False, f"the default job trains: {failed(outcome)}"))

    def section_strategies(self) -> None:
        reference = self.get("strategy single")
        rows = [
            f"| strategy (1 process) | exit | step-1 loss | step-{LOSS_STEPS} loss | largest relative difference "
            f"from single, steps 1-{AGREE_STEPS} | over all {LOSS_STEPS} steps (at step) | wall s |",
            "|---|---|---|---|---|---|---|",
        ]
        trained, agree, worst = [], True, (0.0, 0, "")
        for name in STRATEGIES:
            outcome = self.get(f"strategy {name}")
            if not outcome or not outcome.ok or not finite(outcome):
                rows.append(
                    f"| {name} | {failed(outcome) if not outcome or not outcome.ok else 'non-finite loss'} | | | | | |"
                )
                agree = False
                continue
            trained.append(name)
            losses = outcome.losses()
            early, overall = "-", "-"
            if name != "single":
                if reference and reference.ok:
                    difference, step = worst_difference(losses[:AGREE_STEPS], reference.losses()[:AGREE_STEPS])
                    worst = max(worst, (difference, step, name))
                    whole, at = worst_difference(losses, reference.losses())
                    early, overall = f"{difference:.1e}", f"{whole:.1e}" + (f" ({at})" if whole else "")
                else:
                    difference = math.nan
                agree = agree and difference <= LOSS_TOLERANCE
            rows.append(
                f"| {name} | 0 | {losses[0]:.6f} | {losses[-1]:.6f} | {early} | {overall} | {outcome.wall_s:.0f} |"
            )
        self.targets.append(
            verdict(
                len(trained) == len(STRATEGIES),
                f"every strategy trains on one process (exit 0, finite losses): "
                f"{len(trained)} of {len(STRATEGIES)} ({', '.join(trained) or 'none'})",
            )
        )
        self.targets.append(
            verdict(
                agree,
                f"their per-step losses agree with single's within {LOSS_TOLERANCE:.0e} "
                f"relative over the first {AGREE_STEPS} steps: largest {worst[0]:.1e}"
                + (f" ({worst[2]}, step {worst[1]})" if worst[2] else ""),
            )
        )
        self.table(
            f"Strategies on one process (tiny model, fp32, {LOSS_STEPS} steps, seed 0)",
            [
                *rows,
                "",
                f"Past step {AGREE_STEPS} or so, a loss spike amplifies rounding: on the CPU, single, ZeRO-2 "
                "and train.loss=full agree within 1e-6 to step 30 and drift 3e-3 apart by step 49.",
            ],
        )

    def section_losses(self) -> None:
        runs = {
            "runner (train.loss=auto: chunked)": self.get("strategy single"),
            "runner, train.loss=full": self.get("runner loss=full"),
            "hand loop, run 1": self.get("hand losses 1"),
            "hand loop, run 2": self.get("hand losses 2"),
        }
        rows = ["| run | step 1 | step 10 | step 60 | mean of steps 56-60 |", "|---|---|---|---|---|"]
        losses = {}
        for name, outcome in runs.items():
            if not outcome or not outcome.ok or len(outcome.losses()) < LOSS_STEPS:
                rows.append(
                    f"| {name} | {failed(outcome) if not outcome or not outcome.ok else 'too few steps'} | | | |"
                )
                continue
            losses[name] = found = outcome.losses()
            rows.append(
                f"| {name} | {found[0]:.6f} | {found[9]:.6f} | {found[-1]:.6f} | {statistics.mean(found[-5:]):.6f} |"
            )
        notes = []
        runner, full = losses.get("runner (train.loss=auto: chunked)"), losses.get("runner, train.loss=full")
        hand, hand2 = losses.get("hand loop, run 1"), losses.get("hand loop, run 2")

        def largest(a: list[float], b: list[float]) -> str:
            difference, step = max((abs(x - y), i) for i, (x, y) in enumerate(zip(a, b), start=1))
            return (
                f"{difference:.2e} (step {step}); at step 1 {abs(a[0] - b[0]):.2e}, at step 60 {abs(a[-1] - b[-1]):.2e}"
            )

        if runner and hand:
            notes.append(f"- runner against hand loop, largest |difference|: {largest(runner, hand)}")
        if hand and hand2:
            notes.append(
                f"- hand loop against itself (run-to-run spread), largest |difference|: {largest(hand, hand2)}"
            )
        if runner and full:
            notes.append(
                f"- runner, train.loss=full against the chunked loss, largest |difference|: {largest(runner, full)}"
            )
        if full and hand:
            # the hand loop's loss is transformers' own, over the full logits: train.loss=full's maths
            notes.append(
                f"- runner, train.loss=full against hand loop, largest |difference|: {largest(full, hand)} "
                "(on the CPU: 0 at every step)"
            )
        if runner and hand and hand2:
            spread = max(abs(x - y) for x, y in zip(hand, hand2))
            first = abs(runner[0] - hand[0])
            if first > max(1e-4, 10 * abs(hand[0] - hand2[0])):
                notes.append(
                    "- reading: the first step's losses already differ, before any update: the two loops "
                    "start from different weights or rows, not from different maths in the steps"
                )
            else:
                apart = next(
                    (i for i, (x, y) in enumerate(zip(runner, hand), start=1) if abs(x - y) > max(2 * spread, 1e-4)),
                    None,
                )
                notes.append(
                    "- reading: same first step; "
                    + (
                        f"they drift apart beyond the hand loop's own spread from step {apart}"
                        if apart
                        else "they stay within the hand loop's own run-to-run spread"
                    )
                )
                if full and apart:
                    full_apart = next(
                        (i for i, (x, y) in enumerate(zip(full, hand), start=1) if abs(x - y) > max(2 * spread, 1e-4)),
                        None,
                    )
                    notes.append(
                        "- reading: "
                        + (
                            f"train.loss=full drifts from the hand loop too, from step {full_apart}: not the chunked "
                            "loss's rounding alone"
                            if full_apart
                            else "train.loss=full stays with the hand loop: the drift is the chunked loss's rounding "
                            "(it sums the loss in chunks), amplified after the loss spikes, as on the CPU"
                        )
                    )
        self.table(
            "The losses question (tiny model, fp32, 60 steps: the GPU's 2.7757 against 2.7572)", [*rows, "", *notes]
        )

    def section_loops(self) -> None:
        """The runner against the hand-written loop: the tiny model (the host's cost), the 1B model compiled (the
        GPU's); tokens/s as bench/compare_loops.py measures them, the median of the logging windows after the
        warm-up."""
        rows = ["| model | runner tokens/s | hand loop tokens/s | runner / hand |", "|---|---|---|---|"]
        for section, runner_key, hand_key, warmup, model in (
            (
                "host",
                "runner tiny",
                "hand tiny",
                HOST_WARMUP,
                f"tiny default model, fp32, {HOST_STEPS} steps (windows of {HOST_LOG_EVERY} after step {HOST_WARMUP})",
            ),
            (
                "gpu",
                "1B bf16 compiled",
                "hand 1B bf16 compiled",
                ONE_B_WARMUP,
                f"Llama-3.2-1B's shapes, bf16, blocks compiled, 4 x 2048 tokens a step, {ONE_B_STEPS} steps "
                f"(windows of {ONE_B_LOG_EVERY} after step {ONE_B_WARMUP})",
            ),
        ):
            if section not in self.sections:
                continue
            runner, hand = self.get(runner_key), self.get(hand_key)
            if not (runner and runner.ok and hand and hand.ok):
                why = (
                    f"runner {failed(runner) if not runner or not runner.ok else 'ran'}; hand loop "
                    f"{failed(hand) if not hand or not hand.ok else 'ran'}"
                )
                rows.append(f"| {model} | {why} | | |")
                if section == "host":
                    self.targets.append(
                        verdict(
                            False,
                            f"runner at least {RATIO_TARGET}x the hand-written loop on "
                            f"the tiny model: no figure ({why})",
                        )
                    )
                continue
            ours, theirs = (steady_throughput(o.records, warmup, real_tokens_seen) for o in (runner, hand))
            ratio = ours / theirs
            rows.append(f"| {model} | {ours:,.0f} | {theirs:,.0f} | {ratio:.3f}x |")
            if section == "host":
                self.targets.append(
                    verdict(
                        ratio >= RATIO_TARGET,
                        f"runner at least {RATIO_TARGET}x the hand-written loop on the tiny model "
                        f"(the host's cost): {ratio:.3f}x ({ours:,.0f} against {theirs:,.0f} "
                        "tokens/s)",
                    )
                )
        self.table("The runner against the hand-written loop (bench/peers/hand_loop.py, on the runner's rows)", rows)

    def section_precision(self) -> None:
        rows = [
            "| precision | blocks | tokens/s | vs bf16 eager | MFU | peak memory GiB | compile s | fp8 linear layers |",
            "|---|---|---|---|---|---|---|---|",
        ]
        figures = {}
        for name in PRECISION_RUNS:
            outcome = self.get(f"1B {name}")
            precision, _, blocks = name.rpartition(" ")
            if not outcome or not outcome.ok or not outcome.summary:
                rows.append(f"| {precision} | {blocks} | {failed(outcome)} | | | | | |")
                continue
            figures[name] = found = precision_throughput.steady_state(outcome.run_dir)
            base = figures.get("bf16 eager", {}).get("tokens_per_s")
            ratio = f"{found['tokens_per_s'] / base:.2f}x" if base else "-"
            rows.append(
                f"| {precision} | {blocks} | {found['tokens_per_s']:,.0f} | {ratio} | {found['mfu']:.1%} | "
                f"{found['peak_memory_gib']:.1f} | {found['compile_time_s']:.0f} | "
                f"{found['precision'].get('fp8_linear_layers', 0)} |"
            )
        self.bf16_mfu = {
            name == "bf16 compiled": figures[name]["mfu"] for name in ("bf16 eager", "bf16 compiled") if name in figures
        }
        notes = []
        if "fp8 tensorwise compiled" in figures and "bf16 compiled" in figures:
            notes.append(
                f"- fp8 tensorwise against bf16, both compiled: "
                f"{figures['fp8 tensorwise compiled']['tokens_per_s'] / figures['bf16 compiled']['tokens_per_s']:.2f}x"
                " (the issue's H200: 1.06x)"
            )
        self.table(
            f"Llama-3.2-1B's shapes: precision and compile (one GPU, 4 x 2048 tokens a step, {ONE_B_STEPS} "
            "steps; MFU against the GPU's dense bf16 peak)",
            [*rows, *([""] + notes if notes else [])],
        )

    def section_moe(self) -> None:
        rows = ["| experts kernel | tokens/s | vs eager | peak memory GiB |", "|---|---|---|---|"]
        figures = {}
        for kernel in moe_throughput.GPU_KERNELS:
            outcome = self.get(f"moe {kernel}")
            if not outcome or not outcome.ok or not outcome.summary:
                rows.append(f"| {kernel} | {failed(outcome)} | | |")
                continue
            figures[kernel] = found = precision_throughput.steady_state(outcome.run_dir)
            base = figures.get("eager", {}).get("tokens_per_s")
            ratio = f"{found['tokens_per_s'] / base:.2f}x" if base else "-"
            rows.append(f"| {kernel} | {found['tokens_per_s']:,.0f} | {ratio} | {found['peak_memory_gib']:.1f} |")
        self.table("A Qwen3-MoE's experts: grouped GEMM against the eager loop (one GPU, bf16)", rows)

    def section_memory(self) -> None:
        configs = {
            "single bf16, 4 x 2048 (precision's eager run)": "1B bf16 eager",
            **{name: f"memory {name}" for name in MEMORY_CONFIGS},
        }
        rows = [
            "| config (Llama-3.2-1B's shapes, one GPU) | estimated peak GiB | when | measured peak GiB | error |",
            "|---|---|---|---|---|",
        ]
        errors, missing = [], []
        for name, key in configs.items():
            outcome, estimate = self.get(key), self.proof.estimates.get(key)
            if not isinstance(estimate, tuple) or not outcome or not outcome.ok or not outcome.summary:
                why = estimate if isinstance(estimate, str) else failed(outcome)
                rows.append(f"| {name} | | | | {why} |")
                missing.append(name)
                continue
            peak, when = estimate
            measured = outcome.summary["peak_memory_gib"]
            error = (peak - measured) / measured
            errors.append((abs(error), error, name))
            rows.append(f"| {name} | {peak:.2f} | {when} | {measured:.2f} | {error:+.1%} |")
        worst = max(errors, default=None)
        figure = (f"largest {worst[1]:+.1%} ({worst[2]})" if worst else "no figure") + (
            f"; no figure for {', '.join(missing)}" if missing else ""
        )
        self.targets.append(
            verdict(
                bool(errors) and not missing and worst[0] <= MEMORY_TOLERANCE,
                f"the memory estimate within ±{MEMORY_TOLERANCE:.0%} of the measured peak for "
                f"every single-GPU config: {figure}",
            )
        )
        self.table(
            "Memory: the estimate against torch.cuda.max_memory_allocated (summary.json's peak_memory_gib, "
            f"{MEMORY_STEPS} steps; the eager run {ONE_B_STEPS})",
            rows,
        )

    def section_multi(self) -> None:
        lines = []
        for item, keys in MULTI_ITEMS.items():
            if self.proof.gpus < 2:
                lines.append(f"- skipped: {item}: it needs 2 GPUs; this machine has {self.proof.gpus}")
                continue
            outcomes = {key: self.get(key) for key in keys}
            broken = [f"{key}: {failed(o)}" for key, o in outcomes.items() if not o or not o.ok]
            if broken:
                lines.append(verdict(False, f"{item}: {'; '.join(broken)}"))
                continue
            reference, *others = keys
            if item.startswith("a collective"):
                lines.append(collective_timeout_verdict(item, outcomes[reference]))
                continue
            if item.startswith("async"):
                compiled, async_tp = (precision_throughput.steady_state(outcomes[k].run_dir) for k in keys)
                lines.append(
                    verdict(
                        True,
                        f"{item}: trains; {async_tp['tokens_per_s']:,.0f} against "
                        f"{compiled['tokens_per_s']:,.0f} tokens/s "
                        f"({async_tp['tokens_per_s'] / compiled['tokens_per_s']:.2f}x)",
                    )
                )
                continue
            worst = max(
                (worst_difference(outcomes[k].losses(), outcomes[reference].losses()) + (k,) for k in others),
                default=(0.0, 0, ""),
            )
            lines.append(
                verdict(
                    worst[0] <= LOSS_TOLERANCE,
                    f"{item}: every layout's per-step losses within {LOSS_TOLERANCE:.0e} relative of "
                    f"{reference.removeprefix('2 GPUs: ')}'s: largest {worst[0]:.1e} ({worst[2]}, step "
                    f"{worst[1]})",
                )
            )
        self.table("Two GPUs or more", lines)


def with_rank_1_stopped(argv: list[str], env: dict[str, str], out: Path, step: int, timeout: float) -> Optional[str]:
    """Runs a job of two processes and stops its rank 1 (SIGSTOP) once rank 1 has logged `step`: the job should
    then end on its collective timeout. What went wrong before that, or None."""
    deadline = time.monotonic() + timeout
    with (out / "output.txt").open("w") as output:
        process = subprocess.Popen(
            argv, env=env, stdout=output, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )
        try:
            rank1 = None
            while rank1 is None and process.poll() is None and time.monotonic() < deadline:
                log = out / "rank1.log"
                found = re.search(
                    rf"rank 1 of \d+, process (\d+)(?=[\s\S]*step {step}/)", log.read_text() if log.exists() else ""
                )
                rank1 = int(found.group(1)) if found else None
                time.sleep(0.2)
            if rank1 is None:
                return f"rank 1 did not reach step {step} (exit {process.poll()})"
            os.kill(rank1, signal.SIGSTOP)
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
            return None
        except subprocess.TimeoutExpired:
            return f"still running {timeout:.0f} s after it started, rank 1 stopped: the timeout did not end it"
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)  # the launcher and its workers, the stopped one too
                process.wait()


def collective_timeout_verdict(item: str, outcome: Outcome) -> str:
    output = (outcome.run_dir / "output.txt").read_text() if outcome.run_dir else ""
    told = [line for line in output.splitlines() if line.startswith("run: error: ")]
    line = told[0] if told else "no error line"
    return verdict(
        bool(told) and re.fullmatch(COLLECTIVE_TIMED_OUT, line) is not None,
        f"{item} ({outcome.wall_s:.0f} s in all, {COLLECTIVE_TIMEOUT_S} s of timeout): {line}",
    )


# ---------------------------------------------------------------------------------------------------- main


def write_doc(path: Path, figures: str) -> None:
    """Replaces the figures section of the page (everything below the mark), keeping what is above it."""
    text = path.read_text() if path.exists() else ""
    head = text.split(FIGURES_MARK)[0].rstrip() if FIGURES_MARK in text else text.rstrip()
    path.write_text(f"{head}\n\n{FIGURES_MARK}\n\n{figures}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="compose and check every command, print them, and train nothing (no GPU needed)",
    )
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"sections, of {', '.join(SECTIONS)}")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole proof")
    parser.add_argument("--jobs", type=int, default=9, help="runs side by side, where their figures allow it")
    parser.add_argument("--threads", type=int, default=4, help="torch threads per process (OMP_NUM_THREADS)")
    parser.add_argument("--out", type=Path, default=DOC, help="the page whose figures section it writes")
    parser.add_argument("--keep", type=Path, help="keep the runs' directories here (default: a temporary one)")
    parser.add_argument(
        "--allow-cpu",
        action="store_true",
        help="run on a machine without a GPU: checks the script itself; the figures mean nothing",
    )
    args = parser.parse_args()
    sections = [s for s in args.only.split(",") if s]
    for name in sections:
        if name not in SECTIONS:
            parser.error(f"unknown section {name}; choose from {', '.join(SECTIONS)}")
    sections = [s for s in SECTIONS if s in sections]
    from runner.library_noise import quiet_libraries

    quiet_libraries()  # as `run` does: the proof composes the runner's specs too
    runs = needed(plan(), sections)

    if args.dry_run:
        workdir = args.keep or Path(tempfile.gettempdir()) / "gpu_proof"
        checked = dry_run(runs, workdir)
        for run, line, refusal in checked:
            print(
                f"[{run.section}] {run.key} ({run.gpus} GPU{'s' if run.gpus > 1 else ''}"
                f"{', side by side: ' + run.group if run.group else ''}):\n    {line}"
            )
            if refusal:
                print(f"    REFUSED: {refusal}")
        refused = [run.key for run, _, refusal in checked if refusal]
        print(
            f"\n{len(checked)} commands composed, {len(refused)} refused"
            + (f": {', '.join(refused)}" if refused else "")
        )
        sys.exit(1 if refused else 0)

    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        sys.exit("gpu_proof: needs a CUDA GPU (--dry-run composes the commands without one)")
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="gpu_proof-"))
    workdir.mkdir(parents=True, exist_ok=True)
    proof = Proof(args, workdir)
    print(f"gpu_proof: {len(runs)} runs in {workdir}, at most {args.budget:.0f} s", flush=True)
    proof.run_all(runs)
    report = Report(proof, sections)
    figures = report.build()
    print()
    print(figures)
    write_doc(args.out, figures)
    print(f"wrote {args.out} ({proof.budget.used():.0f} s)")
    if report.bf16_mfu and torch.cuda.is_available():
        from runner.planning.time_plan import MEASURED_MFU, record_measured_mfu

        device = torch.cuda.get_device_name(0)
        record_measured_mfu(
            MEASURED_MFU, device, report.bf16_mfu, "Llama-3.2-1B's shapes", datetime.date.today().isoformat()
        )
        print(f"added {device}'s MFU to {MEASURED_MFU} (the plan's table of measured figures)")
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
