"""A mixture-of-experts model's experts in the estimate (runner/memory/model_shapes.py reads them off the meta
model: ExpertFacts).

Per MoE layer and token, with E routed experts, k of them per token, I an expert's width and h the hidden size, the
experts save for backward what a gated MLP saves, once for each of the token's k assignments: the token's hidden
state (c h, gathered to its expert), gate_up (2 c I), the activation (c I), the down projection's input (l I) and
its output, which the routing weight scales (c h); the router its logits and their fp32 softmax (E (c + 4)).
Under expert parallelism (strategy.ep_size) the assignments travel to their experts' ranks and back by all-to-all:
k x t x h x c each way, a layer at a time.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from runner.memory.breakdown import FP32, Part, dtype_name, readable

if TYPE_CHECKING:
    from runner.config.spec import RunSpec
    from runner.memory.breakdown import Estimate
    from runner.memory.model_shapes import ExpertFacts, ModelFacts


def moe_mlp_bytes(experts: ExpertFacts, hidden: int, compute: int, saved_input: int) -> int:
    """Bytes per token a MoE layer's experts and router save for backward, in place of a dense MLP's (the module's
    docstring): k assignments of a gated expert, the shared experts' gated MLP, the router's logits and softmax."""
    routed = experts.top_k * (2 * compute * hidden + (3 * compute + saved_input) * experts.width)
    shared = (3 * compute + saved_input) * experts.shared_width
    return routed + shared + experts.routed * (compute + FP32)


def dispatch_bytes(experts: ExpertFacts, tokens: int, hidden: int, compute: int) -> int:
    """Expert parallelism's all-to-all buffers of one MoE layer: each assignment's hidden state sent to its expert's
    rank, and its output received back."""
    return 2 * experts.top_k * tokens * hidden * compute


def experts_part(spec: RunSpec, facts: ModelFacts, result: Estimate, gathered: int = 0) -> Part:
    """The routed experts' share of an estimate's parts, for the report (it is not added to the peak again): their
    weights, gradients and optimizer states on the device (a full fine-tune's in proportion to their parameters;
    under an adapter, frozen in the compute dtype and sharded as the strategy shards a frozen model: LoRA adapts
    nn.Linear layers only, and the experts are 3-D parameters), `gathered`, their all-gathered bytes at the start
    of backward, and expert parallelism's all-to-all buffers."""
    experts = facts.experts
    if experts is None:
        return Part()
    ep, compute = spec.layout.ep, spec.precision.compute_dtype.bytes
    if spec.adapter.active:
        held = math.ceil(experts.parameters / spec.strategy.frozen_shards(spec)) * compute
        held = min(held, result.weights.bytes - facts.buffer_bytes)  # none where offload moved the base
    else:
        kept = result.weights.bytes - facts.buffer_bytes + result.gradients.bytes + result.optimizer_states.bytes
        held = round(max(0, kept) * experts.parameters / facts.parameters)
    tokens = spec.train.micro_batch_size * spec.data.seq_len
    dispatched = dispatch_bytes(experts, tokens, facts.layer.hidden, compute) if ep > 1 else 0
    note = (
        f"{experts.routed // ep} of {experts.routed} routed experts x {len(experts.moe_layers)} MoE layers"
        + (f" on each of {ep} expert-parallel ranks" if ep > 1 else "")
        + f", {experts.top_k} per token: {readable(held)} held"
        + (f", {readable(gathered)} all-gathered" if gathered else "")
        + (f", {readable(dispatched)} of all-to-all buffers ({dtype_name(compute)})" if dispatched else "")
    )
    return Part(held + gathered + dispatched, note)
