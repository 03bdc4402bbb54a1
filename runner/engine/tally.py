"""What the loop adds up between two reads of the device, kept on the device so that no step waits for it: each
step's loss and metric shares, the last gradient norm, and this rank's first step whose loss was not finite. The
loop reads it in one transfer, after one cross-rank sum, at log, evaluation, checkpoint and the last step: torchtitan
likewise reads the loss and the norm only at its log steps."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

if TYPE_CHECKING:
    import torch

Number = Union[float, "torch.Tensor"]


@dataclass
class Reading:
    """The steps since the last reading, every rank's shares summed."""

    steps: int
    loss: float  # the sum of the steps' mean losses
    metrics: dict[str, Any]  # the sums of the steps' means of the objective's metrics (a numpy array: a tensor's)
    tokens: int  # the steps' global batches' tokens, padding aside
    grad_norm: float  # the last step's
    first_non_finite: Optional[int]  # the first step whose loss was not finite, on any rank


@dataclass
class DeviceTally:
    device: torch.device
    counted: bool = True  # whether this rank's shares count (a tensor- or context-parallel group's first rank's)
    steps: int = 0
    _loss: Optional[torch.Tensor] = None
    _metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    _grad_norm: Number = math.nan
    _host_tokens: int = 0
    _device_tokens: Optional[torch.Tensor] = None  # a streamed run's, summed across ranks on the device
    _first_non_finite: Optional[torch.Tensor] = None

    def add(
        self,
        step: int,
        loss: torch.Tensor,
        metrics: dict[str, torch.Tensor],
        grad_norm: Number,
        tokens: Union[int, torch.Tensor],
    ) -> None:
        import torch

        if isinstance(tokens, torch.Tensor):
            self._device_tokens = tokens if self._device_tokens is None else self._device_tokens + tokens
        else:
            self._host_tokens += tokens

        loss = loss.detach().to(self.device, torch.float64)
        if self._loss is None:
            self._loss = torch.zeros((), dtype=torch.float64, device=self.device)
            self._first_non_finite = torch.zeros((), dtype=torch.float64, device=self.device)
        self._loss += loss
        bad = ~torch.isfinite(loss) & (self._first_non_finite == 0)
        self._first_non_finite.copy_(torch.where(bad, float(step), self._first_non_finite))
        for name, share in metrics.items():
            self._metrics[name] = self._metrics.get(name, 0.0) + share.detach().to(self.device, torch.float64)
        self._grad_norm, self.steps = grad_norm, self.steps + 1

    def read(self) -> Reading:
        """The sums across ranks, read in one transfer; the tally starts empty again."""
        import torch
        import torch.distributed as dist

        from runner.distributed import process_group_up

        if not self.steps:
            return Reading(0, 0.0, {}, 0, math.nan, None)
        names = list(self._metrics)
        shapes = [self._metrics[name].shape for name in names]
        sums = torch.cat([self._loss.view(1), *(self._metrics[name].reshape(-1) for name in names)]) * self.counted
        norm = self._grad_norm
        host_norm = not isinstance(norm, torch.Tensor)
        zero = torch.zeros(1, dtype=torch.float64, device=self.device)
        whole = torch.cat(
            [
                sums,
                self._first_non_finite.view(1),
                zero if host_norm else norm.detach().to(self.device, torch.float64).view(1),
                zero if self._device_tokens is None else self._device_tokens.to(torch.float64).view(1),
            ]
        )
        grouped = process_group_up()
        if grouped:
            dist.all_reduce(whole[: len(sums)])  # a contiguous view: summed in place
        values = whole.tolist()
        first_bad, device_norm, device_tokens = values[len(sums) :]
        if grouped and not math.isfinite(values[0]):
            first_bad = _first_over_ranks(first_bad, self.device)
        reading = Reading(
            self.steps,
            values[0],
            dict(zip(names, _shaped(values[1 : len(sums)], shapes))),
            self._host_tokens + int(device_tokens),
            float(norm) if host_norm else device_norm,
            int(first_bad) or None,
        )
        self.steps, self._loss, self._metrics, self._first_non_finite = 0, None, {}, None
        self._host_tokens, self._device_tokens = 0, None
        return reading


def _shaped(values: list[float], shapes: list[torch.Size]) -> list[Any]:
    """The metrics' values read in one flat list, each as its tensor was: a number, or an array of its shape."""
    import numpy as np

    shaped, start = [], 0
    for shape in shapes:
        size = math.prod(shape)
        part = values[start : start + size]
        shaped.append(np.array(part).reshape(shape) if shape else part[0])
        start += size
    return shaped


def _first_over_ranks(first_bad: float, device: torch.device) -> float:
    """The earliest of the ranks' first non-finite steps (0 where a rank had none)."""
    import torch
    import torch.distributed as dist

    earliest = torch.tensor([first_bad or math.inf], dtype=torch.float64, device=device)
    dist.all_reduce(earliest, op=dist.ReduceOp.MIN)
    step = earliest.item()
    return step if math.isfinite(step) else 0.0
