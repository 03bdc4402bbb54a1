"""MoE models under every strategy, adapter and precision that runs on the CPU, with the router's losses on.

The router's terms are each micro batch's, weighted as the mean over the global batch's micro batches, so two
data-parallel ranks x 2 accumulation steps under DDP, FSDP (full and hybrid shard) and DeepSpeed ZeRO-2 and 3 log
the losses, the router's terms, the experts' load and the gradient norm of one process x 4 accumulation steps.
"""

import math

import pytest

from runner.engine.job import prepare_job
from runner.engine.loop import train
from tests.support.runs import logged
from tests.support.specs import QUICK_STEPS, resolved_spec
from tests.support.workers import train_in_workers

STEPS = 3
BASE = [
    *QUICK_STEPS,
    f"train.max_steps={STEPS}",
    "train.log_every=1",
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "train.save_model=false",
    "train.micro_batch_size=2",
    "data.seq_len=32",
]
ROUTER = ["model.router_aux_loss_coef=0.01", "model.router_z_loss_coef=0.001"]
QWEN3_MOE = ["model=tiny_qwen3_moe", *ROUTER]
FSDP = ["strategy=fsdp"]
LAYOUTS = {
    "ddp": ["strategy=ddp"],
    "fsdp FULL_SHARD": FSDP,
    "fsdp HYBRID_SHARD (2 x 1)": [*FSDP, "strategy.sharding_strategy=HYBRID_SHARD", "strategy.hybrid_shard_size=1"],
    "deepspeed ZeRO-2": ["strategy=deepspeed", "strategy.zero_stage=2"],
    "deepspeed ZeRO-3": ["strategy=deepspeed", "strategy.zero_stage=3"],
}
# The other MoE models, a sharded strategy each: they train, their router's terms logged.
OTHER_MODELS = {
    "tiny_mixtral, fsdp FULL_SHARD": ["model=tiny_mixtral", *FSDP],
    "tiny_gpt_oss, deepspeed ZeRO-3": ["model=tiny_gpt_oss", "strategy=deepspeed", "strategy.zero_stage=3"],
}
COMPARED = ["loss", "grad_norm", "router/aux_loss", "router/z_loss", "router/load_max_over_mean", "router/dead_experts"]


def figures(run_dir) -> dict[str, list[float]]:
    return {key: list(logged(run_dir, key).values()) for key in COMPARED}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single")
    train(prepare_job(resolved_spec([*BASE, *QWEN3_MOE, "train.grad_accum_steps=4"]), run_dir))
    return figures(run_dir)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    two = ["hardware.nproc_per_node=2", "train.grad_accum_steps=2"]
    variants = {
        **{name: [*QWEN3_MOE, *overrides] for name, overrides in LAYOUTS.items()},
        **{name: [*ROUTER, *overrides] for name, overrides in OTHER_MODELS.items()},
    }
    specs = [resolved_spec([*BASE, *two, *overrides]) for overrides in variants.values()]
    run_dirs = [tmp_path_factory.mktemp(name.split()[0].strip(",")) for name in variants]
    train_in_workers(specs, run_dirs)
    return {name: figures(run_dir) for name, run_dir in zip(variants, run_dirs)}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_moe_models_objective_is_the_same_on_every_layout(layout, one_process, two_ranks):
    found = two_ranks[layout]
    assert len(one_process["router/aux_loss"]) == STEPS
    for key in COMPARED:
        assert found[key] == pytest.approx(one_process[key], rel=1e-4, abs=1e-6), key


@pytest.mark.distributed
@pytest.mark.parametrize("variant", OTHER_MODELS)
def test_the_other_moe_models_train_sharded(variant, two_ranks):
    found = two_ranks[variant]
    assert len(found["loss"]) == STEPS and all(math.isfinite(loss) for loss in found["loss"])
    assert all(aux > 0 for aux in found["router/aux_loss"])


SINGLE = {
    "tiny_qwen3_moe, lora": ["model=tiny_qwen3_moe", "adapter=lora"],
    "tiny_mixtral, qlora": ["model=tiny_mixtral", "adapter=qlora"],
    "tiny_gpt_oss, bf16": ["model=tiny_gpt_oss", "precision=bf16"],
    "tiny_qwen3_moe, fp16": ["model=tiny_qwen3_moe", "precision=fp16"],
    "tiny_mixtral, fp8 (emulated)": [
        "model=tiny_mixtral",
        "precision=fp8",
        "precision.fp8.emulate=true",
        "precision.fp8.min_features=16",
    ],
    "tiny_deepseek_v3": ["model=tiny_deepseek_v3"],
}


@pytest.mark.slow
def test_moe_models_train_with_each_adapter_and_precision(tmp_path):
    for index, (variant, overrides) in enumerate(SINGLE.items()):
        run_dir = tmp_path / str(index)
        run_dir.mkdir()
        spec = resolved_spec([*BASE, "train.max_steps=2", *ROUTER, *overrides])
        train(prepare_job(spec, run_dir))
        losses, aux = logged(run_dir, "loss"), logged(run_dir, "router/aux_loss")
        assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses.values()), variant
        assert all(value > 0 for value in aux.values()), variant
