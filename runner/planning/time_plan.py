"""A run's time and cost before it starts.

Work: FLOPs per token = 6 x trained parameters + 4 x frozen ones (forward, and the backward through them to the
activations: a frozen weight gets no gradient of its own) + 12 x layers x width x sequence for attention (PaLM's
count, appendix B). A mixture-of-experts model counts the parameters a token passes through, its active ones: all
but the routed experts, and k of each MoE layer's (runner/memory/expert_memory.py). A step holds at most global batch x
data.seq_len tokens (rows at full length; padding is not counted, so padded data takes less). A forward alone is a
third of the work: an evaluation's, over train.eval_batches micro batches on each data-parallel rank, the task's
own passes over a step's rows (task.forward_passes: DPO's
reference, GRPO's sampling and log-probs), and each scoring of train.benchmarks where the run counted its requests'
tokens (its own start does; task=estimate does not load the benchmarks, and says so).

Rate: the FLOP/s the hardware reaches, from the first of
  1. the nearest of the user's past runs on the same hardware (device, processes, strategy, compute dtype and
     compile), by the work per token: its summary.json records the FLOP/s it reached (`achieved_tflops`);
  2. the runner's table of figures measured on real GPUs (measured_mfu.yaml, to which bench/gpu_proof.py adds), as a
     share (MFU) of the declared peak;
  3. DEFAULT_MFU of the declared peak.
Hardware without a declared peak (a CPU) has only the first.

Checkpoints are counted at CHECKPOINT_BYTES_PER_S, and a compiled run's compile time at its past run's where one
is known. GPU-hours are the wall time x the processes; the cost, GPU-hours x hardware.cost_per_gpu_hour.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from runner.config.spec import RunSpec

MEASURED_MFU = Path(__file__).with_name("measured_mfu.yaml")
DEFAULT_MFU = 0.30
CHECKPOINT_BYTES_PER_S = 1 * 2**30


@dataclass(frozen=True)
class Rate:
    """A step's seconds: per_step_s + its FLOPs x per_flop_s; a run's, besides its steps: overhead_s."""

    per_flop_s: float  # 0: unknown
    source: str
    per_step_s: float = 0.0
    overhead_s: float = 0.0

    @property
    def flops_per_s(self) -> float:
        return 1 / self.per_flop_s if self.per_flop_s else 0.0


@dataclass(frozen=True)
class TimePlan:
    steps: int
    tokens: int  # at most: every row at full length
    flops: float  # training and evaluation
    rate: Rate
    step_s: float
    wall_s: float
    processes: int
    cost_per_gpu_hour: float
    on_gpus: bool = True  # (the line's unit: GPU-hours, or a CPU's process-hours)
    uncounted: str = ""  # what the plan leaves out, said after its line

    @property
    def known(self) -> bool:
        return self.rate.per_flop_s > 0

    @property
    def gpu_hours(self) -> float:
        return self.wall_s * self.processes / 3600

    def as_dict(self) -> dict[str, Any]:
        return (
            {
                "step_time_s": self.step_s,
                "wall_time_s": self.wall_s,
                "gpu_hours": self.gpu_hours,
                "cost": self.gpu_hours * self.cost_per_gpu_hour if self.cost_per_gpu_hour else None,
                "flops": self.flops,
                "rate_source": self.rate.source,
            }
            if self.known
            else {"rate_source": None}
        )

    def line(self) -> str:
        work = f"{self.steps:,} steps, at most {self.tokens:,} tokens, {self.flops:.3g} FLOPs"
        if not self.known:
            return (
                f"time: {work}; the time is unknown: the hardware declares no peak (hardware.peak_bf16_tflops) "
                "and no past run here measured one; a finished run here calibrates it"
            )
        cost = f", ${self.gpu_hours * self.cost_per_gpu_hour:,.2f}" if self.cost_per_gpu_hour else ""
        unit = "GPU-hours" if self.on_gpus else "process-hours"
        return (
            f"time: {work}; about {readable_seconds(self.step_s)} a step, {readable_seconds(self.wall_s)} in all, "
            f"{self.gpu_hours:,.3g} {unit}{cost} (at {self.rate.flops_per_s / 1e12:,.3g} TFLOP/s: "
            f"{self.rate.source}){self.uncounted}"
        )


def requeue_line(planned: TimePlan, limit_min: float, warning_s: float = 0.0) -> Optional[str]:
    """What a cluster job whose predicted time passes its time limit (hydra.launcher.timeout_min) will take: the
    submissions after the first, each of which trains until SLURM's warning (`warning_s`, the launcher's
    signal_delay_s, before the limit), when the job checkpoints and requeues itself; None when it fits."""
    limit_s = limit_min * 60
    trains_s = limit_s - warning_s if limit_s > warning_s else limit_s
    if not planned.known or planned.wall_s <= trains_s:
        return None
    requeues = math.ceil(planned.wall_s / trains_s) - 1
    resumes = (
        f"the checkpoint the job writes at SLURM's warning, {readable_seconds(warning_s)} before the limit "
        "(hydra.launcher.signal_delay_s)"
        if trains_s < limit_s
        else "the last checkpoint (set train.checkpoint_every so that little is trained again)"
    )
    return (
        f"time limit: about {readable_seconds(planned.wall_s)} passes the {readable_seconds(limit_s)} of "
        f"hydra.launcher.timeout_min={limit_min:g}: about {requeues} requeue{'s' if requeues > 1 else ''}, each "
        f"resuming from {resumes}"
    )


def sweep_line(plans: list[TimePlan]) -> str:
    """A sweep's jobs' plans summed (`run -m ... task=estimate`)."""
    unknown = sum(not planned.known for planned in plans)
    if unknown:
        return (
            f"sweep: {len(plans)} jobs; {unknown} of them have no known time (no peak declared and no past run "
            "measured), so the sweep's has none"
        )
    hours = sum(planned.gpu_hours for planned in plans)
    priced = [planned.gpu_hours * planned.cost_per_gpu_hour for planned in plans if planned.cost_per_gpu_hour]
    cost = (
        ""
        if not priced
        else f", ${sum(priced):,.2f}"
        + ("" if len(priced) == len(plans) else f" for the {len(priced)} jobs with a hardware.cost_per_gpu_hour")
    )
    unit = "GPU-hours" if all(planned.on_gpus for planned in plans) else "process-hours"
    return (
        f"sweep: {len(plans)} jobs, about {readable_seconds(sum(planned.wall_s for planned in plans))} one after "
        f"another, {hours:,.3g} {unit}{cost}"
    )


def readable_seconds(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def flops_per_token(spec: RunSpec) -> float:
    """The training work of one token of the run (forward and backward), as the module's docstring counts it."""
    from runner.memory.model_shapes import facts_of
    from runner.memory.parameters import parameters_of

    facts = facts_of(spec.model)
    idle = facts.parameters - facts.active_parameters  # the routed experts a token does not pass through
    if spec.adapter.active:  # the experts are frozen: LoRA adapts nn.Linear layers only
        parameters = parameters_of(spec, facts)
        trained, frozen = parameters.trained * parameters.tp, parameters.frozen_parameters - idle
    else:
        trained, frozen = facts.active_parameters, 0
    return 6 * trained + 4 * frozen + 12 * facts.layers * facts.layer.hidden * spec.data.seq_len


