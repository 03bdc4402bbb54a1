"""What the benchmarks share: the contenders' commands and environment, running one, reading its records, and
the plan that gives the peer scripts the runner's own settings."""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PEERS = HERE / "peers"
sys.path.insert(0, str(PEERS))
sys.path.insert(0, str(ROOT))

PEER_SCRIPTS = {"hand": "hand_loop.py", "accelerate": "accelerate_loop.py", "trainer": "trainer_loop.py"}
RUN_TIMEOUT_S = 600
UNSUPPORTED = "unsupported: "  # how a peer script says it cannot run a config on this machine


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

def contender_command(contender: str, config: Config, log: Path, run_dir: Path,
                      runner_overrides: list[str]) -> list[str]:
    if contender == "runner":
        return [*run_command(), f"strategy={config.name}", f"hardware.nproc_per_node={config.processes}",
                *runner_overrides, f"hydra.run.dir={run_dir}"]
    script = [str(PEERS / PEER_SCRIPTS[contender]), "--plan", str(config.plan), "--records", str(log),
              "--strategy", config.name]
    if contender == "accelerate":
        import torch

        launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(config.processes),
                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
        if config.processes > 1:
            launch.append("--multi_gpu")  # accelerate's torchrun-based launcher, which also starts CPU processes
        elif not torch.cuda.is_available():
            launch.append("--cpu")
        return [*launch, *script]
    if config.processes > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                str(config.processes), *script]
    return [sys.executable, *script]

def run_contender(command: list[str], env: dict[str, str], output: Path,
                  timeout: float = RUN_TIMEOUT_S) -> tuple[float, str | None]:
    """Runs one contender, for at most `timeout` seconds; returns the time it was started at and its error, if it
    failed."""
    with output.open("w") as out:
        started = time.time()
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                   start_new_session=True)
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

def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None

def peer_plan(spec, workdir: Path, rows: Path | None, global_batch: int, steps: int, log_every: int,
              eval_batches: int = 0) -> dict:
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
