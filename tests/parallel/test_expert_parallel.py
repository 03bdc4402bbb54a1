"""Expert parallelism (strategy.ep_size) does not change the math: beside the dense strategies' equivalence
(tests/strategies/test_equivalence.py), a tiny Qwen3-MoE and a tiny Mixtral trained with their experts split over
ep ranks, alone (ep 2 on two processes), under FSDP (2 x ep 2 on four) and under HSDP (2 replicas of one ep 2 shard
group), log one process's losses (to 1e-5) and gradient norms (to 1e-3: the router's terms add rounding), the router's
auxiliary loss included; checkpoints written at one expert layout resume at another; the export loads with
from_pretrained and gives the trained model's logits.
"""

import re
from pathlib import Path

import pytest
import torch

from runner.engine.job import prepare_job
from runner.engine.loop import train
from runner.errors import SpecError
from tests.support.command import run_cli
from tests.support.exports import exported_logits
from tests.support.runs import kill_at_step, logged, step_losses
from tests.support.specs import QUICK_STEPS, resolved_spec
from tests.support.workers import train_in_workers

STEPS = 20
MODELS = ("tiny_qwen3_moe", "tiny_mixtral")
# Global batch 8: micro batch 2 x 4 accumulation steps on one process, x 2 on two, x 1 on four.
BASE = [
    *QUICK_STEPS,
    f"train.max_steps={STEPS}",
    "train.log_every=1",
    "train.eval_every=0",
    "train.micro_batch_size=2",
    "data.seq_len=64",
    "train.checkpoint_every=10",
]
EP = ["strategy=fsdp", "strategy.ep_size=2"]
TWO = ["hardware.nproc_per_node=2", "train.grad_accum_steps=2"]
FOUR = ["hardware.nproc_per_node=4", "train.grad_accum_steps=1"]
ON_FOUR = {
    "fsdp 2 x ep 2, qwen3_moe": ["model=tiny_qwen3_moe", *EP, "strategy.state_dict_type=SHARDED"],
    "fsdp 2 x ep 2, mixtral": ["model=tiny_mixtral", *EP],
    "hsdp 2 x (1 x ep 2), qwen3_moe": [
        "model=tiny_qwen3_moe",
        *EP,
        "strategy.sharding_strategy=HYBRID_SHARD",
        "strategy.hybrid_shard_size=2",
    ],
}
ON_TWO = {f"ep 2, {model.removeprefix('tiny_')}": [f"model={model}", *EP] for model in MODELS}
# LoRA on the attention of a model whose frozen experts are split over ep (runner/components/lora.py).
ADAPTED = {"ep 2 lora, qwen3_moe": ["model=tiny_qwen3_moe", *EP, "adapter=lora", "adapter.merge=true"]}


def grad_norms(run_dir: Path) -> list[float]:
    return list(logged(run_dir, "grad_norm").values())


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, Path]:
    runs = {}
    for model in MODELS:
        runs[model] = tmp_path_factory.mktemp(model)
        train(prepare_job(resolved_spec([*BASE, f"model={model}", "train.grad_accum_steps=4"]), runs[model]))
    return runs


@pytest.fixture(scope="module")
def expert_parallel(tmp_path_factory) -> dict[str, Path]:
    """Each layout's run; then ep 2 resumed from fsdp 2 x ep 2's step-10 checkpoint (SHARDED), and one process from
    ep 2's (FULL)."""
    runs = {}
    for nproc, variants, processes in ((4, ON_FOUR, FOUR), (2, {**ON_TWO, **ADAPTED}, TWO)):
        dirs = [tmp_path_factory.mktemp("ep") for _ in variants]
        train_in_workers([resolved_spec([*BASE, *processes, *v]) for v in variants.values()], dirs, nproc=nproc)
        runs.update(zip(variants, dirs))
    step_10 = Path("checkpoints") / "step_00000010"
    runs["ep 2 resumed from fsdp 2 x ep 2"] = resumed = tmp_path_factory.mktemp("resumed")
    checkpoint = runs["fsdp 2 x ep 2, qwen3_moe"] / step_10
    train_in_workers([resolved_spec([*BASE, *TWO, *ON_TWO["ep 2, qwen3_moe"], f"resume={checkpoint}"])], [resumed])
    runs["one process resumed from ep 2"] = resumed = tmp_path_factory.mktemp("resumed")
    checkpoint = runs["ep 2, qwen3_moe"] / step_10
    spec = resolved_spec([*BASE, "model=tiny_qwen3_moe", "train.grad_accum_steps=4", f"resume={checkpoint}"])
    train(prepare_job(spec, resumed))
    return runs


