"""A whole copy of everything on each device: the terms of single and ddp (runner/strategies/)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.memory.activations import ActivationDtypes, activations_part, loss_gradient_bytes
from runner.memory.breakdown import Estimate, Part, dtype_name
from runner.memory.expert_memory import experts_part
from runner.memory.model_shapes import fp8_linears
from runner.memory.parameters import adapter_transients, host_loading, parameters_of, weights_note

if TYPE_CHECKING:
    from runner.config.spec import RunSpec
    from runner.memory.model_shapes import ModelFacts


def whole_copies(spec: RunSpec, facts: ModelFacts) -> Estimate:
    """weights P.w, gradients P.w, states k.P.w; autocast keeps a c-byte cast of each linear weight until backward.
    With an adapter P is the trained adapters' T, and the weights add the whole frozen base in its stored dtypes,
    which autocast does not cast (it is in c already)."""
    precision, parameters = spec.precision, parameters_of(spec, facts)
    P = parameters.trained
    w, c = precision.param_dtype.bytes, precision.compute_dtype.bytes
    k, states = spec.optim.states()
    autocast = c < w
    fp8_parameters, fp8_blocks = fp8_linears(facts.model, precision)
    # Autocast keeps one cast of each linear weight from its first use until backward has used it.
    copies = (c * (parameters.trained_linear - fp8_parameters) if autocast else 0) + fp8_parameters
    dequantized, dequantized_note = adapter_transients(parameters, c)
    # A frozen base in c makes a c-byte residual stream, whose inputs autocast need not cast for each projection.
    frozen_base = bool(parameters.frozen)
    dtypes = ActivationDtypes(
        compute=c, stream=c if frozen_base else w, casts=autocast and not frozen_base, fp8=fp8_blocks
    )
    casts_note = ", autocast's casts of the " + ("adapters' weights" if frozen_base else "linear weights")
    result = Estimate(
        weights=Part(
            P * w + parameters.frozen_bytes() + facts.buffer_bytes, weights_note(parameters, dtype_name(w), ", whole")
        ),
        gradients=Part(P * w, f"{dtype_name(w)}, whole"),
        optimizer_states=Part(k * P * w, f"{states}, {dtype_name(w)}"),
        activations=activations_part(spec, facts, dtypes),
        backward_start=Part(
            copies + dequantized + loss_gradient_bytes(spec, facts),
            "the loss gradient" + (casts_note if copies else "") + dequantized_note,
        ),
        step=Part(spec.optim.step_copies() * P * w, "the optimizer's foreach temporaries"),
        host_loading=host_loading(spec, facts, spec.hardware.nproc_per_node or 1),
    )
    result.experts = experts_part(spec, facts, result)
    return result
