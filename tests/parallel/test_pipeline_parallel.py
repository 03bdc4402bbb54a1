"""Pipeline parallelism composed with FSDP (strategy.pp_size, strategy.pp_schedule): the same math as one process.

With the same seed, data order and global batch, in fp32, the per-step losses of one process and of each layout
agree within 1e-5 relative over 10 optimizer steps: pp 2 under each schedule, FSDP 2 x pp 2, pp 2 x tp 2 and FSDP 2
x pp 2 x tp 2 (8 processes). The tiny model's embeddings are tied to its LM head: the first stage holds one end and
the last the other, their gradients summed.
"""

from pathlib import Path

import pytest
import torch

from runner.compat import pipeline_passes_integer_tensors
from runner.engine.job import prepare_job
from runner.engine.loop import train
from tests.support.command import run_cli
from tests.support.runs import logged, step_losses
from tests.support.specs import QUICK, QUICK_STEPS, resolved_spec
from tests.support.workers import train_in_workers

# (torch 2.11 and 2.12: the run refuses strategy.pp_size > 1 before launch)
trains_a_pipeline = pytest.mark.skipif(
    not pipeline_passes_integer_tensors(), reason="this torch's pipeline stages cannot pass on integer tensors"
)

STEPS = 10
# Global batch 8: micro batch 2 x 4 accumulation steps in one process and under pp 2 alone (one data-parallel rank:
# the schedule's 4 microbatches), x 2 data-parallel ranks x 2 steps on four processes. The default model's four
# blocks: Interleaved1F1B cuts four stages.
BASE = [
    *QUICK_STEPS,
    f"train.max_steps={STEPS}",
    "train.log_every=1",
    "train.eval_every=5",
    "train.eval_batches=3",
    "train.save_model=false",
    "train.micro_batch_size=2",
    "data.seq_len=64",
]
PP = ["strategy=fsdp", "strategy.pp_size=2"]
LAYOUTS = {
    "pp 2, GPipe": (2, [*PP, "train.grad_accum_steps=4", "strategy.pp_schedule=GPipe"]),
    "pp 2, 1F1B": (2, [*PP, "train.grad_accum_steps=4", "strategy.pp_schedule=1F1B"]),
    "pp 2, Interleaved1F1B": (2, [*PP, "train.grad_accum_steps=4", "strategy.pp_schedule=Interleaved1F1B"]),
    "fsdp 2 x pp 2": (4, [*PP, "train.grad_accum_steps=2"]),
    # Each stage's blocks split over 2 ranks; the stages pass on each rank's half of the sequence.
    "pp 2 x tp 2": (4, [*PP, "strategy.tp_size=2", "train.grad_accum_steps=4"]),
    "fsdp 2 x pp 2 x tp 2": (8, [*PP, "strategy.tp_size=2", "train.grad_accum_steps=2"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, its checkpoint at step 5 and its model."""
    run_dir = tmp_path_factory.mktemp("single")
    train(
        prepare_job(
            resolved_spec([*BASE, "train.grad_accum_steps=4", "train.checkpoint_every=5", "train.save_model=true"]),
            run_dir,
        )
    )
    return run_dir


def assert_one_process_losses(run_dir: Path, reference: Path) -> None:
    losses, expected = step_losses(run_dir), step_losses(reference)
    assert len(losses) == len(expected) == STEPS
    assert losses == pytest.approx(expected, rel=1e-5)
    evaluated, expected = logged(run_dir, "eval_loss"), logged(reference, "eval_loss")
    assert list(evaluated) == list(expected) == [0, 5, 10]
    assert list(evaluated.values()) == pytest.approx(list(expected.values()), rel=1e-5)


# fsdp 2 x pp 2 trains to the same losses in the checkpoint test below, which runs it.
@trains_a_pipeline
@pytest.mark.distributed
@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if layout != "fsdp 2 x pp 2"])
def test_same_losses_as_one_process(layout, reference, tmp_path):
    nproc, overrides = LAYOUTS[layout]
    spec = resolved_spec([*BASE, f"hardware.nproc_per_node={nproc}", *overrides])
    train_in_workers([spec], [tmp_path], nproc=nproc)
    assert_one_process_losses(tmp_path, reference)


@trains_a_pipeline
@pytest.mark.distributed
@pytest.mark.parametrize("state_dict_type", ["FULL", "SHARDED"])
def test_checkpoints_and_the_model_move_between_a_pipeline_and_one_process(state_dict_type, reference, tmp_path):
    """Trained under fsdp 2 x pp 2 with one process's losses, saved at step 5, resumed in one process, and under
    pp 2 from one process's checkpoint (FULL: every stage's whole state, gathered on rank 0) or from the same one
    (SHARDED: each rank's shards, the tied head's under the embeddings' name): the same losses from step 6 on. The
    model the pipeline exports is the one process's."""
    from safetensors.torch import load_file

    saved = tmp_path / "fsdp 2 x pp 2"
    nproc, overrides = LAYOUTS["fsdp 2 x pp 2"]
    written = f"strategy.state_dict_type={state_dict_type}"
    spec = resolved_spec(
        [
            *BASE,
            f"hardware.nproc_per_node={nproc}",
            *overrides,
            written,
            "train.checkpoint_every=5",
            "train.save_model=true",
        ]
    )
    train_in_workers([spec], [saved], nproc=nproc)
    assert_one_process_losses(saved, reference)
    source = saved if state_dict_type == "SHARDED" else reference
    in_pipeline = resolved_spec(
        [
            *BASE,
            "hardware.nproc_per_node=2",
            *LAYOUTS["pp 2, GPipe"][1],
            f"resume={source / 'checkpoints' / 'step_00000005'}",
        ]
    )
    train_in_workers([in_pipeline], [tmp_path / "pp 2"], nproc=2)
    in_one = resolved_spec([*BASE, f"resume={saved / 'checkpoints' / 'step_00000005'}", "train.grad_accum_steps=4"])
    (tmp_path / "single").mkdir()
    train(prepare_job(in_one, tmp_path / "single"))
    expected = step_losses(reference)
    for resumed in ("single", "pp 2"):
        losses = logged(tmp_path / resumed, "loss")
        assert list(losses) == list(range(6, STEPS + 1))
        assert list(losses.values()) == pytest.approx(expected[5:], rel=1e-5)
    exported = load_file(saved / "model" / "model.safetensors")
    whole = load_file(reference / "model" / "model.safetensors")
    assert sorted(exported) == sorted(whole)
    for name, tensor in whole.items():
        torch.testing.assert_close(exported[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


def test_the_estimate_counts_a_pipeline_rank_s_stages_and_its_microbatches_in_flight():
    """Llama-3-8B on 8 H100s, 4 micro batches a step: fsdp 4 x pp 2 holds the parameters of the heavier pipeline
    rank (16 layers and the embeddings) in 4 shards, about what fsdp 8 holds; its activations are those of its
    layers for each microbatch in flight: 2 under 1F1B (about fsdp 8's one microbatch of every layer), all 4 under
    GPipe, and 2 x 1.25 under Interleaved1F1B. With tp 2 inside the stages, half of them."""
    from runner.memory.breakdown import estimate
    from runner.memory.model_shapes import facts_of

    overrides = [
        "task=estimate",
        "model=llama3_8b",
        "strategy=fsdp",
        "precision=bf16",
        "hardware=8xh100_80gb",
        "data.seq_len=4096",
        "train.micro_batch_size=1",
        "train.grad_accum_steps=4",
    ]
    fsdp = resolved_spec(overrides)
    facts = facts_of(fsdp.model)
    whole = estimate(fsdp, facts)
    staged = {
        schedule: estimate(resolved_spec([*overrides, "strategy.pp_size=2", f"strategy.pp_schedule={schedule}"]), facts)
        for schedule in ("1F1B", "GPipe", "Interleaved1F1B")
    }
    one_f_one_b = staged["1F1B"]
    assert one_f_one_b.weights.bytes == pytest.approx(whole.weights.bytes, rel=0.01)
    assert one_f_one_b.optimizer_states.bytes == pytest.approx(whole.optimizer_states.bytes, rel=0.01)
    assert one_f_one_b.activations.bytes == pytest.approx(whole.activations.bytes, rel=0.02)
    assert staged["GPipe"].activations.bytes == pytest.approx(2 * one_f_one_b.activations.bytes, rel=0.02)
    assert staged["Interleaved1F1B"].activations.bytes == pytest.approx(1.25 * one_f_one_b.activations.bytes, rel=1e-6)
    assert "16 of 32 layers (pipeline rank 0 of 2)" in one_f_one_b.activations.note
    # fsdp 2 x pp 2 x tp 2: the same eighth of the weights, each block's activations split over the tp ranks
    split = estimate(resolved_spec([*overrides, "strategy.pp_size=2", "strategy.tp_size=2"]), facts)
    assert split.weights.bytes == pytest.approx(whole.weights.bytes, rel=0.02)
    assert split.activations.bytes == pytest.approx(one_f_one_b.activations.bytes / 2, rel=0.02)


def test_a_pipeline_pads_each_micro_batch_to_one_shape_without_changing_its_loss():
    """Micro batches go through the stages as [micro_batch_size, seq_len]: the padding gets the label IGNORE and the
    attention mask's 0 (padded rows) or a segment of its own (packed rows), and an eval batch with fewer rows gets
    copies of its first row without labels."""
    from runner.data.batches import MicroBatch
    from runner.data.rows import IGNORE
    from runner.parallel.pipeline.schedule import Pipeline

    pipeline = Pipeline(
        None, first=True, last=True, microbatches=1, rows=3, length=6, pad_token_id=0, pp_group=None, leads_stage=True
    )
    padded = MicroBatch(
        {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 0]]), "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])},
        torch.tensor([[IGNORE, 6, 7], [IGNORE, 9, IGNORE]]),
        tokens=5,
        label_tokens=3,
    )
    input_ids, labels, positions, mask = pipeline._stacked([padded])
    assert input_ids.tolist() == [[5, 6, 7, 0, 0, 0], [8, 9, 0, 0, 0, 0], [5, 6, 7, 0, 0, 0]]
    assert labels.tolist() == [[IGNORE, 6, 7] + [IGNORE] * 3, [IGNORE, 9] + [IGNORE] * 4, [IGNORE] * 6]
    assert mask.tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]]
    assert positions.tolist() == [list(range(6))] * 3
    packed = MicroBatch(
        {
            "input_ids": torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4], [9, 9, 9, 9]]),
            "position_ids": torch.tensor([[0, 1, 0, 1], [0, 1, 2, 3], [0, 1, 2, 3]]),
        },
        torch.tensor([[IGNORE, 6, IGNORE, 8], [IGNORE, 2, 3, 4], [IGNORE, 9, 9, 9]]),
        12,
        8,
    )
    input_ids, labels, positions, mask = pipeline._stacked([packed])
    assert positions.tolist() == [[0, 1, 0, 1, 0, 1], [0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 1]]
    assert mask.tolist() == [[1] * 6] * 3
    assert labels[:, 4:].eq(IGNORE).all()