@pytest.mark.distributed
@pytest.mark.parametrize("variant", [*ON_FOUR, *ON_TWO])
def test_same_losses_as_one_process(variant, one_process, expert_parallel):
    reference = one_process["tiny_mixtral" if "mixtral" in variant else "tiny_qwen3_moe"]
    losses = step_losses(expert_parallel[variant])
    assert len(losses) == STEPS
    assert losses == pytest.approx(step_losses(reference), rel=1e-5, abs=0)
    assert grad_norms(expert_parallel[variant]) == pytest.approx(grad_norms(reference), rel=1e-3)
    aux_losses = logged(reference, "router/aux_loss")
    assert len(aux_losses) == STEPS and all(aux > 0 for aux in aux_losses.values())
    assert logged(expert_parallel[variant], "router/aux_loss") == pytest.approx(aux_losses, rel=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("variant", ["ep 2 resumed from fsdp 2 x ep 2", "one process resumed from ep 2"])
def test_a_checkpoint_resumes_at_another_expert_layout(variant, one_process, expert_parallel):
    resumed = logged(expert_parallel[variant], "loss")
    reference = logged(one_process["tiny_qwen3_moe"], "loss")
    assert sorted(resumed) == list(range(11, STEPS + 1))
    assert [resumed[step] for step in sorted(resumed)] == pytest.approx(
        [reference[step] for step in sorted(resumed)], rel=1e-5, abs=0
    )


@pytest.mark.distributed
@pytest.mark.signals
def test_kill_and_resume_under_expert_parallelism_gives_the_same_losses(one_process, tmp_path):
    """SIGKILL at step 13, `resume=auto` from step 10's checkpoint: the losses of the run that was not killed."""
    run_dir = kill_at_step([*BASE, *TWO, *ON_TWO["ep 2, qwen3_moe"]], tmp_path, 13)
    resumed = run_cli("resume=auto", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    losses = logged(run_dir, "loss")
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert list(losses.values()) == pytest.approx(step_losses(one_process["tiny_qwen3_moe"]), rel=1e-5, abs=0)


@pytest.mark.distributed
def test_the_export_gives_the_trained_model_s_logits(one_process, expert_parallel):
    """Whole experts in the export: from_pretrained of ep 2's model gives one process's trained model's logits."""
    from transformers import AutoModelForCausalLM

    exported, trained = (
        AutoModelForCausalLM.from_pretrained(run / "model")
        for run in (expert_parallel["ep 2, qwen3_moe"], one_process["tiny_qwen3_moe"])
    )
    tokens = torch.randint(3, 200, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(exported(tokens).logits, trained(tokens).logits, atol=1e-5)
    experts = exported.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape[0] == experts.num_experts == 8


@pytest.mark.distributed
def test_a_lora_export_under_expert_parallelism_loads_with_peft(expert_parallel):
    """The adapter (peft's format, on the base saved beside it) and the merged model give the same logits."""
    adapter_logits, merged_logits = exported_logits(expert_parallel["ep 2 lora, qwen3_moe"] / "model")
    torch.testing.assert_close(adapter_logits, merged_logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "overrides,refusal",
    [
        (["model=tiny_llama", *EP, *TWO], "strategy.ep_size=2 splits a MoE model's experts, and model llama has none"),
        (["model=tiny_mixtral", "strategy=fsdp", "strategy.ep_size=8", "hardware.nproc_per_node=8"], "does not divide"),
        (
            ["model=tiny_qwen3_moe", *EP, "strategy.sharding_strategy=NO_SHARD", *TWO],
            "borrows its ranks from FSDP's 1 data-parallel shard(s)",
        ),
        (["model=tiny_qwen3_moe", *EP, "strategy.tp_size=2", *TWO], "with strategy.tp_size=2: not composed yet"),
    ],
    ids=["dense model", "more ranks than experts", "no shards to borrow", "tensor parallel"],
)
def test_a_layout_expert_parallelism_cannot_run_is_refused_before_launch(overrides, refusal):
    with pytest.raises(SpecError, match=re.escape(refusal)):
        resolved_spec([*BASE, *overrides])


def _route_every_token_to_rank_0s_experts(ranks) -> list[bool]:
    """A Qwen3-MoE experts module split over 2 ranks, every token of both routed to rank 0's experts: forward and
    backward; whether each expert parameter got a gradient."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from runner.parallel.experts import shard_experts

    config = AutoConfig.for_model("qwen3_moe", hidden_size=16, moe_intermediate_size=8, num_experts=4)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config)
    for parameter in block.experts.parameters():
        torch.nn.init.normal_(parameter)
    shard_experts(block, init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)))
    hidden = torch.randn(6, 16, requires_grad=True)
    chosen = torch.tensor([[0, 1]] * 6)  # experts 0 and 1: rank 0's two
    block.experts(hidden, chosen, torch.full((6, 2), 0.5)).sum().backward()
    return [parameter.grad is not None for parameter in block.experts.parameters()] + [hidden.grad is not None]


@pytest.mark.distributed
def test_a_rank_whose_experts_get_no_token_still_joins_the_backward():
    """Rank 1's experts receive no row: its backward still takes its turn in both all-to-alls (else rank 0 would
    wait for it for ever) and leaves its experts zero gradients for FSDP's reduce-scatter, not none."""
    from tests.support.workers import run_in_workers

    assert run_in_workers(_route_every_token_to_rank_0s_experts, nproc=2) == [[True, True, True]] * 2
