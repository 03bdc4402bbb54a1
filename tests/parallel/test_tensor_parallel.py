"""Tensor parallelism composed with FSDP (strategy.tp_size): the same math as one process, on 2-D and 3-D meshes.

With the same seed, data order and global batch, in fp32, the per-step losses of one process and of each layout
agree within 1e-5 relative over 10 optimizer steps: tp 2 alone, FSDP 2 x tp 2, and HYBRID_SHARD 2 x 1 x tp 2.
fp8's layers and LoRA's adapters split too.
"""

import json
from pathlib import Path

import pytest
import torch

from runner.compat import dtensor_flattens_a_sharded_sequence
from runner.engine.job import prepare_job
from runner.engine.loop import train
from tests.support.runs import logged, step_losses
from tests.support.specs import QUICK, resolved_spec
from tests.support.workers import run_in_workers, train_in_workers

STEPS = 10
# Global batch 8: micro batch 2 x 4 accumulation steps in one process and under tp 2 alone (one data-parallel rank),
# x 2 data-parallel ranks x 2 steps on four processes.
BASE = [
    *QUICK,
    f"train.max_steps={STEPS}",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=2",
    "train.save_model=false",
    "train.micro_batch_size=2",
    "data.seq_len=64",
]
TP = ["strategy=fsdp", "strategy.tp_size=2"]
LAYOUTS = {
    "tp 2": (2, [*TP, "train.grad_accum_steps=4"]),
    "fsdp 2 x tp 2": (4, [*TP, "train.grad_accum_steps=2"]),
    # Rank 0 alone builds the weights; the other ranks lay the model out on the meta device and receive their parts.
    "hybrid 2 x 1 x tp 2, rank 0 loads": (
        4,
        [
            *TP,
            "train.grad_accum_steps=2",
            "strategy.hybrid_shard_size=1",
            "strategy.sharding_strategy=HYBRID_SHARD",
            "strategy.cpu_ram_efficient_loading=true",
        ],
    ),
    # The whole logits' loss, and each block recomputed in backward with its collectives.
    "tp 2, full logits, activation checkpointing": (
        2,
        [*TP, "train.grad_accum_steps=4", "train.loss=full", "strategy.activation_checkpointing=true"],
    ),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single")
    train(prepare_job(resolved_spec([*BASE, "train.grad_accum_steps=4"]), run_dir))
    return step_losses(run_dir)


@pytest.fixture(scope="module")
def reference_full_logits(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single")
    train(prepare_job(resolved_spec([*BASE, "train.grad_accum_steps=4", "train.loss=full"]), run_dir))
    return step_losses(run_dir)


# fsdp 2 x tp 2 trains to the same losses in the checkpoint test below, which runs it.
@pytest.mark.distributed
@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if layout != "fsdp 2 x tp 2"])
def test_same_losses_as_one_process(layout, reference, reference_full_logits, tmp_path):
    nproc, overrides = LAYOUTS[layout]
    reference = reference_full_logits if "train.loss=full" in overrides else reference
    spec = resolved_spec([*BASE, f"hardware.nproc_per_node={nproc}", *overrides])
    train_in_workers([spec], [tmp_path], nproc=nproc)
    losses = step_losses(tmp_path)
    assert len(losses) == len(reference) == STEPS
    assert losses == pytest.approx(reference, rel=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("state_dict_type", ["FULL", "SHARDED"])
def test_a_checkpoint_of_fsdp_x_tp_resumes_under_fsdp_alone_and_in_one_process(state_dict_type, reference, tmp_path):
    """Trained under fsdp 2 x tp 2 with one process's losses, saved at step 5, resumed under fsdp 4 and in one
    process: the same losses from step 6 on.
    FULL gathers the whole model and optimizer state from both dimensions; SHARDED writes each rank's parts, and
    torch.distributed.checkpoint reads them into the other layouts' parts."""
    saved = tmp_path / "fsdp 2 x tp 2"
    nproc, overrides = LAYOUTS["fsdp 2 x tp 2"]
    written = f"strategy.state_dict_type={state_dict_type}"
    spec = resolved_spec([*BASE, f"hardware.nproc_per_node={nproc}", *overrides, written, "train.checkpoint_every=5"])
    train_in_workers([spec], [saved], nproc=nproc)
    checkpoint = f"resume={saved / 'checkpoints' / 'step_00000005'}"
    on_four = resolved_spec([*BASE, checkpoint, "hardware.nproc_per_node=4", "strategy=fsdp", written])
    train_in_workers([on_four], [tmp_path / "fsdp 4"], nproc=4)
    in_one = resolved_spec([*BASE, checkpoint, "train.grad_accum_steps=4"])
    (tmp_path / "single").mkdir()
    train(prepare_job(in_one, tmp_path / "single"))
    assert step_losses(saved) == pytest.approx(reference, rel=1e-5) and len(reference) == STEPS
    for resumed in ("fsdp 4", "single"):
        losses = logged(tmp_path / resumed, "loss")
        assert list(losses) == list(range(6, STEPS + 1))
        assert list(losses.values()) == pytest.approx(reference[5:], rel=1e-5)


LORA = ["adapter=lora", "adapter.rank=4", "train.save_model=true"]
# (torch 2.11: the run refuses LoRA under tensor parallelism before launch)
splits_lora = pytest.mark.skipif(
    not dtensor_flattens_a_sharded_sequence(), reason="this torch's DTensor cannot flatten a sharded sequence"
)


@pytest.mark.distributed
@splits_lora
def test_lora_adapters_split_with_their_layers(tmp_path):
    """LoRA under fsdp 2 x tp 2: each adapted layer's frozen base split by the plan, and of its adapter the matrix
    on the split side (B beside a layer split by columns, A by rows), the rank-sized other whole. The losses are one
    process's, the base stays frozen, the exported adapter is one process's, and a SHARDED checkpoint resumes in
    one process with the same losses."""
    from safetensors.torch import load_file

    (tmp_path / "single").mkdir()
    train(prepare_job(resolved_spec([*BASE, *LORA, "train.grad_accum_steps=4"]), tmp_path / "single"))
    nproc, layout = LAYOUTS["fsdp 2 x tp 2"]
    train_in_workers(
        [
            resolved_spec(
                [
                    *BASE,
                    *LORA,
                    f"hardware.nproc_per_node={nproc}",
                    *layout,
                    "strategy.state_dict_type=SHARDED",
                    "train.checkpoint_every=5",
                ]
            )
        ],
        [tmp_path / "tp"],
        nproc=nproc,
    )
    reference = step_losses(tmp_path / "single")
    assert len(reference) == STEPS and reference[-1] < reference[0]
    assert step_losses(tmp_path / "tp") == pytest.approx(reference, rel=1e-5)
    (tmp_path / "resumed").mkdir()
    train(
        prepare_job(
            resolved_spec(
                [
                    *BASE,
                    *LORA,
                    "train.grad_accum_steps=4",
                    "train.save_model=false",
                    f"resume={tmp_path / 'tp' / 'checkpoints' / 'step_00000005'}",
                ]
            ),
            tmp_path / "resumed",
        )
    )
    resumed = logged(tmp_path / "resumed", "loss")
    assert list(resumed) == list(range(6, STEPS + 1))
    assert list(resumed.values()) == pytest.approx(reference[5:], rel=1e-5)
    exported, expected = (load_file(tmp_path / run / "model" / "adapter_model.safetensors") for run in ("tp", "single"))
    assert sorted(exported) == sorted(expected) and len(expected) == 2 * 7 * 2
    for name, tensor in expected.items():
        torch.testing.assert_close(exported[name], tensor, rtol=1e-4, atol=1e-6)


def _trained_and_frozen_on_this_rank(ranks, spec, run_dir):
    job = prepare_job(spec, Path(run_dir), ranks)
    local = {True: 0, False: 0}
    for parameter in job.model.parameters():
        local[parameter.requires_grad] += parameter.to_local().numel()
    return local


@pytest.mark.distributed
@splits_lora
def test_the_estimate_counts_each_tensor_parallel_rank_s_parts_of_the_adapters_and_the_base(tmp_path):
    """tp 2 on 2 processes (one data-parallel rank: FSDP shards nothing): the trained and frozen elements rank 0
    holds are the estimate's (rank 1 holds one vocabulary row fewer of the byte tokenizer's odd vocabulary)."""
    from runner.memory.model_shapes import facts_of
    from runner.memory.parameters import parameters_of

    spec = resolved_spec([*BASE, *LORA, "hardware.nproc_per_node=2", *TP])
    held = run_in_workers(_trained_and_frozen_on_this_rank, spec, str(tmp_path), nproc=2)
    parameters = parameters_of(spec, facts_of(spec.model))
    assert held[0] == {True: parameters.trained, False: parameters.frozen_parameters}
    assert held[1] == {
        True: parameters.trained,
        False: parameters.frozen_parameters - spec.model.architecture["hidden_size"],
    }
    assert parameters.trained < parameters_of(resolved_spec([*BASE, *LORA]), facts_of(spec.model)).trained


FP8 = ["precision=fp8", "precision.fp8.emulate=true", "precision.fp8.min_features=16", "precision.compute_dtype=fp32"]


@pytest.mark.distributed
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_layers_split_with_scales_of_the_whole_tensor(recipe, tmp_path):
    """torchao's float8 layers split by the plan: each scale is taken over the whole tensor (DTensor's amax across
    the tensor-parallel ranks), so the first step's loss, the forward of the same weights, is one process's to
    float32's rounding (1e-6 measured); scales from each rank's part alone (tried) move it by 6e-4. After that
    step, fp8's rounding of sums added in another order moves the losses apart (tensorwise: 2.2e-4 by step 4)."""
    overrides = [*BASE, *FP8, f"precision.fp8.recipe={recipe}", "train.max_steps=4"]
    (tmp_path / "single").mkdir()
    train(prepare_job(resolved_spec([*overrides, "train.grad_accum_steps=4"]), tmp_path / "single"))
    nproc, layout = LAYOUTS["tp 2"]
    train_in_workers(
        [resolved_spec([*overrides, f"hardware.nproc_per_node={nproc}", *layout])], [tmp_path / "tp"], nproc=nproc
    )
    reference, losses = step_losses(tmp_path / "single"), step_losses(tmp_path / "tp")
    assert len(losses) == len(reference) == 4
    assert losses[0] == pytest.approx(reference[0], rel=1e-5)
    assert losses == pytest.approx(reference, rel=2e-3)
    summary = json.loads((tmp_path / "tp" / "summary.json").read_text())
    assert summary["precision"]["fp8_linear_layers"] == 14


def _mesh_places(ranks, dims):
    """This rank's place on the job's mesh, as DTensor's mesh gives it and as the data loader is told it."""
    mesh = dims.mesh("cpu")
    batch = mesh["dp_replicate", "dp_shard"]
    return {
        "batch": batch.get_local_rank(0) * batch.size(1) + batch.get_local_rank(1),
        "tp": mesh.get_local_rank("tp"),
        "dp_rank": dims.dp_rank(ranks.rank),
        "counted": dims.counted(ranks.rank),
    }


@pytest.mark.distributed
def test_the_data_loader_is_told_its_place_on_the_mesh_batch_dimension():
    """On a 2 x 2 x 2 mesh of 8 processes (HYBRID_SHARD x tp): the data-parallel rank each process reads for is its
    coordinate along dp_replicate x dp_shard, and one rank of each tensor-parallel group counts in sums."""
    from runner.parallel.dims import ParallelDims
    from tests.support.workers import run_in_workers

    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=2)
    places = run_in_workers(_mesh_places, dims, nproc=8)
    assert [place["batch"] for place in places] == [place["dp_rank"] for place in places] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [place["tp"] for place in places] == [0, 1] * 4
    assert [place["counted"] for place in places] == [True, False] * 4


