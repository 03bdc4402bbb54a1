"""Checkpoints and resume: a job killed at any step continues exactly where it stopped."""

import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runner.engine.job import prepare_job
from runner.engine.loop import train
from runner.errors import NonFiniteLoss
from runner.files.checkpoint_dirs import complete_checkpoints
from tests.support.command import run_cli, start_cli
from tests.support.runs import (
    deleted_files_mapped,
    hold_at_step,
    kill_at_step,
    logged,
    run_dirs,
    uninterrupted_losses,
    wait_until,
)
from tests.support.specs import QUICK, resolved_spec
from tests.support.workers import run_in_workers

STEPS = 12
TWO_RANKS = ["hardware.nproc_per_node=2", "train.grad_accum_steps=1"]
ONE_RANK = ["hardware.nproc_per_node=1", "train.grad_accum_steps=2"]  # the same global batch
ARGS = [
    *QUICK,
    f"train.max_steps={STEPS}",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=2",
    "train.micro_batch_size=2",
    "train.grad_accum_steps=2",
    "train.checkpoint_every=3",
]


def losses(run_dir: Path) -> dict[int, float]:
    return logged(run_dir, "loss")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return uninterrupted_losses(ARGS, tmp_path_factory)


@pytest.fixture(scope="module")
def uninterrupted_ddp(tmp_path_factory):
    return uninterrupted_losses([*ARGS, *TWO_RANKS, "strategy=ddp"], tmp_path_factory)


