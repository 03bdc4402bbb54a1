"""The loss every task computes: next-token cross entropy summed over the label tokens, in fp32 whatever dtype the
forward ran in, computed inside the model's forward so that every strategy's wrapping (DDP, FSDP's all-gathers,
DeepSpeed's partitions) sees it as part of the forward.

`with_summed_loss` gives the model a forward that takes `loss_labels` and returns that sum. Chunked (the default
where it is exact), it never materialises the whole batch's logits: the head runs on the label positions only,
`chunk_tokens` at a time, each chunk's logits recomputed in backward (as Liger's and torchtune's chunked losses
avoid the (tokens x vocab) fp32 logits, the largest activation of a large-vocabulary model). Full, it is the
model's own forward and its logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from runner.config.training import LossKind, loss_kind_in_effect
from runner.data.batches import shifted
from runner.data.rows import IGNORE
from runner.engine.router import ATTRIBUTE as ROUTER_ATTRIBUTE

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PretrainedConfig

    from runner.config.training import TrainConfig
    from runner.data.batches import MicroBatch
    from runner.engine.router import RouterLoss


def with_summed_loss(
    model: nn.Module, requested: LossKind, chunk_tokens: int, router: Optional[RouterLoss] = None
) -> LossKind:
    """Sets the model's forward to return the summed loss when it is given `loss_labels` (each row's, with
    `per_row`: minus the row's summed log-probability of its labels, as preference losses take it; each position's,
    with `per_token`: minus the log-probability of its target, 0 where it has none, as policy-gradient losses take
    it, of the logits over `temperature`, the distribution a sampler drew from), and to be its own forward
    otherwise; the kind in effect. A MoE model's `router` records the router's terms of each such forward that
    computes gradients (runner/engine/router.py), kept on the model for the step to add."""
    import torch

    kind = loss_kind_in_effect(requested, model.config.model_type, model.config.vocab_size)
    own_forward = model.forward
    if router is not None:
        setattr(model, ROUTER_ATTRIBUTE, router)

    def forward(
        *args,
        loss_labels: Optional[torch.Tensor] = None,
        per_row: bool = False,
        per_token: bool = False,
        labels_shifted: bool = False,
        label_count: Optional[int] = None,
        temperature: float = 1.0,
        **kwargs,
    ):
        if loss_labels is None:
            return own_forward(*args, **kwargs)
        each = "token" if per_token else "row" if per_row else None
        routed = router is not None and torch.is_grad_enabled()
        if routed:
            kwargs["output_router_logits"] = True
        if kind is LossKind.full:
            outputs = own_forward(*args, use_cache=False, **kwargs)
        else:
            outputs = model.base_model(*args, use_cache=False, **kwargs)
        if routed:
            router.record(outputs.router_logits, kwargs.get("attention_mask"))
        if kind is LossKind.full:
            return summed_cross_entropy(tempered(outputs.logits, temperature), loss_labels, each, labels_shifted)
        return chunked_summed_cross_entropy(
            outputs.last_hidden_state,
            model.get_output_embeddings(),
            loss_labels,
            chunk_tokens,
            each,
            labels_shifted,
            label_count,
            temperature,
        )

    model.forward = forward
    return kind


def loss_arguments(micro_batch: MicroBatch) -> dict[str, Any]:
    """What the forward takes to return a micro batch's summed loss: its labels and, where the host knows it (whole
    rows, not a split's slices), how many of them are predicted, so that the chunked loss picks them out without
    waiting for the device."""
    return {
        "loss_labels": micro_batch.labels,
        "labels_shifted": micro_batch.labels_shifted,
        "label_count": None if micro_batch.labels_shifted else micro_batch.label_tokens,
    }


def summed_loss_from_hidden(
    kind: LossKind, chunk_tokens: int, head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """The same summed loss from the final hidden states and the LM head, as a pipeline's last stage computes it
    (runner/parallel/pipeline/stages.py)."""
    if kind is LossKind.full:
        return summed_cross_entropy(head(hidden), labels)
    return chunked_summed_cross_entropy(hidden, head, labels, chunk_tokens)


def summed_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, each: Optional[str] = None, labels_shifted: bool = False
) -> torch.Tensor:
    """Summed next-token cross entropy over the whole batch's logits (`each`: "row", each row's; "token", each
    position's). The labels are shifted (the last position gets IGNORE) rather than the logits, whose slice would be
    a copy of the largest activation; `labels_shifted`: they were, before context parallelism split the sequences."""
    import torch.nn.functional as F

    targets = labels if labels_shifted else shifted(labels)
    losses = F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="none" if each else "sum"
    )
    if each is None:
        return losses
    return losses.view(targets.shape).sum(1) if each == "row" else losses.view(targets.shape)


def chunked_summed_cross_entropy(
    hidden: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor,
    chunk_tokens: int,
    each: Optional[str] = None,
    labels_shifted: bool = False,
    label_count: Optional[int] = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The same sum from the last hidden states: the head runs chunk by chunk on the `label_count` positions that
    predict a label (where the count is not given, on every position, the others' targets IGNORE); under autograd
    each chunk keeps only its input, and backward recomputes its logits one chunk at a time. The count comes from
    the host: selecting by a mask of the targets would make the host wait for the device to learn its size. The
    logits are divided by `temperature`."""
    import torch
    from torch.utils.checkpoint import checkpoint

    targets = (labels if labels_shifted else shifted(labels)).to(hidden.device).flatten()
    hidden = hidden.flatten(0, 1)
    if label_count is None:
        positions = torch.arange(len(targets), device=hidden.device)
    else:
        positions = torch.nonzero_static(targets != IGNORE, size=label_count).flatten()
        hidden, targets = hidden[positions], targets[positions]
    # Where each chunk's losses go: each position's slot, each row's, or one sum.
    slots = positions if each == "token" else positions // labels.shape[1]
    total = torch.zeros(labels.numel() if each == "token" else labels.shape[0] if each else (), device=hidden.device)
    for hidden_chunk, target_chunk, slot_chunk in zip(
        hidden.split(chunk_tokens), targets.split(chunk_tokens), slots.split(chunk_tokens)
    ):
        if torch.is_grad_enabled():
            losses = checkpoint(
                _chunk_loss, head, hidden_chunk, target_chunk, bool(each), temperature, use_reentrant=False
            )
        else:
            losses = _chunk_loss(head, hidden_chunk, target_chunk, bool(each), temperature)
        total = total.index_add(0, slot_chunk, losses) if each else total + losses
    return total.view(labels.shape) if each == "token" else total


def _chunk_loss(
    head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, per_token: bool, temperature: float = 1.0
) -> torch.Tensor:
    import torch.nn.functional as F

    return F.cross_entropy(
        tempered(head(hidden).float(), temperature),
        targets,
        ignore_index=IGNORE,
        reduction="none" if per_token else "sum",
    )


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The logits over the sampling temperature (the same tensor at 1)."""
    return logits if temperature == 1.0 else logits / temperature


def loss_line(train: TrainConfig, model_config: PretrainedConfig) -> str:
    """How the forward computes its loss, for the run's overview: chunked or from the full logits, compiled or not."""
    kind = loss_kind_in_effect(train.loss, model_config.model_type, model_config.vocab_size)
    how = (
        f"chunked ({train.loss_chunk_tokens:,} label tokens a chunk; no whole-batch logits)"
        if kind is LossKind.chunked
        else "full logits"
    )
    compiled = "; transformer blocks compiled (train.compile)" if train.compile else ""
    return f"{how} (train.loss={train.loss.value}){compiled}"
