"""The training loop, top to bottom: a step, its results tallied on the device, and at the steps that log, evaluate
or checkpoint, the tally read and summed across ranks, then the log line, the evaluation and the checkpoint; at the
end the model and the summary."""

from __future__ import annotations

import logging
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from runner.components import lora
from runner.engine import checkpoint
from runner.engine.metrics import MetricsWindow, ProgressBar, compile_seconds, peak_memory_gib
from runner.engine.out_of_memory import out_of_memory, record_out_of_memory
from runner.engine.overview import overview
from runner.engine.placement import frozen_base
from runner.engine.step import SHOWN_METRICS, benchmark, evaluate, objective_of, train_step
from runner.engine.tally import DeviceTally
from runner.errors import DeviceOutOfMemory, NonFiniteLoss, RewardFailed, Stopped
from runner.files.atomic import move_into_place, write_json_atomically
from runner.files.checkpoint_dirs import checkpoints_dir, complete_checkpoints
from runner.files.refused_writes import refused_write, written_whole
from runner.memory.disk import disk_need
from runner.memory.out_of_memory_report import out_of_memory_line, take_out_of_memory_record
from runner.planning.time_plan import TimePlan, flops_per_token, hardware_identity, plan, step_flops
from runner.processes.signals import GracefulStop, StopVote
from runner.processes.stall_watch import StallWatch, process_watch, stalls_file
from runner.strategies.strategy_protocol import unwrapped

if TYPE_CHECKING:
    from runner.components.trackers import Tracker
    from runner.data.batches import GlobalBatch
    from runner.engine.job import PreparedJob
    from runner.engine.tally import Reading
    from runner.strategies.strategy_protocol import StepOutcome

log = logging.getLogger("runner")


@dataclass
class Progress:
    """What the loop has counted; a checkpoint keeps it, and a resumed run goes on from it."""

    first_eval_loss: float = math.nan
    tokens_seen: float = 0
    train_time: float = 0.0  # the steps' own, compilation aside
    skipped_steps: int = 0
    best_value: float = math.nan  # train.keep_best's metric's best value so far, and its step
    best_step: int = 0


def train(job: PreparedJob) -> dict[str, Any]:
    stop = GracefulStop()
    rank = job.ranks.rank
    watch = process_watch(rank, job.spec.train.stall_report_s, stalls_file(job.run_dir, rank))
    batches = job.train_batches(job.start_step, job.stream_position)  # built ahead on a thread, from the first step
    try:
        return _train(job, batches, stop, watch)
    except (RuntimeError, MemoryError) as error:  # torch.OutOfMemoryError is a RuntimeError
        if not out_of_memory(error):
            raise
        record = record_out_of_memory(error, job, watch.doing)
        if job.ranks.world_size == 1:  # else the launcher takes the first rank's record
            take_out_of_memory_record(job.run_dir)
        raise DeviceOutOfMemory(out_of_memory_line(record, job.spec)) from None
    finally:
        batches.close()  # ends that thread
        watch.close()
        stop.restore()


