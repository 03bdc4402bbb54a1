"""The runner against the loops its users would write instead, side by side on this machine (not a test).

    python bench/compare_loops.py              # single, ddp, fsdp, then start-up: about 15 minutes on 2 CPU cores
    python bench/compare_loops.py --steps 60 --repeats 3 --configs single,ddp --no-startup

Every contender trains the runner's default job (model tiny_llama, data python_stdlib, AdamW with its warmup and
cosine schedule, clipping at 1.0) from the same seed on the same rows for the same steps:

    runner      the `run` command itself, in its own process
    hand        bench/peers/hand_loop.py: plain PyTorch, DDP or fully_shard under torchrun
    accelerate  bench/peers/accelerate_loop.py: an Accelerator loop under `accelerate launch` (FSDP2 plugin)
    trainer     bench/peers/trainer_loop.py: the transformers Trainer (under torchrun for 2 processes)

Configs: single (one process), ddp and fsdp (2 processes, gloo on the CPU; on a machine with 2 GPUs, NCCL).
Runs alternate (runner, hand, accelerate, trainer, runner, ...) `--repeats` times, each process with `--threads`
torch threads. Every contender logs its loss every `--log-every` steps with the wall-clock time (the runner in
its metrics.jsonl, the peers in their own log); a run's tokens/s is the median over its logging windows after
`--warmup` steps, and the table shows the median over the runs. The rows come from the runner's data
pipeline, written once to a file the peers read.

Start-up: the wall time of `run --help` and `run --cfg job` (and whether they import torch), and from process
start to the end of the first optimizer step: the default `run`, the hand-written loop under `python` and the
accelerate loop under `accelerate launch`, all reading and tokenizing the default data themselves. The default
run evaluates before its first step; the equivalent scripts evaluate the same rows first too, and the hand-written
loop also runs without that evaluation.

Prints Markdown for docs/benchmarks.md. The peers need `pip install '.[bench]'`.
"""

from __future__ import annotations

import argparse
import datetime
import json
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
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PEERS = HERE / "peers"
sys.path.insert(0, str(PEERS))
sys.path.insert(0, str(ROOT))

CONTENDERS = ("runner", "hand", "accelerate", "trainer")
PROCESSES = {"single": 1, "ddp": 2, "fsdp": 2}
PEER_SCRIPTS = {"hand": "hand_loop.py", "accelerate": "accelerate_loop.py", "trainer": "trainer_loop.py"}
# Targets from the benchmark issue; reported, never asserted.
RATIO_TARGET = 0.98
RUN_TIMEOUT_S = 600
UNSUPPORTED = "unsupported: "  # how a peer script says it cannot run a config on this machine
CFG_JOB_TARGET_S = 0.5
FIRST_STEP_MARGIN_S = 2.0
RUNNER_FIRST_STEP = "run (default job)"
HAND_FIRST_STEP = "python hand_loop.py, evaluating first"
BARE_HAND_FIRST_STEP = "python hand_loop.py, without the evaluation"
HYDRA_FLOOR = "python -c 'import hydra, omegaconf'"  # what any Hydra app pays before it composes a config
QUICK_REPEATS = 5  # runs of `run --help` and `run --cfg job` in each start-up round: a second each


@dataclass
class Config:
    name: str
    processes: int
    plan: Path


@dataclass
class Outcome:
    tokens_per_s: float | None = None
    final_loss: float | None = None
    error: str | None = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=25, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the throughput")
    parser.add_argument("--log-every", type=int, default=5,
                        help="every contender's logging interval: the windows the throughput is measured over")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds of all contenders")
    parser.add_argument("--configs", default="single,ddp,fsdp")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--startup-repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per process (OMP_NUM_THREADS); on a shared machine more threads than "
                             "free cores make every run erratic")
    parser.add_argument("--no-startup", action="store_true")
    parser.add_argument("--keep", help="a directory to keep the runs' files and logs in (default: a temporary one)")
    args = parser.parse_args()
    if args.warmup % args.log_every or args.steps < args.warmup + 2 * args.log_every:
        parser.error("--warmup must be a multiple of --log-every, and --steps leave at least two windows after it")
    contenders = [c for c in args.contenders.split(",") if c]
    for name in contenders:
        if name not in CONTENDERS:
            parser.error(f"unknown contender {name}; choose from {', '.join(CONTENDERS)}")

    began = time.perf_counter()
    workdir = Path(args.keep or tempfile.mkdtemp(prefix="compare_loops-"))
    workdir.mkdir(parents=True, exist_ok=True)
    from runner.cli import quiet_libraries

    quiet_libraries()  # as `run` does: the harness composes the runner's spec too
    print(header())
    spec = runner_spec(args.steps)
    configs, skipped = prepare_configs(spec, args, workdir)
    for name, why in skipped.items():
        print(f"\n{name}: skipped, {why}")
    if configs:
        results = measure_throughput(configs, contenders, args, workdir)
        print(throughput_table(configs, contenders, results, spec.data.seq_len, spec.train.micro_batch_size))
    if not args.no_startup:
        print(startup_section(spec, args.startup_repeats, args.threads, workdir))
    print(f"\n(wall time of this benchmark: {time.perf_counter() - began:.0f} s)")
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)


