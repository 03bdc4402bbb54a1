"""A full disk, seen coming and met, on a real small filesystem (a tmpfs this test mounts): a run that cannot hold
its checkpoints and model is refused before launch with the figures; a run whose disk fills at a checkpoint ends
in one line that names the path and the sizes, leaves no half-written checkpoint, and, resumed once there is room,
ends with the uninterrupted run's losses. Under one process, fsdp SHARDED and DeepSpeed ZeRO-2. A tracker that cannot
write is reported once, and the run goes on."""

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from runner.errors import WriteFailed
from runner.files.refused_writes import refused_write, write_failed_line, written_whole
from runner.memory.disk import disk_need
from tests.support.command import run_cli, start_cli
from tests.support.runs import deleted_files_mapped, hold_at_step, run_dirs, step_losses
from tests.support.specs import QUICK, composed

pytestmark = pytest.mark.slow

MIB = 2**20
RUN = [
    *QUICK,
    "train.max_steps=6",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.checkpoint_every=3",
    "train.keep_checkpoints=1",
    "train.save_model=false",
]
STRATEGIES = {
    "single": [],
    "fsdp SHARDED": ["strategy=fsdp", "hardware.nproc_per_node=2", "strategy.state_dict_type=SHARDED"],
    "deepspeed ZeRO-2": ["strategy=deepspeed", "strategy.zero_stage=2", "hardware.nproc_per_node=2"],
}


