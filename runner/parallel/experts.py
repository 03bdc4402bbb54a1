"""Expert parallelism: each MoE layer's experts split over the ranks of the mesh's `ep` dimension, the tokens sent to
their experts and back by two all-to-alls (torchtitan's token dispatcher; runner/parallel/experts_layout.py has the
rules it runs under).

transformers' experts modules (Qwen3-MoE's, Mixtral's, gpt-oss's, DeepSeek-V3's...) hold every expert's weights as
3-D parameters, experts first, and take `(hidden_states, top_k_index, top_k_weights)` from their layer's router. Here
each of those parameters becomes a DTensor sharded by experts over `ep` (so that checkpoints, exports and the
gradient norm see whole experts), and the module's forward becomes the dispatch:

    sort     this rank's (token, choice) pairs by expert, so that those for each ep rank are contiguous
    counts   an all-to-all of the per-expert counts: each rank learns how many rows it will receive, from whom
    send     all_to_all_single with those split sizes (gloo has it: it runs on the CPU)
    compute  the module's own forward (its kernel: eager, grouped_mm...) on the local experts' weights, each row
             with its one expert and weight 1
    return   the reverse all-to-all, back into (token, choice) order, weighted by the router and summed

No token is dropped (no capacity factor), so the math is one process's whatever the layout. Each expert's gradient
arrives summed over its ep group's rows; the runner's losses are scaled for an average over the data-parallel ranks,
which FSDP takes over the experts' dp_shard_mod_ep x dp_replicate replicas only, so the local weights' gradient is
scaled by 1/ep on its way.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable

from runner.distributed import local

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """Each MoE layer's experts: transformers' modules that count their experts and hold them in 3-D parameters."""

    def holds_experts(module: nn.Module) -> bool:
        count, own = getattr(module, "num_experts", None), [local(p) for p in module.parameters(recurse=False)]
        # (3-D weights, experts first: a router's own weight is 2-D)
        return isinstance(count, int) and any(p.dim() == 3 for p in own) and all(p.shape[0] == count for p in own)

    return [module for module in model.modules() if holds_experts(module)]


def shard_experts(model: nn.Module, ep_mesh: DeviceMesh) -> int:
    """Splits every MoE layer's experts over `ep_mesh` (rank 0's weights, scattered) and sets their forward to
    dispatch the tokens; how many layers."""
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor

    modules = experts_modules(model)
    for experts in modules:
        for name, parameter in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(parameter.detach(), ep_mesh, [Shard(0)], src_data_rank=0)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=parameter.requires_grad))
        experts.num_experts //= ep_mesh.size()
        experts.forward = _dispatching(experts, ep_mesh)
    return len(modules)


def _dispatching(experts: nn.Module, ep_mesh: DeviceMesh) -> Callable[..., torch.Tensor]:
    own_forward = type(experts).forward
    group, ep = ep_mesh.get_group(), ep_mesh.size()

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        import torch

        tokens, top_k = top_k_index.shape
        local_experts = experts.num_experts
        chosen = top_k_index.reshape(-1)
        order = torch.argsort(chosen, stable=True)
        counts = torch.bincount(chosen, minlength=local_experts * ep)
        received_counts = _exchanged_counts(counts, group)  # (ep, local_experts): from each rank, per local expert
        send_splits = counts.view(ep, local_experts).sum(1).tolist()
        receive_splits = received_counts.sum(1).tolist()
        received = _all_to_all(hidden_states[order // top_k], receive_splits, send_splits, group)
        local_index = torch.arange(local_experts, device=chosen.device).repeat(ep)
        local_index = local_index.repeat_interleave(received_counts.reshape(-1))[:, None]
        with _local_weights(experts, 1.0 / ep) as weights:
            computed = own_forward(experts, received, local_index, torch.ones_like(local_index, dtype=received.dtype))
            if not len(received):
                # No token for this rank's experts: the kernel's output is then a constant, and the backward would
                # skip this rank's turn in both all-to-alls (the others wait for it for ever) and leave its experts
                # without gradients (FSDP would skip its reduce-scatter). Zero terms keep both in the graph.
                computed = computed + sum(tensor.sum() for tensor in (received, *weights) if tensor.requires_grad) * 0
        returned = _all_to_all(computed, send_splits, receive_splits, group)
        unsorted = torch.empty_like(returned).index_copy(0, order, returned)
        weighted = unsorted.view(tokens, top_k, -1) * top_k_weights.to(unsorted.dtype)[..., None]
        return weighted.sum(1).to(hidden_states.dtype)

    return forward


def _exchanged_counts(counts: torch.Tensor, group: Any) -> torch.Tensor:
    import torch
    import torch.distributed as dist

    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    return received.view(dist.get_world_size(group), -1)


def _all_to_all(rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any) -> torch.Tensor:
    """Rows sent in `input_splits` to each rank of `group`, received in `output_splits`, differentiably (the
    backward sends the gradients the other way)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(rows.contiguous(), output_splits, input_splits, group))


class _local_weights:
    """The experts module's parameters as this rank's local shards while its own forward runs (and as the context's
    value), their gradients scaled by `grad_scale` on the way back to the sharded parameters."""

    def __init__(self, experts: nn.Module, grad_scale: float):
        self.experts, self.grad_scale, self.saved = experts, grad_scale, {}

    def __enter__(self) -> list[torch.Tensor]:
        parameters = self.experts._parameters
        self.saved = dict(parameters)
        for name, parameter in self.saved.items():
            own = local(parameter)
            parameters[name] = _scaled_gradient().apply(own, self.grad_scale) if own.requires_grad else own
        return [parameters[name] for name in self.saved]

    def __exit__(self, *exc: Any) -> None:
        self.experts._parameters.update(self.saved)


@functools.cache
def _scaled_gradient() -> Any:
    """An autograd function: the identity forward, its gradient scaled (made on first use: torch stays unimported
    until then)."""
    import torch

    class ScaledGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:
            ctx.scale = scale
            return tensor.view_as(tensor)

        @staticmethod
        def backward(ctx, grad: torch.Tensor):
            return grad * ctx.scale, None

    return ScaledGradient
