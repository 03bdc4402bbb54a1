"""The end of a training run: the model saved (rank 0 gathers it whole, or the adapter), summary.json written with
the FLOP rate reached and what was predicted, the trackers finished, and the done line with what to do next."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from runner.components import lora
from runner.components.trackers import call_tracker
from runner.engine import checkpoint
from runner.engine.metrics import compile_seconds, peak_memory_gib
from runner.engine.placement import frozen_base
from runner.files.atomic import move_into_place, write_json_atomically
from runner.files.refused_writes import written_whole
from runner.memory.disk import disk_need
from runner.planning.time_plan import TimePlan, flops_per_token, hardware_identity, step_flops
from runner.strategies.strategy_protocol import unwrapped

if TYPE_CHECKING:
    from runner.engine.job import PreparedJob
    from runner.engine.progress import Progress

log = logging.getLogger("runner")


def finish(
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
        "tokens_per_s": progress.tokens_per_s,
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
        call_tracker(job.trackers, tracker, tracker.finish)
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
    if model_dir:
        _say_how_to_use(job, model_dir)
    return summary


def _say_how_to_use(job: PreparedJob, model_dir: Path) -> None:
    """The commands (or the peft call) that read the saved model."""
    adapter_only = job.spec.adapter.active and not job.spec.adapter.merge
    if adapter_only:
        log.info(
            "use it: PeftModel.from_pretrained(<the base>, %s) (peft); adapter.merge=true also saves the merged "
            "model, which task=evaluate and task=generate read",
            model_dir,
        )
    elif job.spec.data.format.value == "prompt":  # (its spec's data are prompts, not rows to evaluate)
        log.info("use it: run task=generate task.trained=%s task.prompts=<a file, a prompt per line>", model_dir)
    else:
        log.info(
            "use it: run task=generate task.trained=%s task.prompts=<a file, a prompt per line> | "
            "run task=evaluate task.trained=%s",
            job.run_dir,
            job.run_dir,
        )


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
