"""The runner against the loops its users would write instead, side by side on this machine (not a test).

    python bench/compare_loops.py              # text: single, ddp, fsdp, then start-up: about 15 minutes on 2 CPU cores
    python bench/compare_loops.py --steps 60 --repeats 3 --configs single,ddp --no-startup
    python bench/compare_loops.py --workload instruction --configs single,ddp --steps 60 --repeats 3 --no-startup
    python bench/compare_loops.py --workload text,instruction --compile

Two workloads (`--workload`, default text):

text: every contender trains the runner's default job (model tiny_llama, data python_stdlib, AdamW with its warmup
and cosine schedule, clipping at 1.0) from the same initial weights (the runner's seed and way of drawing them:
bench/peers/shared.py's initial_model) on the same rows (blocks of 256 tokens) for the same steps; single's runner and
hand loop agree at every step on the CPU with train.loss=full, and within 2e-6 to step 30 with the chunked loss:

    runner      the `run` command itself, in its own process
    hand        bench/peers/hand_loop.py: plain PyTorch, DDP or fully_shard under torchrun
    accelerate  bench/peers/accelerate_loop.py: an Accelerator loop under `accelerate launch` (FSDP2 plugin)
    trainer     bench/peers/trainer_loop.py: the transformers Trainer (under torchrun for 2 processes)

instruction: the same job on prompt/response pairs of very different lengths (tens to thousands of tokens), made
from the standard library's documented functions by bench/instruction_data.py, sequence 1024 (longer examples
truncated by the runner; the peers get the same truncated rows), the loss on the responses only:

    runner                 `run data=instruction_files data.seq_len=1024`: its defaults, one example per row,
                           padded to the longest row of its micro batch
    runner-packed          the same with data.packing=true: several whole examples per row of 1024 tokens, each
                           attending only to itself
    runner-packed-compile  the same with train.compile=true too (only with --compile: torch.compile takes 30-60 s
                           on a CPU, outside the measured window)
    hand, accelerate       the peers above on the runner's unpacked rows, in its order, each micro batch padded to
                           its longest row (attention mask; labels -100 on the padding and the prompt)
    trainer                the Trainer with the collator it needs for such rows, DataCollatorForSeq2Seq (it pads
                           the labels with -100; the Trainer's default collator pads none)
    trainer-padding-free   the Trainer with DataCollatorWithFlattening, transformers' padding-free option: each
                           micro batch's examples in one row, position_ids and no attention mask

Configs: single (one process), ddp and fsdp (2 processes, gloo on the CPU; on a machine with 2 GPUs, NCCL); the
instruction workload runs single and ddp. Runs alternate (runner, hand, accelerate, trainer, runner, ...)
`--repeats` times, each process with `--threads` torch threads. Every contender logs its loss every `--log-every`
steps with the wall-clock time and the real (non-padding) tokens it has trained on so far (the runner in its
metrics.jsonl, the peers in their own log); a run's tokens/s is the median over its logging windows after
`--warmup` steps of the window's tokens over its seconds (text: every token is real), and the table shows the
median over the runs. The instruction table also shows the peak memory: the runner's summary.json's, the peers'
own (the peak resident memory of the first process, on the CPU). The rows come from the runner's data pipeline,
written once to a file the peers read.

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
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from harness import UNSUPPORTED, Config, child_env, contender_command, median, peer_plan, read_records, run_contender
from instruction_data import write_instruction_set
from startup import startup_section

WORKLOADS = ("text", "instruction")
CONTENDERS = {
    "text": ("runner", "hand", "accelerate", "trainer"),
    "instruction": ("runner", "runner-packed", "runner-packed-compile", "hand", "accelerate", "trainer",
                    "trainer-padding-free"),
}
# A variant of a contender: the program it runs, and what it adds to that program's command line.
VARIANTS = {
    "runner-packed": ("runner", ["data.packing=true"]),
    "runner-packed-compile": ("runner", ["data.packing=true", "train.compile=true"]),
    "trainer-padding-free": ("trainer", ["--collator", "flattening"]),
}
PROCESSES = {"single": 1, "ddp": 2, "fsdp": 2}
WORKLOAD_CONFIGS = {"text": ("single", "ddp", "fsdp"), "instruction": ("single", "ddp")}
RATIO_TARGET = 0.98
PACKED_TARGET = 1.5  # runner-packed's real tokens/s over the padded loops'
INSTRUCTION_SEQ_LEN = 1024
INSTRUCTION_EXAMPLES = 4000  # about two epochs of packed rows at 60 steps of ddp's global batch of 16 rows


@dataclass
class Outcome:
    tokens_per_s: float | None = None
    final_loss: float | None = None
    peak_memory_gib: float | None = None
    error: str | None = None


@dataclass
class Workload:
    name: str
    spec: object  # the runner's resolved spec for it
    overrides: list[str]  # what `run` is given for it (the text workload: the defaults, nothing)
    contenders: list[str]
    data_note: str = ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="text",
                        help="text, instruction, or both (text,instruction): the data the contenders train on")
    parser.add_argument("--steps", type=int, default=25, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the throughput")
    parser.add_argument("--log-every", type=int, default=5,
                        help="every contender's logging interval: the windows the throughput is measured over")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds of all contenders")
    parser.add_argument("--configs", default="single,ddp,fsdp",
                        help="the instruction workload runs those of them it has (single, ddp)")
    parser.add_argument("--contenders", default=None,
                        help="a subset of the workloads' contenders (default: all of them)")
    parser.add_argument("--compile", action="store_true",
                        help="instruction workload: also runner-packed-compile "
                             "(torch.compile: 30-60 s per run on a CPU)")
    parser.add_argument("--startup-repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per process (OMP_NUM_THREADS); on a shared machine more threads than "
                             "free cores make every run erratic")
    parser.add_argument("--no-startup", action="store_true")
    parser.add_argument("--keep", help="a directory to keep the runs' files and logs in (default: a temporary one)")
    args = parser.parse_args()
    if args.warmup % args.log_every or args.steps < args.warmup + 2 * args.log_every:
        parser.error("--warmup must be a multiple of --log-every, and --steps leave at least two windows after it")
    workloads = [w for w in args.workload.split(",") if w]
    for name in workloads:
        if name not in WORKLOADS:
            parser.error(f"unknown workload {name}; choose from {', '.join(WORKLOADS)}")
    known = {c for w in WORKLOADS for c in CONTENDERS[w]}
    wanted = set(c for c in args.contenders.split(",") if c) if args.contenders else known
    for name in sorted(wanted - known):
        parser.error(f"unknown contender {name}; choose from {', '.join(sorted(known))}")
    if args.compile:
        wanted.add("runner-packed-compile")
    elif "runner-packed-compile" in wanted:
        wanted.discard("runner-packed-compile")
        if args.contenders:
            parser.error("runner-packed-compile runs with --compile")
    for name in args.configs.split(","):
        if name and name not in PROCESSES:
            parser.error(f"unknown config {name}; choose from {', '.join(PROCESSES)}")

    began = time.perf_counter()
    workdir = Path(args.keep or tempfile.mkdtemp(prefix="compare_loops-"))
    workdir.mkdir(parents=True, exist_ok=True)
    from runner.quiet import quiet_libraries

    quiet_libraries()  # as `run` does: the harness composes the runner's spec too
    print(header())
    for name in workloads:
        workload = prepare_workload(name, [c for c in CONTENDERS[name] if c in wanted], args, workdir)
        configs, skipped = prepare_configs(workload, args, workdir)
        for config, why in skipped.items():
            print(f"\n{name} workload, {config}: skipped, {why}")
        if configs and workload.contenders:
            results = measure_throughput(workload, configs, args, workdir)
            spec = workload.spec
            if name == "text":
                print(throughput_table(configs, workload.contenders, results, spec.data.seq_len,
                                       spec.train.micro_batch_size))
            else:
                print(instruction_table(workload, configs, results))
    if not args.no_startup:
        print(startup_section(runner_spec(args.steps), args.startup_repeats, args.threads, workdir))
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


def runner_spec(steps: int, overrides: list[str] = ()):
    """The runner's default spec with `overrides`, resolved the way `run` resolves it."""
    from runner.cli.compose import compose_config
    from runner.config.spec import load_spec, validate

    return validate(load_spec(compose_config([*overrides, f"train.max_steps={steps}"])))