def header() -> str:
    import accelerate
    import datasets
    import torch
    import transformers

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_name()
    return (f"{datetime.date.today()} | {device}, {len(os.sched_getaffinity(0))} cores | Python "
            f"{platform.python_version()} | torch {torch.__version__} | transformers {transformers.__version__} | "
            f"accelerate {accelerate.__version__} | datasets {datasets.__version__}\n"
            f"command: python bench/compare_loops.py {' '.join(sys.argv[1:])}")


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "CPU"


def runner_spec(steps: int):
    """The runner's default spec, resolved the way `run` resolves it."""
    from hydra import compose, initialize_config_dir

    from runner import spec as spec_module
    from runner.cli import CONF_DIR, RECIPES_DIR

    spec_module.register(RECIPES_DIR)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        config = compose("config", overrides=[f"train.max_steps={steps}"])
    return spec_module.validate(spec_module.load_spec(config))


def prepare_configs(spec, args: argparse.Namespace, workdir: Path) -> tuple[list[Config], dict[str, str]]:
    """Each config's plan for the peers, and its rows file; configs this machine cannot run, with the reason."""
    import torch

    from runner.model import architecture_config, byte_tokenizer
    from shared import runner_rows

    architecture_config(spec.model, byte_tokenizer()).save_pretrained(workdir / "model_config")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    configs, skipped = [], {}
    for name in [c for c in args.configs.split(",") if c]:
        processes = PROCESSES[name]
        if gpus and processes > gpus:
            skipped[name] = f"it needs {processes} GPUs and this machine has {gpus}"
            continue
        global_batch = spec.train.micro_batch_size * processes
        rows = workdir / f"rows_{global_batch}.pt"
        if not rows.exists():
            torch.save(runner_rows(spec.data.files, spec.data.seq_len, spec.seed, global_batch, args.steps)[0], rows)
        plan = workdir / f"plan_{name}.json"
        plan.write_text(json.dumps(peer_plan(spec, workdir, rows, global_batch, args.steps, args.log_every)))
        configs.append(Config(name, processes, plan))
    return configs, skipped


def peer_plan(spec, workdir: Path, rows: Path | None, global_batch: int, steps: int, log_every: int,
              eval_batches: int = 0) -> dict:
    """The runner's settings, as the peer scripts read them; `eval_batches`: evaluate that many micro batches of the
    runner's eval rows before the first step, as the runner does (start-up runs only)."""
    from runner.optim import AdamWConfig
    from runner.scheduler import Decay, warmup_steps

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
    }


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


def run_contender(command: list[str], env: dict[str, str], output: Path) -> tuple[float, str | None]:
    """Runs one contender; returns the time it was started at and its error, if it failed."""
    with output.open("w") as out:
        started = time.time()
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                   start_new_session=True)
        try:
            returncode = process.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the launcher and its workers
            process.wait()
            return started, f"no result after {RUN_TIMEOUT_S} s; stopped"
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


def steady_throughput(records: list[dict], warmup: int, tokens_per_step: int) -> float:
    """The median over the logging windows after the warm-up of the window's tokens/s: on a shared machine, a
    window that another process slowed down moves it less than it would move the mean."""
    steps = [r for r in records if "loss" in r and r["step"] >= warmup]
    return statistics.median((b["step"] - a["step"]) * tokens_per_step / (b["time"] - a["time"])
                             for a, b in zip(steps, steps[1:]))


