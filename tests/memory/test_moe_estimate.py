"""The estimate of mixture-of-experts models (runner/memory/expert_memory.py): the experts read off the meta model, the
published models' parameter counts, the per-device share of the experts under expert parallelism, the fit check's
strategy.ep_size, and what each rank really holds of a tiny MoE model."""

from pathlib import Path

import pytest

from runner.memory.advice import cheapest_fits
from runner.memory.breakdown import estimate
from runner.memory.model_shapes import facts_of
from runner.memory.report import report
from tests.support.held import assert_estimate_holds, held_bytes
from tests.support.specs import QUICK, composed, resolved_spec
from tests.support.workers import run_in_workers

GIB = 1024**3
QWEN3_8XH100 = ["model=qwen3_30b_a3b", "hardware=8xh100_80gb", "strategy=fsdp", "precision=bf16"]


@pytest.mark.parametrize(
    "model, total, active, experts",
    [
        # published: 30.5B, 3.3B active (3.35B); 128 experts of width 768, 8 per token, in all 48 layers
        ("qwen3_30b_a3b", 30.5e9, 3.3e9, (128, 8, 768, 48)),
        # published: 20.9B, 3.6B active without the 0.58B embedding table (OpenAI's count)
        ("gpt_oss_20b", 20.9e9, 3.6e9 + 201_088 * 2880, (32, 4, 2880, 24)),
        ("mixtral_8x7b", 46.7e9, 12.9e9, (8, 2, 14336, 32)),
    ],
)
def test_the_published_moe_models_count_their_parameters_and_active_ones(model, total, active, experts):
    facts = facts_of(composed([f"model={model}"]).model)
    found = facts.experts
    assert (found.routed, found.top_k, found.width, len(found.moe_layers)) == experts
    assert facts.parameters == pytest.approx(total, rel=0.005)
    assert facts.active_parameters == pytest.approx(active, rel=0.02)


def test_deepseek_v3s_dense_first_layers_and_shared_experts_are_read_off_the_model(tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model(
        "deepseek_v3",
        hidden_size=64,
        intermediate_size=160,
        moe_intermediate_size=32,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        vocab_size=300,
    ).save_pretrained(tmp_path)
    facts = facts_of(composed(["model=pretrained", f"model.pretrained={tmp_path}"]).model)
    found = facts.experts
    assert (found.routed, found.top_k, found.width, found.moe_layers, found.shared_width) == (8, 2, 32, (1, 2), 64)
    assert found.parameters == 2 * 8 * 3 * 64 * 32
    assert facts.active_parameters == facts.parameters - 2 * (8 - 2) * 3 * 64 * 32


def test_the_experts_share_per_device_falls_with_expert_parallelism():
    """Qwen3-30B-A3B on 8 H100s: FULL_SHARD holds 1/8 of the experts at any ep_size; what falls is what a layer
    all-gathers of them (each rank its own 128 / ep), with a MoE layer's all-to-all buffers beside it."""
    shares, texts = [], []
    for ep in (1, 2, 4, 8):
        spec = composed([*QWEN3_8XH100, f"strategy.ep_size={ep}"])
        shares.append(estimate(spec, facts_of(spec.model)).experts.bytes)
        texts.append(report(spec))
    assert shares == sorted(shares, reverse=True) and len(set(shares)) == 4
    assert "of which experts          57.38 GiB  128 of 128 routed experts x 48 MoE layers" in texts[0]
    assert "16 of 128 routed experts x 48 MoE layers on each of 8 expert-parallel ranks" in texts[3]
    assert "54.00 GiB held, 432.00 MiB all-gathered, 128.00 MiB of all-to-all buffers (16-bit)" in texts[3]


def test_the_dispatched_tokens_activations_are_k_experts_per_token():
    """Without checkpointing a MoE layer saves, per token, k experts' gated MLP where a dense layer saves one: 8
    experts of width 768 for Qwen3-30B-A3B, beside their inputs and outputs (2 h each) and the router's scores."""
    spec = composed([*QWEN3_8XH100, "train.micro_batch_size=1", "data.seq_len=1024"])
    facts = facts_of(spec.model)
    tokens, h, c = 1024, 2048, 2
    moe = estimate(spec, facts).activations.bytes
    # the dense MLP the experts take the place of (Qwen3-MoE's has no gate_proj to read a gated MLP off)
    dense_mlp = (3 * c + c if facts.layer.gated_mlp else c + c) * facts.layer.intermediate
    experts = 8 * (2 * c * h + (3 * c + c) * 768) + 128 * (c + 4)
    facts.experts, saved = None, facts.experts
    try:
        dense = estimate(spec, facts).activations.bytes
    finally:
        facts.experts = saved
    assert moe - dense == tokens * 48 * (experts - dense_mlp)


def test_the_fit_check_proposes_expert_parallelism_where_it_lowers_the_peak():
    """Pure bf16 Qwen3-30B-A3B on 8 GPUs under plain SGD peaks in backward, where a layer's experts are
    all-gathered: given memory between that peak and ep_size=8's, the fit check names strategy.ep_size, and only
    sizes that divide the 128 experts and the 8 shards."""
    base = [*QWEN3_8XH100, "precision=pure_bf16", "optim=sgd", "optim.momentum=0", "train.micro_batch_size=1"]
    peaks = {}
    for ep in (1, 8):
        spec = composed([*base, f"strategy.ep_size={ep}", "strategy.activation_checkpointing=true"])
        peaks[ep] = estimate(spec, facts_of(spec.model)).peak
    assert peaks[8] < peaks[1]
    memory = (peaks[1] + peaks[8]) / 2 / GIB
    spec = composed([*base, "strategy.activation_checkpointing=true", f"hardware.device_memory_gib={memory}"])
    proposed = [change.overrides for change, _ in cheapest_fits(spec, facts_of(spec.model))]
    assert any(override.startswith("strategy.ep_size=") for overrides in proposed for override in overrides)
    assert not {"strategy.ep_size=3", "strategy.ep_size=16"} & {o for overrides in proposed for o in overrides}


# ---- what each rank holds of a tiny MoE model, against the estimate

TINY_MOE = [*QUICK, "model=tiny_qwen3_moe", "train.micro_batch_size=2"]


def test_one_process_holds_what_the_estimate_says_of_a_moe_model():
    from runner.distributed import Ranks

    spec = resolved_spec(TINY_MOE)
    assert_estimate_holds({"single": spec}, [held_bytes(Ranks(), {"single": spec})])


EXPERTS_RUNTIME = Path(__file__).parents[2] / "runner" / "parallel" / "experts.py"
TWO_RANK_MOE = {
    "fsdp": ["strategy=fsdp"],
    "fsdp, experts over 2 ranks": pytest.param(
        ["strategy=fsdp", "strategy.ep_size=2"],
        marks=pytest.mark.skipif(not EXPERTS_RUNTIME.exists(), reason="expert parallelism runtime not merged yet"),
    ),
}


@pytest.mark.distributed
@pytest.mark.parametrize("overrides", list(TWO_RANK_MOE.values()), ids=list(TWO_RANK_MOE))
def test_each_rank_holds_what_the_estimate_says_of_a_moe_model(overrides):
    spec = resolved_spec([*TINY_MOE, *overrides, "hardware.nproc_per_node=2"])
    held = run_in_workers(held_bytes, {"case": spec}, nproc=2)
    assert_estimate_holds({"case": spec}, held)
