"""Context parallelism (FSDP's strategy.cp_size): the ranks of a context-parallel group run the same rows, each a slice
of every sequence, and compute the attention together as a ring (torch's `context_parallel`, as torchtitan uses it).

Around each micro batch's forward and backward, `RingSplit.split`:
- takes the whole rows as runner/parallel/sequence.py's `sliceable` gives them (targets shifted, positions explicit,
  no attention mask), padded to a multiple of 2 x cp;
- splits input ids, positions and targets in place, each rank taking a slice from each end of the sequence, which
  balances the causal attention's work (torch's head-tail load balancer);
- swaps SDPA for the ring inside the block: only the flash, memory-efficient and cuDNN kernels have one (CUDA);
- sums the slices' losses over the group, differentiably, so that every rank of it holds the row's whole loss and
  counts like a tensor-parallel rank. FSDP averages the gradients over dp_shard x cp, and the sum's backward gives
  each slice the gradient of the whole, so the average is right.

The model attends with causal sdpa, no mask and its key-value heads repeated, the call torch's ring takes (as
torchtitan's attention makes it): transformers' own would read a slice's jump in positions (0, 1, 6, 7) as packed
sequences and build a mask, and pass grouped heads to sdpa on CUDA.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar, Iterator, Optional

from runner.parallel.sequence import AttentionFunction, WholeLoss, sliceable

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from runner.data.batches import MicroBatch


@dataclass
class RingSplit:
    mesh: DeviceMesh  # the context-parallel group's

    name: ClassVar[str] = "runner_causal_unmasked"

    def attention(self, model: nn.Module, within_examples: Optional[AttentionFunction]) -> AttentionFunction:
        if within_examples is not None:
            raise ValueError("the ring attends causally over whole rows: packed rows are refused before launch")
        return causal_unmasked_attention

    @contextlib.contextmanager
    def split(self, micro_batch: MicroBatch) -> Iterator[tuple[MicroBatch, WholeLoss]]:
        import torch.distributed.nn.functional as distributed
        from torch.distributed.tensor.experimental import context_parallel
        from torch.nn.attention import SDPBackend, sdpa_kernel

        buffers = list(sliceable(micro_batch, 2 * self.mesh.size()))
        input_ids, positions, targets = buffers
        ring_kernels = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
        with (
            sdpa_kernel(ring_kernels),
            context_parallel(self.mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)),
        ):
            sliced = replace(
                micro_batch,
                inputs={"input_ids": input_ids, "position_ids": positions},
                labels=targets,
                labels_shifted=True,
            )
            yield sliced, lambda loss: distributed.all_reduce(loss, group=self.mesh.get_group())


def causal_unmasked_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface, over the whole row: causal, no mask, the key-value heads
    repeated to the query heads."""
    import torch.nn.functional as F

    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    output = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True, scale=scaling)
    return output.transpose(1, 2).contiguous(), None
