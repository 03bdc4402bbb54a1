"""Ulysses sequence parallelism under DeepSpeed (strategy.sp_size, accelerate's `sp_backend: deepspeed`): each rank
of a group runs a slice of every sequence of the same rows, and DeepSpeed's all-to-all trades the slices for a share
of the heads around the attention. Its all-to-all runs on gloo: on the CPU, with the same seed, data order and
global batch, in fp32, the per-step losses and gradient norms equal one process's within 1e-5 relative.
"""

import re

import pytest
import torch

from runner.engine.job import prepare_job
from runner.engine.loop import train
from runner.errors import SpecError
from tests.support import DATA
from tests.support.runs import logged, step_losses
from tests.support.specs import QUICK, resolved_spec
from tests.support.workers import run_in_workers, train_in_workers

STEPS = 6
# Global batch 8: micro batch 2 x 4 accumulation steps in one process and under sp 2 alone (one data-parallel
# rank), x 2 data-parallel ranks x 2 steps on four processes; the rows (64 tokens at most, and shorter ones) are split
# in halves.
# SGD without clipping: each update is proportional to the gradient, so that a gradient off by the group's size
# shows in the losses (Adam's and clipping's scale invariance would hide it).
BASE = [
    *QUICK,
    f"train.max_steps={STEPS}",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=2",
    "train.save_model=false",
    "train.micro_batch_size=2",
    "data.seq_len=64",
    "optim=sgd",
    "train.max_grad_norm=0",
]
SP = ["strategy=deepspeed", "strategy.sp_size=2"]
LAYOUTS = {
    "sp 2, ZeRO-2": (2, [*SP, "train.grad_accum_steps=4"]),
    # Each block recomputed in backward, its all-to-alls with it.
    "sp 2, ZeRO-2, activation checkpointing": (
        2,
        [*SP, "train.grad_accum_steps=4", "strategy.activation_checkpointing=true"],
    ),
    # The layout of the public accelerate files (tests/support/data/accelerate_corpus: TRL's alst_ulysses_4gpu.yaml).
    "ZeRO-3, dp 2 x sp 2": (4, [*SP, "strategy.zero_stage=3", "train.grad_accum_steps=2"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single")
    train(prepare_job(resolved_spec([*BASE, "train.grad_accum_steps=4"]), run_dir))
    return run_dir


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ulysses_gives_one_process_losses_and_gradient_norms(layout, reference, tmp_path):
    """ZeRO-0, 1 and 2 divide the summed gradients by the data-parallel ranks, ZeRO-3 by every rank: each slice's
    gradient is its own share under the first, the whole group's under the second."""
    nproc, overrides = LAYOUTS[layout]
    train_in_workers([resolved_spec([*BASE, f"hardware.nproc_per_node={nproc}", *overrides])], [tmp_path], nproc=nproc)
    assert len(step_losses(reference)) == STEPS
    assert step_losses(tmp_path) == pytest.approx(step_losses(reference), rel=1e-5)
    norms = [list(logged(run_dir, "grad_norm").values()) for run_dir in (reference, tmp_path)]
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)


ALPACA = DATA / "llama_factory" / "alpaca_en_demo.json"
PACKED = [
    "data=instruction_files",
    f"data.files={ALPACA}",
    "data.prompt_field=instruction",
    "data.response_field=output",
    "data.seq_len=512",
    "data.packing=true",
]


@pytest.mark.distributed
def test_packed_rows_keep_their_examples_apart_across_the_slices(tmp_path):
    """Rows of LLaMA-Factory's Alpaca demo packed several examples each: DeepSpeed gathers the slices' positions
    around the attention, and each example attends to itself alone over the whole row, as in one process."""
    packed = [*BASE, *PACKED, "train.grad_accum_steps=4"]
    (tmp_path / "single").mkdir()
    train(prepare_job(resolved_spec(packed), tmp_path / "single"))
    train_in_workers([resolved_spec([*packed, *SP, "hardware.nproc_per_node=2"])], [tmp_path / "sp 2"], nproc=2)
    assert step_losses(tmp_path / "sp 2") == pytest.approx(step_losses(tmp_path / "single"), rel=1e-5)
    norms = [list(logged(tmp_path / run, "grad_norm").values()) for run in ("single", "sp 2")]
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)


def _ulysses_slices(ranks, length):
    from runner.data.batches import MicroBatch
    from runner.data.rows import IGNORE
    from runner.parallel.ulysses import UlyssesSplit, sequence_parallel_group

    ids = torch.arange(length).view(1, length)
    labels = ids.clone()
    labels[0, :2] = IGNORE
    batch = MicroBatch(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, labels, tokens=length, label_tokens=length - 2
    )
    losses = {}
    for whole_gradients in (False, True):
        with UlyssesSplit(sequence_parallel_group(2), whole_gradients).split(batch) as (sliced, whole_loss):
            local = torch.tensor(float(ranks.rank + 1), requires_grad=True)
            total = whole_loss(local)
            total.backward()
        losses[whole_gradients] = (total.item(), local.grad.item())
    packed = MicroBatch(
        {"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1]])},
        labels,
        tokens=length,
        label_tokens=length - 2,
    )
    with UlyssesSplit(sequence_parallel_group(2), False).split(packed) as (packed_slice, _):
        pass
    return {
        "inputs": sorted(sliced.inputs),
        "positions": sliced.inputs["position_ids"].tolist(),
        "targets": sliced.labels.tolist(),
        "losses": losses,
        "packed positions": packed_slice.inputs["position_ids"].tolist(),
    }


@pytest.mark.distributed
def test_each_rank_gets_a_contiguous_slice_padded_to_equal_length():
    """A row of 7 tokens over sp 2: padded to 8 (the padding's target IGNORE), rank 0 runs positions 0..3 and rank 1
    4..7 (a packed row, its own positions), the targets shifted before the split. The group's loss is the sum of its
    slices' on each rank; each slice's gradient is its own (ZeRO-0, 1, 2), or that of the sum (ZeRO-3: every rank's
    backward adds one)."""
    from runner.data.rows import IGNORE

    places = run_in_workers(_ulysses_slices, 7, nproc=2)
    assert [place["positions"] for place in places] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    assert [place["targets"] for place in places] == [[[IGNORE, 2, 3, 4]], [[5, 6, IGNORE, IGNORE]]]
    assert all(place["inputs"] == ["input_ids", "position_ids"] for place in places)
    assert [place["losses"] for place in places] == [{False: (3.0, 1.0), True: (3.0, 2.0)}] * 2
    # A packed row's positions as they come, the padding's going on from its last example's.
    assert [place["packed positions"] for place in places] == [[[0, 1, 2, 0]], [[1, 0, 1, 2]]]


def test_ulysses_is_estimated_by_its_slices_and_refused_where_it_cannot_split():
    """Llama-3-70B at 64k tokens under ZeRO-3 on 8 H100s: sp 2 holds half a sequence's activations; what Ulysses
    cannot split is refused before launch, in one line."""
    from runner.memory.breakdown import estimate
    from runner.memory.model_shapes import facts_of

    overrides = [
        "task=estimate",
        "model=llama3_70b",
        "strategy=deepspeed",
        "strategy.zero_stage=3",
        "precision=bf16",
        "hardware=8xh100_80gb",
        "data.seq_len=65536",
        "train.micro_batch_size=1",
        "strategy.activation_checkpointing=true",
    ]
    whole, sliced = resolved_spec(overrides), resolved_spec([*overrides, "strategy.sp_size=2"])
    facts = facts_of(whole.model)
    alone, split = estimate(whole, facts), estimate(sliced, facts)
    assert split.activations.bytes == pytest.approx(alone.activations.bytes / 2, rel=1e-3)
    assert "a 1/2 slice of each sequence (context parallel)" in split.activations.note
    assert sliced.strategy.describe(sliced) == (
        "deepspeed ZeRO-3, 8 processes, mesh 1 x 4 x 2 (dp_replicate x dp_shard x cp), Ulysses sequence parallel"
    )
    for given, refusal in (
        ([*overrides, "strategy.sp_size=3"], "strategy.sp_size=3 does not divide the 8 processes"),
        (
            [*overrides, "strategy.sp_size=4", "model.architecture.num_key_value_heads=6"],
            "does not divide the model's 64 attention heads, or its 6 key-value heads",
        ),
    ):
        with pytest.raises(SpecError, match=re.escape(refusal)) as refused:
            resolved_spec(given)
        assert "\n" not in str(refused.value)


def test_a_run_whose_sequences_fit_only_sliced_is_told_to_slice():
    """Llama-3-8B at 256k tokens under ZeRO-3 with activation checkpointing on 8 H100s: the checkpointed layers'
    inputs alone outgrow a GPU, which no ZeRO stage partitions; the fit check proposes Ulysses."""
    from runner.memory.advice import check_fit

    long = resolved_spec(
        [
            "task=estimate",
            "model=llama3_8b",
            "strategy=deepspeed",
            "strategy.zero_stage=3",
            "precision=bf16",
            "hardware=8xh100_80gb",
            "data.seq_len=262144",
            "train.micro_batch_size=1",
            "strategy.activation_checkpointing=true",
        ]
    )
    with pytest.raises(SpecError, match=r"it fits with: strategy\.sp_size=2 \(78\.\d\d GiB"):
        check_fit(long)
