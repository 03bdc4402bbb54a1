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
instruction workload runs single and ddp. Each config runs `--repeats` rounds of its contenders, each process with
`--threads` torch threads, in a rotating order: repeat r starts with contender r mod n (runner, hand, accelerate,
trainer; then hand, accelerate, trainer, runner; ...), so that on a machine that speeds up over a run no contender
always runs first. Every contender logs its loss every `--log-every` steps with the wall-clock time and the real
(non-padding) tokens it has trained on so far (the runner in its metrics.jsonl, the peers in their own log); a run's
tokens/s is the median over its logging windows after `--warmup` steps of the window's tokens over its seconds
(text: every token is real), and the table shows the median over the runs. The paired table divides the runner's
tokens/s (instruction: each runner variant's) by every other contender's in the same repeat, under the same load,
and shows those ratios' median and range; the verdicts read the paired medians. The instruction table also shows the
peak memory: the runner's summary.json's, the peers' own (the peak resident memory of the first process, on the
CPU). The rows come from the runner's data pipeline, written once to a file the peers read.

Start-up: the wall time of `run --help` and `run --cfg job` (and whether they import torch), and from process
start to the end of the first optimizer step: the default `run`, the hand-written loop under `python` and the
accelerate loop under `accelerate launch`, all reading and tokenizing the default data themselves. The default
run evaluates before its first step; the equivalent scripts evaluate the same rows first too, and the hand-written
loop also runs without that evaluation. Each round rotates its commands' order the same way.

Prints Markdown for docs/benchmarks.md. The peers need `pip install '.[bench]'`.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from harness import (
    UNSUPPORTED,
    Config,
    Outcome,
    child_env,
    contender_command,
    failed,
    header,
    median,
    pair_of,
    paired_table,
    peak_memory,
    peer_plan,
    ratio_spread,
    read_records,
    real_tokens_seen,
    rotated,
    run_contender,
    runner_spec,
    steady_throughput,
)
from instruction_data import write_instruction_set
from startup import startup_section