@pytest.mark.signals
def test_kill_and_resume_gives_the_same_losses(uninterrupted, tmp_path):
    run_dir = kill_at_step(ARGS, tmp_path, random.Random().randint(4, STEPS - 2))
    result = run_cli("resume=auto", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resuming from step" in result.stdout
    assert run_dirs(tmp_path) == [run_dir]  # continued in its own directory
    assert losses(run_dir) == uninterrupted  # exactly, step for step
    kept = sorted((run_dir / "checkpoints").glob("step_*"))
    assert len(kept) == 2  # train.keep_checkpoints
    assert json.loads((kept[-1] / "meta.json").read_text())["global_batch"] == 4  # 2 x 2 accumulation steps
    assert "global batch of" not in result.stderr


@pytest.mark.signals
def test_a_killed_run_keeps_its_best_checkpoint_and_value_across_the_resume(tmp_path):
    """train.keep_best=eval_loss with a learning rate whose eval loss is lowest at step 2 and higher after: killed at
    step 5 and resumed, the run still names step 2 the best (a best forgotten in the resume would take step 6's
    worse loss), keeps its checkpoint beside the last one, and reports what the uninterrupted run reports."""
    args = [
        *QUICK,
        "train.max_steps=8",
        "train.log_every=1",
        "train.eval_every=2",
        "train.eval_batches=1",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=1",
        "train.keep_best=eval_loss",
        "optim.lr=0.03",
        "scheduler=constant",
        "scheduler.warmup_steps=0",
        "train.save_model=false",
    ]
    (tmp_path / "uninterrupted").mkdir()
    uninterrupted = run_cli(*args, cwd=tmp_path / "uninterrupted")
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-2000:]
    [expected_dir] = run_dirs(tmp_path / "uninterrupted")
    expected = json.loads((expected_dir / "summary.json").read_text())["best"]
    evaluated = logged(expected_dir, "eval_loss")
    assert expected["step"] == 2 and min(evaluated[step] for step in (4, 6, 8)) > evaluated[2]  # what it tests
    run_dir = kill_at_step(args, tmp_path, 5)
    resumed = run_cli("resume=auto", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    best = json.loads((run_dir / "summary.json").read_text())["best"]
    assert (best["step"], best["value"]) == (expected["step"], expected["value"])
    assert best["checkpoint"] == str(run_dir / "checkpoints" / "step_00000002")
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000008"]


@pytest.mark.signals
def test_a_half_written_newest_checkpoint_is_skipped(uninterrupted, tmp_path):
    run_dir = kill_at_step(ARGS, tmp_path, 8)
    # The kill may also have left the next step's checkpoint half-written, as step_<N>.partial.
    newest = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if not p.name.endswith(".partial"))[-1]
    (newest / "meta.json").unlink()  # as if the disk filled up while it was written
    result = run_cli(f"resume={run_dir}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"skipping {newest}: it was not completely written" in result.stderr
    assert losses(run_dir) == uninterrupted


def test_tensors_read_from_a_checkpoint_are_the_process_s_own_memory(tmp_path):
    """read_tensors gives what safetensors wrote, in each dtype and shape, and no view of the file: once the file is
    deleted, the process maps nothing of it (its space is freed), and the tensors still hold their values."""
    import torch
    from safetensors.torch import save_file

    from runner.files.tensor_io import read_tensors

    path = tmp_path / "optimizer.safetensors"
    written = {
        "state/w/exp_avg": torch.randn(3, 5),
        "state/w/step": torch.tensor(7.0),
        "state/b/exp_avg": torch.randn(4).bfloat16(),
        "rng": torch.get_rng_state(),
        "mask": torch.tensor([True, False]),
        "empty": torch.zeros(0, 4),
    }
    save_file(written, path)
    read = read_tensors(path)
    of_w = read_tensors(path, {"w"}, lambda key: key.split("/")[1] if "/" in key else key)
    path.unlink()
    assert str(path) not in Path("/proc/self/maps").read_text()
    assert {key: (t.dtype, t.shape) for key, t in read.items()} == {
        key: (t.dtype, t.shape) for key, t in written.items()
    }
    assert all(torch.equal(read[key], written[key]) for key in written)
    assert sorted(of_w) == ["state/w/exp_avg", "state/w/step"]


def test_resume_that_names_nothing_resumable_is_one_line(tmp_path):
    result = run_cli("resume=auto", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == "run: error: resume=auto found no run with a complete checkpoint under outputs/"


@pytest.mark.parametrize("log_every", [1, 4])
def test_non_finite_loss_stops_the_run_naming_the_step(log_every, tmp_path):
    """Logging every 4th step, the losses of steps 5 and 6 stay on the device until step 6's checkpoint reads them:
    the run stops there, before writing it."""
    job = prepare_job(resolved_spec([*ARGS, f"train.log_every={log_every}"]), tmp_path)
    forwards = []

    def poison_from_step_5(module, args, output):
        forwards.append(1)
        if len(forwards) > 2 * 4 + 2:  # the eval's forwards, then 2 micro batches a step: step 5 on
            return output * float("nan")  # the forward returns the summed loss
        return output

    job.model.register_forward_hook(poison_from_step_5)
    with pytest.raises(NonFiniteLoss, match=r"the loss is nan at step 5; the last good checkpoint is .*step_00000003"):
        train(job)
    assert [path.name for path in complete_checkpoints(tmp_path)] == ["step_00000003"]


def _fsdp_checkpoint_files(ranks, spec, run_dir):
    summary = train(prepare_job(spec, Path(run_dir), ranks))
    return summary["steps"]


@pytest.mark.distributed
@pytest.mark.parametrize(
    "state_dict_type,files",
    [
        ("FULL", {"model.safetensors", "optimizer.safetensors"}),
        (
            "SHARDED",
            {
                f"{state}/shard-0000{rank}-model-00001-of-00001.safetensors"
                for state in ("model", "optimizer")
                for rank in (1, 2)
            },
        ),
    ],
)
def test_fsdp_state_dict_type_chooses_whole_or_per_rank_files(state_dict_type, files, tmp_path):
    spec = resolved_spec(
        [
            *ARGS,
            "train.max_steps=2",
            "strategy=fsdp",
            "hardware.nproc_per_node=2",
            f"strategy.state_dict_type={state_dict_type}",
            "train.save_model=false",
        ]
    )
    run_in_workers(_fsdp_checkpoint_files, spec, str(tmp_path), nproc=2)
    [checkpoint] = (tmp_path / "checkpoints").glob("step_*")
    written = {str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*.safetensors") if "rng" not in p.name}
    assert written == files
    assert {p.suffix for p in checkpoint.rglob("*") if p.is_file()} == {".safetensors", ".json"}  # nothing to unpickle


@pytest.mark.distributed
@pytest.mark.signals
@pytest.mark.parametrize(
    "strategy,resume_on,tolerance",
    [
        (["strategy=ddp"], TWO_RANKS, 0),
        (["strategy=fsdp", "strategy.state_dict_type=SHARDED"], TWO_RANKS, 1e-5),
        (["strategy=fsdp", "strategy.state_dict_type=FULL"], ONE_RANK, 1e-5),  # a FULL checkpoint reshards
        (["strategy=deepspeed", "strategy.zero_stage=2"], TWO_RANKS, 1e-5),
        (["strategy=deepspeed", "strategy.zero_stage=3", "strategy.offload_optimizer=cpu"], TWO_RANKS, 1e-5),
    ],
    ids=["ddp", "fsdp sharded", "fsdp full, resumed on one process", "deepspeed zero-2", "deepspeed zero-3 offload"],
)
def test_multi_process_kill_and_resume(strategy, resume_on, tolerance, uninterrupted, uninterrupted_ddp, tmp_path):
    """Exactly the losses of the same strategy uninterrupted (ddp), or within 1e-5 of one process (sharded). Once the
    checkpoint it resumed from is rotated out, no process of the resumed run maps a deleted file of the run: what it
    read from the checkpoint is its own memory, and the file's space is freed."""
    reference = uninterrupted_ddp if tolerance == 0 else uninterrupted
    run_dir = kill_at_step([*ARGS, *TWO_RANKS, *strategy], tmp_path, 4)
    job = start_cli("resume=auto", *resume_on, cwd=tmp_path, stop_at_step=10)
    try:
        hold_at_step(job, tmp_path)  # step 9's checkpoint written, step 3's (resumed from) rotated out
        assert not (run_dir / "checkpoints" / "step_00000003").exists()
        assert deleted_files_mapped(job.pid, run_dir) == {}
        job.resume()
        assert job.wait(timeout=300) == 0, job.stderr()[-2000:]
    finally:
        job.kill()
    resumed = losses(run_dir)
    assert sorted(resumed) == sorted(reference)
    for step, loss in reference.items():
        assert resumed[step] == pytest.approx(loss, rel=tolerance, abs=0)


@pytest.mark.parametrize(
    "layout,file,refusal",
    [
        ("engine", "zero.safetensors", "holds 2 ranks' shards (engine) and this run has 1 processes"),
        ("sharded", "model-rank0.safetensors", "holds SHARDED files of an earlier runner"),
    ],
    ids=["deepspeed's own, on another process count", "sharded, written before DCP"],
)
def test_a_checkpoint_that_cannot_move_is_refused_before_launch(layout, file, refusal, tmp_path):
    from runner.errors import SpecError

    checkpoint = tmp_path / "checkpoints" / "step_00000003"
    checkpoint.mkdir(parents=True)
    (checkpoint / file).write_bytes(b"")
    (checkpoint / "meta.json").write_text(
        json.dumps(
            {"step": 3, "world_size": 2, "layout": layout, "strategy": "deepspeed" if layout == "engine" else "fsdp"}
        )
    )
    strategy = "strategy=deepspeed" if layout == "engine" else "strategy=fsdp"
    with pytest.raises(SpecError, match=re.escape(refusal)):
        resolved_spec([*ARGS, strategy, f"resume={checkpoint}", "train.max_steps=6"])


@pytest.mark.slow
def test_a_resume_that_changes_the_global_batch_says_so(tmp_path, caplog):
    """A resume with another global batch than the checkpoint's run trains on other batches than that run's own:
    the run says so (a resume with the same one, on another process count, does not: the signals tests)."""
    written = resolved_spec([*ARGS, "train.max_steps=3"])  # 2 x 2 accumulation steps
    (tmp_path / "written").mkdir()
    train(prepare_job(written, tmp_path / "written"))
    checkpoint = tmp_path / "written" / "checkpoints" / "step_00000003"
    assert json.loads((checkpoint / "meta.json").read_text())["global_batch"] == 4
    (tmp_path / "resumed").mkdir()
    with caplog.at_level(logging.WARNING, logger="runner"):
        train(
            prepare_job(
                resolved_spec([*ARGS, "train.max_steps=4", "train.micro_batch_size=4", f"resume={checkpoint}"]),
                tmp_path / "resumed",
            )
        )
    [warning] = [record for record in caplog.records if "global batch" in record.getMessage()]
    assert warning.getMessage().startswith(
        "resuming with a global batch of 8 (micro batch 4 x 1 data-parallel ranks "
        "x 2 accumulation steps) where the checkpoint's run had 4"
    )


@pytest.mark.signals
@pytest.mark.parametrize(
    "strategy", [[], pytest.param(["strategy=ddp", *TWO_RANKS], marks=pytest.mark.distributed)], ids=["single", "ddp"]
)
def test_sigterm_checkpoints_the_step_and_exits_3_then_resumes(strategy, uninterrupted, uninterrupted_ddp, tmp_path):
    job = start_cli(*ARGS, *strategy, "train.checkpoint_every=100", cwd=tmp_path, stop_at_step=4)
    try:
        run_dir, _ = hold_at_step(job, tmp_path)
        job.send_signal(signal.SIGTERM)  # to the run process, as `kill <pid>` sends it; it arrives mid-step
        if strategy:
            # The run passes it on to its workers (torch elastic's shutdown). They stay stopped until each has it,
            # so that they stop after the step they are in, however long the passing on takes.
            workers = [worker_pid(run_dir, rank) for rank in range(2)]
            os.kill(job.pid, signal.SIGCONT)
            wait_until(
                lambda: all(signal.SIGTERM in pending_signals(pid) for pid in workers),
                "the run to pass SIGTERM on to its workers",
                job,
            )
        job.resume()
        assert job.wait(timeout=120) == 3
    finally:
        job.kill()
    stopped_at = sorted((run_dir / "checkpoints").glob("step_*"))
    assert len(stopped_at) == 1 and (stopped_at[0] / "meta.json").exists()
    assert "continue with: run resume=" in job.stderr()
    result = run_cli(f"resume={run_dir}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    reference = uninterrupted_ddp if strategy else uninterrupted
    assert losses(run_dir) == reference


def worker_pid(run_dir: Path, rank: int) -> int:
    """A worker's process, from the line its rank log starts with."""
    return int(re.search(rf"rank {rank} of \d+, process (\d+)", (run_dir / f"rank{rank}.log").read_text()).group(1))


def pending_signals(pid: int) -> set[signal.Signals]:
    """The signals sent to a process that it has not handled yet (a stopped process keeps them), from /proc."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    status = dict(line.split(":\t", 1) for line in lines if ":\t" in line)
    mask = int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)
    return {number for number in signal.valid_signals() if number < 32 and mask >> (number - 1) & 1}


@pytest.mark.signals
@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGUSR2"])
def test_a_second_signal_stops_at_once(signal_name, tmp_path):
    """The loop's handler: the first signal asks for a stop after the step, a later one ends the process. SIGUSR2,
    SLURM's warning before a time limit under the submitit launcher, which installs its own handler first."""
    probe = textwrap.dedent(f"""
        import os, signal, time
        signal.signal(signal.SIGUSR2, lambda *args: print("submitit's handler", flush=True))
        from runner.processes.signals import GracefulStop
        stop = GracefulStop()
        os.kill(os.getpid(), signal.{signal_name})
        time.sleep(1.2)
        print("first:", stop.requested, flush=True)
        os.kill(os.getpid(), signal.{signal_name})
        time.sleep(10)
        print("still running", flush=True)
    """)
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == f"first: {signal_name}"
    assert result.returncode == -getattr(signal, signal_name)
