"""Multi-process jobs started by `run` itself: rank logs, failures that end the job, sweeps."""

import json
import os
import re
import signal
import socket
import time

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM

from runner.distributed import close_process_group
from runner.parallel.dims import ParallelDims
from runner.processes.launch import LOST_PEER
from tests.support.command import Started, run_cli, start_cli
from tests.support.runs import run_dirs, step_losses, wait_until
from tests.support.specs import QUICK, resolved_spec
from tests.support.workers import run_in_workers

pytestmark = pytest.mark.distributed

SHORT = [
    *QUICK,
    "train.max_steps=4",
    "train.log_every=2",
    "train.eval_every=0",
    "train.eval_batches=2",
    "train.micro_batch_size=4",
]


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


def _models_left_after_closing(ranks, spec, run_dir):
    import gc

    spec.task.run(spec, run_dir, ranks, None)  # its DDP model, whose reducer holds the group, left in a cycle
    close_process_group()
    return [type(o).__name__ for o in gc.get_objects() if isinstance(o, torch.nn.parallel.DistributedDataParallel)]


def test_a_ranks_models_are_gone_before_its_process_group_is_destroyed(tmp_path):
    """Left to a later collection, a DDP model's reducer would destroy the group at the interpreter's exit, where
    gloo's destructor can deadlock with its own threads (runner/distributed.py, close_process_group)."""
    spec = resolved_spec(
        [*SHORT, "strategy=ddp", "hardware.nproc_per_node=2", "train.max_steps=2", "train.save_model=false"]
    )
    assert run_in_workers(_models_left_after_closing, spec, tmp_path, nproc=2) == [[], []]