WORKLOADS = ("text", "instruction")
CONTENDERS = {
    "text": ("runner", "hand", "accelerate", "trainer"),
    "instruction": (
        "runner",
        "runner-packed",
        "runner-packed-compile",
        "hand",
        "accelerate",
        "trainer",
        "trainer-padding-free",
    ),
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
TEXT_TARGETS = (
    ("hand", RATIO_TARGET, f"at least {RATIO_TARGET}x the hand-written loop", False),
    ("accelerate", 1.0, "ahead of accelerate", True),
    ("trainer", 1.0, "ahead of trainer", True),
)
PACKED_TARGETS = (
    ("hand", PACKED_TARGET, f"at least {PACKED_TARGET}x the padded hand-written loop", False),
    ("trainer", PACKED_TARGET, f"at least {PACKED_TARGET}x the Trainer with its defaults", False),
)
INSTRUCTION_SEQ_LEN = 1024
INSTRUCTION_EXAMPLES = 4000  # about two epochs of packed rows at 60 steps of ddp's global batch of 16 rows


@dataclass
class Workload:
    name: str
    spec: object  # the runner's resolved spec for it
    overrides: list[str]  # what `run` is given for it (the text workload: the defaults, nothing)
    contenders: list[str]
    data_note: str = ""


def arguments() -> tuple[argparse.Namespace, list[str], set[str]]:
    """The options, checked; the workloads to run and the contenders wanted."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workload",
        default="text",
        help="text, instruction, or both (text,instruction): the data the contenders train on",
    )
    parser.add_argument("--steps", type=int, default=25, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the throughput")
    parser.add_argument(
        "--log-every",
        type=int,
        default=5,
        help="every contender's logging interval: the windows the throughput is measured over",
    )
    parser.add_argument("--repeats", type=int, default=3, help="rounds of all contenders, each in a rotated order")
    parser.add_argument(
        "--configs", default="single,ddp,fsdp", help="the instruction workload runs those of them it has (single, ddp)"
    )
    parser.add_argument(
        "--contenders", default=None, help="a subset of the workloads' contenders (default: all of them)"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="instruction workload: also runner-packed-compile (torch.compile: 30-60 s per run on a CPU)",
    )
    parser.add_argument("--startup-repeats", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per process (OMP_NUM_THREADS); on a shared machine more threads than "
        "free cores make every run erratic",
    )
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
    return args, workloads, wanted


def main() -> None:
    args, workloads, wanted = arguments()
    began = time.perf_counter()
    workdir = Path(args.keep or tempfile.mkdtemp(prefix="compare_loops-"))
    workdir.mkdir(parents=True, exist_ok=True)
    from runner.library_noise import quiet_libraries

    quiet_libraries()  # as `run` does: the harness composes the runner's spec too
    print(header())
    for name in workloads:
        workload = prepare_workload(name, [c for c in CONTENDERS[name] if c in wanted], args, workdir)
        configs, skipped = prepare_configs(workload, args, workdir)
        for config, why in skipped.items():
            print(f"\n{name} workload, {config}: skipped, {why}")
        if configs and workload.contenders:
            results = measure_throughput(workload, configs, args, workdir)
            table = throughput_table if name == "text" else instruction_table
            print(table(workload, configs, results, args.repeats))
    if not args.no_startup:
        print(startup_section(runner_spec(args.steps), args.startup_repeats, args.threads, workdir))
    print(f"\n(wall time of this benchmark: {time.perf_counter() - began:.0f} s)")
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)


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
    return (
        f"{len(rows)} prompt/response pairs from the Python {platform.python_version()} standard library's "
        f"documented functions (bench/instruction_data.py): {lengths[0]} to {lengths[-1]} tokens, median "
        f"{lengths[len(lengths) // 2]}, {longer:.0%} longer than the sequence of {INSTRUCTION_SEQ_LEN} (truncated)"
    )


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
                torch.save(
                    runner_rows(spec.data.files, spec.data.seq_len, spec.seed, global_batch, args.steps)[0], rows
                )
            else:
                torch.save(
                    instruction_rows(spec.data.files, spec.data.seq_len, spec.seed, global_batch, args.steps), rows
                )
        plan = workdir / f"plan_{workload.name}_{name}.json"
        plan.write_text(json.dumps(peer_plan(spec, workdir, rows, global_batch, args.steps, args.log_every)))
        configs.append(Config(name, processes, plan))
    return configs, skipped


def measure_throughput(
    workload: Workload, configs: list[Config], args: argparse.Namespace, workdir: Path
) -> dict[tuple[str, str], list[Outcome]]:
    """Each config's `--repeats` rounds of its contenders, each round in its rotated order."""
    # The runner evaluates before the first step and after the last, outside the measured window; the peers do
    # not evaluate, so the runner evaluates as little as it can and does not save the model.
    overrides = [
        *workload.overrides,
        f"train.max_steps={args.steps}",
        f"train.log_every={args.log_every}",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.save_model=false",
    ]
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
            for contender in rotated(workload.contenders, repeat):
                if any(o.error and o.error.startswith(UNSUPPORTED) for o in results.get((config.name, contender), [])):
                    continue  # it said once that it cannot run this config here
                outcome = run_once(workload, config, contender, repeat, overrides, tokens_seen, args, workdir)
                results.setdefault((config.name, contender), []).append(outcome)
    return results


def run_once(
    workload: Workload,
    config: Config,
    contender: str,
    repeat: int,
    overrides: list[str],
    tokens_seen,
    args: argparse.Namespace,
    workdir: Path,
) -> Outcome:
    """One run of one contender: its tokens/s, final loss and peak memory, or its error."""
    program, extra = VARIANTS.get(contender, (contender, []))
    name = f"{workload.name}_{config.name}_{contender}_{repeat}"
    log, run_dir = workdir / f"{name}.jsonl", workdir / name
    if program == "runner":
        command = contender_command(program, config, log, run_dir, [*overrides, *extra])
    else:  # the script's own options come last in every launcher's command line
        command = [*contender_command(program, config, log, run_dir, overrides), *extra]
    _, error = run_contender(command, child_env(args.threads), workdir / f"{name}.out")
    if error:
        outcome = Outcome(repeat, error=error)
    else:
        records = read_records(program, log, run_dir)
        outcome = Outcome(
            repeat,
            steady_throughput(records, args.warmup, tokens_seen),
            [r for r in records if "loss" in r][-1]["loss"],
            peak_memory(program, records, run_dir),
        )
    shown = error or (
        f"{outcome.tokens_per_s:.0f} tokens/s, final loss {outcome.final_loss:.4f}, peak "
        f"memory {outcome.peak_memory_gib or float('nan'):.2f} GiB"
    )
    print(f"  {workload.name} {config.name} {contender} run {repeat + 1}: {shown}", file=sys.stderr, flush=True)
    return outcome


def throughput_table(workload: Workload, configs: list[Config], results: dict, repeats: int) -> str:
    contenders, spec = workload.contenders, workload.spec
    lines = [
        "",
        f"Throughput: tokens/s after the warm-up steps, median of the runs (sequence {spec.data.seq_len}, micro "
        f"batch {spec.train.micro_batch_size} per process)",
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
            lines.append(
                f"| {config.name} | {contender} | {medians[contender]:.0f} | {ratio} | {losses:.4f} | {runs} |"
            )
        verdicts += target_verdicts(config.name, "runner", TEXT_TARGETS, results)
    paired = paired_table(configs, [("runner", c) for c in contenders if c != "runner"], results, repeats)
    return "\n".join([*lines, *paired, "", *verdicts])


def target_verdicts(config: str, base: str, targets: tuple, results: dict) -> list[str]:
    """Each target (peer, ratio, what, whether strictly above) met or missed by the median of `base`'s paired
    ratios over the peer: its tokens/s over the peer's, repeat by repeat."""
    if (config, base) not in results:
        return []
    verdicts = []
    for peer, target, what, strictly in targets:
        ratios = pair_of(config, base, peer, results)
        if ratios is None:
            continue  # the peer was not run
        if not ratios:
            verdicts.append(f"- {config}: {base} {what}: no figure (no repeat in which both {base} and {peer} ran)")
            continue
        paired = median(list(ratios.values()))
        met = paired > target if strictly else paired >= target
        verdicts.append(f"- {config}: {base} {what}: {'met' if met else 'MISSED'} (paired: {ratio_spread(ratios)})")
    return verdicts


def padding_share(config: Config) -> float:
    """The share of padding in the padded contenders' micro batches (each padded to its longest row)."""
    import torch

    plan = json.loads(config.plan.read_text())
    rows, micro = torch.load(plan["rows"]), plan["micro_batch_size"]
    lengths = [len(ids) for ids, _ in rows]
    batches = [lengths[i : i + micro] for i in range(0, len(lengths), micro)]
    return 1 - sum(lengths) / sum(max(batch) * len(batch) for batch in batches)


def instruction_table(workload: Workload, configs: list[Config], results: dict, repeats: int) -> str:
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
            lines.append(
                f"| {config.name} | {contender} | {medians[contender]:.0f} | {ratio} | {memory} | "
                f"{median([o.final_loss for o in done]):.4f} | {runs} |"
            )
        verdicts.append(
            f"- {config.name}: the padded micro batches (runner, hand, accelerate, trainer) are "
            f"{padding_share(config):.0%} padding"
        )
        verdicts += target_verdicts(config.name, "runner-packed", PACKED_TARGETS, results)
    pairs = [
        (base, peer)
        for base in workload.contenders
        if base.startswith("runner")
        for peer in workload.contenders
        if not peer.startswith("runner")
    ]
    return "\n".join([*lines, *paired_table(configs, pairs, results, repeats), "", *verdicts])


if __name__ == "__main__":
    main()
