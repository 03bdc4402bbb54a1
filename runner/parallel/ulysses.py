"""Ulysses sequence parallelism (DeepSpeed's strategy.sp_size, accelerate's `sp_backend: deepspeed`): the ranks of a
sequence-parallel group run the same rows, each a contiguous slice of every sequence. Around the attention,
DeepSpeed's `UlyssesSPAttentionHF` (its ALST) trades the slices for a share of the heads with one all-to-all, so
that each rank attends over whole sequences for heads / sp of the heads, and trades them back after: the rest of
every block sees its slice only. Its all-to-all runs on any backend (gloo too), so it trains on the CPU.

`sequence_parallel_group` makes DeepSpeed's groups (consecutive ranks, as ParallelDims lays out cp), which its
engine then reads (`deepspeed.initialize(mpu=...)`): ZeRO partitions over every rank. What it divides the summed
gradients by differs by stage (DeepSpeed 0.19): ZeRO-0, 1 and 2 by the data-parallel ranks alone, so a slice's
gradient must be its own share of the group's loss; ZeRO-3's reduce-scatter by every rank, so a slice's gradient
must be that of the group's whole loss, as FSDP's is under the ring (`whole_gradients`). Either way the whole loss's
value is the group's sum, what the step reports.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Optional

from runner.library_noise import deepspeed_setup
from runner.parallel.context import causal_unmasked_attention
from runner.parallel.sequence import AttentionFunction, WholeLoss, sliceable

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed import ProcessGroup

    from runner.data.batches import MicroBatch


def sequence_parallel_group(size: int) -> ProcessGroup:
    """This rank's sequence-parallel group of `size` consecutive ranks, made once per process with DeepSpeed's
    (deepspeed.runtime.sequence_parallel.parallel_state_sp, the `mpu` its engine takes)."""
    import deepspeed
    import torch.distributed as dist

    groups = deepspeed_groups()
    with deepspeed_setup():
        deepspeed.init_distributed(dist_backend=dist.get_backend())
    try:
        return groups.get_sequence_parallel_group()
    except AssertionError:  # not made yet
        groups.initialize_sequence_parallel(size)
        return groups.get_sequence_parallel_group()


def deepspeed_groups() -> Any:
    """DeepSpeed's sequence-parallel groups, as its engine takes them (`mpu`)."""
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as groups

    return groups


@dataclass
class UlyssesSplit:
    group: ProcessGroup
    # Whether each slice's gradient is that of the group's whole loss (the engine averages over every rank of the
    # group too), or that of its own share.
    whole_gradients: bool

    name: ClassVar[str] = "runner_ulysses"

    def attention(self, model: nn.Module, within_examples: Optional[AttentionFunction]) -> AttentionFunction:
        """DeepSpeed's Ulysses attention, one per micro batch size (it checks the shapes it is given against its
        batch size), around causal unmasked sdpa, or `within_examples` for packed rows: it gathers the slices'
        positions, so that the attention over whole rows sees where each example starts."""
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        config = model.config.get_text_config()
        head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        by_batch_size: dict[int, Any] = {}

        def attend(
            module: nn.Module,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: Any,
            *args: Any,
            **kwargs: Any,
        ) -> tuple[torch.Tensor, Any]:
            batch = query.shape[0]
            if batch not in by_batch_size:
                by_batch_size[batch] = UlyssesSPAttentionHF(
                    attn=within_examples or causal_unmasked_attention,
                    batch_size=batch,
                    attn_head_count=config.num_attention_heads,
                    attn_head_size=head_size,
                    kv_head_count=config.num_key_value_heads,
                    num_hidden_layers=config.num_hidden_layers,
                    process_group=self.group,
                    seq_length_is_variable=True,
                )
            return by_batch_size[batch](module, query, key, value, None, *args, **kwargs)

        return attend

    @contextlib.contextmanager
    def split(self, micro_batch: MicroBatch) -> Iterator[tuple[MicroBatch, WholeLoss]]:
        import torch.distributed as dist

        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        input_ids, positions, targets = sliceable(micro_batch, size)
        length = input_ids.shape[1] // size
        mine = slice(rank * length, (rank + 1) * length)
        yield (
            replace(
                micro_batch,
                inputs={"input_ids": input_ids[:, mine], "position_ids": positions[:, mine]},
                labels=targets[:, mine],
                labels_shifted=True,
            ),
            self.whole_loss,
        )

    def whole_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The group's summed loss as the value; the gradient of that sum, or of this slice's loss."""
        import torch.distributed as dist
        import torch.distributed.nn.functional as distributed

        if self.whole_gradients:
            return distributed.all_reduce(loss, group=self.group)
        total = loss.detach().clone()
        dist.all_reduce(total, group=self.group)
        return loss + (total - loss.detach())
