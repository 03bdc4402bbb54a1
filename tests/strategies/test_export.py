"""The final model of every strategy, gathered from its shards, loads in plain transformers as trained."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from runner.engine.job import prepare_job
from runner.engine.loop import train
from runner.strategies.strategy_protocol import parameter_count, unwrapped
from tests.support import DATA
from tests.support.specs import QUICK, resolved_spec
from tests.support.workers import run_in_workers

pytestmark = pytest.mark.distributed

PROBE = torch.tensor([[3, 40, 41, 42, 10, 99, 100, 7]])
STRATEGIES = {
    "ddp": ["strategy=ddp"],
    "fsdp": ["strategy=fsdp"],
    "fsdp sharded, offloaded": ["strategy=fsdp", "strategy.state_dict_type=SHARDED", "strategy.offload_params=true"],
    # ZeRO-3 keeps parameters under 100k elements whole, which would be all of this small model's.
    "deepspeed ZeRO-3": [
        "strategy=deepspeed",
        "strategy.zero_stage=3",
        f"strategy.config_file={DATA / 'zero3_partition_every_parameter.json'}",
    ],
}


def _train_and_probe(ranks, specs, run_dirs):
    """Trains each spec, then returns the final model directory, the trained model's logits on PROBE, its dtype and
    the parameter count the loop logs (and computes MFU from)."""
    results = []
    for spec, run_dir in zip(specs, run_dirs):
        job = prepare_job(spec, Path(run_dir), ranks)
        summary = train(job)
        job.model.eval()
        with torch.no_grad():
            # Every rank runs the forward: the sharded strategies gather parameters collectively.
            logits = job.model(input_ids=PROBE.to(job.device)).logits.float().cpu()
        results.append((summary["model_dir"], logits, str(unwrapped(job.model).dtype), parameter_count(job.model)))
    return results


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    specs = [
        resolved_spec(
            [
                *QUICK,
                *overrides,
                "hardware.nproc_per_node=2",
                "train.max_steps=3",
                "train.eval_every=0",
                "train.micro_batch_size=2",
            ]
        )
        for overrides in STRATEGIES.values()
    ]
    run_dirs = [str(tmp_path_factory.mktemp(name.split()[0])) for name in STRATEGIES]
    return dict(zip(STRATEGIES, run_in_workers(_train_and_probe, specs, run_dirs, nproc=2)[0]))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_exported_model_gives_the_trained_logits(strategy, exported):
    model_dir, trained_logits, _, _ = exported[strategy]
    reloaded = AutoModelForCausalLM.from_pretrained(model_dir)
    assert reloaded.dtype == torch.float32
    assert all(p.numel() > 0 for p in reloaded.parameters())  # real weights, not ZeRO-3's empty placeholders
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=PROBE).logits, trained_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_parameter_count_is_the_whole_models_however_it_is_sharded(strategy, exported):
    model_dir, _, _, counted = exported[strategy]
    assert counted == sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
