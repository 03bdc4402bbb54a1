"""Groups of worker processes: a function, or a spec's training, in each rank of one gloo group, each worker forked
from the warm forkserver (warm.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.support.warm import warm_processes


def _in_process_group(fn, args):
    import torch
    import torch.distributed as dist

    from runner.distributed import Ranks, close_process_group

    ranks = Ranks(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))
    # The cores shared among the group, as `run` shares them among its workers.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // ranks.world_size))
    dist.init_process_group("gloo")
    try:
        return fn(ranks, *args)
    finally:
        if dist.is_initialized():  # fn may have closed it
            close_process_group()


def run_in_workers(fn, *args, nproc: int) -> list:
    """fn(ranks, *args) in each of `nproc` worker processes of one gloo group; the results in rank order.

    `fn` must be importable (a module-level function): the workers are forked from the warm forkserver.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from runner.distributed import free_port

    warm_processes()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        rdzv_backend="static",
        run_id="test",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"rank": 0},
        max_restarts=0,
        start_method="forkserver",
    )
    results = elastic_launch(config, _in_process_group)(fn, args)
    return [results[rank] for rank in range(nproc)]


def _train_each(ranks, specs, run_dirs):
    """Each spec's task (train, dpo) run into its run directory."""
    return [spec.task.run(spec, Path(run_dir), ranks, None) for spec, run_dir in zip(specs, run_dirs)]


def train_in_workers(specs, run_dirs: list[Path], nproc: int = 2) -> list[dict]:
    """Each spec trained in turn into its run directory (made if missing) by one group of `nproc` worker processes;
    rank 0's summaries."""
    for run_dir in run_dirs:
        run_dir.mkdir(parents=True, exist_ok=True)
    return run_in_workers(_train_each, specs, [str(d) for d in run_dirs], nproc=nproc)[0]
