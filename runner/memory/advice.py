"""The fit check and its advice: whether a run fits its hardware's memory, and if not, the cheapest changes
that would, each checked by estimating the changed spec again."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

from runner.config.adapter import AdapterConfig, AdapterKind
from runner.config.adapter import check as check_adapter
from runner.config.hardware import GIB, Accelerator
from runner.config.precision import Dtype
from runner.config.spec import check_combination
from runner.errors import SpecError
from runner.memory.breakdown import Change, Estimate, estimate, processes, readable, strategy_change
from runner.memory.model_shapes import facts_of

if TYPE_CHECKING:
    from runner.config.spec import RunSpec
    from runner.memory.model_shapes import ModelFacts


@dataclass
class Fit:
    device: Optional[float]  # GiB each device has (None: unknown)
    host: Optional[float]  # GiB of CPU RAM per node (None: unknown)
    device_needs: int  # bytes per device; on a CPU, of the node's processes together
    host_needs: int  # bytes of CPU RAM per node besides the devices'
    shared: bool  # the devices are this machine's CPU: its processes share one RAM

    @property
    def device_fits(self) -> bool:
        return self.device is None or self.device_needs <= self.device * GIB

    @property
    def host_fits(self) -> bool:
        return self.host is None or self.host_needs <= self.host * GIB

    @property
    def fits(self) -> bool:
        return self.device_fits and self.host_fits


def fit(spec: RunSpec, result: Estimate) -> Fit:
    hardware = spec.hardware
    if hardware.accelerator is Accelerator.cpu:
        needs = (hardware.nproc_per_node or 1) * result.peak + result.host_offload.bytes
        return Fit(hardware.device_memory_gib, None, max(needs, result.host_loading.bytes), 0, shared=True)
    return Fit(hardware.device_memory_gib, hardware.host_memory_gib, result.peak, result.host_peak, shared=False)


def changes(spec: RunSpec) -> list[Change]:
    """The changes that apply to this spec and keep it valid: the strategy's own, then what any run can change."""
    precision, train = spec.precision, spec.train
    found = list(spec.strategy.memory_changes(spec))
    if not spec.strategy.activation_checkpointing:
        found.append(strategy_change("strategy.activation_checkpointing=true", 2.0, activation_checkpointing=True))
    if precision.compute_dtype is Dtype.fp32:
        found.append(
            Change(
                ("precision=bf16",), 0.5, lambda s: replace(s, precision=replace(s.precision, compute_dtype=Dtype.bf16))
            )
        )
    if precision.param_dtype is Dtype.fp32:
        # Half the bytes of weights, gradients and states, at a cost in quality: small updates are lost.
        found.append(
            Change(
                ("precision=pure_bf16",),
                4.0,
                lambda s: replace(
                    s,
                    precision=replace(
                        s.precision, compute_dtype=Dtype.bf16, param_dtype=Dtype.bf16, reduce_dtype=Dtype.bf16
                    ),
                ),
            )
        )
    # A smaller micro batch with more accumulation steps: the same global batch.
    micro = train.micro_batch_size // 2
    while micro >= 1:
        steps = train.grad_accum_steps * train.micro_batch_size // micro
        if micro * steps == train.micro_batch_size * train.grad_accum_steps:
            found.append(
                Change(
                    (f"train.micro_batch_size={micro}", f"train.grad_accum_steps={steps}"),
                    1.0 + 0.1 * math.log2(train.micro_batch_size / micro),
                    lambda s, micro=micro, steps=steps: replace(
                        s, train=replace(s.train, micro_batch_size=micro, grad_accum_steps=steps)
                    ),
                )
            )
        micro //= 2
    # Train LoRA adapters on a frozen base instead of every weight: a different fine-tune, so dearer than any
    # change of how the same training is laid out.
    if spec.adapter.kind is AdapterKind.none:
        found += [adapter_change(AdapterKind.lora, 6.0), adapter_change(AdapterKind.qlora, 8.0)]
    elif spec.adapter.kind is AdapterKind.lora:
        found.append(adapter_change(AdapterKind.qlora, 2.0))
    return [change for change in found if _valid(change.apply(spec))]


