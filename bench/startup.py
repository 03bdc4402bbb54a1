"""Start-up, for bench/compare_loops.py: the wall time of `run --help` and `run --cfg job` (and whether they import
torch), and from process start to the end of the first optimizer step, the runner against scripts that do the same
first (not a test).

On its own, `python bench/startup.py [--repeats N] [overrides...]`: `run --cfg job` against a bare Hydra compose of
the same config (conf/ and the runner's schemas, composed and printed, nothing checked), each a new process, their
order rotating from one repeat to the next; the medians and the ratio of each repeat's pair, against
CFG_JOB_RATIO_TARGET.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import (
    ROOT,
    Config,
    child_env,
    contender_command,
    median,
    peer_plan,
    read_records,
    rotated,
    run_command,
    run_contender,
)

CFG_JOB_TARGET_S = 0.5
CFG_JOB_RATIO_TARGET = 1.5  # `run --cfg job` over a bare Hydra compose of the same config (issue 66, item 7)
FIRST_STEP_MARGIN_S = 2.0
RUNNER_FIRST_STEP = "run (default job)"
HAND_FIRST_STEP = "python hand_loop.py, evaluating first"
BARE_HAND_FIRST_STEP = "python hand_loop.py, without the evaluation"
HYDRA_FLOOR = "python -c 'import hydra, omegaconf'"  # what any Hydra app pays before it composes a config
QUICK_REPEATS = 5  # runs of `run --help` and `run --cfg job` in each start-up round: a second each
# The default run, stopped after one step, evaluates before it as every run does; the equivalent scripts evaluate
# the same rows first too, and the hand-written loop runs once more without that evaluation.
FIRST_STEP = {
    RUNNER_FIRST_STEP: ("runner", "evaluating"),
    HAND_FIRST_STEP: ("hand", "evaluating"),
    "accelerate launch accelerate_loop.py, evaluating first": ("accelerate", "evaluating"),
    BARE_HAND_FIRST_STEP: ("hand", "bare"),
}


def startup_section(spec, repeats: int, threads: int, workdir: Path) -> str:
    """Wall times of the runner's cheap commands, and process start to the end of the first optimizer step."""
    env = child_env(threads)
    quick = {
        "run --help": [*run_command(), "--help"],
        "run --cfg job": [*run_command(), "--cfg", "job"],
        HYDRA_FLOOR: [sys.executable, "-c", "import hydra, omegaconf"],
    }
    plans = {}
    for name, eval_batches in (("evaluating", spec.train.eval_batches), ("bare", 0)):
        plans[name] = workdir / f"plan_startup_{name}.json"
        plans[name].write_text(
            json.dumps(peer_plan(spec, workdir, None, spec.train.micro_batch_size, 1, 1, eval_batches))
        )
    times: dict[str, list[float]] = {name: [] for name in [*quick, *FIRST_STEP]}
    evaluated: dict[str, list[float]] = {}  # each contender's eval loss before its first step
    errors: dict[str, str] = {}
    for repeat in range(repeats):
        for name, command in rotated(quick.items(), repeat):  # each round starts one further on
            for _ in range(QUICK_REPEATS):
                began = time.perf_counter()
                result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=workdir)
                times[name].append(time.perf_counter() - began)
                if result.returncode:
                    errors[name] = result.stderr.strip().splitlines()[-1]
        for name, (contender, plan) in rotated(FIRST_STEP.items(), repeat):
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
    return startup_table(times, evaluated, errors, repeats, quick, env)


def startup_table(
    times: dict[str, list[float]],
    evaluated: dict[str, list[float]],
    errors: dict[str, str],
    repeats: int,
    quick: dict[str, list[str]],
    env: dict[str, str],
) -> str:
    lines = [
        "",
        f"Start-up: wall time in seconds, median of {repeats} runs ({repeats * QUICK_REPEATS} of the quick commands)",
        "",
        "| what | median s | runs (s) |",
        "|---|---|---|",
    ]
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
        lines.append(
            f"- `run --cfg job` under {CFG_JOB_TARGET_S} s: "
            f"{'met' if cfg_job < CFG_JOB_TARGET_S else 'MISSED'} ({cfg_job:.2f} s)"
        )
        floor = median(times[HYDRA_FLOOR])
        if floor is not None:
            lines.append(
                f"- a Python process that only imports Hydra and OmegaConf, as every Hydra app does: {floor:.2f} s"
            )
    runner_first, hand_first, bare_first = (
        median(times[name]) for name in (RUNNER_FIRST_STEP, HAND_FIRST_STEP, BARE_HAND_FIRST_STEP)
    )
    if runner_first is not None and hand_first is not None:
        gap = runner_first - hand_first
        lines.append(
            f"- the default run's first step within {FIRST_STEP_MARGIN_S:.0f} s of the equivalent "
            f"hand-written loop's: {'met' if gap <= FIRST_STEP_MARGIN_S else 'MISSED'} ({gap:+.2f} s)"
        )
    if runner_first is not None and bare_first is not None:
        lines.append(
            f"- the same against the hand-written loop without the evaluation: {runner_first - bare_first:+.2f} s"
        )
    return "\n".join(lines)


