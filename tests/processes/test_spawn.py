"""The start path of CUDA runs, on the CPU: workers spawned (each a new interpreter, which receives what it runs
pickled), not forked from `run`. hardware.start_method=spawn starts them as on GPUs."""

import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from runner.cli.app import validated
from runner.cli.compose import compose_config
from runner.config.hardware import StartMethod
from runner.config.tracker import RunIdentity
from runner.processes.launch import launch, start_method
from runner.processes.rank import worker
from tests.support import DATA
from tests.support.command import run_cli
from tests.support.runs import logged, run_dirs
from tests.support.specs import QUICK, composed

TRL_PAIRS = DATA / "trl" / "preference_standard.jsonl"
# What a worker's spec may hold: every strategy, a tensor-parallel layout, adapters, trackers, streaming, DPO.
SPECS = {
    "ddp, tensorboard": ["strategy=ddp", "tracker=tensorboard"],
    "fsdp tp 2, lora": ["strategy=fsdp", "strategy.tp_size=2", "adapter=lora"],
    "deepspeed ZeRO-3, wandb": [
        "strategy=deepspeed",
        "strategy.zero_stage=3",
        "tracker=wandb",
        "tracker.wandb.mode=offline",
    ],
    "ddp, streaming, mlflow": ["strategy=ddp", "data.streaming=true", "tracker=mlflow"],
    "fsdp, dpo, qlora": [
        "strategy=fsdp",
        "task=dpo",
        "data=preference_files",
        f"data.files={TRL_PAIRS}",
        "adapter=qlora",
    ],
}
# The libraries whose import-time messages the worker silences (runner/library_noise.py) once it runs: unpickling
# what it runs must not import them ahead of that.
NOISY = ("transformers", "torchao", "deepspeed", "datasets", "peft", "wandb", "mlflow", "tensorboard")


def launched(overrides: list[str], run_dir, monkeypatch) -> tuple:
    """What launch() hands the elastic launcher for the spec of `overrides`: its config, and the entrypoint and
    arguments that each worker receives (pickled, when spawned)."""
    import torch.distributed.launcher.api as api

    calls = []

    def recorded(config, entrypoint):
        def run(*args):
            calls.append((config, entrypoint, args))
            return {0: {"objective": 0.0}}

        return run

    monkeypatch.setattr(api, "elastic_launch", recorded)
    # The spec as run_job launches it (the task's checks before launch change nothing in it).
    spec = validated(compose_config([*QUICK, "hardware.nproc_per_node=2", *overrides]), Path.cwd())
    # The log format as `run` passes it: Hydra's job_logging formatter (conf/config.yaml), as a plain dict.
    launch(
        spec,
        run_dir,
        {"format": "%(asctime)s %(message)s", "datefmt": "%H:%M:%S"},
        RunIdentity("m/0", group="outputs/multirun/x"),
    )
    [call] = calls
    return call


def test_what_each_worker_receives_pickles_and_unpickles_in_a_new_interpreter(tmp_path, monkeypatch):
    """A spawned worker gets its entrypoint and arguments pickled: every spec field must pickle, and unpickle in a
    new interpreter (no class defined in a function or in `run`'s __main__, no state of the process that `run` set
    up). Unpickling imports none of the noisy libraries either, ahead of the worker's quieting."""
    payloads = {}
    for case, overrides in SPECS.items():
        config, entrypoint, args = launched([*overrides, "hardware.start_method=spawn"], tmp_path, monkeypatch)
        assert config.start_method == "spawn"
        assert pickle.loads(pickle.dumps(entrypoint)) is worker
        assert repr(pickle.loads(pickle.dumps(args))) == repr(args), case
        payloads[case] = args
    shown = subprocess.run(
        [
            sys.executable,
            "-c",
            "import pickle, sys\n"
            "payloads = pickle.load(sys.stdin.buffer)\n"
            f"print(repr({{case: repr(args) for case, args in payloads.items()}}))\n"
            f"print(sorted(name for name in {NOISY!r} if name in sys.modules))",
        ],
        input=pickle.dumps(payloads),
        capture_output=True,
        check=True,
    )
    unpickled, imported = shown.stdout.decode().splitlines()
    assert unpickled == repr({case: repr(args) for case, args in payloads.items()})
    assert imported == "[]"
    assert not shown.stderr, shown.stderr.decode()