def prepare_workload(name: str, contenders: list[str], args: argparse.Namespace, workdir: Path) -> Workload:
    """The runner's spec for the workload, and its data where the workload makes its own."""
    if name == "text":
        return Workload(name, runner_spec(args.steps), [], contenders)
    data = write_instruction_set(workdir / "instruction.jsonl", INSTRUCTION_EXAMPLES)
    overrides = ["data=instruction_files", f"data.files={data}", f"data.seq_len={INSTRUCTION_SEQ_LEN}"]
    return Workload(name, runner_spec(args.steps, overrides), overrides, contenders, instruction_note(data))


def instruction_note(data: Path) -> str:
    """The instruction set's size and lengths in the runner's tokens (bytes, plus the end-of-sequence token)."""
    rows = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines()]
    lengths = sorted(len((r["prompt"] + r["response"]).encode()) + 1 for r in rows)
    longer = sum(length > INSTRUCTION_SEQ_LEN for length in lengths) / len(lengths)
    return (f"{len(rows)} prompt/response pairs from the Python {platform.python_version()} standard library's "
            f"documented functions (bench/instruction_data.py): {lengths[0]} to {lengths[-1]} tokens, median "
            f"{lengths[len(lengths) // 2]}, {longer:.0%} longer than the sequence of {INSTRUCTION_SEQ_LEN} (truncated)")


