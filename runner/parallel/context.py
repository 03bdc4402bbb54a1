"""Context parallelism (strategy.cp_size): the ranks of a context-parallel group run the same rows, each a slice
of every sequence, and compute the attention together as a ring (torch's `context_parallel`, as torchtitan uses it).

Around each micro batch's forward and backward, `split_sequences`:
- shifts the labels to each position's target first, since a slice's last position predicts the next slice's
  first token;
- gives the positions explicitly, so that each slice's rotary embeddings are those of its place in the sequence;
- drops the attention mask: padding is on the right, and a causal ring attends to no later position, so no real
  token sees it (its targets are IGNORE). The model's attention is causal sdpa without a mask, the call the ring
  takes (runner/engine/attention.py, set at placement);
- splits input ids, positions and targets in place, each rank taking a slice from each end of the sequence, which
  balances the causal attention's work (torch's head-tail load balancer);
- swaps SDPA for the ring inside the block: only the flash, memory-efficient and cuDNN kernels have one (CUDA);
- sums the slices' losses over the group, differentiably, so that every rank of it holds the row's whole loss and
  counts like a tensor-parallel rank (its backward gives each slice the gradient of the whole).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Iterator, Optional

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from runner.data.batches import MicroBatch

WholeLoss = Callable[["torch.Tensor"], "torch.Tensor"]


@contextlib.contextmanager
def split_sequences(mesh: Optional[DeviceMesh], micro_batch: MicroBatch) -> Iterator[tuple[MicroBatch, WholeLoss]]:
    """This rank's slices of the micro batch, and the function that makes its summed loss the rows' whole one;
    without a context-parallel mesh, the micro batch itself."""
    if mesh is None:
        yield micro_batch, lambda loss: loss
        return
    import torch
    import torch.distributed.nn.functional as distributed
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from runner.data.batches import shifted

    input_ids = micro_batch.inputs["input_ids"].clone()
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids).contiguous()
    targets = shifted(micro_batch.labels).contiguous()
    buffers = [input_ids, positions, targets]
    ring_kernels = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    with sdpa_kernel(ring_kernels), context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1],
                                                     no_restore_buffers=set(buffers)):
        sliced = replace(micro_batch, inputs={"input_ids": input_ids, "position_ids": positions}, labels=targets,
                         labels_shifted=True)
        yield sliced, lambda loss: distributed.all_reduce(loss, group=mesh.get_group())