def imports_torch(arguments: list[str], env: dict[str, str]) -> bool:
    """Whether `run <arguments>` imports torch, from Python's own import log."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "runner", *arguments],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    modules = [
        line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")
    ]
    return "torch" in modules


# A bare Hydra app's compose of the runner's config: conf/ with the schemas its options start from (`/schema/...`)
# and, where the overrides can choose one, the recipes, registered by the runner's own function, composed by Hydra's
# compose API and printed resolved (as `run --cfg job` prints the spec); no checks, no spec.
BARE_COMPOSE = """
import sys
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from runner.cli import recipes
from runner.cli.compose import CONF_DIR, RECIPES_DIR, choosable_recipes, register
register(*choosable_recipes(recipes.search_path(RECIPES_DIR), sys.argv[1:]))
with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
    config = compose("config", overrides=sys.argv[1:])
print(OmegaConf.to_yaml(config, resolve=True))
"""
CFG_JOB = "run --cfg job"
BARE = "bare Hydra compose"


def cfg_job_contenders(overrides: list[str]) -> dict[str, list[str]]:
    """`run --cfg job` (this checkout's, through -m) and the bare compose of the same config, and what any Hydra app
    pays before it composes, for scale."""
    return {
        CFG_JOB: [sys.executable, "-m", "runner", "--cfg", "job", *overrides],
        BARE: [sys.executable, "-c", BARE_COMPOSE, *overrides],
        HYDRA_FLOOR: [sys.executable, "-c", "import hydra, omegaconf"],
    }


def time_cfg_job(repeats: int, overrides: list[str], workdir: Path) -> dict[str, dict[str, list[float]]]:
    """Each contender's wall and CPU times (user and system, which a busy machine disturbs less), one run of each
    per repeat, in an order that rotates from one repeat to the next (a machine speeds up and slows down over a
    run). One untimed run of each first compiles and caches."""
    env = child_env(1)
    contenders = cfg_job_contenders(overrides)
    names = list(contenders)
    for name in names:
        result = subprocess.run(contenders[name], env=env, capture_output=True, text=True, cwd=workdir)
        if result.returncode:
            sys.exit(f"{name} failed: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
    times: dict[str, dict[str, list[float]]] = {
        "wall": {name: [] for name in names},
        "cpu": {name: [] for name in names},
    }
    for repeat in range(repeats):
        for name in rotated(names, repeat):
            used, began = children_cpu(), time.perf_counter()
            subprocess.run(contenders[name], env=env, capture_output=True, cwd=workdir, check=True)
            times["wall"][name].append(time.perf_counter() - began)
            times["cpu"][name].append(children_cpu() - used)
    return times


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cfg_job_report(times: dict[str, dict[str, list[float]]]) -> str:
    """The medians, and the ratio of `run --cfg job` to the bare compose in each repeat: its median and spread, of
    the wall time (the target's) and of the CPU time."""
    repeats = len(times["wall"][CFG_JOB])
    lines = [
        f"`run --cfg job` against a bare Hydra compose of the same config: seconds, {repeats} repeats",
        "",
        "| what | median wall | min wall | max wall | median CPU |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {name} | {statistics.median(wall):.3f} | {min(wall):.3f} | {max(wall):.3f} | "
        f"{statistics.median(times['cpu'][name]):.3f} |"
        for name, wall in times["wall"].items()
    ]
    lines.append("")
    medians = {}
    for kind, measured in times.items():
        ratios = sorted(runner / bare for runner, bare in zip(measured[CFG_JOB], measured[BARE]))
        medians[kind] = statistics.median(ratios)
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        lines.append(
            f"- {kind} time ratio per repeat, `run --cfg job` over the bare compose: median "
            f"{medians[kind]:.2f}, quartiles {quartiles[0]:.2f}-{quartiles[2]:.2f}, range "
            f"{ratios[0]:.2f}-{ratios[-1]:.2f}"
        )
    ratio = medians["wall"]
    lines.append(
        f"- within {CFG_JOB_RATIO_TARGET}x (the median wall time ratio): "
        f"{'met' if ratio <= CFG_JOB_RATIO_TARGET else 'MISSED'} ({ratio:.2f})"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description="`run --cfg job` against a bare Hydra compose of the same config")
    parser.add_argument("--repeats", type=int, default=20, help="rounds of one run of each contender")
    parser.add_argument("overrides", nargs="*", help="the config's overrides, given to both (e.g. task=dpo)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="startup-") as workdir:  # nothing of the checkout's cwd is read
        print(cfg_job_report(time_cfg_job(args.repeats, args.overrides, Path(workdir))))


if __name__ == "__main__":
    main()
