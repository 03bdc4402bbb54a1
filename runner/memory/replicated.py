"""A whole copy of everything on each device: the terms of single and ddp (runner/strategies/)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.memory.activations import ActivationDtypes, activations_part, loss_gradient_bytes
from runner.memory.facts import fp8_linears
from runner.memory.terms import FP32, Estimate, Part, dtype_name

if TYPE_CHECKING:
    from runner.config.spec import RunSpec
    from runner.memory.facts import ModelFacts


def whole_copies(spec: RunSpec, facts: ModelFacts) -> Estimate:
    """weights P.w, gradients P.w, states k.P.w; autocast keeps a c-byte cast of each linear weight until backward."""
    precision, P = spec.precision, facts.parameters
    w, c = precision.param_dtype.bytes, precision.compute_dtype.bytes
    k, states = spec.optim.states()
    autocast = c < w
    fp8_parameters, fp8_blocks = fp8_linears(facts.model, precision)
    # Autocast keeps one cast of each linear weight from its first use until backward has used it.
    copies = (c * (facts.linear_parameters - fp8_parameters) if autocast else 0) + fp8_parameters
    dtypes = ActivationDtypes(compute=c, stream=w, casts=autocast, fp8=fp8_blocks)
    return Estimate(
        weights=Part(P * w + facts.buffer_bytes, f"{dtype_name(w)}, whole"),
        gradients=Part(P * w, f"{dtype_name(w)}, whole"),
        optimizer_states=Part(k * P * w, f"{states}, {dtype_name(w)}"),
        activations=activations_part(spec, facts, dtypes),
        backward_start=Part(copies + loss_gradient_bytes(spec, facts),
                            "the loss gradient" + (", autocast's casts of the linear weights" if copies else "")),
        step=Part(spec.optim.step_copies() * P * w, "the optimizer's foreach temporaries"),
        host_loading=Part((spec.hardware.nproc_per_node or 1) * FP32 * P, "each process builds the fp32 model"),
    )
