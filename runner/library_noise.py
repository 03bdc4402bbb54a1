"""Keeps the libraries' start-up chatter (progress bars, advisory warnings) out of the user's terminal."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from typing import Iterator


def quiet_libraries() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    if not sys.stderr.isatty():  # colorlog (the Optuna sweeper's logs) writes colour codes into files otherwise
        os.environ.setdefault("NO_COLOR", "1")
    quiet_loggers()


def quiet_loggers() -> None:
    """torchao, which transformers imports whenever it is installed (validation builds a model on the meta
    device), warns about kernels this machine does not need, and torch about torchao's enum registrations;
    alembic, which the Optuna sweeper imports, lists its plugins; matplotlib (the sweep report's plot) says it
    builds its font cache; huggingface_hub retries an unreachable hub five times, a warning each, before the one
    error the run reports; DTensor suggests flattening mesh dimensions whenever a tensor-parallel and FSDP-sharded
    tensor is gathered over both (the gradient norm at each step, a checkpoint's whole weights); lm-eval logs each
    task it builds. Errors still show."""
    for name in (
        "torchao",
        "torch.utils._pytree",
        "alembic",
        "matplotlib.font_manager",
        "huggingface_hub",
        "torch.distributed.tensor._redistribute",
        "lm_eval",
    ):
        logging.getLogger(name).setLevel(logging.ERROR)
    # datasets logs, as an error, the bad file that it then raises about (runner/data/stream.py names its line).
    logging.getLogger("datasets.packaged_modules").setLevel(logging.CRITICAL)


def name_deepspeed_accelerator(accelerator: str) -> None:
    """DeepSpeed, which transformers and accelerate import when it is installed, guesses the accelerator and says
    so on the console; the spec knows it. Workers inherit it from the process that starts them."""
    os.environ.setdefault("DS_ACCELERATOR", accelerator)


@contextlib.contextmanager
def deepspeed_setup() -> Iterator[None]:
    """DeepSpeed as the runner runs it. On the CPU, DeepSpeed compiles a shared-memory op the first time it sets up
    its collectives (a minute or two, and a C++ compiler), though only its inference all-reduce uses it, which the
    runner never calls: it is marked unavailable, so that the collectives go through torch.distributed, as training's
    always do. Its first look at which ops this machine can build logs, at INFO, the commands of a test compile
    (through setuptools' distutils, whose logger's name changes between versions), and its setup prints. Its errors
    raise; its warnings show."""
    import deepspeed.ops

    before = logging.root.manager.disable
    logging.disable(logging.INFO)
    try:
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # probed once, then kept
    finally:
        logging.disable(before)
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def quiet_launcher() -> None:
    """The elastic launcher's own loggers would print each failure's traceback ahead of the runner's report; what it
    says of the ranks it ends once one has failed is said in the runner's words."""
    for name in ("torch.distributed.elastic", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    ending = logging.getLogger("torch.multiprocessing.spawn")
    ending.setLevel(logging.WARNING)
    ending.addFilter(_ranks_ended)


# torch's words (torch.multiprocessing.spawn) for the ranks still running once one has failed, and the runner's.
ENDING_RANKS = {
    "Terminating process %s via signal SIGTERM": "a rank failed; process %s, another rank of this node, is still "
    "running: ending it (SIGTERM, then SIGKILL after 30 s)",
    "Unable to shutdown process %s via SIGTERM , forcefully exiting via SIGKILL": "process %s did not end on "
    "SIGTERM: killed (SIGKILL)",
}


def _ranks_ended(record: logging.LogRecord) -> bool:
    """The launcher's warnings as it ends the ranks still running after one failed, said by the runner instead (a
    rank that hangs keeps the job for 30 s more); its other records dropped."""
    words = ENDING_RANKS.get(record.msg)
    if words is not None:
        logging.getLogger("runner").warning(words, *record.args)
    return False
