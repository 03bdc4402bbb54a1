"""Runs several specs in one group of real gloo worker processes, so that a test pays the process start once."""

import os
from pathlib import Path

from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from runner.launch import Ranks, free_port


def _train_each(specs, run_dirs):
    import torch.distributed as dist

    from runner.job import prepare_job
    from runner.train import train

    ranks = Ranks(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))
    dist.init_process_group("gloo")
    try:
        return [train(prepare_job(spec, Path(run_dir), ranks)) for spec, run_dir in zip(specs, run_dirs)]
    finally:
        dist.destroy_process_group()


def train_in_workers(specs, run_dirs, nproc):
    """Rank 0's summaries, one per spec, trained one after another by the same `nproc` worker processes."""
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, rdzv_backend="static",
        rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_configs={"rank": 0}, max_restarts=0, start_method="spawn",
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return elastic_launch(config, _train_each)(specs, [str(d) for d in run_dirs])[0]