def measure_throughput(configs: list[Config], contenders: list[str], args: argparse.Namespace,
                       workdir: Path) -> dict[tuple[str, str], list[Outcome]]:
    # The runner evaluates before the first step and after the last, outside the measured window; the peers do
    # not evaluate, so the runner evaluates as little as it can and does not save the model.
    overrides = [f"train.max_steps={args.steps}", f"train.log_every={args.log_every}", "train.eval_every=0",
                 "train.eval_batches=1", "train.save_model=false"]
    results: dict[tuple[str, str], list[Outcome]] = {}
    for config in configs:
        plan = json.loads(config.plan.read_text())
        tokens_per_step = plan["global_batch"] * plan["seq_len"]
        for repeat in range(args.repeats):
            for contender in contenders:
                if any(o.error and o.error.startswith(UNSUPPORTED) for o in results.get((config.name, contender), [])):
                    continue  # it said once that it cannot run this config here
                name = f"{config.name}_{contender}_{repeat}"
                log, run_dir = workdir / f"{name}.jsonl", workdir / name
                command = contender_command(contender, config, log, run_dir, overrides)
                _, error = run_contender(command, child_env(args.threads), workdir / f"{name}.out")
                if error:
                    outcome = Outcome(error=error)
                else:
                    records = read_records(contender, log, run_dir)
                    outcome = Outcome(steady_throughput(records, args.warmup, tokens_per_step),
                                      [r for r in records if "loss" in r][-1]["loss"])
                results.setdefault((config.name, contender), []).append(outcome)
                shown = error or f"{outcome.tokens_per_s:.0f} tokens/s, final loss {outcome.final_loss:.4f}"
                print(f"  {config.name} {contender} run {repeat + 1}: {shown}", file=sys.stderr, flush=True)
    return results


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def throughput_table(configs: list[Config], contenders: list[str], results: dict, seq_len: int,
                     micro_batch: int) -> str:
    lines = [
        "",
        f"Throughput: tokens/s after the warm-up steps, median of the runs (sequence {seq_len}, micro batch "
        f"{micro_batch} per process)",
        "",
        "| config | contender | tokens/s | vs hand-written | final loss | runs (tokens/s) |",
        "|---|---|---|---|---|---|",
    ]
    verdicts = []
    for config in configs:
        finished = {c: [o for o in results[(config.name, c)] if o.error is None] for c in contenders}
        medians = {c: median([o.tokens_per_s for o in done]) for c, done in finished.items()}
        for contender, done in finished.items():
            errors = [o.error for o in results[(config.name, contender)] if o.error]
            if not done:
                shown = errors[0].replace(UNSUPPORTED, "n/a: ") if errors[0].startswith(UNSUPPORTED) else f"failed: {errors[0]}"
                lines.append(f"| {config.name} | {contender} | {shown} | | | |")
                continue
            losses = median([o.final_loss for o in done])
            base = medians.get("hand")
            ratio = f"{medians[contender] / base:.3f}x" if base else "-"
            runs = ", ".join(f"{o.tokens_per_s:.0f}" for o in done) + (f" ({len(errors)} failed)" if errors else "")
            lines.append(f"| {config.name} | {contender} | {medians[contender]:.0f} | {ratio} | {losses:.4f} | {runs} |")
        verdicts += config_verdicts(config.name, medians)
    return "\n".join([*lines, "", *verdicts])


def config_verdicts(config: str, medians: dict[str, float | None]) -> list[str]:
    runner, hand = medians.get("runner"), medians.get("hand")
    if runner is None:
        return []
    verdicts = []
    if hand:
        met = "met" if runner >= RATIO_TARGET * hand else "MISSED"
        verdicts.append(f"- {config}: runner at least {RATIO_TARGET}x the hand-written loop: {met} "
                        f"({runner / hand:.3f}x)")
    for peer in ("accelerate", "trainer"):
        if medians.get(peer):
            met = "met" if runner > medians[peer] else "MISSED"
            verdicts.append(f"- {config}: runner ahead of {peer}: {met} ({runner / medians[peer]:.3f}x)")
        elif peer in medians:
            verdicts.append(f"- {config}: runner ahead of {peer}: no figure ({peer} did not run)")
    return verdicts