def adapter_change(kind: AdapterKind, cost: float) -> Change:
    """adapter=<kind>, as typed: conf/adapter/<kind>.yaml's values, which are the schema's defaults."""
    return Change((f"adapter={kind.value}",), cost, lambda s: replace(s, adapter=AdapterConfig(kind=kind)))


def _valid(spec: RunSpec) -> bool:
    """Whether the strategy and precision accept the changed spec (pure bf16 under DeepSpeed, bf16 on an old GPU,
    an adapter with fp8 or qlora under DeepSpeed), and the adapter its packages (peft, torchao)."""
    try:
        check_combination(spec)
        check_adapter(spec.adapter)
    except SpecError:
        return False
    return True


def cheapest_fits(spec: RunSpec, facts: ModelFacts, limit: int = 3, depth: int = 3) -> list[tuple[Change, Fit]]:
    """Up to `limit` sets of up to `depth` changes, cheapest first, each checked by estimating the changed spec."""
    found: list[tuple[Change, Fit]] = []
    frontier = [Change((), 0.0, lambda s: s)]
    for _ in range(depth):
        grown: list[Change] = []
        for base in frontier:
            keys = {override.split("=")[0] for override in base.overrides}
            for change in changes(base.apply(spec)):
                if keys & {override.split("=")[0] for override in change.overrides}:
                    continue
                combined = Change(
                    base.overrides + change.overrides,
                    base.cost + change.cost,
                    lambda s, base=base, change=change: change.apply(base.apply(s)),
                )
                if any(set(c.overrides) <= set(combined.overrides) for c, _ in found):
                    continue  # fewer of these changes fit already
                if any(set(g.overrides) == set(combined.overrides) for g in grown):
                    continue
                changed = combined.apply(spec)
                verdict = fit(changed, estimate(changed, facts))
                if verdict.fits:
                    found.append((combined, verdict))
                else:
                    grown.append(combined)
        frontier = sorted(grown, key=lambda c: c.cost)[:40]
    found.sort(key=lambda item: (item[0].cost, item[1].device_needs))
    return found[:limit]


def proposals(fixes: list[tuple[Change, Fit]]) -> str:
    return " | ".join(
        f"{' '.join(change.overrides)} ({readable(verdict.device_needs)}"
        + (f", {readable(verdict.host_needs)} of CPU RAM" if verdict.host_needs and verdict.host else "")
        + ")"
        for change, verdict in fixes
    )


def check_fit(spec: RunSpec) -> None:
    """Refuses, in one line, a run that cannot fit its hardware, naming the cheapest changes that would."""
    facts = facts_of(spec.model)
    verdict = fit(spec, estimate(spec, facts))
    if verdict.fits:
        return
    hardware = spec.hardware
    if not verdict.device_fits and verdict.shared:
        problem = (
            f"an estimated {readable(verdict.device_needs)} for {processes(hardware.nproc_per_node or 1)} "
            f"of this machine's RAM ({verdict.device:g} GiB)"
        )
    elif not verdict.device_fits:
        problem = (
            f"an estimated {readable(verdict.device_needs)} per device of the {verdict.device:g} GiB of "
            f"{hardware.device_name or 'each device'}"
        )
    else:
        problem = f"an estimated {readable(verdict.host_needs)} of CPU RAM of the {verdict.host:g} GiB of each node"
    fixes = cheapest_fits(spec, facts)
    advice = (
        f"it fits with: {proposals(fixes)}"
        if fixes
        else "no change tried fits (sharding, checkpointing, offload, a micro batch of 1): use more or larger devices"
    )
    raise SpecError(
        f"the run does not fit: {problem}; {advice}; `run task=estimate` with the same overrides shows "
        "the breakdown, task.fit_check=false launches anyway"
    )