def test_the_estimate_splits_parameters_and_activations_over_the_tensor_parallel_ranks():
    """Llama-3-8B on 8 H100s: fsdp 4 x tp 2 holds the same 1/8 of the weights as fsdp 8 (to the shards' padding),
    half its activations but for the head's gathered input, and a fit check short of memory proposes tp."""
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
    ]
    fsdp = resolved_spec(overrides)
    split = resolved_spec([*overrides, "strategy.tp_size=2"])
    facts = facts_of(fsdp.model)
    whole, parts = estimate(fsdp, facts), estimate(split, facts)
    assert parts.weights.bytes == pytest.approx(whole.weights.bytes, rel=1e-3)
    assert parts.optimizer_states.bytes == pytest.approx(whole.optimizer_states.bytes, rel=1e-3)
    assert whole.activations.bytes / 2 < parts.activations.bytes < whole.activations.bytes / 2 * 1.02
    assert "a 1/4 shard of its 1/2 tensor-parallel part" in parts.weights.note


def test_a_run_that_fits_only_split_is_told_to_split():
    from runner.errors import SpecError
    from runner.memory.advice import check_fit

    long = resolved_spec(
        [
            "task=estimate",
            "model=llama3_8b",
            "strategy=fsdp",
            "precision=bf16",
            "hardware=8xh100_80gb",
            "data.seq_len=32768",
            "train.micro_batch_size=1",
        ]
    )
    with pytest.raises(SpecError, match=r"it fits with: .*strategy\.tp_size=4"):
        check_fit(long)
