"""What `run task=estimate` prints: the estimate per device and per node, the fit, and accelerate's view."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from runner.memory.accelerate_view import format_accelerate_view
from runner.memory.advice import cheapest_fits, fit, proposals
from runner.memory.breakdown import Estimate, Part, Phase, estimate, part_row, processes, readable
from runner.memory.model_shapes import facts_of
from runner.memory.parameters import parameters_of

if TYPE_CHECKING:
    from runner.config.spec import RunSpec


def report(spec: RunSpec, accelerate_view: bool = False) -> str:
    """What `run task=estimate` prints; `accelerate_view` adds accelerate estimate-memory's table."""
    facts = facts_of(spec.model)
    result = estimate(spec, facts)
    verdict = fit(spec, result)
    hardware, precision = spec.hardware, spec.precision
    dtypes = f"{precision.compute_dtype.value} compute, {precision.param_dtype.value} weights"
    if precision.fp8 is not None:
        dtypes += ", fp8 linear layers"
    memory = f"{hardware.device_memory_gib:g} GiB" if hardware.device_memory_gib else "memory not declared"
    nproc = hardware.nproc_per_node or 1

    def row(label: str, part: Part) -> str:
        return part_row(label, part, 22)

    lines = [
        f"memory estimate: {type(facts.model).__name__} ({facts.parameters:,} parameters), "
        f"{spec.strategy.describe(spec)}, {dtypes}, {type(spec.optim).__name__.removesuffix('Config')}, "
        f"micro batch {spec.train.micro_batch_size} x {spec.data.seq_len} tokens",
        f"parameters: {parameters_of(spec, facts).describe(precision.param_dtype.value)}",
        f"per device ({hardware.device_name or hardware.accelerator.value}, {memory}), rank 0:",
        row("weights", result.weights),
        row("gradients", result.gradients),
        row("optimizer states", result.optimizer_states),
        row("activations", result.activations),
        *([row("reference model", result.reference)] if result.reference.note else []),
        *([row("of which experts", result.experts)] if result.experts.note else []),
        "  transient buffers",
        *([row("  kept throughout", result.buffers)] if result.buffers.bytes else []),
        row("  start of backward", result.backward_start),
        row("  end of backward", result.backward_end),
        row("  optimizer step", result.step),
        *([row("model loading", result.loading)] if result.loading.bytes else []),
        *([row("sampling", result.sampling)] if result.sampling.bytes else []),
        row("peak", Part(result.peak, f"{result.peak_phase.value}: {_peak_formula(result)}")),
    ]
    if verdict.shared:
        lines.append(
            f"  fits: {_verdict(verdict.device_fits, verdict.device)} ({readable(verdict.device_needs)} "
            f"for {processes(nproc)} in this machine's RAM of {memory})"
        )
    else:
        host = f"{hardware.host_memory_gib:g} GiB" if hardware.host_memory_gib else "RAM not declared"
        lines += [
            f"  fits: {_verdict(verdict.device_fits, verdict.device)}",
            f"CPU RAM per node ({processes(nproc)}, {host}):",
            row("offloaded", result.host_offload if result.host_offload.bytes else Part(0, "nothing")),
            row("model loading", result.host_loading),
            f"  fits: {_verdict(verdict.host_fits, verdict.host)}",
        ]
    if not verdict.fits:
        lines.append(f"cheapest changes that fit: {proposals(cheapest_fits(spec, facts)) or 'none found'}")
    if accelerate_view:
        lines += ["", format_accelerate_view(facts.model)]
    return "\n".join(lines)


def _peak_formula(result: Estimate) -> str:
    kept = (
        "weights + optimizer states"
        + (" + buffers kept throughout" if result.buffers.bytes else "")
        + (" + reference model" if result.reference.bytes else "")
    )
    return {
        Phase.LOADING: "the whole module on the device",
        Phase.BACKWARD_START: (
            kept + " + activations + its transients" + (" + gradients" if result.accumulating else "")
        ),
        Phase.BACKWARD_END: kept + " + gradients + its transients",
        Phase.OPTIMIZER_STEP: kept + " + gradients + the step's temporaries",
        Phase.SAMPLING: kept + " + the KV cache and logits of sampling",
    }[result.peak_phase]


def _verdict(fits: bool, available: Optional[float]) -> str:
    if available is None:
        return "unknown (the hardware declares no memory)"
    return "yes" if fits else "NO"
