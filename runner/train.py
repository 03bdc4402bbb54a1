"""The training loop, top to bottom: accumulate, clip, step, log, evaluate, save."""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

    from runner.data import Batch
    from runner.job import PreparedJob

log = logging.getLogger("runner")


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite; the run stops rather than train on garbage."""


class Stopped(RuntimeError):
    """A SIGTERM, SIGINT or SIGUSR2 stopped the run after a step, with a checkpoint to resume from."""


class GracefulStop:
    """The first SIGTERM or SIGINT asks the loop to stop after the current step, with a checkpoint; another one
    stops the process at once. Signals within a second of the first (a terminal's Ctrl-C reaching the whole
    process group, then the launcher passing it on) count as that one request. SIGUSR2 is the warning a SLURM job
    of the submitit launcher gets before its time limit; the loop takes it for a SIGTERM too, ahead of submitit's
    own handler, which would end rank 0 in the middle of a step."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)

    def __init__(self) -> None:
        self.requested: Optional[str] = None
        self._at = 0.0
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested is None:
            self.requested, self._at = signal.Signals(signum).name, time.monotonic()
            log.warning("%s: stopping after this step, with a checkpoint (send it again to stop at once)",
                        self.requested)
        elif time.monotonic() - self._at > 1.0:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclass
class TrainConfig:
    max_steps: int = 100
    micro_batch_size: int = 8
    grad_accum_steps: int = 1
    # Clip the global gradient norm to this; 0 turns clipping off.
    max_grad_norm: float = 1.0
    log_every: int = 10
    # Evaluate every N optimizer steps, and always before the first and after the last; 0: only those two.
    eval_every: int = 0
    eval_batches: int = 20
    # Write a checkpoint every N optimizer steps (and after the last); 0: only after the last.
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    save_model: bool = True


def train(job: PreparedJob) -> dict[str, Any]:
    stop = GracefulStop()
    try:
        return _train(job, stop)
    finally:
        stop.restore()


