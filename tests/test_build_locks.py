"""A compile lock left by a run stopped while torch compiled an extension (DeepSpeed's CPU communication op) is
removed before workers start, and a recent one is reported, never waited on in silence."""

import logging
import os
import shutil
import time
from pathlib import Path

import pytest
from helpers import QUICK, run_cli

from runner.processes.build_locks import STALE_AFTER_S, clear_stale_build_locks

BUILT = Path.home() / ".cache" / "torch_extensions"


def test_an_old_lock_is_removed_and_a_recent_one_reported(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    for name, age in (("old_op", STALE_AFTER_S + 60), ("compiling_op", 5)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "lock").touch()
        os.utime(tmp_path / name / "lock", (time.time() - age,) * 2)
    with caplog.at_level(logging.WARNING, logger="runner"):
        clear_stale_build_locks()
    assert not (tmp_path / "old_op" / "lock").exists() and (tmp_path / "compiling_op" / "lock").exists()
    assert f"removed {tmp_path / 'old_op' / 'lock'}, a compile lock 11 minutes old" in caplog.text
    assert f"waiting on {tmp_path / 'compiling_op' / 'lock'}: a compile of compiling_op started 5 s ago" in caplog.text


@pytest.mark.distributed
def test_a_deepspeed_job_runs_past_a_lock_that_a_stopped_compile_left(tmp_path):
    built = sorted(BUILT.glob("*/deepspeed_shm_comm/*.so"))
    if not built:
        pytest.skip("DeepSpeed's CPU communication op has not been compiled on this machine yet")
    extensions = tmp_path / "extensions"
    shutil.copytree(built[0].parent, extensions / "deepspeed_shm_comm", ignore=shutil.ignore_patterns("lock"))
    lock = extensions / "deepspeed_shm_comm" / "lock"
    lock.touch()
    os.utime(lock, (time.time() - 3600,) * 2)
    result = run_cli("strategy=deepspeed", "hardware.nproc_per_node=2", *QUICK, "train.max_steps=2",
                     "train.eval_every=0", "train.eval_batches=1", "train.save_model=false", cwd=tmp_path,
                     env={"TORCH_EXTENSIONS_DIR": str(extensions)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"removed {lock}, a compile lock 60 minutes old" in result.stdout + result.stderr