def test_stages_are_balanced_by_the_parameters_they_hold():
    """The first stage holds the embeddings and the last the head (Llama-3-8B's: 0.53B parameters each, about 2.4
    of its 0.22B layers): they take fewer layers, and the stage that holds the most holds less than under an even
    split by layers. The tiny model's ends weigh little: its split is the even one."""
    import math

    from runner.memory.model_shapes import meta_model
    from runner.parallel.pipeline.layout import balanced_bounds, stage_bounds, stage_parameters
    from tests.support.specs import composed

    model = meta_model(composed(["model=llama3_8b"]).model)
    shapes = [tuple(parameter.shape) for parameter in model.parameters()]

    def largest(bounds):
        return max(sum(math.prod(shape) for shape in held) for held in stage_parameters(model, bounds, shapes))

    balanced = balanced_bounds(model, 4)
    assert [end - start for start, end in balanced] == [7, 9, 9, 7]
    assert largest(balanced) < 0.91 * largest(stage_bounds(32, 4))  # 2.05B against 2.27B parameters
    tiny = meta_model(composed([]).model)
    assert balanced_bounds(tiny, 2) == stage_bounds(4, 2) and balanced_bounds(tiny, 4) == stage_bounds(4, 4)


@trains_a_pipeline
@pytest.mark.distributed
def test_a_pipeline_of_split_stages_prints_no_library_warning(tmp_path):
    """pp 2 x tp 2 from the command line: a stage passes on a copy of its local part of the hidden states, not a
    view of it, on which FSDP warns that its backward hooks would not hold."""
    result = run_cli(
        *QUICK,
        "strategy=fsdp",
        "strategy.pp_size=2",
        "strategy.tp_size=2",
        "hardware.nproc_per_node=4",
        "train.grad_accum_steps=2",
        "data.seq_len=64",
        "train.max_steps=2",
        "train.eval_every=0",
        "train.save_model=false",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "done: train loss" in output
    for noise in ("Warning", "Traceback"):
        assert noise not in output, noise