def _train(job: PreparedJob, stop: GracefulStop) -> dict[str, Any]:
    import torch

    from runner import checkpoint
    from runner.precision import describe as describe_precision
    from runner.strategy import describe, parameter_count, unwrapped

    spec, model = job.spec, job.model
    cfg = spec.train
    n_params = parameter_count(model)
    flops_per_token = training_flops_per_token(unwrapped(model).config, n_params, spec.data.seq_len)
    peak_flops = spec.hardware.peak_bf16_tflops * 1e12 * job.ranks.world_size
    log.info(
        "%s | model %s, %.2fM parameters | global batch %d = micro batch %d x %d data-parallel ranks"
        " x %d accumulation steps | %d steps",
        # fully_shard swaps the model's class for an FSDP<Name> subclass; the name users know is the original.
        describe(spec.strategy, spec.hardware), type(unwrapped(model)).__name__.removeprefix("FSDP"), n_params / 1e6,
        job.global_batch_size, cfg.micro_batch_size, job.dp_size, cfg.grad_accum_steps, cfg.max_steps,
    )

    log.info("precision: %s", describe_precision(job.precision_in_effect()))
    progress = job.progress
    if job.start_step:
        log.info("resuming from step %d of %s", job.start_step, spec.resume)
        first_eval_loss = eval_loss = progress["first_eval_loss"]
    else:
        first_eval_loss = eval_loss = evaluate(job, step=0)
    model.train()
    train_time, tokens_seen = progress.get("train_time", 0.0), progress.get("tokens_seen", 0)
    skipped_steps = progress.get("skipped_steps", 0)
    window_loss, window_tokens, window_time, window_steps = 0.0, 0, 0.0, 0
    started = time.perf_counter()
    batches = job.train_batches(job.start_step)
    bar = ProgressBar(job.ranks.rank == 0 and sys.stdout.isatty(), job.start_step, cfg.max_steps)

    for step in range(job.start_step + 1, cfg.max_steps + 1):
        tic = time.perf_counter()
        host_batches = next(batches)
        # The loss is the mean over every label token of the global batch, whatever way it is split. Data-parallel
        # strategies average gradients over ranks, so each rank's share is scaled by dp_size to make that a sum.
        # Each collective is a point where every rank waits for the slowest: a step has two.
        label_tokens, step_tokens = all_ranks_sums([sum(count_label_tokens(batch) for batch in host_batches),
                                                    sum(int(batch["attention_mask"].sum()) for batch in host_batches)])
        micro_batches = [{k: v.to(job.device) for k, v in batch.items()} for batch in host_batches]
        step_loss = torch.zeros((), device=job.device)
        for i, batch in enumerate(micro_batches):
            with job.gradient_sync(i == len(micro_batches) - 1):
                with job.autocast():
                    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                loss = causal_lm_loss_sum(logits, batch["labels"]) / label_tokens
                job.stepper.backward(loss * job.dp_size)
            step_loss += loss.detach()
        outcome = job.stepper.step()
        if outcome.applied:
            job.scheduler.step()
        else:  # fp16's loss scale overflowed: no update, so the schedule does not advance either
            skipped_steps += 1
            log.warning("step %d/%d | gradients overflowed fp16; update skipped, loss scale lowered to %g",
                        step, cfg.max_steps, outcome.loss_scale)

        # The loss's .item() also waits for the device, so the timing is the step's own. Every rank stops after
        # the same step.
        step_loss, stop_votes = all_ranks_sums([step_loss.item(), stop.requested is not None])
        stopping = stop_votes > 0
        if not math.isfinite(step_loss):
            last_good = checkpoint.complete_checkpoints(job.run_dir)
            raise NonFiniteLoss(f"the loss is {step_loss} at step {step}; the last good checkpoint is "
                                f"{last_good[-1] if last_good else 'none (train.checkpoint_every=0)'}")
        elapsed = time.perf_counter() - tic
        train_time, tokens_seen = train_time + elapsed, tokens_seen + step_tokens
        window_loss, window_tokens = window_loss + step_loss, window_tokens + step_tokens
        window_time, window_steps = window_time + elapsed, window_steps + 1
        bar.advance(step_loss, step_tokens / elapsed)

        if step % cfg.log_every == 0 or step == cfg.max_steps:
            record = {
                "loss": window_loss / window_steps,
                "lr": job.scheduler.get_last_lr()[0],
                "grad_norm": outcome.grad_norm,
                "tokens_per_s": window_tokens / window_time,
                "tokens_seen": tokens_seen,
                "peak_memory_gib": peak_memory_gib(job.device),
            }
            if outcome.loss_scale is not None:
                record["loss_scale"] = outcome.loss_scale
            if peak_flops:
                record["mfu"] = record["tokens_per_s"] * flops_per_token / peak_flops
            for tracker in job.trackers:
                tracker.log(record, step)
            log.info(
                "step %d/%d | loss %.4f | lr %.2e | grad norm %.3f | %.0f tokens/s",
                step, cfg.max_steps, record["loss"], record["lr"], outcome.grad_norm, record["tokens_per_s"],
            )
            train_loss = record["loss"]
            window_loss, window_tokens, window_time, window_steps = 0.0, 0, 0.0, 0
        if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.max_steps:
            eval_loss = evaluate(job, step)
            model.train()
        if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.max_steps or stopping:
            saved = checkpoint.save(job, step, {"tokens_seen": tokens_seen, "train_time": train_time,
                                                "first_eval_loss": first_eval_loss, "skipped_steps": skipped_steps})
            log.info("step %d/%d | checkpoint %s", step, cfg.max_steps, saved)
        if stopping:
            raise Stopped(f"stopped by {stop.requested or 'a signal'} after step {step}, checkpoint {saved}; "
                          f"continue with: run resume={job.run_dir}")

    bar.close()
    model_dir = save_model(job) if cfg.save_model else None
    summary = {
        "steps": cfg.max_steps,
        "train_loss": train_loss,
        "first_eval_loss": first_eval_loss,
        "eval_loss": eval_loss,
        "tokens_seen": tokens_seen,
        "skipped_steps": skipped_steps,
        "tokens_per_s": tokens_seen / train_time,
        "peak_memory_gib": peak_memory_gib(job.device),
        "wall_time_s": time.perf_counter() - started,
        "run_dir": str(job.run_dir),
        "model_dir": str(model_dir) if model_dir else None,
        "precision": job.precision_in_effect(),
    }
    if job.ranks.rank == 0:
        write_json_atomically(job.run_dir / "summary.json", summary)
    for tracker in job.trackers:
        tracker.finish()
    log.info(
        "done: train loss %.4f | eval loss %.4f (from %.4f) | %.0f tokens/s | peak memory %.2f GiB | %.0f s",
        summary["train_loss"], eval_loss, first_eval_loss, summary["tokens_per_s"], summary["peak_memory_gib"],
        summary["wall_time_s"],
    )
    log.info("outputs: %s%s", job.run_dir, f" (model: {model_dir})" if model_dir else "")
    return summary


