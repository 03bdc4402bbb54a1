"""The contract that keeps a GPU busy: no step that neither logs, evaluates nor checkpoints makes the host wait for
the device. Each variant trains a few steps, logging every third, with every read of the device counted by the step
it falls in (tests/support/host_reads.py); the steps between log steps must have none, under single, DDP, FSDP and
DeepSpeed, with packed, chat-like (instruction), preference and streamed data, and with the chunked and the full loss.

Four kinds of read are of host tensors, which a GPU run keeps on the host too, and are left out by where they are
made: torch's optimizers read their step counters (host tensors unless capturable, which the runner's are not); the
stop vote is a host tensor summed over gloo and read a step late (runner/processes/signals.py); the batches are built on
the host, on a thread of their own (runner/data/: each epoch's seeded permutation); and the per-example attention of
packed rows runs on the CPU alone (on GPUs transformers' own attention takes packed rows).

DeepSpeed's ZeRO optimizers read their gradient norm inside their own step (`is_invalid_grad_norm`, to skip an
overflowed step and to clip): those reads are the engine's, not the runner's, and are left out too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import DATA
from tests.support.host_reads import counting_host_reads
from tests.support.specs import QUICK, resolved_spec
from tests.support.workers import run_in_workers

ALPACA = DATA / "llama_factory" / "alpaca_en_demo.json"  # tests/support/data/llama_factory/SOURCE.md
DPO_DEMO = DATA / "llama_factory" / "dpo_en_demo.json"
STEPS, LOG_EVERY = 6, 3
BASE = [
    *QUICK,
    f"train.max_steps={STEPS}",
    f"train.log_every={LOG_EVERY}",
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "train.save_model=false",
    "train.micro_batch_size=2",
    "data.seq_len=64",
    "train.grad_accum_steps=2",
    "train.eval_batches=1",
]
INSTRUCTION = [
    "data=instruction_files",
    f"data.files={ALPACA}",
    "data.prompt_field=instruction",
    "data.response_field=output",
    "data.seq_len=256",
]
HOST_SIDE = ("/torch/optim/", "/runner/processes/signals.py", "/runner/data/", "/runner/engine/attention.py")
DEEPSPEEDS_OWN = ("/deepspeed/runtime/",)


def reads_by_step(ranks, spec, run_dir) -> dict[int, dict[str, int]]:
    """This rank's device reads in each step of the spec's task (from the step's start to the next one's), those of
    host tensors left out."""
    import runner.engine.loop as loop

    own_step, marks = loop.train_step, []
    with counting_host_reads(leave_out=HOST_SIDE + DEEPSPEEDS_OWN) as counter:

        def marked_step(job, batch):
            marks.append(counter.snapshot())
            return own_step(job, batch)

        loop.train_step = marked_step
        try:
            spec.task.run(spec, Path(run_dir), ranks, None)
        finally:
            loop.train_step = own_step
        marks.append(counter.snapshot())
    return {step: dict(marks[step] - marks[step - 1]) for step in range(1, len(marks))}


def quiet_steps(reads: dict[int, dict[str, int]]) -> dict[int, dict[str, int]]:
    """The reads of the steps that neither log nor end the run."""
    return {step: found for step, found in reads.items() if step % LOG_EVERY and step != STEPS and found}


STREAMED = ["data.streaming=true", "data.eval_fraction=0.25"]
SINGLE = {
    "text, chunked loss": ["train.loss=chunked"],
    "text, streamed": STREAMED,
    "text, full loss": ["train.loss=full"],
    "instruction rows, padded": INSTRUCTION,
    "instruction rows, packed": [*INSTRUCTION, "data.packing=true"],
    "dpo": [
        "task=dpo",
        "data=preference_files",
        f"data.files={DPO_DEMO}",
        "data.drop_long_prompts=true",
        "data.seq_len=256",
    ],
    # the router's terms and load stay on the device; grouped_mm, the experts' kernel on GPUs, reads nothing
    "moe, router losses": [
        "model=tiny_qwen3_moe",
        "model.router_z_loss_coef=0.001",
        "model.experts_kernel=grouped_mm",
    ],
}


@pytest.mark.parametrize(
    "variant",
    [pytest.param(variant, marks=[] if index == 0 else [pytest.mark.slow]) for index, variant in enumerate(SINGLE)],
)
def test_a_single_process_step_reads_nothing_from_the_device_between_log_steps(variant, tmp_path):
    spec = resolved_spec([*BASE, *SINGLE[variant]])
    from runner.distributed import Ranks

    reads = reads_by_step(Ranks(), spec, tmp_path)
    assert len(reads) == STEPS
    assert quiet_steps(reads) == {}
    assert sum(reads[LOG_EVERY].values()) >= 1  # the log step reads them all at once


DISTRIBUTED = {
    "ddp": ["strategy=ddp"],
    "ddp, streamed": ["strategy=ddp", *STREAMED],
    "fsdp": ["strategy=fsdp"],
    "deepspeed ZeRO-2": ["strategy=deepspeed", "strategy.zero_stage=2"],
    "deepspeed ZeRO-3": ["strategy=deepspeed", "strategy.zero_stage=3"],
}


def reads_of_each(ranks, specs, run_dirs) -> list[dict[int, dict[str, int]]]:
    return [reads_by_step(ranks, spec, run_dir) for spec, run_dir in zip(specs, run_dirs)]


@pytest.mark.distributed
def test_a_data_parallel_step_reads_nothing_from_the_device_between_log_steps(tmp_path):
    specs = [
        resolved_spec([*BASE, *overrides, "hardware.nproc_per_node=2", "train.grad_accum_steps=1"])
        for overrides in DISTRIBUTED.values()
    ]
    run_dirs = [tmp_path / str(index) for index in range(len(specs))]
    for run_dir in run_dirs:
        run_dir.mkdir()
    for rank, reads_of_rank in enumerate(run_in_workers(reads_of_each, specs, list(map(str, run_dirs)), nproc=2)):
        for variant, reads in zip(DISTRIBUTED, reads_of_rank):
            assert len(reads) == STEPS, variant
            assert quiet_steps(reads) == {}, f"{variant}, rank {rank}"


def test_the_optimizers_step_counters_are_host_tensors():
    """What leaving torch/optim's reads out assumes: AdamW as the runner builds it keeps its step on the host."""
    import torch

    from runner.components.optimizers import build_optimizer
    from runner.config.optim import AdamWConfig

    model = torch.nn.Linear(4, 4)
    optimizer = build_optimizer(model, AdamWConfig())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    assert not optimizer.defaults["capturable"] and not optimizer.defaults["fused"]
    assert all(state["step"].device.type == "cpu" for state in optimizer.state.values())
