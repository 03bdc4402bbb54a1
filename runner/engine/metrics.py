"""What the loop measures and shows: the metrics of each logged window of steps, peak memory, MFU's FLOPs, and
a progress bar on a terminal."""

from __future__ import annotations

import resource
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from runner.engine.router import load_figures

if TYPE_CHECKING:
    import torch

    from runner.engine.tally import Reading


@dataclass
class MetricsWindow:
    """The steps since the last logged one, as the loop read them from the device: their mean loss and their
    tokens/s."""

    flops_per_token: float
    peak_flops: float  # of all devices together; 0 where unknown (no MFU)
    loss: float = 0.0
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    # the objective's own (task=dpo's rewards, a MoE router's), summed; a MoE model's tokens per expert, an array
    metrics: dict[str, Any] = field(default_factory=dict)

    def add(self, reading: Reading, seconds: float) -> None:
        self.loss, self.tokens = self.loss + reading.loss, self.tokens + reading.tokens
        self.seconds, self.steps = self.seconds + seconds, self.steps + reading.steps
        for name, value in reading.metrics.items():
            self.metrics[name] = self.metrics.get(name, 0.0) + value

    def close(
        self, lr: float, grad_norm: float, loss_scale: Optional[float], tokens_seen: int, device: torch.device
    ) -> dict[str, Any]:
        """The window's record, as metrics.jsonl and the trackers log it; the next window starts empty."""
        record = {
            "loss": self.loss / self.steps,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": self.tokens / self.seconds,
            "tokens_seen": tokens_seen,
            "peak_memory_gib": peak_memory_gib(device),
        }
        if loss_scale is not None:
            record["loss_scale"] = loss_scale
        if self.peak_flops:
            record["mfu"] = record["tokens_per_s"] * self.flops_per_token / self.peak_flops
        record.update(load_figures({name: value / self.steps for name, value in self.metrics.items()}))
        self.loss, self.tokens, self.seconds, self.steps, self.metrics = 0.0, 0, 0.0, 0, {}
        return record


def compile_seconds() -> float:
    """The seconds torch.compile has spent in this process: tracing, lowering and code generation, of the forward
    and (when its first backward runs) of the backward."""
    from torch._dynamo.utils import calculate_time_spent

    return calculate_time_spent().get("total_wall_time", 0.0)


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated device memory on a GPU; the process's peak resident memory on the CPU."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1024**3
    return peak_resident_kib() / 1024**2


def peak_resident_kib() -> int:
    """This process's own peak resident memory. Linux's VmHWM starts afresh when a process starts a program;
    ru_maxrss keeps the peak of the process it was forked from (a large parent's, for a job started from one)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


class ProgressBar:
    """On a terminal, a bar with the count done, what the loop shows of it (the loss, tokens/s) and the time left,
    the log lines printed above it; elsewhere (CI, SLURM logs) nothing but the periodic log lines."""

    def __init__(self, enabled: bool, start: int, total: int, unit: str = "step"):
        self._bar = self._redirect = None
        self.done = start
        if enabled:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()
            # A terminal that reports no size (0 x 0) would get a hidden bar.
            size = shutil.get_terminal_size()
            self._bar = tqdm(total=total, initial=start, unit=unit, ncols=size.columns or 100, nrows=size.lines or 24)

    def advance(self, count: int = 1, **shown: str) -> None:
        self.done += count
        if self._bar is not None:
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(count)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._redirect.__exit__(None, None, None)
