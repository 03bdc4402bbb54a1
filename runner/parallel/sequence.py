"""Sequences split over a context-parallel group (ParallelDims' cp): every rank of the group runs the same rows,
each a slice of every sequence, and the attention gathers what each slice needs from the others. Two ways:

- FSDP's `strategy.cp_size`: torch's ring over sdpa (runner/parallel/context.py), CUDA only;
- DeepSpeed's `strategy.sp_size`: Ulysses (runner/parallel/ulysses.py), whose all-to-all trades the sequence
  slices for a share of the heads around the attention, on any backend.

A strategy gives its way (`Strategy.sequence_split`); placement gives the model its attention, and each step
splits every micro batch around its forward and backward. Both start from the same whole rows (`sliceable`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, ContextManager, Iterator, Optional, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from runner.data.batches import MicroBatch

WholeLoss = Callable[["torch.Tensor"], "torch.Tensor"]
# transformers' attention-function interface: (module, query, key, value, attention_mask, **kwargs) -> (output,
# weights), query (batch, heads, seq, dim), the output (batch, seq, heads, dim).
AttentionFunction = Callable[..., tuple["torch.Tensor", Optional["torch.Tensor"]]]


class SequenceSplit(Protocol):
    # The model's attention over the slices (registered with transformers under `name`, with no mask).
    name: str

    def attention(self, model: nn.Module, within_examples: Optional[AttentionFunction]) -> AttentionFunction:
        """`within_examples`: where rows are packed, the attention that keeps a whole row's examples apart, by the
        row's positions (None: causal over the whole row)."""
        ...

    def split(self, micro_batch: MicroBatch) -> ContextManager[tuple[MicroBatch, WholeLoss]]:
        """This rank's slices of the micro batch, and the function that makes their summed loss the value of the
        whole rows' loss, with the gradient the strategy's reduction expects."""
        ...


@contextlib.contextmanager
def split_sequences(split: Optional[SequenceSplit], micro_batch: MicroBatch) -> Iterator[tuple[MicroBatch, WholeLoss]]:
    """The micro batch as this rank runs it: its slices under a split, else itself."""
    if split is None:
        yield micro_batch, lambda loss: loss
        return
    with split.split(micro_batch) as sliced:
        yield sliced


def sliceable(micro_batch: MicroBatch, multiple: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' input ids, positions and targets, ready to slice along the sequence:
    - the targets shifted to each position's next token first, since a slice's last position predicts the next
      slice's first token;
    - the positions explicit, so that each slice's rotary embeddings are those of its place in the sequence (a
      packed row's, which restart at each example, as they come);
    - right-padded to a multiple of `multiple` (equal slices), the padding's targets IGNORE and its positions going
      on from the last example's. No attention mask: padding is on the right, and causal attention lets no real
      token see it."""
    import torch
    import torch.nn.functional as F

    from runner.data.batches import shifted
    from runner.data.rows import IGNORE

    input_ids, targets = micro_batch.inputs["input_ids"], shifted(micro_batch.labels)
    padding = -input_ids.shape[1] % multiple
    input_ids = F.pad(input_ids, (0, padding), value=0).clone()  # any token: its targets are IGNORE
    targets = F.pad(targets, (0, padding), value=IGNORE)
    positions = micro_batch.inputs.get("position_ids")
    if positions is None:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    else:
        after = positions[:, -1:] + 1 + torch.arange(padding, device=positions.device)
        positions = torch.cat([positions, after], dim=1)
    return input_ids.contiguous(), positions.contiguous(), targets.contiguous()
