"""The job's layout: its processes as a device mesh with named dimensions, outermost first (torchtitan's
`ParallelDims`, and its order):

    pp             pipeline stages: each holds a slice of the layers, the activations pass from one to the next
    dp_replicate   data-parallel replicas (HYBRID_SHARD's groups, NO_SHARD's and DDP's ranks)
    dp_shard       data-parallel shards (FULL_SHARD's ranks, DeepSpeed's)
    cp             context-parallel ranks: each runs a slice of every sequence of its rows (FSDP's ring, which
                   shards over dp_shard x cp as torchtitan's dp_shard_cp; DeepSpeed's Ulysses, which ZeRO partitions
                   over too)
    tp             tensor-parallel ranks: each holds a part of every block, all of them run the same rows
    ep             expert-parallel ranks, borrowed from dp_shard (torchtitan's): each holds 1/ep of every MoE layer's
                   experts, and the tokens travel to their experts and back by an all-to-all; FSDP shards the
                   experts over the rest of dp_shard (dp_shard_mod_ep) and everything else over the whole of it

A global batch is split over the data-parallel ranks, dp_replicate x dp_shard of them (torchtitan's "batch"
dimension); every stage of a pipeline, and every rank of a context-parallel group, runs the same rows. Consecutive
ranks share a tensor-parallel group, so that a group sits within one node, where its all-gathers at every layer are
fastest; a pipeline's stages, which exchange only activations, may sit on different nodes.

torch is imported inside the methods: the command line answers `--help` and `--cfg` without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Optional

from runner.distributed import groups_wait_as_long_as_the_world

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class ParallelDims:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # a divisor of dp_shard, not a dimension of its own: the world is the product of the others
    # The pipeline stages each pp rank runs (2 under an interleaved schedule: rank r runs stages r and r + pp).
    stages_per_rank: int = 1
    _mesh: Optional[Any] = field(default=None, init=False, repr=False, compare=False)
    _experts_view: Optional[Any] = field(default=None, init=False, repr=False, compare=False)

    names: ClassVar[tuple[str, ...]] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp_size(self) -> int:
        """The data-parallel ranks, which split each global batch."""
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, rank: int) -> int:
        """A rank's place along the batch dimension: which part of each global batch it runs."""
        return rank // (self.cp * self.tp) % self.dp_size

    def pp_rank(self, rank: int) -> int:
        """A rank's pipeline stage (its first, where it holds several)."""
        return rank // (self.dp_size * self.cp * self.tp)

    def counted(self, rank: int) -> bool:
        """Whether a rank's shares count in sums over the data-parallel ranks: one rank of each tensor- and
        context-parallel group, whose others repeat its rows and its loss (a context-parallel group sums its
        slices' losses first), on the last pipeline stage, which has the loss."""
        return rank % (self.cp * self.tp) == 0 and self.pp_rank(rank) == self.pp - 1

    def mesh(self, device_type: str) -> DeviceMesh:
        """The device mesh over every process, built once (its process groups are made on the first call)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=self.names)
            if self.cp > 1:
                self._mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
            groups_wait_as_long_as_the_world(device_type)
        return self._mesh

    def experts_view(self, device_type: str) -> DeviceMesh:
        """The mesh with dp_shard seen as dp_shard_mod_ep x ep (consecutive ranks an expert-parallel group), built
        once: the experts' dimensions are sliced from it."""
        if self._experts_view is None:
            sizes = (self.dp_shard // self.ep, self.ep)
            self._experts_view = self.mesh(device_type)._unflatten("dp_shard", sizes, ("dp_shard_mod_ep", "ep"))
            groups_wait_as_long_as_the_world(device_type)
        return self._experts_view

    def sharding_mesh(self, device_type: str) -> DeviceMesh:
        """The dimensions FSDP shards and replicates over: dp_replicate x dp_shard, with cp folded into the
        shards (each context-parallel rank computes gradients of every parameter, for its slices)."""
        mesh = self.mesh(device_type)
        return mesh["dp_replicate", "dp_shard_cp" if self.cp > 1 else "dp_shard"]

    def experts_mesh(self, device_type: str) -> DeviceMesh:
        """The dimensions FSDP shards and replicates the experts over: dp_replicate x dp_shard_mod_ep (each
        expert-parallel rank's experts are its own, and only the ranks at its place in the other groups share them)."""
        return self.experts_view(device_type)["dp_replicate", "dp_shard_mod_ep"]

    def describe(self) -> str:
        shown = [
            (name, size) for name, size in zip(self.names, self.shape) if name not in ("pp", "cp", "tp") or size > 1
        ]
        described = f"mesh {' x '.join(str(size) for _, size in shown)} ({' x '.join(name for name, _ in shown)})"
        return described + (f", experts over ep {self.ep} of dp_shard" if self.ep > 1 else "")