def _train(job: PreparedJob, batches: Iterator[GlobalBatch], stop: GracefulStop, watch: StallWatch) -> dict[str, Any]:
    cfg = job.spec.train
    window, planned = _start(job)
    progress = _starting_progress(job, watch)
    job.model.train()  # from_pretrained leaves a model in eval mode
    evaluated, train_loss = {"eval_loss": progress.first_eval_loss}, math.nan
    started = time.perf_counter()
    bar = ProgressBar(job.ranks.rank == 0 and sys.stdout.isatty(), job.start_step, cfg.max_steps)
    # The steps' results stay on the device until a step that logs, evaluates or checkpoints reads them: no other
    # step waits for the device, which runs behind the host by a step or more.
    tally, vote, shown = DeviceTally(job.device, job.counted), StopVote(stop), {}
    read_at, compiled_before = time.perf_counter(), compile_seconds() if cfg.compile else 0.0

    for step in range(job.start_step + 1, cfg.max_steps + 1):
        watch.entering(f"in step {step}")
        batch = _step_batch(job, next(batches), step, progress)  # task=grpo: its completions sampled and scored
        result = train_step(job, batch)
        _advance_schedule(job, result.outcome, step, progress)
        tally.add(step, result.loss, result.metrics, result.outcome.grad_norm, result.tokens)
        stopping = vote.after_step()
        logging_step = due(step, cfg.log_every, cfg.max_steps)
        evaluating = due(step, cfg.eval_every, cfg.max_steps)
        checkpointing = due(step, cfg.checkpoint_every, cfg.max_steps)
        benchmarking = job.benchmarks is not None and due(step, cfg.benchmark_every, cfg.max_steps)
        if not (logging_step or evaluating or benchmarking or checkpointing or stopping):
            bar.advance(**shown)  # what the last reading showed
            continue

        reading = tally.read()  # waits for the device: the steps since the last reading are done
        _stop_if_non_finite(job, reading)
        compiled = _compile_seconds_logged(job, step, compiled_before)
        seconds = time.perf_counter() - read_at - (compiled - compiled_before)
        progress.train_time, progress.tokens_seen = progress.train_time + seconds, progress.tokens_seen + reading.tokens
        window.add(reading, seconds)
        # The mean tokens/s of the training steps so far, as the done line gives it.
        shown = {
            "loss": f"{reading.loss / reading.steps:.4f}",
            "tokens_per_s": f"{progress.tokens_seen / progress.train_time:,.0f}",
        }
        bar.advance(**shown)

        if logging_step:
            train_loss = _log(
                job,
                step,
                window.close(
                    job.scheduler.get_last_lr()[0],
                    reading.grad_norm,
                    result.outcome.loss_scale,
                    progress.tokens_seen,
                    job.device,
                ),
            )
        fresh = _evaluated(job, step, evaluating, benchmarking, progress, watch)
        evaluated, best = {**evaluated, **fresh}, _best_so_far(job, step, fresh, progress)
        if checkpointing or stopping or best:
            watch.entering(f"saving the checkpoint of step {step}")
            saved = checkpoint.save(job, step, asdict(progress), batch, best)
            log.info("step %d/%d | checkpoint %s", step, cfg.max_steps, saved)
        if stopping:
            vote.close()
            raise Stopped(
                f"stopped by {stop.requested or 'a signal'} after step {step}, checkpoint {saved}; "
                f"continue with: run resume={job.run_dir}",
                signal=stop.requested,
            )
        read_at, compiled_before = time.perf_counter(), compiled

    vote.close()
    bar.close()
    watch.entering("saving the model")
    return _finish(job, progress, train_loss, evaluated, started, planned)


def _evaluated(
    job: PreparedJob, step: int, evaluating: bool, benchmarking: bool, progress: Progress, watch: StallWatch
) -> dict[str, float]:
    """The metrics of this step's evaluation and the benchmarks' scores, where the step has them."""
    fresh: dict[str, float] = {}
    if evaluating:
        watch.entering(f"evaluating after step {step}")
        fresh.update(evaluate(job, step))
    if benchmarking:
        watch.entering(f"scoring the benchmarks after step {step}")
        fresh.update(benchmark(job, step, progress.tokens_seen))
    return fresh


def _best_so_far(job: PreparedJob, step: int, fresh: dict[str, float], progress: Progress) -> Optional[dict[str, Any]]:
    """train.keep_best's metric and value where this step's is the best so far (its checkpoint is then kept)."""
    keep = job.keep_best
    if keep is None or keep.metric not in fresh or not keep.better(fresh[keep.metric], progress.best_value):
        return None
    progress.best_value, progress.best_step = fresh[keep.metric], step
    log.info(
        "step %d/%d | best %s so far: %.4f; its checkpoint is kept",
        step,
        job.spec.train.max_steps,
        keep.metric,
        progress.best_value,
    )
    return {"metric": keep.metric, "value": progress.best_value, "step": step}