def startup_section(spec, repeats: int, threads: int, workdir: Path) -> str:
    """Wall times of the runner's cheap commands, and process start to the end of the first optimizer step."""
    env = child_env(threads)
    quick = {"run --help": [*run_command(), "--help"], "run --cfg job": [*run_command(), "--cfg", "job"],
             HYDRA_FLOOR: [sys.executable, "-c", "import hydra, omegaconf"]}
    # The default run, stopped after one step, evaluates before it as every run does; the equivalent scripts
    # evaluate the same rows first too, and the hand-written loop runs once more without that evaluation.
    plans = {}
    for name, eval_batches in (("evaluating", spec.train.eval_batches), ("bare", 0)):
        plans[name] = workdir / f"plan_startup_{name}.json"
        plans[name].write_text(json.dumps(peer_plan(spec, workdir, None, spec.train.micro_batch_size, 1, 1, eval_batches)))
    first_step = {
        RUNNER_FIRST_STEP: ("runner", "evaluating"),
        HAND_FIRST_STEP: ("hand", "evaluating"),
        "accelerate launch accelerate_loop.py, evaluating first": ("accelerate", "evaluating"),
        BARE_HAND_FIRST_STEP: ("hand", "bare"),
    }
    times: dict[str, list[float]] = {name: [] for name in [*quick, *first_step]}
    evaluated: dict[str, list[float]] = {}  # each contender's eval loss before its first step
    errors: dict[str, str] = {}
    for repeat in range(repeats):
        for name, command in quick.items():
            for _ in range(QUICK_REPEATS):
                began = time.perf_counter()
                result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=workdir)
                times[name].append(time.perf_counter() - began)
                if result.returncode:
                    errors[name] = result.stderr.strip().splitlines()[-1]
        for name, (contender, plan) in first_step.items():
            label = f"startup_{contender}_{plan}_{repeat}"
            log, run_dir = workdir / f"{label}.jsonl", workdir / label
            overrides = ["train.max_steps=1", "train.log_every=1", "train.save_model=false"]
            command = contender_command(contender, Config("single", 1, plans[plan]), log, run_dir, overrides)
            started, error = run_contender(command, env, workdir / f"{label}.out")
            if error:
                errors[name] = error
                continue
            records = read_records(contender, log, run_dir)
            times[name].append(next(r for r in records if "loss" in r)["time"] - started)
            if plan == "evaluating":
                evaluated.setdefault(contender, []).append(next(r for r in records if "eval_loss" in r)["eval_loss"])
        print(f"  start-up round {repeat + 1} done", file=sys.stderr, flush=True)

    lines = ["", f"Start-up: wall time in seconds, median of {repeats} runs ({repeats * QUICK_REPEATS} of the quick "
             "commands)", "",
             "| what | median s | runs (s) |", "|---|---|---|"]
    for name, values in times.items():
        shown = f"failed: {errors[name]}" if name in errors else f"{median(values):.2f}"
        label = name if name in quick else f"to the first optimizer step: {name}"
        lines.append(f"| {label} | {shown} | {', '.join(f'{v:.2f}' for v in values)} |")
    lines.append("")
    if evaluated:
        losses = ", ".join(f"{contender} {values[0]:.4f}" for contender, values in evaluated.items())
        lines.append(f"- the eval loss before the first step, the same rows for all: {losses}")
    for name in ("run --help", "run --cfg job"):
        lines.append(f"- `{name}` imports torch: {'yes' if imports_torch(name.split()[1:], env) else 'no'}")
    cfg_job = median(times["run --cfg job"])
    if cfg_job is not None:
        lines.append(f"- `run --cfg job` under {CFG_JOB_TARGET_S} s: "
                     f"{'met' if cfg_job < CFG_JOB_TARGET_S else 'MISSED'} ({cfg_job:.2f} s)")
        floor = median(times[HYDRA_FLOOR])
        if floor is not None:
            lines.append(f"- a Python process that only imports Hydra and OmegaConf, as every Hydra app does: {floor:.2f} s")
    runner_first, hand_first, bare_first = (median(times[name]) for name in
                                            (RUNNER_FIRST_STEP, HAND_FIRST_STEP, BARE_HAND_FIRST_STEP))
    if runner_first is not None and hand_first is not None:
        gap = runner_first - hand_first
        lines.append(f"- the default run's first step within {FIRST_STEP_MARGIN_S:.0f} s of the equivalent hand-written "
                     f"loop's: {'met' if gap <= FIRST_STEP_MARGIN_S else 'MISSED'} ({gap:+.2f} s)")
    if runner_first is not None and bare_first is not None:
        lines.append(f"- the same against the hand-written loop without the evaluation: {runner_first - bare_first:+.2f} s")
    return "\n".join(lines)


def imports_torch(arguments: list[str], env: dict[str, str]) -> bool:
    """Whether `run <arguments>` imports torch, from Python's own import log."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "runner", *arguments], env=env,
                            capture_output=True, text=True, cwd=ROOT)
    modules = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")]
    return "torch" in modules


if __name__ == "__main__":
    main()
