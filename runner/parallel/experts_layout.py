"""Expert parallelism's layout rules (strategy.ep_size), without torch: validation asks them before launch, and
runner/parallel/experts.py runs the layout they allow.

The ep ranks are borrowed from FSDP's data-parallel shards, consecutive ranks one group, as torchtitan borrows them:
every rank still runs its own rows, and the experts of a MoE layer are split ep ways. The rest of the layout is
not composed with them yet (tensor, pipeline and context parallelism), and is refused in one line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runner.config.model import expert_count
from runner.errors import require

if TYPE_CHECKING:
    from runner.config.spec import RunSpec


def check_expert_parallel(strategy: Any, spec: RunSpec) -> None:
    """strategy=fsdp's expert parallelism (`strategy`: its schema), refused where it cannot run."""
    ep = strategy.ep_size
    require(ep >= 1, f"strategy.ep_size={ep} must be >= 1")
    if ep == 1:
        return
    key = f"strategy.ep_size={ep}"
    experts = expert_count(spec.model)
    model_type = spec.model.architecture.get("model_type") or spec.model.pretrained
    require(
        experts is not None,
        f"{key} splits a MoE model's experts, and model {model_type} has none (no num_experts, num_local_experts "
        "or n_routed_experts in its config); use strategy.ep_size=1",
    )
    require(
        experts % ep == 0,
        f"{key} does not divide the model's {experts} experts: each expert-parallel rank holds an equal share; pick "
        f"a divisor of {experts}",
    )
    for refused, why in (
        (strategy.tp_size > 1, f"strategy.tp_size={strategy.tp_size}: not composed yet"),
        (strategy.pp_size > 1, f"strategy.pp_size={strategy.pp_size}: not composed yet"),
        (strategy.cp_size > 1, f"strategy.cp_size={strategy.cp_size}: not composed yet"),
    ):
        require(not refused, f"{key} with {why}")
    shards = spec.layout.dp_shard
    require(
        shards % ep == 0,
        f"{key} borrows its ranks from FSDP's {shards} data-parallel shard(s) (sharding_strategy="
        f"{strategy.sharding_strategy.value}, {spec.hardware.world_size} processes), and does not divide them; pick "
        f"a divisor of {shards}" + (", or a sharding strategy that shards" if shards == 1 else ""),
    )