def _starting_progress(job: PreparedJob, watch: StallWatch) -> Progress:
    """A resumed run's progress from its checkpoint (warning when the global batch changed); a new run's, with
    its evaluation before the first step."""
    cfg = job.spec.train
    if not job.start_step:
        watch.entering("evaluating before the first step")
        return Progress(first_eval_loss=evaluate(job, step=0)["eval_loss"])
    log.info("resuming from step %d of %s", job.start_step, job.spec.resume)
    written = job.progress.get("global_batch", job.global_batch_size)  # older checkpoints do not say
    if written != job.global_batch_size:
        log.warning(
            "resuming with a global batch of %d (micro batch %d x %d data-parallel ranks x %d "
            "accumulation steps) where the checkpoint's run had %d: the steps from here train on other "
            "batches than that run's own; set train.micro_batch_size or train.grad_accum_steps to give "
            "%d again for the same losses",
            job.global_batch_size,
            cfg.micro_batch_size,
            job.dp_size,
            cfg.grad_accum_steps,
            written,
            written,
        )
    return Progress(**{f.name: job.progress.get(f.name, f.default) for f in fields(Progress)})


def _advance_schedule(job: PreparedJob, outcome: StepOutcome, step: int, progress: Progress) -> None:
    """The LR schedule steps once per applied optimizer step; fp16's overflowed loss scale skips the update, so
    the schedule does not advance either."""
    if outcome.applied:
        job.scheduler.step()
        return
    progress.skipped_steps += 1
    log.warning(
        "step %d/%d | gradients overflowed fp16; update skipped, loss scale lowered to %g",
        step,
        job.spec.train.max_steps,
        outcome.loss_scale,
    )


def _stop_if_non_finite(job: PreparedJob, reading: Reading) -> None:
    if reading.first_non_finite is not None:
        last_good = complete_checkpoints(job.run_dir)
        raise NonFiniteLoss(
            f"the loss is {reading.loss} at step {reading.first_non_finite}; the last good "
            f"checkpoint is {last_good[-1] if last_good else 'none (train.checkpoint_every=0)'}"
        )


def due(step: int, every: int, last: int) -> bool:
    """Whether `step` is one of every `every` steps (0: none of them) or the `last` one."""
    return (every > 0 and step % every == 0) or step == last


def _step_batch(job: PreparedJob, drawn: GlobalBatch, step: int, progress: Progress) -> GlobalBatch:
    """The global batch the step trains on (runner/engine/job.py's Objective.step_batch). A reward that fails in
    it ends the run in one line that names it, after the checkpoint of the step before (where none was written)."""
    try:
        return objective_of(job).step_batch(job, drawn, step)
    except RewardFailed as failure:
        last_step = step - 1
        cfg = job.spec.train
        saved = checkpoints_dir(job.run_dir) / f"step_{last_step:08d}"
        if last_step and not due(last_step, cfg.checkpoint_every, cfg.max_steps):
            saved = checkpoint.save(job, last_step, asdict(progress), None)
        kept = (
            (
                f"the checkpoint of step {last_step}, {saved}, holds the run so far; fix the reward, then continue "
                f"with: run resume={job.run_dir}"
            )
            if last_step
            else "no step had been trained"
        )
        raise RewardFailed(f"{failure} in step {step}; {kept}") from None


def _compile_seconds_logged(job: PreparedJob, step: int, compiled_before: float) -> float:
    """torch.compile's time so far, its growth since the last reading logged: the step times leave it out."""
    cfg = job.spec.train
    compiled = compile_seconds() if cfg.compile else 0.0
    if compiled > compiled_before:
        log.info(
            "step %d/%d | torch.compile: %.1f s, left out of the step times",
            step,
            cfg.max_steps,
            compiled - compiled_before,
        )
    return compiled


