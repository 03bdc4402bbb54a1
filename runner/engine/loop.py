"""The training loop, top to bottom: a step, its results tallied on the device, and at the steps that log, evaluate
or checkpoint, the tally read and summed across ranks, then the log line, the evaluation and the checkpoint; at the
end the model and the summary."""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import asdict, fields
from typing import TYPE_CHECKING, Any, Iterator, Optional

from runner.components.trackers import call_tracker
from runner.engine import checkpoint
from runner.engine.metrics import MetricsWindow, ProgressBar, compile_seconds
from runner.engine.out_of_memory import out_of_memory, record_out_of_memory
from runner.engine.overview import overview
from runner.engine.progress import Progress
from runner.engine.run_end import finish
from runner.engine.step import SHOWN_METRICS, benchmark, evaluate, objective_of, train_step
from runner.engine.tally import DeviceTally
from runner.errors import DeviceOutOfMemory, NonFiniteLoss, RewardFailed, Stopped
from runner.files.checkpoint_dirs import checkpoints_dir, complete_checkpoints
from runner.memory.out_of_memory_report import out_of_memory_line, take_out_of_memory_record
from runner.planning.time_plan import TimePlan, flops_per_token, plan
from runner.processes.signals import GracefulStop, StopVote
from runner.processes.stall_watch import StallWatch, process_watch, stalls_file

if TYPE_CHECKING:
    from runner.data.batches import GlobalBatch
    from runner.engine.job import PreparedJob
    from runner.engine.tally import Reading
    from runner.strategies.strategy_protocol import StepOutcome

log = logging.getLogger("runner")


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
        shown = {"loss": f"{reading.loss / reading.steps:.4f}", "tokens_per_s": f"{progress.tokens_per_s:,.0f}"}
        bar.advance(**shown)
        if logging_step:
            train_loss = _log(job, step, window, reading, result.outcome, progress)
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
    return finish(job, progress, train_loss, evaluated, started, planned)


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


def _log(
    job: PreparedJob, step: int, window: MetricsWindow, reading: Reading, outcome: StepOutcome, progress: Progress
) -> float:
    lr = job.scheduler.get_last_lr()[0]
    record = window.close(lr, reading.grad_norm, outcome.loss_scale, progress.tokens_seen, job.device)
    for tracker in list(job.trackers):
        call_tracker(job.trackers, tracker, lambda: tracker.log(record, step))
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