def step_tokens(spec: RunSpec) -> int:
    """A step's tokens at most: every row of the global batch at full length."""
    train = spec.train
    return train.micro_batch_size * spec.layout.dp_size * train.grad_accum_steps * spec.data.seq_len


def step_flops(spec: RunSpec) -> float:
    """A step's work: its rows trained, and the task's forward passes over them."""
    return flops_per_token(spec) * step_tokens(spec) * (1 + spec.task.forward_passes / 3)


def plan(spec: RunSpec, runs_dir: Optional[Path] = None, benchmark_tokens: int = 0) -> TimePlan:
    """The run's work, and its time at the rate its hardware reaches (past runs under `runs_dir`: the spec's
    hardware.measured_runs, else ./outputs). `benchmark_tokens`: what one scoring of train.benchmarks passes
    forward (0: not counted)."""
    train, hardware = spec.train, spec.hardware
    per_token, per_step = flops_per_token(spec), step_flops(spec)
    evaluations = (train.max_steps // train.eval_every if train.eval_every else 0) + 2  # before, and at the end
    eval_tokens = evaluations * train.eval_batches * train.micro_batch_size * spec.layout.dp_size * spec.data.seq_len
    every = train.benchmark_every
    scorings = (train.max_steps // every if every else 0) + (not every or train.max_steps % every > 0)
    forward_only = eval_tokens + scorings * benchmark_tokens  # tokens passed forward outside the steps
    uncounted = "; the benchmarks' forwards are not counted" if train.benchmarks and not benchmark_tokens else ""
    flops = train.max_steps * per_step + per_token * forward_only / 3
    rate = measured_rate(spec, per_step, Path(runs_dir or hardware.measured_runs or "outputs"))
    step_s = rate.per_step_s + per_step * rate.per_flop_s
    wall_s = 0.0
    if rate.per_flop_s:
        from runner.memory.disk import disk_need

        need = disk_need(spec)
        checkpoints = (train.max_steps // train.checkpoint_every if train.checkpoint_every else 0) + 1
        writing = (checkpoints * need.checkpoint + need.export) / CHECKPOINT_BYTES_PER_S
        wall_s = train.max_steps * step_s + per_token * forward_only / 3 * rate.per_flop_s + writing + rate.overhead_s
    return TimePlan(
        train.max_steps,
        train.max_steps * step_tokens(spec),
        flops,
        rate,
        step_s,
        wall_s,
        hardware.world_size,
        hardware.cost_per_gpu_hour,
        hardware.accelerator.value == "cuda",
        uncounted,
    )


def measured_rate(spec: RunSpec, step_flops: float, runs_dir: Path) -> Rate:
    """How long the run's steps take on its hardware: from the past runs on the same hardware, else from an MFU of
    its declared peak."""
    hardware = spec.hardware
    past = [summary for summary in past_summaries(runs_dir) if summary.get("identity") == hardware_identity(spec)]
    if past:
        return fitted_rate(past, step_flops)
    peak = hardware.peak_bf16_tflops * 1e12 * hardware.world_size
    if not peak:
        return Rate(0.0, "none")
    device = hardware.device_name or ""
    dtype = spec.precision.compute_dtype.value
    for row in measured_mfu():
        if row["device"] in device and row["compute_dtype"] == dtype and row["compile"] == spec.train.compile:
            return Rate(
                1 / (row["mfu"] * peak),
                f"{row['mfu']:.1%} MFU, the runner's figure for {row['what']}; {row['device']}, {row['measured']}",
            )
    return Rate(1 / (DEFAULT_MFU * peak), f"{DEFAULT_MFU:.0%} MFU, the default: no figure measured for this hardware")


def fitted_rate(past: list[dict[str, Any]], step_flops: float) -> Rate:
    """The past runs' step times as a fixed part and a part per FLOP (a least-squares line through runs of two or
    more step sizes; one size: a part per FLOP alone, from the nearest), and the nearest run's time besides its
    steps (its evaluations' launch, the model's saving, compilation)."""
    nearest = min(
        past, key=lambda summary: (abs(math.log(summary["flops_per_step"] / step_flops)), -summary["finished"])
    )
    overhead = max(0.0, nearest["wall_time_s"] - nearest["steps"] * nearest["step_time_s"])
    sizes = {summary["flops_per_step"] for summary in past}
    if len(sizes) > 1:
        xs = [summary["flops_per_step"] for summary in past]
        ys = [summary["step_time_s"] for summary in past]
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
        if slope > 0:
            return Rate(
                slope,
                f"fitted to your {len(past)} runs on this hardware, the nearest {nearest['run_dir']}",
                max(0.0, mean_y - slope * mean_x),
                overhead,
            )
    return Rate(
        nearest["step_time_s"] / nearest["flops_per_step"], f"measured by your run {nearest['run_dir']}", 0.0, overhead
    )


def measured_mfu(table: Optional[Path] = None) -> list[dict[str, Any]]:
    """The rows of the runner's table of figures measured on real GPUs (`table`: another copy of it)."""
    import yaml

    return yaml.safe_load((table or MEASURED_MFU).read_text())


def record_measured_mfu(table: Path, device: str, figures: dict[bool, float], what: str, measured: str) -> None:
    """Puts a GPU's bf16 figures (MFU, eager and compiled: `figures[compile]`) in the table, in place of its rows of
    the same setting; the table's leading comment is kept."""
    import yaml

    text = table.read_text()
    kept = [
        row
        for row in yaml.safe_load(text)
        if not (row["device"] == device and row["compute_dtype"] == "bf16" and row["compile"] in figures)
    ]
    added = [
        {
            "device": device,
            "compute_dtype": "bf16",
            "compile": compiled,
            "mfu": round(mfu, 4),
            "what": f"{what}, bf16, {'compiled' if compiled else 'eager'}",
            "measured": measured,
        }
        for compiled, mfu in sorted(figures.items(), reverse=True)
    ]
    comment = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    table.write_text(comment + yaml.safe_dump(kept + added, sort_keys=False, allow_unicode=True))


def hardware_identity(spec: RunSpec) -> dict[str, Any]:
    """What a past run must share with this one for its FLOP rate to stand for this one's."""
    hardware = spec.hardware
    return {
        "device": hardware.device_name or hardware.accelerator.value,
        "processes": hardware.world_size,
        "strategy": spec.strategy.name,
        "compute_dtype": spec.precision.compute_dtype.value,
        "compile": spec.train.compile,
        "adapter": spec.adapter.kind.value,
        "step": spec.task.step_kind,
    }


def past_summaries(runs_dir: Path) -> list[dict[str, Any]]:
    """The summaries of the finished runs under `runs_dir` (runs, <date>/<time>/, and sweeps' jobs,
    multirun/<date>/<time>/<job>/) that record their FLOP rate: looked for at those depths only, not in the runs'
    checkpoints and trackers' files."""
    found = []
    for path in (path for depth in range(5) for path in runs_dir.glob("*/" * depth + "summary.json")):
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if summary.get("step_time_s") and summary.get("flops_per_step"):
            found.append({**summary, "finished": path.stat().st_mtime})
    return found
