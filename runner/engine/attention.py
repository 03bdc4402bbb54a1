"""The attention functions the runner gives transformers' models where their own would not do.

Packed rows where no kernel does variable-length attention: each example of a row attends causally to itself
alone, one example at a time. On GPUs, flash attention's variable-length kernel and flex attention's block mask
skip the attention between a row's examples; sdpa with transformers' block-diagonal mask computes it and masks it
out. On the CPU flex attention has no backward, and the block-diagonal mask costs the whole row's (seq_len x
seq_len) attention however short the examples are: one causal sdpa per example costs the sum of their squares
instead, with no mask to build.

Split sequences (context parallelism, Ulysses): the split's own attention (runner/parallel/sequence.py), with no
mask: a slice's positions are one sequence's, and the attention is causal over the whole row.

Other rows of a causal model's training and evaluation: its own kernel (sdpa, flash attention), causal, with no
mask built. Rows are padded on the right, and causal attention lets no real token see the padding, whose targets
are IGNORE: the mask would change no loss. Building it makes the host wait for the device at every forward
(transformers checks on the host whether a mask or the positions hold padding or packed examples).

Decoding on the trained model (GRPO's rollout, generated benchmark answers) takes left-padded prompts, whose
padding a real token would see: it runs under `own_attention`, the model's own kernel with its mask, and the swapped
one comes back after it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator, Optional
from weakref import WeakKeyDictionary

if TYPE_CHECKING:
    import torch
    from torch import nn

NAME = "runner_packed_examples"
# Each model's own kernel, from before the runner swapped it.
OWN_KERNELS: WeakKeyDictionary = WeakKeyDictionary()


def attend_within_examples(model: nn.Module) -> None:
    """Makes the model's attention the per-example one. Its rows must carry position_ids restarting at 0 at each
    example, and no attention mask: packed rows (runner/data/pack.py)."""
    import torch

    # torch.compile leaves it out of a compiled block: the examples' bounds are data, not shapes.
    attend_with(model, NAME, torch.compiler.disable(per_example_attention))


# The kernels that are causal by themselves when they are given no mask.
CAUSAL_WITHOUT_MASK = ("sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4")


def attend_causally_unmasked(model: nn.Module) -> None:
    """Makes a causal model's attention its own kernel under another name, for which transformers builds no mask;
    other models' attention stays as it is."""
    from transformers import AttentionInterface

    kernel = model.config._attn_implementation
    causal = model.can_generate() and not model.config.is_encoder_decoder
    if causal and kernel in CAUSAL_WITHOUT_MASK:
        attend_with(model, f"runner_unmasked_{kernel}", AttentionInterface._global_mapping[kernel])


def attend_with(model: nn.Module, name: str, attention: Callable) -> None:
    """Makes `attention` the model's, registered under `name`. transformers builds no mask for a name it has no mask
    function for, nor checks the positions for packed examples on the host: packed rows take the examples' bounds
    from their positions, split sequences are causal over the whole row."""
    from transformers import AttentionInterface

    OWN_KERNELS.setdefault(model, model.config._attn_implementation)
    AttentionInterface.register(name, attention)
    model.set_attn_implementation(name)


@contextmanager
def own_attention(model: nn.Module) -> Iterator[None]:
    """The model's own kernel, which masks what the attention mask masks, for the block; the runner's after it. A
    model whose kernel the runner never swapped keeps it."""
    swapped, own = model.config._attn_implementation, OWN_KERNELS.get(model)
    if own is None or own == swapped:
        yield
        return
    model.set_attn_implementation(own)
    try:
        yield
    finally:
        model.set_attn_implementation(swapped)


def per_example_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    position_ids: Optional[torch.Tensor] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: query (batch, heads, seq, dim), key and value (batch, kv heads,
    seq, dim); the output (batch, seq, heads, dim)."""
    import torch
    import torch.nn.functional as F

    if position_ids is None or attention_mask is not None:
        raise ValueError("per-example attention takes packed rows: position_ids and no attention mask")
    rows = []
    for row in range(query.shape[0]):
        starts = (position_ids[row] == 0).nonzero().flatten().tolist() + [query.shape[2]]
        rows.append(
            torch.cat(
                [
                    F.scaled_dot_product_attention(
                        query[row : row + 1, :, start:end],
                        key[row : row + 1, :, start:end],
                        value[row : row + 1, :, start:end],
                        dropout_p=dropout,
                        is_causal=True,
                        scale=scaling,
                        enable_gqa=query.shape[1] != key.shape[1],
                    )
                    for start, end in zip(starts, starts[1:])
                ],
                dim=2,
            )
        )
    return torch.cat(rows).transpose(1, 2).contiguous(), None