@pytest.mark.parametrize(
    "accelerator,chosen,method",
    [
        ("cpu", "auto", "fork"),
        ("cuda", "auto", "spawn"),
        ("cpu", "spawn", "spawn"),
        ("cpu", "fork", "fork"),
        ("cuda", "spawn", "spawn"),
    ],
)
def test_the_start_method_is_the_accelerators_unless_chosen(accelerator, chosen, method):
    hardware = composed([f"hardware.accelerator={accelerator}", f"hardware.start_method={chosen}"]).hardware
    assert hardware.start_method is StartMethod(chosen)
    assert start_method(hardware) == method


def test_an_unknown_start_method_is_one_line_and_writes_nothing(workdir):
    result = run_cli("strategy=ddp", "hardware.nproc_per_node=2", "hardware.start_method=forkserver", cwd=workdir)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "run: error: hardware.start_method: Invalid value 'forkserver', expected one of [auto, fork, spawn]"
    ]
    assert not (workdir / "outputs").exists()


def test_a_forked_cuda_worker_is_refused_before_anything_starts(monkeypatch):
    from runner.config import hardware
    from runner.config.spec import validate
    from runner.errors import SpecError

    gpu = composed(["strategy=ddp", "hardware=2xrtx4090", "hardware.start_method=fork"])
    # This machine's two GPUs, as detect() would read them.
    monkeypatch.setattr(hardware, "cuda_device_count", lambda: 2)
    monkeypatch.setattr(hardware, "detect", lambda declared: declared)
    with pytest.raises(SpecError, match="hardware.start_method=fork on CUDA GPUs: a forked worker cannot use"):
        validate(gpu)
    validate(composed(["strategy=ddp", "hardware=2xrtx4090", "hardware.start_method=spawn"]))


# Three steps: the first step's loss (the initial weights, the first batch) and two updates.
RUN = [
    *QUICK,
    "hardware.nproc_per_node=2",
    "train.max_steps=3",
    "train.log_every=1",
    "train.eval_every=0",
    "train.save_model=false",
]


@pytest.mark.distributed
def test_spawned_workers_train_as_forked_ones(tmp_path):
    """`run` with the workers spawned, as on GPUs: the run finishes with the forked workers' losses, step for step
    (the same seed and global batch), and the new interpreters print no library warning. FSDP's (a mesh, sharded
    parameters, a process group per dimension): the start method changes the launch alone, the same for every
    strategy, and what each strategy's worker receives is unpickled in a new interpreter above."""
    strategy = "fsdp"
    outputs, losses = {}, {}
    for method in ("fork", "spawn"):
        result = run_cli(f"strategy={strategy}", *RUN, f"hardware.start_method={method}", cwd=tmp_path / method)
        assert result.returncode == 0, result.stderr[-3000:]
        [run_dir] = run_dirs(tmp_path / method)
        outputs[method], losses[method] = result.stdout + result.stderr, logged(run_dir, "loss")
    assert "starting 2 worker processes on this node (spawned: each imports the libraries anew)" in outputs["spawn"]
    assert "(spawned" not in outputs["fork"]
    assert list(losses["spawn"]) == [1, 2, 3]
    assert losses["spawn"] == losses["fork"]
    assert "done: train loss" in outputs["spawn"]
    for noise in ("Warning", "Traceback", "warn(", "Setting accelerator", "deprecated"):
        assert noise not in outputs["spawn"], noise
    assert not re.search(r"^[IWEF]\d{4} ", outputs["spawn"], re.MULTILINE), outputs["spawn"]  # torch's log lines
