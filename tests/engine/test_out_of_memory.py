"""An out-of-memory error mid-run ends the job in one line, in whichever rank it comes: the step and its phase, the
device's figures, the memory estimate's peak and what would need less. torch.OutOfMemoryError is raised by the
last rank's backward, in a real worker process of a real run (as a GPU's allocator raises it)."""

import pytest

from tests.support.command import start_cli
from tests.support.specs import QUICK

# Micro batches of 4: a smaller one is then among what needs less.
RUN = [
    *QUICK,
    "train.micro_batch_size=4",
    "train.max_steps=6",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.save_model=false",
]


@pytest.mark.distributed
@pytest.mark.parametrize("overrides", [[], ["strategy=ddp", "hardware.nproc_per_node=2"]], ids=["single", "ddp"])
def test_out_of_memory_in_a_rank_ends_the_job_in_one_line(overrides, tmp_path):
    job = start_cli(*RUN, *overrides, cwd=tmp_path, out_of_memory_at_step=3)
    try:
        stdout, stderr = job.communicate(timeout=300)
    finally:
        job.kill()
    assert job.returncode == 1, stderr[-3000:]
    assert len(stderr.strip().splitlines()) == 1, stderr
    [line] = stderr.strip().splitlines()
    rank = 1 if overrides else 0
    assert line.startswith(f"run: error: rank {rank} ran out of memory in step 3, in the backward: "), line
    assert "the estimate's peak for this run is " in line and " per device; " in line
    assert "what needs less: " in line and "train.micro_batch_size=" in line, line
    assert "Traceback" not in stderr