def prepare_configs(workload: Workload, args: argparse.Namespace, workdir: Path) -> tuple[list[Config], dict[str, str]]:
    """Each config's plan for the peers, and its rows file; configs this machine cannot run, with the reason."""
    import torch
    from shared import instruction_rows, runner_rows

    from runner.components.modeling import architecture_config, byte_tokenizer

    spec = workload.spec
    architecture_config(spec.model, byte_tokenizer()).save_pretrained(workdir / "model_config")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    configs, skipped = [], {}
    for name in [c for c in args.configs.split(",") if c]:
        if name not in WORKLOAD_CONFIGS[workload.name]:
            skipped[name] = f"the {workload.name} workload runs {', '.join(WORKLOAD_CONFIGS[workload.name])}"
            continue
        processes = PROCESSES[name]
        if gpus and processes > gpus:
            skipped[name] = f"it needs {processes} GPUs and this machine has {gpus}"
            continue
        global_batch = spec.train.micro_batch_size * processes
        rows = workdir / f"rows_{workload.name}_{global_batch}.pt"
        if not rows.exists():
            if workload.name == "text":
                torch.save(runner_rows(spec.data.files, spec.data.seq_len, spec.seed, global_batch, args.steps)[0],
                           rows)
            else:
                torch.save(instruction_rows(spec.data.files, spec.data.seq_len, spec.seed, global_batch, args.steps),
                           rows)
        plan = workdir / f"plan_{workload.name}_{name}.json"
        plan.write_text(json.dumps(peer_plan(spec, workdir, rows, global_batch, args.steps, args.log_every)))
        configs.append(Config(name, processes, plan))
    return configs, skipped


def steady_throughput(records: list[dict], warmup: int, tokens_seen) -> float:
    """The median over the logging windows after the warm-up of the window's tokens/s (`tokens_seen`: a record's
    tokens so far): on a shared machine, a window that another process slowed down moves it less than it would
    move the mean."""
    steps = [r for r in records if "loss" in r and r["step"] >= warmup]
    return statistics.median((tokens_seen(b) - tokens_seen(a)) / (b["time"] - a["time"])
                             for a, b in zip(steps, steps[1:]))


def real_tokens_seen(record: dict) -> int:
    """The real tokens trained on by a record's step: the runner's tokens_seen, the peers' tokens."""
    return record["tokens_seen"] if "tokens_seen" in record else record["tokens"]


def peak_memory(program: str, records: list[dict], run_dir: Path) -> float | None:
    """The runner's peak memory from its summary.json; a peer's from its last record."""
    if program == "runner":
        summary = run_dir / "summary.json"
        return json.loads(summary.read_text())["peak_memory_gib"] if summary.exists() else None
    return next((r["peak_memory_gib"] for r in reversed(records) if "peak_memory_gib" in r), None)


def measure_throughput(workload: Workload, configs: list[Config], args: argparse.Namespace,
                       workdir: Path) -> dict[tuple[str, str], list[Outcome]]:
    # The runner evaluates before the first step and after the last, outside the measured window; the peers do
    # not evaluate, so the runner evaluates as little as it can and does not save the model.
    overrides = [*workload.overrides, f"train.max_steps={args.steps}", f"train.log_every={args.log_every}",
                 "train.eval_every=0", "train.eval_batches=1", "train.save_model=false"]
    results: dict[tuple[str, str], list[Outcome]] = {}
    for config in configs:
        plan = json.loads(config.plan.read_text())
        tokens_per_step = plan["global_batch"] * plan["seq_len"]
        if workload.name == "text":
            def tokens_seen(record: dict) -> int:
                return record["step"] * tokens_per_step  # every token of a block is real
        else:
            tokens_seen = real_tokens_seen
        for repeat in range(args.repeats):
            for contender in workload.contenders:
                if any(o.error and o.error.startswith(UNSUPPORTED) for o in results.get((config.name, contender), [])):
                    continue  # it said once that it cannot run this config here
                program, extra = VARIANTS.get(contender, (contender, []))
                name = f"{workload.name}_{config.name}_{contender}_{repeat}"
                log, run_dir = workdir / f"{name}.jsonl", workdir / name
                if program == "runner":
                    command = contender_command(program, config, log, run_dir, [*overrides, *extra])
                else:  # the script's own options come last in every launcher's command line
                    command = [*contender_command(program, config, log, run_dir, overrides), *extra]
                _, error = run_contender(command, child_env(args.threads), workdir / f"{name}.out")
                if error:
                    outcome = Outcome(error=error)
                else:
                    records = read_records(program, log, run_dir)
                    outcome = Outcome(steady_throughput(records, args.warmup, tokens_seen),
                                      [r for r in records if "loss" in r][-1]["loss"],
                                      peak_memory(program, records, run_dir))
                results.setdefault((config.name, contender), []).append(outcome)
                shown = error or (f"{outcome.tokens_per_s:.0f} tokens/s, final loss {outcome.final_loss:.4f}, peak "
                                  f"memory {outcome.peak_memory_gib or float('nan'):.2f} GiB")
                print(f"  {workload.name} {config.name} {contender} run {repeat + 1}: {shown}", file=sys.stderr,
                      flush=True)
    return results