@contextlib.contextmanager
def small_filesystem(path: Path, size: int):
    """A tmpfs of `size` bytes mounted at `path` (root, or a user allowed to mount), unmounted after."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def test_a_run_whose_checkpoints_cannot_fit_is_refused_before_launch_with_the_figures(tmp_path):
    need = disk_need(composed(RUN))
    with small_filesystem(tmp_path / "small", need.peak // 2) as small:
        result = run_cli(*RUN, cwd=small)
        assert result.returncode == 2, result.stderr[-2000:]
        [line] = result.stderr.strip().splitlines()
        assert line.startswith(f"run: error: the run directory's filesystem ({small}) has ")
        assert f"a checkpoint about {need.checkpoint / MIB:.2f} MiB, 2 on disk at once" in line
        assert "train.keep_checkpoints=1" in line and "train.checkpoint_every=0" in line
        assert not (small / "outputs").exists()


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_disk_that_fills_at_a_checkpoint_ends_the_run_in_one_line_and_resumes_exactly(strategy, tmp_path):
    """The resumed run writes two checkpoints in the room the run's own estimate gives it: once the checkpoint it
    resumed from is rotated out, none of its processes maps a deleted file of the run (which would keep that file's
    space taken, and the next checkpoint would find no room)."""
    overrides = [*RUN, *STRATEGIES[strategy], "train.checkpoint_every=2"]
    uninterrupted = run_cli(*overrides, cwd=tmp_path / "uninterrupted")
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-2000:]
    [expected] = run_dirs(tmp_path / "uninterrupted")
    checkpoint = sum(path.stat().st_size for path in (expected / "checkpoints").rglob("*") if path.is_file())
    # Room for the two checkpoints the run holds at once, as the check before launch counts them, and its logs.
    room = 2 * max(checkpoint, disk_need(composed(overrides)).checkpoint) + MIB
    with small_filesystem(tmp_path / "small", room) as small:
        job = start_cli(*overrides, cwd=small / "work", stop_at_step=3)
        try:
            run_dir, _ = hold_at_step(job, small / "work")  # its step 2 checkpoint written
            ballast = small / "ballast"
            ballast.write_bytes(b"\0" * (os.statvfs(small).f_bavail * os.statvfs(small).f_frsize - checkpoint // 2))
            job.resume()
            assert job.wait(timeout=300) == 4, job.stderr()[-3000:]
        finally:
            job.kill()
        [line] = [line for line in job.stderr().splitlines() if line.strip() and not line.startswith("W1")]
        assert line.startswith("run: error: writing the checkpoint of step 4 failed: No space left on device"), line
        assert f"the last complete checkpoint, {run_dir / 'checkpoints' / 'step_00000002'}, is intact" in line
        assert f"continue with: run resume={run_dir}" in line and " MiB are free on " in line
        assert [path.name for path in (run_dir / "checkpoints").iterdir()] == ["step_00000002"]
        assert "Traceback" not in job.stderr() and "Error executing job" not in job.stderr()

        ballast.unlink()
        resumed = start_cli(f"resume={run_dir}", cwd=small / "work", stop_at_step=5)
        try:
            hold_at_step(resumed, small / "work")  # step 4's checkpoint written, step 2's rotated out
            assert deleted_files_mapped(resumed.pid, run_dir) == {}
            resumed.resume()
            assert resumed.wait(timeout=300) == 0, resumed.stderr()[-2000:]
        finally:
            resumed.kill()
        assert step_losses(run_dir) == step_losses(expected)


def test_a_run_directory_that_cannot_be_written_is_refused_before_launch(tmp_path):
    with small_filesystem(tmp_path / "read_only", 1 * MIB) as read_only:
        subprocess.run(["mount", "-o", "remount,ro", str(read_only)], check=True)
        result = run_cli(*RUN, f"hydra.run.dir={read_only}/run", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip() == (
        f"run: error: the run directory {read_only}/run cannot be written ({read_only} is "
        "not writable); choose another with hydra.run.dir=<a directory>"
    )


def test_a_disk_that_fills_at_the_export_says_the_last_checkpoint_holds_the_training(tmp_path):
    """The only checkpoint, the last step's, is written; the model saved after it finds no room: one line that
    points at that checkpoint, which the inference tasks read, and no model.partial left."""
    overrides = [*RUN, "train.checkpoint_every=0", "train.save_model=true"]
    need = disk_need(composed(overrides))
    with small_filesystem(tmp_path / "small", need.peak + 4 * MIB) as small:
        job = start_cli(*overrides, cwd=small / "work", stop_at_step=5)
        try:
            run_dir, _ = hold_at_step(job, small / "work")
            free = os.statvfs(small).f_bavail * os.statvfs(small).f_frsize
            # room for the checkpoint with its files' headers (a few percent), and half the model
            (small / "ballast").write_bytes(b"\0" * (free - need.checkpoint - need.export // 2 - MIB // 4))
            job.resume()
            assert job.wait(timeout=300) == 4, job.stderr()[-3000:]
        finally:
            job.kill()
        [line] = job.stderr().strip().splitlines()
        last = run_dir / "checkpoints" / "step_00000006"
        assert line.startswith("run: error: writing the model failed: No space left on device"), line
        assert f"the training is done and its last checkpoint, {last}, holds it" in line
        assert f"task.trained={last}" in line
        assert not (run_dir / "model.partial").exists() and (last / "meta.json").exists()


def test_a_sweep_whose_jobs_cannot_all_fit_is_refused_before_launch(tmp_path):
    """Each job leaves its checkpoints behind: room for one job is not room for two."""
    need = disk_need(composed(RUN))
    with small_filesystem(tmp_path / "small", need.peak + need.left // 2) as small:
        result = run_cli("-m", *RUN, "seed=1,2", cwd=small)
        assert result.returncode == 2, result.stderr[-2000:]
        [line] = result.stderr.strip().splitlines()
        assert line.startswith(f"run: error: the sweep directory's filesystem ({small}) has ")
        assert "the sweep's 2 training jobs need " in line
        assert not (small / "multirun").exists() and not (small / "outputs").exists()


def test_torch_save_cut_short_by_a_full_filesystem_is_a_refused_write_even_once_its_room_is_freed(tmp_path):
    """torch.save keeps no reason ("unexpected pos", raised while handling "iostream error"); under DeepSpeed the
    other rank may already have removed the half-written checkpoint, so the free room no longer says it either."""
    import torch

    with small_filesystem(tmp_path / "small", 256 * 1024) as small:
        partial = small / "run" / "checkpoints" / "step_00000006.partial"
        partial.mkdir(parents=True)
        with pytest.raises(RuntimeError) as cut_short:
            torch.save({"weights": torch.zeros(2**18)}, partial / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        (partial / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
        assert refused_write(cut_short.value)
        line = write_failed_line(cut_short.value, partial, "the checkpoint of step 6", small / "run", needed=MIB)
    assert line.startswith(
        f"writing the checkpoint of step 6 failed: No space left on device ({partial}); it needs about 1.0 MiB and "
    ), line
    assert refused_write(OSError(28, "No space left on device")) and not refused_write(ValueError("a bug"))


def test_a_write_refused_with_room_left_says_the_filesystems_reason(tmp_path):
    partial = tmp_path / "run" / "checkpoints" / "step_00000006.partial"
    refused = partial / "model.safetensors"
    with pytest.raises(WriteFailed) as failed:
        with written_whole(partial, "the checkpoint of step 6", tmp_path / "run", lambda: MIB):
            partial.mkdir(parents=True)
            raise OSError(122, "Disk quota exceeded", str(refused))
    assert str(failed.value).startswith(f"writing the checkpoint of step 6 failed: Disk quota exceeded ({refused}); ")
    assert not partial.exists()


def test_an_error_before_a_directory_of_ones_own_exists_is_not_a_refused_write(tmp_path):
    """The model's directory is rank 0's alone, made by save_pretrained: an error before it exists is the error."""
    with pytest.raises(ValueError, match="a bug"):
        with written_whole(tmp_path / "run" / "model.partial", "the model", tmp_path / "run", lambda: MIB):
            raise ValueError("a bug")


@pytest.mark.parametrize("room", ["full", "freed"])
def test_a_rank_whose_checkpoint_a_peer_removed_ends_with_the_refused_write(room, tmp_path):
    """Under DeepSpeed, a rank whose write was refused removes the half-written checkpoint while its peer still
    writes into it; the peer's torch.save then finds no directory ("Parent directory ... does not exist"). That is
    the same refused write, in one line, whichever rank the launcher hears first: for want of room where the
    checkpoint still cannot fit."""
    import torch

    partial = tmp_path / "run" / "checkpoints" / "step_00000006.partial"
    needed = 2**60 if room == "full" else MIB
    with pytest.raises(WriteFailed) as failed:
        with written_whole(partial, "the checkpoint of step 6", tmp_path / "run", lambda: needed, shared=True):
            (partial / "deepspeed" / "engine").mkdir(parents=True)
            shutil.rmtree(partial)  # the peer's refusal
            torch.save({"weights": torch.zeros(4)}, partial / "deepspeed" / "engine" / "zero_pp_rank_1_optim.pt")
    reason = "No space left on device" if room == "full" else "another rank's write was refused"
    line = str(failed.value)
    assert line.startswith(f"writing the checkpoint of step 6 failed: {reason} ({partial}); "), line


def test_a_tracker_that_cannot_write_is_reported_once_and_training_goes_on(tmp_path):
    """MLflow's file store on a filesystem that turns read-only mid-run: one warning names the tracker and the
    error, and the run trains to its end, its checkpoint and metrics.jsonl (elsewhere) whole."""
    overrides = [
        *RUN,
        "train.checkpoint_every=0",
        "tracker=mlflow",
        f"tracker.mlflow.tracking_uri=file://{tmp_path / 'small' / 'mlruns'}",
    ]
    with small_filesystem(tmp_path / "small", 4 * MIB) as small:
        job = start_cli(*overrides, cwd=tmp_path / "work", env={"MLFLOW_ALLOW_FILE_STORE": "true"}, stop_at_step=2)
        try:
            run_dir, _ = hold_at_step(job, tmp_path / "work")
            subprocess.run(["mount", "-o", "remount,ro", str(small)], check=True)
            job.resume()
            assert job.wait(timeout=300) == 0, job.stderr()[-3000:]
        finally:
            job.kill()
    warnings = [line for line in job.stdout().splitlines() if "stopped recording" in line]
    assert len(warnings) == 1 and "MLflowTracker stopped recording: " in warnings[0], job.stdout()[-3000:]
    assert "Read-only file system" in warnings[0] and "training goes on without it" in warnings[0]
    assert len(step_losses(run_dir)) == 6
    assert (run_dir / "checkpoints" / "step_00000006" / "meta.json").is_file()