def _start(job: PreparedJob) -> tuple[MetricsWindow, Optional[TimePlan]]:
    """The job's first log lines, with its time planned (rank 0's); the metrics window that MFU is computed in."""
    spec = job.spec
    n_params = job.parameter_count()
    for line in overview(job, n_params):
        log.info("%s", line)
    planned = plan(spec, benchmark_tokens=job.benchmark_tokens) if job.ranks.rank == 0 else None
    if planned is not None:
        log.info("%s", planned.line())
    return MetricsWindow(flops_per_token(spec), spec.hardware.peak_bf16_tflops * 1e12 * job.ranks.world_size), planned


def _log(job: PreparedJob, step: int, record: dict[str, Any]) -> float:
    for tracker in list(job.trackers):
        _tracked(job, tracker, lambda: tracker.log(record, step))
    shown = "".join(f" | {name} {record[name]:.4f}" for name in SHOWN_METRICS if name in record)
    log.info(
        "step %d/%d | loss %.4f | lr %.2e | grad norm %.3f | %s tokens/s%s",
        step,
        job.spec.train.max_steps,
        record["loss"],
        record["lr"],
        record["grad_norm"],
        f"{record['tokens_per_s']:,.0f}",
        shown,
    )
    return record["loss"]


def _tracked(job: PreparedJob, tracker: Tracker, call: Callable[[], None]) -> None:
    """A tracker that cannot write (a full disk, a read-only directory) is reported once and dropped; training goes
    on, its checkpoints say whether the disk holds them."""
    try:
        call()
    except Exception as error:
        if not refused_write(error):
            raise
        log.warning(
            "%s stopped recording: %s; training goes on without it",
            type(tracker).__name__,
            " ".join(str(error).split())[:200],
        )
        job.trackers.remove(tracker)


def _finish(
    job: PreparedJob,
    progress: Progress,
    train_loss: float,
    evaluated: dict[str, float],
    started: float,
    planned: Optional[TimePlan],
) -> dict[str, Any]:
    """The model saved, summary.json written, the trackers finished; the summary, with the last evaluation's
    metrics (task=dpo's rewards), the FLOP rate reached (which later runs' plans read) and what was predicted."""
    eval_loss = evaluated["eval_loss"]
    model_dir = save_model(job) if job.spec.train.save_model else None
    summary = {
        "steps": job.spec.train.max_steps,
        "train_loss": train_loss,
        "first_eval_loss": progress.first_eval_loss,
        "eval_loss": eval_loss,
        "tokens_seen": progress.tokens_seen,
        "skipped_steps": progress.skipped_steps,
        "tokens_per_s": progress.tokens_seen / progress.train_time,
        # This process's: the evaluations' graphs too (a resumed run compiles again)
        "compile_time_s": compile_seconds() if job.spec.train.compile else 0.0,
        "peak_memory_gib": peak_memory_gib(job.device),
        "wall_time_s": time.perf_counter() - started,
        "run_dir": str(job.run_dir),
        "model_dir": str(model_dir) if model_dir else None,
        "precision": job.precision_in_effect().as_dict(),
        **_rate_reached(job, progress),
        "predicted": planned.as_dict() if planned is not None else None,
        "best": _best(job, progress),
        **{name: value for name, value in evaluated.items() if name != "eval_loss"},
    }
    summary["gpu_hours"] = summary["wall_time_s"] * job.ranks.world_size / 3600
    summary["cost"] = summary["gpu_hours"] * job.spec.hardware.cost_per_gpu_hour or None  # (where a price is set)
    if job.ranks.rank == 0:
        write_json_atomically(job.run_dir / "summary.json", summary)
    for tracker in list(job.trackers):
        _tracked(job, tracker, tracker.finish)
    log.info(
        "done: train loss %.4f | eval loss %.4f (from %.4f) | %s tokens/s (mean of the training steps) | "
        "peak memory %.2f GiB | %.0f s%s",
        train_loss,
        eval_loss,
        progress.first_eval_loss,
        f"{summary['tokens_per_s']:,.0f}",
        summary["peak_memory_gib"],
        summary["wall_time_s"],
        f" (torch.compile: {summary['compile_time_s']:.0f} s of it)" if job.spec.train.compile else "",
    )
    log.info("outputs: %s%s", job.run_dir, f" (model: {model_dir})" if model_dir else "")
    adapter_only = job.spec.adapter.active and not job.spec.adapter.merge
    if model_dir and adapter_only:
        log.info(
            "use it: PeftModel.from_pretrained(<the base>, %s) (peft); adapter.merge=true also saves the merged "
            "model, which task=evaluate and task=generate read",
            model_dir,
        )
    elif model_dir and job.spec.data.format.value == "prompt":  # (its spec's data are prompts, not rows to evaluate)
        log.info("use it: run task=generate task.trained=%s task.prompts=<a file, a prompt per line>", model_dir)
    elif model_dir:
        log.info(
            "use it: run task=generate task.trained=%s task.prompts=<a file, a prompt per line> | "
            "run task=evaluate task.trained=%s",
            job.run_dir,
            job.run_dir,
        )
    return summary