def failed(errors: list[str]) -> str:
    return errors[0].replace(UNSUPPORTED, "n/a: ") if errors[0].startswith(UNSUPPORTED) else f"failed: {errors[0]}"


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
                lines.append(f"| {config.name} | {contender} | {failed(errors)} | | | |")
                continue
            losses = median([o.final_loss for o in done])
            base = medians.get("hand")
            ratio = f"{medians[contender] / base:.3f}x" if base else "-"
            runs = ", ".join(f"{o.tokens_per_s:.0f}" for o in done) + (f" ({len(errors)} failed)" if errors else "")
            lines.append(f"| {config.name} | {contender} | {medians[contender]:.0f} | {ratio} | {losses:.4f} "
                         f"| {runs} |")
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


def padding_share(config: Config) -> float:
    """The share of padding in the padded contenders' micro batches (each padded to its longest row)."""
    import torch

    plan = json.loads(config.plan.read_text())
    rows, micro = torch.load(plan["rows"]), plan["micro_batch_size"]
    lengths = [len(ids) for ids, _ in rows]
    batches = [lengths[i : i + micro] for i in range(0, len(lengths), micro)]
    return 1 - sum(lengths) / sum(max(batch) * len(batch) for batch in batches)


def instruction_table(workload: Workload, configs: list[Config], results: dict) -> str:
    spec = workload.spec
    lines = [
        "",
        f"Instruction data: {workload.data_note}. Micro batch {spec.train.micro_batch_size} rows per process. "
        "Real tokens/s: the tokens trained on, padding aside, per second after the warm-up steps, median of the "
        "runs; peak memory: the first process's peak resident memory on the CPU (peak allocated on a GPU), median "
        "of the runs.",
        "",
        "| config | contender | real tokens/s | vs hand-written (padded) | peak memory GiB | final loss "
        "| runs (real tokens/s) |",
        "|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for config in configs:
        finished = {c: [o for o in results[(config.name, c)] if o.error is None] for c in workload.contenders}
        medians = {c: median([o.tokens_per_s for o in done]) for c, done in finished.items()}
        for contender, done in finished.items():
            errors = [o.error for o in results[(config.name, contender)] if o.error]
            if not done:
                lines.append(f"| {config.name} | {contender} | {failed(errors)} | | | | |")
                continue
            base = medians.get("hand")
            ratio = f"{medians[contender] / base:.2f}x" if base else "-"
            memory = median([o.peak_memory_gib for o in done if o.peak_memory_gib is not None])
            memory = f"{memory:.2f}" if memory is not None else "-"
            runs = ", ".join(f"{o.tokens_per_s:.0f}" for o in done) + (f" ({len(errors)} failed)" if errors else "")
            lines.append(f"| {config.name} | {contender} | {medians[contender]:.0f} | {ratio} | {memory} | "
                         f"{median([o.final_loss for o in done]):.4f} | {runs} |")
        verdicts.append(f"- {config.name}: the padded micro batches (runner, hand, accelerate, trainer) are "
                        f"{padding_share(config):.0%} padding")
        verdicts += packed_verdicts(config.name, medians)
    return "\n".join([*lines, "", *verdicts])


def packed_verdicts(config: str, medians: dict[str, float | None]) -> list[str]:
    packed = medians.get("runner-packed")
    if "runner-packed" not in medians:
        return []
    verdicts = []
    for peer, label in (("hand", "the padded hand-written loop"), ("trainer", "the Trainer with its defaults")):
        what = f"- {config}: runner-packed at least {PACKED_TARGET}x {label}"
        if packed and medians.get(peer):
            ratio = packed / medians[peer]
            verdicts.append(f"{what}: {'met' if ratio >= PACKED_TARGET else 'MISSED'} ({ratio:.2f}x)")
        elif peer in medians or not packed:
            verdicts.append(f"{what}: no figure ({'runner-packed' if not packed else peer} did not run)")
    return verdicts


if __name__ == "__main__":
    main()
