"""Multi-process jobs started by `run` itself: rank logs, failures that end the job, sweeps."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import QUICK, run_cli, run_dirs

pytestmark = pytest.mark.distributed

SHORT = [*QUICK, "train.max_steps=4", "train.log_every=2", "train.eval_every=0", "train.eval_batches=2",
         "train.micro_batch_size=4"]

def test_ddp_job_writes_one_run_directory_with_a_log_per_rank(workdir):
    result = run_cli("strategy=ddp", "hardware.nproc_per_node=2", *SHORT, cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    [run_dir] = run_dirs(workdir)
    assert (run_dir / ".hydra" / "config.yaml").exists()
    assert "global batch 8 = micro batch 4 x 2 data-parallel ranks x 1 accumulation steps" in result.stdout
    for rank in (0, 1):
        assert "step 4/4" in (run_dir / f"rank{rank}.log").read_text()
    assert "step 4/4" in (run_dir / "run.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_loss"] < summary["first_eval_loss"]
    model = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    assert model(torch.tensor([[5, 6, 7]])).logits.shape[-1] == model.config.vocab_size

def test_hybrid_shard_on_four_processes_trains_on_a_2x2_mesh(workdir):
    result = run_cli("strategy=fsdp", "strategy.sharding_strategy=HYBRID_SHARD", "strategy.hybrid_shard_size=2",
                     "hardware.nproc_per_node=4", *SHORT, "train.micro_batch_size=2", cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fsdp HYBRID_SHARD, 4 processes, mesh 2 x 2 (replicate x shard)" in result.stdout
    assert "done: train loss" in result.stdout

def test_a_worker_that_raises_ends_the_job_with_its_error_first(workdir):
    started = time.monotonic()
    # 4 query heads cannot share 3 key-value heads: the model builds (and validates), its first forward fails.
    result = run_cli("strategy=ddp", "hardware.nproc_per_node=2", *SHORT, "model.architecture.num_key_value_heads=3",
                     cwd=workdir)
    assert result.returncode != 0
    assert time.monotonic() - started < 120
    report = result.stderr[result.stderr.index("run: error: "):]
    assert report.startswith("run: error: rank ") and " failed: " in report.splitlines()[0]
    assert "must match the size of tensor b (3)" in report.splitlines()[0]
    assert "traceback" in report

def test_killing_one_rank_ends_the_job_within_30_seconds_and_leaves_no_process(workdir):
    job = subprocess.Popen([sys.executable, "-m", "runner", "strategy=ddp", "hardware.nproc_per_node=2", *QUICK,
                            "train.max_steps=500", "train.eval_every=0"],
                           cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        rank1 = None
        while time.monotonic() < deadline and rank1 is None:
            time.sleep(1)
            logs = list(workdir.glob("outputs/*/*/rank1.log"))
            if logs and "step 10/500" in logs[0].read_text():
                pid = int(re.search(r"rank 1 of 2, process (\d+)", logs[0].read_text()).group(1))
                rank1 = psutil.Process(pid)
        assert rank1 is not None, "rank 1 never got to step 10"
        workers = psutil.Process(job.pid).children(recursive=True)
        os.kill(rank1.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        job.wait(timeout=60)
        assert time.monotonic() - killed_at < 30
        assert job.returncode != 0
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive
        assert "rank 1 failed" in job.stderr.read()
    finally:
        if job.poll() is None:
            job.kill()

def test_sweep_runs_each_job_worker_group_in_turn(workdir):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    result = run_cli("-m", "strategy=ddp,fsdp", "hardware.nproc_per_node=2", *SHORT, cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = sorted(workdir.glob("outputs/multirun/*/*/*/summary.json"))
    assert len(summaries) == 2
    assert all(json.loads(s.read_text())["steps"] == 4 for s in summaries)
    assert not [p for p in psutil.Process().children(recursive=True) if p.pid not in before]


def test_two_nodes_meet_at_the_rendezvous_endpoint(tmp_path):
    """Two `run` processes, as on two machines, form one job of two nodes through a static rendezvous."""
    from runner.distributed import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [tmp_path / f"node{rank}" for rank in (0, 1)]
    jobs = []
    for rank, node in enumerate(nodes):
        node.mkdir()
        if rank:
            time.sleep(2)  # as on two machines, started apart: their run directories are named by other seconds
        jobs.append(subprocess.Popen(
            [sys.executable, "-m", "runner", "strategy=fsdp", "hardware.nnodes=2", "hardware.nproc_per_node=1",
             f"hardware.node_rank={rank}", f"hardware.rdzv_endpoint={endpoint}", *SHORT, "train.micro_batch_size=2"],
            cwd=node, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outputs = [job.communicate(timeout=300) for job in jobs]
    finally:
        for job in jobs:
            job.kill()  # if they still wait for each other: no process outlives the test
    assert [job.returncode for job in jobs] == [0, 0], outputs[1][1][-2000:]
    assert "fsdp FULL_SHARD, 2 processes" in outputs[0][0]
    [node0_run] = run_dirs(nodes[0])
    [node1_run] = run_dirs(nodes[1])
    assert node0_run.name != node1_run.name
    assert (node0_run / "summary.json").exists() and (node0_run / "model").is_dir()
    assert "step 4/4" in (node1_run / "rank1.log").read_text()


def test_a_rank_that_waits_on_a_stopped_rank_says_where_it_waits(workdir):
    """Rank 1 stopped (SIGSTOP) mid-run: rank 0 waits in a collective and, after train.stall_report_s, says so with
    its stack; once rank 1 goes on, the job ends as usual."""
    job = subprocess.Popen([sys.executable, "-m", "runner", "strategy=ddp", "hardware.nproc_per_node=2", *QUICK,
                            "train.max_steps=100", "train.log_every=1", "train.eval_every=0", "train.save_model=false",
                            "train.stall_report_s=2"],
                           cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        rank1 = None
        while time.monotonic() < deadline and rank1 is None and job.poll() is None:
            time.sleep(0.2)
            logs = list(workdir.glob("outputs/*/*/rank1.log"))
            if logs and "step 3/100" in logs[0].read_text():
                rank1 = int(re.search(r"rank 1 of 2, process (\d+)", logs[0].read_text()).group(1))
        assert rank1 is not None, "rank 1 never got to step 3"
        os.kill(rank1, signal.SIGSTOP)
        [run_dir] = run_dirs(workdir)
        stalls = run_dir / "stalls_rank0.txt"
        while time.monotonic() < deadline and not stalls.exists():
            time.sleep(0.5)
        time.sleep(1)
        os.kill(rank1, signal.SIGCONT)
        stdout, stderr = job.communicate(timeout=120)
        assert job.returncode == 0, stderr[-3000:]
        assert re.search(r"rank 0: no progress for \d+ s, in step \d+; where each thread waits: .*stalls_rank0.txt",
                         stdout)
        stacks = stalls.read_text()
        assert "== rank 0, in step" in stacks and "(most recent call first)" in stacks and "loop.py" in stacks
    finally:
        if job.poll() is None:
            job.kill()
