"""What the benchmarks share: the contenders' commands and environment, the order they run in, running one,
reading its records and its tokens/s, comparing two contenders repeat by repeat, and the plan that gives the peer
scripts the runner's own settings."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PEERS = HERE / "peers"
sys.path.insert(0, str(PEERS))
sys.path.insert(0, str(ROOT))

PEER_SCRIPTS = {"hand": "hand_loop.py", "accelerate": "accelerate_loop.py", "trainer": "trainer_loop.py"}
RUN_TIMEOUT_S = 600
UNSUPPORTED = "unsupported: "  # how a peer script says it cannot run a config on this machine


@dataclass
class Outcome:
    repeat: int
    tokens_per_s: Optional[float] = None
    final_loss: Optional[float] = None
    peak_memory_gib: Optional[float] = None
    error: Optional[str] = None


@dataclass
class Config:
    name: str
    processes: int
    plan: Path


def run_command() -> list[str]:
    """The installed `run` script beside this Python, else the same entry point through -m."""
    script = Path(sys.executable).with_name("run")
    return [str(script)] if script.exists() else [sys.executable, "-m", "runner"]


def child_env(threads: int) -> dict[str, str]:
    """The same environment for every contender: this checkout's runner, as many threads per process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env["OMP_NUM_THREADS"] = str(threads)
    # Python caches compiled modules as a user's install does; without it every run would compile the runner's.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    return env


def contender_command(
    contender: str, config: Config, log: Path, run_dir: Path, runner_overrides: list[str]
) -> list[str]:
    if contender == "runner":
        return [
            *run_command(),
            f"strategy={config.name}",
            f"hardware.nproc_per_node={config.processes}",
            *runner_overrides,
            f"hydra.run.dir={run_dir}",
        ]
    script = [
        str(PEERS / PEER_SCRIPTS[contender]),
        "--plan",
        str(config.plan),
        "--records",
        str(log),
        "--strategy",
        config.name,
    ]
    if contender == "accelerate":
        import torch

        launch = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--num_processes",
            str(config.processes),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
        ]
        if config.processes > 1:
            launch.append("--multi_gpu")  # accelerate's torchrun-based launcher, which also starts CPU processes
        elif not torch.cuda.is_available():
            launch.append("--cpu")
        return [*launch, *script]
    if config.processes > 1:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(config.processes),
            *script,
        ]
    return [sys.executable, *script]


def run_contender(
    command: list[str], env: dict[str, str], output: Path, timeout: float = RUN_TIMEOUT_S
) -> tuple[float, Optional[str]]:
    """Runs one contender, for at most `timeout` seconds; returns the time it was started at and its error, if it
    failed."""
    with output.open("w") as out:
        started = time.time()
        process = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the launcher and its workers
            process.wait()
            return started, f"no result after {timeout:.0f} s; stopped"
    return started, None if returncode == 0 else failure(output.read_text(), returncode)


def failure(output: str, returncode: int) -> str:
    """A contender's reason for not running, or the first exception it printed (a failed rank's, under a
    launcher), else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        if line.startswith(UNSUPPORTED) or re.match(r"[\w.]+(Error|Exception): ", line):
            return line
    return f"exit {returncode}: {lines[-1] if lines else 'no output'}"


def read_records(contender: str, log: Path, run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl" if contender == "runner" else log
    return [json.loads(line) for line in path.read_text().splitlines()]


def steady_throughput(records: list[dict], warmup: int, tokens_seen) -> float:
    """The median over the logging windows after the warm-up of the window's tokens/s (`tokens_seen`: a record's
    tokens so far): on a shared machine, a window that another process slowed down moves it less than it would
    move the mean."""
    steps = [r for r in records if "loss" in r and r["step"] >= warmup]
    return statistics.median(
        (tokens_seen(b) - tokens_seen(a)) / (b["time"] - a["time"]) for a, b in zip(steps, steps[1:])
    )


def real_tokens_seen(record: dict) -> int:
    """The real tokens trained on by a record's step: the runner's tokens_seen, the peers' tokens."""
    return record["tokens_seen"] if "tokens_seen" in record else record["tokens"]


def peak_memory(program: str, records: list[dict], run_dir: Path) -> Optional[float]:
    """The runner's peak memory from its summary.json; a peer's from its last record."""
    if program == "runner":
        summary = run_dir / "summary.json"
        return json.loads(summary.read_text())["peak_memory_gib"] if summary.exists() else None
    return next((r["peak_memory_gib"] for r in reversed(records) if "peak_memory_gib" in r), None)