def test_hybrid_shard_on_four_processes_trains_on_a_2x2_mesh(workdir):
    result = run_cli(
        "strategy=fsdp",
        "strategy.sharding_strategy=HYBRID_SHARD",
        "strategy.hybrid_shard_size=2",
        "hardware.nproc_per_node=4",
        *SHORT,
        "train.micro_batch_size=2",
        cwd=workdir,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fsdp HYBRID_SHARD, 4 processes, mesh 2 x 2 (dp_replicate x dp_shard)" in result.stdout
    assert "done: train loss" in result.stdout


def test_a_worker_that_raises_ends_the_job_with_its_error_first(workdir):
    started = time.monotonic()
    # 4 query heads cannot share 3 key-value heads: the model builds (and validates), its first forward fails.
    result = run_cli(
        "strategy=ddp", "hardware.nproc_per_node=2", *SHORT, "model.architecture.num_key_value_heads=3", cwd=workdir
    )
    assert result.returncode != 0
    assert time.monotonic() - started < 120
    report = result.stderr[result.stderr.index("run: error: ") :]
    assert report.startswith("run: error: rank ") and " failed: " in report.splitlines()[0]
    assert "must match the size of tensor b (3)" in report.splitlines()[0]
    assert "traceback" in report


def rank_pid(log_glob: str, cwd, rank: int, step: str) -> int:
    """The process of `rank`, from its rank log, once that log shows `step` (such as "step 10/500")."""

    def found():
        logs = list(cwd.glob(log_glob))
        return logs and step in logs[0].read_text() and logs[0]

    log = wait_until(found, f"rank {rank} at {step}")
    return int(re.search(rf"rank {rank} of \d+, process (\d+)", log.read_text()).group(1))


@pytest.mark.signals
def test_killing_one_rank_ends_the_job_within_30_seconds_and_leaves_no_process(workdir):
    job = start_cli(
        "strategy=ddp",
        "hardware.nproc_per_node=2",
        *QUICK,
        "train.max_steps=500",
        "train.eval_every=0",
        cwd=workdir,
        new_session=True,
    )
    try:
        rank1 = psutil.Process(rank_pid("outputs/*/*/rank1.log", workdir, 1, "step 10/500"))
        workers = psutil.Process(job.pid).children(recursive=True)
        os.kill(rank1.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        job.wait(timeout=60)
        assert time.monotonic() - killed_at < 30
        assert job.returncode != 0
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive
        # torch reports one failure of a group when several workers end within one poll: rank 1's kill, or rank 0's
        # lost connection to it (then the first line says so); test_a_rank_that_lost_its_peer_... covers both.
        first_line = job.stderr()[job.stderr().index("run: error: ") :].splitlines()[0]
        assert first_line.startswith("run: error: rank 1 failed: Signal 9 (SIGKILL)") or (
            first_line.startswith("run: error: rank 0 failed: ") and re.search(LOST_PEER, first_line)
        ), first_line
    finally:
        job.kill()


def test_a_rank_that_lost_its_peer_is_not_reported_as_the_cause(tmp_path, monkeypatch):
    """Rank 1 killed, rank 0 failing on the closed connection within the same second: torch's first failure may be
    either; the report names rank 1."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

    from runner.config.hardware import HardwareConfig
    from runner.processes.launch import failures_report

    error_file = tmp_path / "rank0.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        raise RuntimeError(
            "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:41822: "
            "Connection reset by peer"
        )
    except RuntimeError as lost:
        ErrorHandler().record_exception(lost)
    rank0 = ProcessFailure(local_rank=0, pid=101, exitcode=1, error_file=str(error_file))
    rank1 = ProcessFailure(local_rank=1, pid=102, exitcode=-9, error_file=str(tmp_path / "none.json"))
    rank1.timestamp = rank0.timestamp
    error = ChildFailedError("worker", {0: rank0, 1: rank1})
    assert failures_report(error, HardwareConfig(nproc_per_node=2), tmp_path) == (
        f"rank 1 failed: Signal 9 (SIGKILL) received by PID 102 (see {tmp_path / 'rank1.log'})"
    )


@pytest.mark.signals
def test_a_collective_that_a_rank_never_joins_ends_the_job_in_one_line_after_the_timeout(workdir):
    """Rank 1 stopped (SIGSTOP) mid-run: rank 0 waits in a collective and, after train.stall_report_s, says so with
    its stack; after train.collective_timeout_s the job ends in one line naming the rank, its step and the
    collective, with where its threads waited and torch's record of its collectives; the traceback goes to the
    rank's log. The launcher's report of a rank that NCCL's watchdog ends (SIGABRT, once the rank's record is
    written) reads the same record and stall reports."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from runner.processes.launch import failure_report

    job = start_cli(
        "strategy=ddp",
        "hardware.nproc_per_node=2",
        *QUICK,
        "train.max_steps=500",
        "train.log_every=1",
        "train.eval_every=0",
        "train.save_model=false",
        "train.stall_report_s=2",
        "train.collective_timeout_s=6",
        cwd=workdir,
        new_session=True,
    )
    try:
        rank0 = psutil.Process(rank_pid("outputs/*/*/rank0.log", workdir, 0, "step 3/500"))
        rank1 = psutil.Process(rank_pid("outputs/*/*/rank1.log", workdir, 1, "step 3/500"))
        rank1.suspend()
        rank0.wait(timeout=120)
        wait_until(
            lambda: re.search(
                rf"a rank failed; process {rank1.pid}, another rank of this node, is still "
                r"running: ending it \(SIGTERM, then SIGKILL after 30 s\)",
                job.stdout(),
            ),
            "the launcher's word that it ends rank 1",
            job,
        )
        rank1.resume()  # the launcher's SIGTERM ends it now, rather than its SIGKILL in 30 s
        job.wait(timeout=120)
        [run_dir] = run_dirs(workdir)
        waited = (
            r"rank 0 waited 6 s in a collective that another rank did not join, (in step \d+): (gloo:\w+ #\d+ "
            r"of group default_pg, \w+ \[[\d, ]*\]); the process group's timeout \(train.collective_timeout_s\) "
            rf"ended it; where each thread waited: {run_dir}/stalls_rank0.txt; torch's record of the rank's "
            rf"collectives: {run_dir}/flight_recorder_rank0"
        )
        assert job.returncode == 1
        lines = job.stderr().splitlines()
        assert len(lines) == 1, job.stderr()
        told = re.fullmatch(f"run: error: {waited}", lines[0])
        assert told, lines[0]
        assert re.search("Timed out waiting 6000ms|Application timeout", (run_dir / "rank0.log").read_text())
        stall = rf"rank 0: no progress for \d+ s, in step \d+; where each thread waits: {run_dir}/stalls_rank0.txt"
        assert re.search(stall, job.stdout())
        stacks = (run_dir / "stalls_rank0.txt").read_text()
        assert "== rank 0, in step" in stacks and "(most recent call first)" in stacks and "loop.py" in stacks

        aborted = ProcessFailure(local_rank=0, pid=101, exitcode=-6, error_file=str(run_dir / "none.json"))
        report = failure_report(0, aborted, run_dir / "rank0.log")
        nccl = re.fullmatch(
            rf"rank 0 failed: Signal 6 \(SIGABRT\) received by PID 101, after it "
            rf"{waited.removeprefix('rank 0 ')} \(see {run_dir}/rank0.log\)",
            report,
        )
        assert nccl and nccl.group(2) == told.group(2), report
        assert nccl.group(1) == told.group(1) or "no progress" not in (run_dir / "stalls_rank0.txt").read_text()
    finally:
        job.kill()


def test_every_group_waits_as_long_as_the_worlds():
    """torch gives the groups made after the world's (a device mesh's dimensions, DeepSpeed's ZeRO group) its own
    default timeout, 30 minutes under gloo; the runner gives them the world's, train.collective_timeout_s."""
    spec = resolved_spec(["strategy=deepspeed", "strategy.zero_stage=2", "hardware.nproc_per_node=2"])
    for with_the_mesh, with_deepspeed, timeouts in run_in_workers(_group_timeouts, spec, nproc=2):
        assert with_deepspeed > with_the_mesh > 1 and timeouts == {77.0}, (with_the_mesh, with_deepspeed, timeouts)


def _group_timeouts(ranks, spec):
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    from runner.strategies.deepspeed_engine import initialized

    c10d._set_pg_timeout(timedelta(seconds=77))
    ParallelDims(dp_shard=2).mesh("cpu")
    with_the_mesh = len(c10d._world.pg_map)
    model = torch.nn.Linear(8, 8)
    initialized(model, torch.optim.AdamW(model.parameters()), spec, sp_size=1)
    groups = list(c10d._world.pg_map)
    return (
        with_the_mesh,
        len(groups),
        {group._get_backend(torch.device("cpu")).options._timeout.total_seconds() for group in groups},
    )


def test_sweep_runs_each_job_worker_group_in_turn(workdir):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    result = run_cli("-m", "strategy=ddp,fsdp", "hardware.nproc_per_node=2", *SHORT, cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = sorted(workdir.glob("outputs/multirun/*/*/*/summary.json"))
    assert len(summaries) == 2
    assert all(json.loads(s.read_text())["steps"] == 4 for s in summaries)
    assert not [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    # The workers, which outlive their `run` only as orphans of another parent, ended too.
    workers = [
        int(pid)
        for log in workdir.glob("outputs/multirun/*/*/*/rank*.log")
        for pid in re.findall(r"rank \d of 2, process (\d+)", log.read_text())
    ]
    assert len(workers) == 4 and not [pid for pid in workers if psutil.pid_exists(pid)]


TWO_NODE_JOB = ["strategy=fsdp", *SHORT, "train.micro_batch_size=2", "train.log_every=1"]


def start_node(rank: int, endpoint: str, cwd, *overrides: str) -> Started:
    """`run` as node `rank` of a job of two nodes with one process each."""
    return start_cli(
        "hardware.nnodes=2",
        "hardware.nproc_per_node=1",
        f"hardware.node_rank={rank}",
        f"hardware.rdzv_endpoint={endpoint}",
        *overrides,
        cwd=cwd,
        new_session=True,
    )


def first_error(stderr: str) -> str:
    return stderr[stderr.index("run: error: ") :].splitlines()[0]


def test_two_nodes_train_as_the_same_job_on_one_node(tmp_path):
    """Two `run` processes, as on two machines, form one job of two nodes through a static rendezvous: started 2 s
    apart (their run directories are named by other seconds), node 0 naming its host localhost, node 1 127.0.0.1.
    The job's losses are those of its two processes on one node, to the bit."""
    from runner.distributed import free_port

    port = free_port()
    jobs = []
    for rank, host in enumerate(("localhost", "127.0.0.1")):
        if rank:
            time.sleep(2)
        jobs.append(start_node(rank, f"{host}:{port}", tmp_path / f"node{rank}", *TWO_NODE_JOB))
    try:
        outputs = [job.communicate(timeout=300) for job in jobs]
    finally:
        for job in jobs:
            job.kill()  # if they still wait for each other: no process outlives the test
    assert [job.returncode for job in jobs] == [0, 0], outputs[1][1][-2000:]
    assert "fsdp FULL_SHARD, 2 processes" in outputs[0][0]
    for rank, (stdout, _) in enumerate(outputs):
        assert (
            f"node {rank} of 2: waiting up to 900 s (hardware.rdzv_timeout_s) for the job's 2 nodes at the rendezvous"
        ) in stdout
    assert (
        outputs[1][0]
        .strip()
        .splitlines()[-1]
        .endswith("node 1 of 2: this node's ranks (1) finished; the job's outputs are in node 0's run directory")
    )
    [node0_run] = run_dirs(tmp_path / "node0")
    [node1_run] = run_dirs(tmp_path / "node1")
    assert node0_run.name != node1_run.name
    assert (node0_run / "summary.json").exists() and (node0_run / "model").is_dir()
    assert "step 4/4" in (node1_run / "rank1.log").read_text()

    (tmp_path / "one_node").mkdir()
    one_node = run_cli(*TWO_NODE_JOB, "hardware.nproc_per_node=2", cwd=tmp_path / "one_node")
    assert one_node.returncode == 0, one_node.stderr[-3000:]
    [one_node_run] = run_dirs(tmp_path / "one_node")
    assert len(step_losses(node0_run)) == 4
    assert step_losses(node0_run) == step_losses(one_node_run)


@pytest.mark.signals
@pytest.mark.parametrize("killed", ["run process and worker", "run process"])
def test_a_node_that_dies_ends_the_other_within_30_seconds_and_leaves_no_process(tmp_path, killed):
    """Node 1 killed mid-training, its worker with it or (its run process alone) left to notice: node 0 ends
    within 30 s, its first error line naming node 1, and no process of either node is left."""
    from runner.distributed import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    job = [
        "strategy=fsdp",
        *QUICK,
        "train.max_steps=500",
        "train.log_every=1",
        "train.eval_every=0",
        "train.micro_batch_size=2",
    ]
    node0, node1 = (start_node(rank, endpoint, tmp_path / f"node{rank}", *job) for rank in (0, 1))
    try:
        worker = rank_pid("node1/outputs/*/*/rank1.log", tmp_path, 1, "step 3/500")
        [log] = tmp_path.glob("node1/outputs/*/*/rank1.log")
        processes = [psutil.Process(node.pid) for node in (node0, node1)]
        processes += [child for process in list(processes) for child in process.children(recursive=True)]
        os.kill(node1.pid, signal.SIGKILL)
        if killed == "run process and worker":
            os.kill(worker, signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = node0.communicate(timeout=60)
        assert time.monotonic() - killed_at < 30
        assert node0.returncode != 0
        assert first_error(stderr).startswith(
            "run: error: node 1 left the job: rank 0 on this node lost its connection to it ("
        ), stderr[-3000:]
        _, alive = psutil.wait_procs(processes, timeout=10)
        assert not alive
        if killed == "run process":
            assert re.search(r"rank 1: this node's run process \(\d+\) ended; leaving the job", log.read_text())
    finally:
        for node in (node0, node1):
            node.kill()


def test_a_node_whose_peers_never_come_ends_after_the_rendezvous_timeout(tmp_path):
    """Node 0 without node 1, and node 1 without node 0 (each alone at its own endpoint): each says once what it
    waits for, then ends after hardware.rdzv_timeout_s with one line naming the endpoint and what did not come."""
    from runner.distributed import free_port

    # Node 1's node 0 never comes: its port stays bound here, without a listener, so that no process of another
    # test (a gloo connection, say) listens there instead.
    absent = socket.socket()
    absent.bind(("127.0.0.1", 0))
    endpoints = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{absent.getsockname()[1]}"]
    started = time.monotonic()
    nodes = [
        start_node(
            rank, endpoints[rank], tmp_path / f"node{rank}", "strategy=fsdp", *SHORT, "hardware.rdzv_timeout_s=3"
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=120) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
        absent.close()
    assert time.monotonic() - started < 90  # starting, reading the data, 3 s at the rendezvous
    for rank, (stdout, stderr) in enumerate(outputs):
        assert nodes[rank].returncode != 0
        assert stdout.count("waiting up to") == 1
        assert (
            f"node {rank} of 2: waiting up to 3 s (hardware.rdzv_timeout_s) for the job's 2 nodes at the "
            f"rendezvous {endpoints[rank]}, then starting 1 worker processes on this node"
        ) in stdout
        assert "frame #" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    for rank, awaited in enumerate(("the other nodes", "node 0")):
        assert first_error(outputs[rank][1]).startswith(
            f"run: error: node {rank} of 2: the job's nodes did not meet at the rendezvous {endpoints[rank]}, where "
            f"this node waits up to 3 s (hardware.rdzv_timeout_s) for {awaited}: "
        )
    assert "1/2 clients joined" in first_error(outputs[0][1])


@pytest.mark.signals
def test_a_rank_stuck_before_the_first_step_says_where_it_waits(workdir):
    """Rank 1 stopped (SIGSTOP) as soon as it starts: rank 0 waits for it in the process group's meeting or in a
    collective of the model's placement, and after train.stall_report_s says which, with its stack, rather than
    waiting in silence; once rank 1 goes on, the job ends as usual."""
    job = start_cli(
        "strategy=fsdp",
        "hardware.nproc_per_node=2",
        *QUICK,
        "train.max_steps=2",
        "train.eval_every=0",
        "train.save_model=false",
        "train.stall_report_s=2",
        cwd=workdir,
        new_session=True,
    )
    try:
        rank1 = rank_pid("outputs/*/*/rank1.log", workdir, 1, "rank 1 of 2")
        os.kill(rank1, signal.SIGSTOP)
        [run_dir] = run_dirs(workdir)
        stalls = run_dir / "stalls_rank0.txt"
        reported = (
            r"rank 0: no progress for \d+ s, (joining the process group|preparing the job: its data, the "
            r"model's placement); where each thread waits: .*stalls_rank0.txt"
        )
        wait_until(
            lambda: stalls.exists() and re.search(reported, job.stdout() + (run_dir / "rank0.log").read_text()),
            "rank 0's report of the wait before the first step",
            job,
        )
        os.kill(rank1, signal.SIGCONT)
        stdout, stderr = job.communicate(timeout=120)
        assert job.returncode == 0, stderr[-3000:]
        assert "(most recent call first)" in stalls.read_text()
    finally:
        job.kill()
