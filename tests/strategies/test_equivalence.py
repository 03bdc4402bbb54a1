"""The product's contract: swapping the strategy does not change the math.

With the same seed, data order and global batch, in fp32, the per-step losses of one process with gradient
accumulation, of DDP, of FSDP under each sharding strategy and wrap policy, and of DeepSpeed ZeRO 0-3 agree within
1e-4 relative over
10 optimizer steps, and so do the gradient norms they log. Activation checkpointing, under any strategy, changes
none of them.
"""

import pytest

from runner.config.scheduler import lr_factor
from runner.engine.job import prepare_job
from runner.engine.loop import train
from tests.support.runs import logged, step_losses
from tests.support.specs import QUICK, resolved_spec
from tests.support.workers import train_in_workers

STEPS = 10
# Global batch 8 = micro batch 2 x 4 accumulation steps in one process, or x 2 ranks x 2 steps.
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
TWO_RANKS = ["hardware.nproc_per_node=2", "train.grad_accum_steps=2"]
FSDP = ["strategy=fsdp"]
VARIANTS = {
    "ddp": ["strategy=ddp"],
    "fsdp FULL_SHARD": FSDP,
    "fsdp SHARD_GRAD_OP": [*FSDP, "strategy.sharding_strategy=SHARD_GRAD_OP"],
    "fsdp NO_SHARD": [*FSDP, "strategy.sharding_strategy=NO_SHARD"],
    "fsdp HYBRID_SHARD (2 x 1)": [*FSDP, "strategy.sharding_strategy=HYBRID_SHARD", "strategy.hybrid_shard_size=1"],
    "fsdp HYBRID_SHARD_ZERO2 (1 x 2)": [
        *FSDP,
        "strategy.sharding_strategy=HYBRID_SHARD_ZERO2",
        "strategy.hybrid_shard_size=2",
    ],
    "fsdp SIZE_BASED_WRAP": [*FSDP, "strategy.auto_wrap_policy=SIZE_BASED_WRAP", "strategy.min_num_params=30000"],
    "fsdp NO_WRAP": [*FSDP, "strategy.auto_wrap_policy=NO_WRAP"],
    "fsdp activation checkpointing, prefetch": [
        *FSDP,
        "strategy.activation_checkpointing=true",
        "strategy.forward_prefetch=1",
        "strategy.backward_prefetch=2",
    ],
    "fsdp offload_params": [*FSDP, "strategy.offload_params=true"],
    "fsdp cpu_ram_efficient_loading": [*FSDP, "strategy.cpu_ram_efficient_loading=true"],
    **{f"deepspeed ZeRO-{stage}": ["strategy=deepspeed", f"strategy.zero_stage={stage}"] for stage in range(4)},
    "deepspeed ZeRO-3 offload": [
        "strategy=deepspeed",
        "strategy.zero_stage=3",
        "strategy.offload_optimizer=cpu",
        "strategy.offload_param=cpu",
    ],
    # Activation checkpointing recomputes the same forward under every strategy, not FSDP's only.
    "ddp activation checkpointing": ["strategy=ddp", "strategy.activation_checkpointing=true"],
    "deepspeed ZeRO-2 activation checkpointing": [
        "strategy=deepspeed",
        "strategy.zero_stage=2",
        "strategy.activation_checkpointing=true",
    ],
}


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single")
    spec = resolved_spec([*BASE, "train.grad_accum_steps=4"])
    train(prepare_job(spec, run_dir))
    return spec, run_dir


@pytest.fixture(scope="module")
def reference(reference_run):
    return step_losses(reference_run[1])


def grad_norms(run_dir) -> list[float]:
    return list(logged(run_dir, "grad_norm").values())


@pytest.mark.slow
def test_scheduler_steps_once_per_optimizer_step(reference_run):
    spec, run_dir = reference_run
    rates = logged(run_dir, "lr")
    assert list(rates) == list(range(1, STEPS + 1))
    for step, lr in rates.items():
        assert lr == pytest.approx(spec.optim.lr * lr_factor(spec.scheduler, step, STEPS))


@pytest.fixture(scope="module")
def two_rank_losses(tmp_path_factory):
    specs = [resolved_spec([*BASE, *TWO_RANKS, *overrides]) for overrides in VARIANTS.values()]
    run_dirs = [tmp_path_factory.mktemp(name.split()[0]) for name in VARIANTS]
    train_in_workers(specs, run_dirs)
    return {name: (step_losses(run_dir), grad_norms(run_dir)) for name, run_dir in zip(VARIANTS, run_dirs)}


@pytest.mark.distributed
@pytest.mark.parametrize("variant", VARIANTS)
def test_same_losses_as_one_process(variant, reference_run, reference, two_rank_losses):
    losses, norms = two_rank_losses[variant]
    assert len(losses) == len(reference) == STEPS
    assert losses == pytest.approx(reference, rel=1e-4)
    assert losses[-1] < losses[0]
    assert norms == pytest.approx(grad_norms(reference_run[1]), rel=1e-4)


@pytest.mark.slow
def test_activation_checkpointing_in_one_process_keeps_the_losses(reference, tmp_path):
    spec = resolved_spec([*BASE, "train.grad_accum_steps=4", "strategy.activation_checkpointing=true"])
    job = prepare_job(spec, tmp_path)
    # the flag each block carries in every transformers version (is_activation_checkpointing, the model's, is 5.23's)
    assert any(getattr(module, "gradient_checkpointing", False) for module in job.model.modules())
    train(job)
    assert step_losses(tmp_path) == pytest.approx(reference, rel=1e-6)
