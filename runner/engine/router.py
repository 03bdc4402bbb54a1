"""A MoE model's router, as the training objective and the log see it: the load-balancing loss and the z-loss added
to the objective, and the experts' load.

Each training forward's router logits give its micro batch's terms, padding left out (transformers' own
load_balancing_loss_func, per forward). A rank adds each micro batch's terms over the global batch's micro batches
(dp_size x its own), so that the step minimises their mean over the global batch whatever the layout: 1 process x 4
accumulation steps, 2 data-parallel ranks x 2 or 4 x 1 give the same objective. The tokens each expert got stay on
the device, summed over the steps and ranks until a log step reads them with the loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from runner.config.model import EXPERT_COUNT_KEYS

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torch import nn
    from transformers import PretrainedConfig

    from runner.config.model import ModelConfig

# The metric that carries each MoE layer's tokens per expert from the step to the log step (not logged itself).
EXPERT_TOKENS = "router/expert_tokens"
# Where a model keeps its RouterLoss (with_summed_loss's forward records into it).
ATTRIBUTE = "router_loss"


@dataclass
class RouterTerms:
    aux: torch.Tensor  # the load-balancing loss
    z: torch.Tensor  # the z-loss
    tokens: torch.Tensor  # (MoE layers, experts): the tokens routed to each expert, padding left out


@dataclass
class RouterLoss:
    experts: int
    top_k: int
    aux_coef: float
    z_coef: float
    recorded: list[RouterTerms] = field(default_factory=list)

    def record(self, router_logits: tuple[torch.Tensor, ...], attention_mask: Optional[torch.Tensor]) -> None:
        """Keeps a training forward's terms for the step to add."""
        self.recorded.append(router_terms(router_logits, attention_mask, self.experts, self.top_k))

    def taken(self, weight: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The last forward's terms times their coefficients and `weight` (the micro batch's share of the global
        batch), as the objective adds them; the metrics' shares."""
        terms = self.recorded.pop()
        self.recorded.clear()
        added = terms.aux * (self.aux_coef * weight)
        metrics = {"router/aux_loss": terms.aux.detach() * weight, EXPERT_TOKENS: terms.tokens}
        if self.z_coef:
            added = added + terms.z * (self.z_coef * weight)
            metrics["router/z_loss"] = terms.z.detach() * weight
        return added, metrics

    def line(self) -> str:
        z = f" + z-loss x {self.z_coef:g}" if self.z_coef else ""
        return f"load-balancing loss x {self.aux_coef:g}{z} ({self.experts} experts, top {self.top_k})"


def router_loss(config: PretrainedConfig, model: ModelConfig) -> Optional[RouterLoss]:
    """The router's terms of a MoE model (model.router_aux_loss_coef, else its config's own); None for a dense
    one."""
    experts = next((getattr(config, key) for key in EXPERT_COUNT_KEYS if getattr(config, key, None)), None)
    if experts is None:
        return None
    aux_coef = model.router_aux_loss_coef
    if aux_coef is None:
        aux_coef = getattr(config, "router_aux_loss_coef", None) or 0.0
    return RouterLoss(int(experts), int(config.num_experts_per_tok), float(aux_coef), model.router_z_loss_coef)


def router_of(model: nn.Module) -> Optional[RouterLoss]:
    return getattr(model, ATTRIBUTE, None)


def router_terms(
    router_logits: tuple[torch.Tensor, ...], attention_mask: Optional[torch.Tensor], experts: int, top_k: int
) -> RouterTerms:
    """One forward's terms from each MoE layer's (tokens, experts) router logits. The load-balancing loss is
    transformers' (Switch Transformer's, over every layer's tokens): experts x the sum over experts of the share of
    top-k assignments it got times its mean router probability. The z-loss is ST-MoE's: the mean over tokens and
    layers of logsumexp(logits)^2."""
    import torch

    logits = torch.stack([layer.float() for layer in router_logits])  # (layers, tokens, experts)
    layers, tokens = logits.shape[:2]
    real = (
        torch.ones(tokens, device=logits.device)
        if attention_mask is None
        else attention_mask.reshape(-1).to(logits.device, torch.float32)
    )
    probs = logits.softmax(-1)
    chosen = probs.topk(top_k, dim=-1).indices.flatten(1)  # (layers, tokens x top_k)
    counts = torch.zeros(layers, experts, device=logits.device)
    counts.scatter_add_(1, chosen, real.repeat_interleave(top_k).expand(layers, -1))
    rows = real.sum() * layers
    token_share = counts.sum(0) / rows
    prob_share = (probs * real[:, None]).sum((0, 1)) / rows
    aux = experts * (token_share * prob_share).sum()
    z = (logits.logsumexp(-1).square() * real).sum() / rows
    return RouterTerms(aux, z, counts)


def load_figures(metrics: dict[str, Any]) -> dict[str, Any]:
    """The metrics with the experts' token counts (a window's, every rank's) replaced by what they show: each MoE
    layer's max over mean tokens per expert (1: balanced), the worst layer's, and the share of experts that got no
    token."""
    tokens: Optional[np.ndarray] = metrics.get(EXPERT_TOKENS)
    if tokens is None:
        return metrics
    per_layer = tokens.max(1) / tokens.mean(1)
    return {
        **{name: value for name, value in metrics.items() if name != EXPERT_TOKENS},
        "router/load_max_over_mean": float(per_layer.max()),
        **{f"router/load_max_over_mean/layer{i}": float(load) for i, load in enumerate(per_layer)},
        "router/dead_experts": float((tokens == 0).mean()),
    }