def median(values: list[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def rotated(items, repeat: int) -> list:
    """Repeat `repeat`'s order of `items`: from item `repeat` mod n on, then those before it. Each item runs first
    in turn, so on a machine that speeds up (or slows down) over a run no contender always takes the first,
    slowest slot."""
    items = list(items)
    shift = repeat % len(items) if items else 0
    return items[shift:] + items[:shift]


def paired_ratios(base: dict[int, float], other: dict[int, float]) -> dict[int, float]:
    """`base`'s figure over `other`'s in each repeat both finished (each: repeat -> figure): the two ran minutes
    apart, under the same load, so a ratio per repeat cancels the drift that a ratio of medians keeps."""
    return {repeat: base[repeat] / other[repeat] for repeat in sorted(base.keys() & other.keys()) if other[repeat]}


def ratio_spread(ratios: dict[int, float]) -> str:
    """The paired ratios' median and range, as 'median 0.988x, range 0.940-1.039x over 3 repeats'."""
    values = list(ratios.values())
    return (
        f"median {statistics.median(values):.3f}x, range {min(values):.3f}-{max(values):.3f}x over "
        f"{len(values)} repeat{'s' if len(values) != 1 else ''}"
    )


def peer_plan(
    spec, workdir: Path, rows: Optional[Path], global_batch: int, steps: int, log_every: int, eval_batches: int = 0
) -> dict:
    """The runner's settings, as the peer scripts read them; `eval_batches`: evaluate that many micro batches of the
    runner's eval rows before the first step, as the runner does (start-up runs only)."""
    from runner.components.modeling import byte_tokenizer
    from runner.config.optim import AdamWConfig
    from runner.config.scheduler import Decay, warmup_steps

    if not isinstance(spec.optim, AdamWConfig) or spec.scheduler.decay is not Decay.cosine:
        raise SystemExit("the peers implement AdamW with warmup and cosine decay, the runner's defaults")
    return {
        "rows": str(rows) if rows else None,
        "text_files": spec.data.files,
        "seq_len": spec.data.seq_len,
        "seed": spec.seed,
        "global_batch": global_batch,
        "micro_batch_size": spec.train.micro_batch_size,
        "max_steps": steps,
        "log_every": log_every,
        "eval_batches": eval_batches,
        "model_config": str(workdir / "model_config"),
        "lr": spec.optim.lr,
        "weight_decay": spec.optim.weight_decay,
        "betas": list(spec.optim.betas),
        "eps": spec.optim.eps,
        "warmup_steps": warmup_steps(spec.scheduler, steps),
        "min_lr_ratio": spec.scheduler.min_lr_ratio,
        "max_grad_norm": spec.train.max_grad_norm,
        "pad_token_id": byte_tokenizer().pad_token_id,  # the runner's default tokenizer's, for padding instruction rows
    }


def by_repeat(outcomes: list[Outcome]) -> dict[int, float]:
    """The finished runs' tokens/s, by repeat."""
    return {o.repeat: o.tokens_per_s for o in outcomes if o.error is None}


def paired_table(configs: list[Config], pairs: list[tuple[str, str]], results: dict, repeats: int) -> list[str]:
    """Each pair's ratio repeat by repeat (the first's tokens/s over the second's in the same repeat), its median
    and its range; nothing where no pair ran."""
    rows = [
        "",
        "Paired: the first contender's tokens/s over the second's in the same repeat (the order rotates "
        "each repeat), median and range (min-max) over the repeats both finished",
        "",
        "| config | ratio | median | min-max | per repeat |",
        "|---|---|---|---|---|",
    ]
    for config in configs:
        for base, other in pairs:
            ratios = pair_of(config.name, base, other, results)
            if ratios is None or (config.name, base) not in results:
                continue  # one of them was not run
            label = f"{base} / {other}"
            if not ratios:
                rows.append(f"| {config.name} | {label} | no pair | | |")
                continue
            values = list(ratios.values())
            each = ", ".join(f"{ratios[r]:.3f}" if r in ratios else "-" for r in range(repeats))
            rows.append(
                f"| {config.name} | {label} | {median(values):.3f}x | {min(values):.3f}-{max(values):.3f}x | {each} |"
            )
    return rows if len(rows) > 5 else []


def pair_of(config: str, base: str, other: str, results: dict) -> Optional[dict[int, float]]:
    """`base`'s paired ratios over `other` in `config`; None where `other` never ran there."""
    if (config, other) not in results:
        return None
    return paired_ratios(by_repeat(results.get((config, base), [])), by_repeat(results[(config, other)]))


def header() -> str:
    """The date, the machine, the versions and the command line, for a results table."""
    import accelerate
    import datasets
    import torch
    import transformers

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_name()
    return (
        f"{datetime.date.today()} | {device}, {len(os.sched_getaffinity(0))} cores | Python "
        f"{platform.python_version()} | torch {torch.__version__} | transformers {transformers.__version__} | "
        f"accelerate {accelerate.__version__} | datasets {datasets.__version__}\n"
        f"command: python bench/{Path(sys.argv[0]).name} {' '.join(sys.argv[1:])}"
    )


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "CPU"


def failed(errors: list[str]) -> str:
    return errors[0].replace(UNSUPPORTED, "n/a: ") if errors[0].startswith(UNSUPPORTED) else f"failed: {errors[0]}"


def runner_spec(steps: int, overrides: list[str] = ()):
    """The runner's default spec with `overrides`, resolved the way `run` resolves it."""
    from runner.cli.compose import compose_config
    from runner.config.spec import load_spec, validate

    return validate(load_spec(compose_config([*overrides, f"train.max_steps={steps}"])))
