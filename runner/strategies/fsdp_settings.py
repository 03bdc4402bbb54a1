"""strategy=fsdp's settings as its placement (fsdp_placement.py) and its memory terms (fsdp_memory.py) read them:
the values its keys take, in the vocabulary of FSDP1 and accelerate, and `FSDPSettings`, the keys those modules
read of the schema, runner/strategies/fsdp.py's FSDPStrategy (which calls them, so that they cannot name it)."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, List, Protocol

if TYPE_CHECKING:
    from runner.parallel.pipeline.layout import PipelineSchedule


class ShardingStrategy(str, Enum):
    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"
    HYBRID_SHARD_ZERO2 = "HYBRID_SHARD_ZERO2"

    @property
    def reshards_after_forward(self) -> bool:
        """ZeRO-3's way: free the gathered parameters after forward and gather them again for backward."""
        return self not in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.HYBRID_SHARD_ZERO2)

    @property
    def hybrid(self) -> bool:
        return self in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)


class AutoWrapPolicy(str, Enum):
    TRANSFORMER_BASED_WRAP = "TRANSFORMER_BASED_WRAP"
    SIZE_BASED_WRAP = "SIZE_BASED_WRAP"
    NO_WRAP = "NO_WRAP"


class StateDictType(str, Enum):
    FULL = "FULL"
    SHARDED = "SHARDED"


class FSDPSettings(Protocol):
    """The keys of strategy=fsdp that its placement and memory terms read (FSDPStrategy's fields, explained there)."""

    sharding_strategy: ShardingStrategy
    auto_wrap_policy: AutoWrapPolicy
    transformer_layer_cls: List[str]
    min_num_params: int
    offload_params: bool
    cpu_ram_efficient_loading: bool
    sync_module_states: bool
    forward_prefetch: int
    backward_prefetch: int
    tp_size: int
    async_tp: bool
    pp_size: int

    @property
    def pipeline_schedule(self) -> PipelineSchedule: ...