def _best(job: PreparedJob, progress: Progress) -> Optional[dict[str, Any]]:
    """train.keep_best's checkpoint: its metric, value, step and directory."""
    kept = checkpoint.best_checkpoint(job.run_dir) if job.keep_best is not None else None
    if kept is None:
        return None
    log.info(
        "best checkpoint: %s (%s %.4f at step %d)", kept, job.keep_best.metric, progress.best_value, progress.best_step
    )
    return {
        "metric": job.keep_best.metric,
        "value": progress.best_value,
        "step": progress.best_step,
        "checkpoint": str(kept),
    }


def _rate_reached(job: PreparedJob, progress: Progress) -> dict[str, Any]:
    """The steps' own time and the FLOP rate they reached (their work counted as the plan counts it: rows at full
    length), and on what: what later runs' plans read."""
    spec, per_step = job.spec, step_flops(job.spec)
    step_s = progress.train_time / spec.train.max_steps
    achieved = per_step / step_s
    peak = spec.hardware.peak_bf16_tflops * 1e12 * job.ranks.world_size
    return {
        "flops_per_token": flops_per_token(spec),
        "flops_per_step": per_step,
        "step_time_s": step_s,
        "achieved_tflops": achieved / 1e12,
        "mfu": achieved / peak if peak else None,
        "identity": hardware_identity(spec),
    }


def save_model(job: PreparedJob) -> Optional[Path]:
    """save_pretrained (safetensors) of the whole model, or the adapter of a frozen base, plus the tokenizer, by
    rank 0, moved into place once complete; every rank takes part in gathering the weights."""
    final = job.run_dir / "model"
    state = job.stepper.full_state_dict()
    if job.ranks.rank == 0:
        partial = job.run_dir / "model.partial"
        shutil.rmtree(partial, ignore_errors=True)
        with written_whole(partial, "the model", job.run_dir, lambda: disk_need(job.spec).export, trained=True):
            if job.spec.adapter.active:
                save_adapter(job, state, partial, final)
            else:
                unwrapped(job.model).save_pretrained(partial, state_dict=state)
            job.tokenizer.save_pretrained(partial)
        move_into_place(partial, final)  # a resumed run replaces the model its first part saved
    return final


def save_adapter(job: PreparedJob, state: Optional[dict[str, Any]], directory: Path, final: Path) -> None:
    """The adapter in peft's format; the base beside it (base/) when it was initialised here rather than loaded
    from model.pretrained; with adapter.merge, the merged model (merged/)."""
    spec, model = job.spec, unwrapped(job.model)
    trained = (
        state
        if state is not None
        else {name: parameter.detach() for name, parameter in model.named_parameters() if parameter.requires_grad}
    )
    needs_base = spec.adapter.merge or not spec.model.pretrained
    base = frozen_base(spec, job.tokenizer) if needs_base else None
    if not spec.model.pretrained:
        base.save_pretrained(directory / "base")
    lora.export(directory, spec.adapter, trained, model, spec.model.pretrained or str(final / "base"))
    if spec.adapter.merge:
        lora.export_merged(directory / "merged", spec.adapter, trained, base, spec.hardware.world_size)
        job.tokenizer.save_pretrained(directory / "merged")
