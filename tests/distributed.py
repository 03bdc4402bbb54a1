"""Runs a function in a group of real gloo worker processes, so that a test pays the process start once."""

import os
from pathlib import Path

from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from runner.distributed import Ranks, free_port


def _in_process_group(fn, args):
    import torch.distributed as dist

    ranks = Ranks(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))
    dist.init_process_group("gloo")
    try:
        return fn(ranks, *args)
    finally:
        dist.destroy_process_group()


def run_in_workers(fn, *args, nproc: int) -> list:
    """fn(ranks, *args) in each of `nproc` worker processes; the results in rank order.

    `fn` must be importable (a module-level function), as the workers are spawned.
    """
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, rdzv_backend="static", run_id="test",
        rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_configs={"rank": 0}, max_restarts=0, start_method="spawn",
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = elastic_launch(config, _in_process_group)(fn, args)
    return [results[rank] for rank in range(nproc)]


def _train_each(ranks, specs, run_dirs):
    from runner.engine.job import prepare_job
    from runner.engine.loop import train

    return [train(prepare_job(spec, Path(run_dir), ranks)) for spec, run_dir in zip(specs, run_dirs)]


def train_in_workers(specs, run_dirs: list[Path], nproc: int = 2) -> list[dict]:
    """Each spec trained in turn into its run directory (made if missing) by one group of `nproc` worker processes;
    rank 0's summaries."""
    for run_dir in run_dirs:
        run_dir.mkdir(parents=True, exist_ok=True)
    return run_in_workers(_train_each, specs, [str(d) for d in run_dirs], nproc=nproc)[0]
