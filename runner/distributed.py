"""The distributed plumbing every layer shares: ranks, ports, cross-rank sums and maxima, plain CPU copies of tensors.

torch is imported inside the functions: the command line answers `--help` and `--cfg` without it.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1


def process_group_up() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def all_ranks_sums(values: list[float], counted: bool = True) -> list[float]:
    """The sums of several numbers over all ranks, in one collective (the numbers themselves in a single process).
    A rank that is not `counted` adds zeros: it repeats another's shares (a tensor-parallel group's other ranks)."""
    return _all_reduced(values, "SUM", counted)


def all_ranks_maxima(values: list[float]) -> list[float]:
    """The largest of each of several numbers over all ranks, in one collective (the numbers themselves in a single
    process); the least of x is minus the largest of -x."""
    return _all_reduced(values, "MAX")


def _all_reduced(values: list[float], op: str, counted: bool = True) -> list[float]:
    import torch
    import torch.distributed as dist

    if not process_group_up():
        return list(values)
    reduced = torch.tensor([float(value) * counted for value in values], dtype=torch.float64)
    dist.all_reduce(reduced, op=getattr(dist.ReduceOp, op))
    return reduced.tolist()


def summed_on_device(counts: list[int], device: torch.device, counted: bool = True) -> torch.Tensor:
    """The sums of several counts over all ranks, on the device, without the host waiting: copied there from pinned
    memory (on CUDA) and summed by the device's own collective (NCCL's on GPUs). A rank that is not `counted` adds
    zeros."""
    import torch
    import torch.distributed as dist

    host = torch.tensor([count * counted for count in counts], dtype=torch.int64)
    summed = (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)
    if process_group_up():
        dist.all_reduce(summed)
    return summed


def barrier() -> None:
    import torch.distributed as dist

    if process_group_up():
        dist.barrier()


def groups_wait_as_long_as_the_world(device_type: str) -> None:
    """torch gives a process group made after the world's (a device mesh's dimension, DeepSpeed's data-parallel
    group) its backend's default timeout, 30 minutes under gloo and 10 under NCCL, rather than the world's
    (train.collective_timeout_s): every group of this process gets the world's."""
    import torch
    from torch.distributed import distributed_c10d as c10d

    if not process_group_up():
        return
    world = c10d._get_default_group()
    timeout = world._get_backend(torch.device(device_type)).options._timeout
    for group in list(c10d._world.pg_map):
        if group is not world and not c10d._rank_not_in_group(group):
            c10d._set_pg_timeout(timeout, group)


def close_process_group() -> None:
    """Destroys the process group once the garbage of the rank's work is collected. A DDP model sits in a reference
    cycle after its run, and its reducer holds the group: left to a later collection (at the interpreter's exit,
    seen in a submitit task), gloo's destructor joins its threads holding the GIL while one of them waits for the
    GIL to free a finished collective's tensors, and the process never exits."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard, any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def gradient_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all the gradients, each DTensor's shards combined: one norm per device mesh (FSDP's, and the
    experts' under expert parallelism, whose DTensors cannot be stacked with the others), then the norm of those."""
    import torch

    if not grads:
        return torch.nn.utils.get_total_norm(grads)
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for grad in grads:
        by_mesh.setdefault(getattr(grad, "device_mesh", None), []).append(grad)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    return torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else norms[0]


def whole_on_cpu(state: dict[str, torch.Tensor], keep: bool) -> dict[str, torch.Tensor]:
    """Each tensor whole, a DTensor's shards gathered one tensor at a time (every rank of its mesh takes part), as
    a CPU copy where `keep`; empty elsewhere."""
    whole = {}
    for name, tensor in state.items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        if keep:
            whole[name] = cpu_copy(full)
    return whole


def cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A plain, contiguous CPU copy: safetensors stores each tensor once (tied weights and views get their own
    copies), and a tensor subclass (torchao's float8 all-gather weights) becomes the plain tensor it wraps."""
    import torch

    return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor.detach())
