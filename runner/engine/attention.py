"""The attention functions the runner gives transformers' models where their own would not do.

Packed rows where no kernel does variable-length attention: each example of a row attends causally to itself
alone, one example at a time. On GPUs, flash attention's variable-length kernel and flex attention's block mask
skip the attention between a row's examples; sdpa with transformers' block-diagonal mask computes it and masks it
out. On the CPU flex attention has no backward, and the block-diagonal mask costs the whole row's (seq_len x
seq_len) attention however short the examples are: one causal sdpa per example costs the sum of their squares
instead, with no mask to build.

Context parallelism: causal sdpa with no mask and the key-value heads repeated to the query heads, the call that
torch's ring takes (as torchtitan's attention makes it). transformers' own would read a slice's jump in positions
(0, 1, 6, 7) as packed sequences and build a mask, and pass grouped heads to sdpa on CUDA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch
    from torch import nn

NAME = "runner_packed_examples"
RING_NAME = "runner_causal_unmasked"


def attend_within_examples(model: nn.Module) -> None:
    """Makes the model's attention the per-example one. Its rows must carry position_ids restarting at 0 at each
    example, and no attention mask: packed rows (runner/data/pack.py)."""
    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    # torch.compile leaves it out of a compiled block: the examples' bounds are data, not shapes.
    AttentionInterface.register(NAME, torch.compiler.disable(per_example_attention))
    AttentionMaskInterface.register(NAME, no_mask)
    model.set_attn_implementation(NAME)


def attend_as_the_ring_takes_it(model: nn.Module) -> None:
    """Makes the model's attention causal sdpa without a mask, its key-value heads repeated (context parallelism:
    runner/parallel/context.py swaps that sdpa for torch's ring)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(RING_NAME, causal_unmasked_attention)
    AttentionMaskInterface.register(RING_NAME, no_mask)
    model.set_attn_implementation(RING_NAME)


def no_mask(*args, **kwargs) -> None:
    return None  # packed rows: the examples' bounds come from the position ids; the ring: causal over the row


def causal_unmasked_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                              scaling: Optional[float] = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface, as per_example_attention's, over the whole row."""
    import torch.nn.functional as F

    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    output = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True, scale=scaling)
    return output.transpose(1, 2).contiguous(), None


def per_example_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                          scaling: Optional[float] = None, position_ids: Optional[torch.Tensor] = None,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: query (batch, heads, seq, dim), key and value (batch, kv heads,
    seq, dim); the output (batch, seq, heads, dim)."""
    import torch
    import torch.nn.functional as F

    if position_ids is None or attention_mask is not None:
        raise ValueError("per-example attention takes packed rows: position_ids and no attention mask")
    rows = []
    for row in range(query.shape[0]):
        starts = (position_ids[row] == 0).nonzero().flatten().tolist() + [query.shape[2]]
        rows.append(torch.cat([
            F.scaled_dot_product_attention(query[row : row + 1, :, start:end], key[row : row + 1, :, start:end],
                                           value[row : row + 1, :, start:end], dropout_p=dropout, is_causal=True,
                                           scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
            for start, end in zip(starts, starts[1:])
        ], dim=2))
    return torch.cat(rows).transpose(1, 2).contiguous(), None