class ProgressBar:
    """On a terminal, a bar with the step, loss, tokens/s and time left, the log lines printed above it;
    elsewhere (CI, SLURM logs) nothing but the periodic log lines."""

    def __init__(self, enabled: bool, start: int, total: int):
        self._bar = self._redirect = None
        if enabled:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()
            # A terminal that reports no size (0 x 0) would get a hidden bar.
            size = shutil.get_terminal_size()
            self._bar = tqdm(total=total, initial=start, unit="step", ncols=size.columns or 100, nrows=size.lines or 24)

    def advance(self, loss: float, tokens_per_s: float) -> None:
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", tokens_per_s=f"{tokens_per_s:.0f}", refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._redirect.__exit__(None, None, None)


def training_flops_per_token(config: Any, n_params: int, seq_len: int) -> float:
    """Forward and backward FLOPs per token: 6 per parameter, plus attention's 12 x layers x width x sequence
    (Chowdhery et al., 2022, "PaLM", appendix B), the count MFU is usually quoted against."""
    return 6 * n_params + 12 * config.num_hidden_layers * config.hidden_size * seq_len


def count_label_tokens(batch: Batch) -> int:
    """Label positions that are predicted: every label but the first of each row, and not IGNORE."""
    from runner.data import IGNORE

    return int((batch["labels"][:, 1:] != IGNORE).sum())


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross entropy, computed in fp32 whatever dtype the forward ran in. The labels are shifted
    (the last position gets IGNORE) rather than the logits, whose slice would be a copy of the largest activation."""
    import torch.nn.functional as F

    from runner.data import IGNORE

    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")


def all_ranks_sums(values: list[float]) -> list[float]:
    """The sums of several numbers over all ranks, in one collective (the numbers themselves in a single process)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    totals = torch.tensor([float(value) for value in values], dtype=torch.float64)
    dist.all_reduce(totals)
    return totals.tolist()


def evaluate(job: PreparedJob, step: int) -> float:
    import torch

    job.model.eval()
    loss_sum = torch.zeros((), device=job.device)
    label_tokens = 0
    with torch.no_grad():
        for batch in job.eval_batches():
            batch = {k: v.to(job.device) for k, v in batch.items()}
            with job.autocast():
                logits = job.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss_sum += causal_lm_loss_sum(logits, batch["labels"])
            label_tokens += count_label_tokens(batch)
    total_loss, total_tokens = all_ranks_sums([loss_sum.item(), label_tokens])
    eval_loss = total_loss / total_tokens
    for tracker in job.trackers:
        tracker.log({"eval_loss": eval_loss}, step)
    log.info("step %d/%d | eval loss %.4f", step, job.spec.train.max_steps, eval_loss)
    return eval_loss


def save_model(job: PreparedJob) -> Path:
    """save_pretrained (safetensors) of the whole model plus the tokenizer, by rank 0, moved into place once complete."""
    from runner.strategy import SingleStrategy, full_state_dict, unwrapped

    final = job.run_dir / "model"
    single = isinstance(job.spec.strategy, SingleStrategy)
    state = None if single else full_state_dict(job.model, job.spec.strategy)
    if job.ranks.rank == 0:
        partial = job.run_dir / "model.partial"
        shutil.rmtree(partial, ignore_errors=True)
        unwrapped(job.model).save_pretrained(partial, state_dict=state)
        job.tokenizer.save_pretrained(partial)
        if final.exists():  # a resumed run replaces the model its first part saved
            previous = job.run_dir / "model.previous"
            os.replace(final, previous)
            os.replace(partial, final)
            shutil.rmtree(previous)
        else:
            os.replace(partial, final)
    return final


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated device memory on a GPU; the process's peak resident memory on the CPU."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1024**3
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def write_json_atomically(path: Path, value: Any) -> None:
    partial = path.with_suffix(path.suffix + ".partial")
    partial.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(partial, path)
