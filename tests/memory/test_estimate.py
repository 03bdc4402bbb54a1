"""The memory estimate: accelerate's reference table to the hundredth, Llama-3-8B's counts, the bytes each rank's
tensors really hold under every strategy, the fit check of the seed scenario, and `run task=estimate`."""

import math
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from runner.distributed import Ranks
from runner.errors import SpecError
from runner.memory import model_shapes as model_facts
from runner.memory.accelerate_view import accelerate_bytes, accelerate_sizes, format_accelerate_view
from runner.memory.activations import ActivationDtypes, activation_bytes, layer_activation_bytes
from runner.memory.advice import cheapest_fits, check_fit, fit
from runner.memory.breakdown import estimate, gib
from runner.memory.model_shapes import LayerShape, facts_of, meta_model
from runner.memory.report import report
from tests.support.command import run_cli
from tests.support.held import assert_estimate_holds, held_bytes
from tests.support.specs import QUICK, composed, resolved_spec
from tests.support.workers import run_in_workers

GIB = 1024**3


# ---- accelerate's reference table and Llama-3-8B's counts


def test_accelerate_view_reproduces_the_reference_table_for_bert_base_cased():
    model = meta_model(composed(["model=bert_base_cased"]).model)
    rows = {dtype: [accelerate_bytes(size) for size in sizes] for dtype, sizes in accelerate_sizes(model).items()}
    assert rows == {
        "float32": ["413.18 MB", "413.18 MB", "826.36 MB", "1.61 GB"],
        "float16": ["413.18 MB", "619.77 MB", "826.36 MB", "826.36 MB"],
    }
    assert "BertModel, no LM head: 108,310,272 parameters" in format_accelerate_view(model)


def test_llama3_8b_counts_every_parameter_and_explains_the_slides_28_21_gb():
    spec = composed(["model=llama3_8b"])
    facts = facts_of(spec.model)
    model = facts.model
    assert facts.parameters == 8_030_261_248
    assert model.config.vocab_size == 128_256  # the architecture's own, not the byte tokenizer's 259
    assert gib(estimate(spec, facts).weights.bytes) == "29.92"  # fp32, one process
    model_bytes = accelerate_sizes(model)["float32"][0]
    assert accelerate_bytes(model_bytes) == "27.96 GB"  # AutoModel: no LM head
    lm_head = 128_256 * 4096
    assert facts.parameters - lm_head == (model_bytes - 512) // 4 and lm_head == 525_336_576  # 512: rotary buffers
    # The transformers of the slides' day also kept cos and sin caches (8192 positions x head_dim 128, fp32) in
    # each of the 32 layers' rotary embedding, and an inv_freq there rather than one for the model.
    old_rotary_caches = 32 * (2 * 8192 * 128 * 4 + 64 * 4)
    assert accelerate_bytes(model_bytes - 512 + old_rotary_caches) == "28.21 GB"


def test_activation_formula_is_korthikantis_for_their_gpt_layer():
    """Korthikanti et al., 2022, eq. 1: sbh(34 + 5as/h) bytes per layer in 16-bit, with dropout and eager scores."""
    h, a, s = 1024, 16, 2048
    gpt = LayerShape(
        hidden=h,
        heads=a,
        kv_heads=a,
        head_dim=h // a,
        intermediate=4 * h,
        gated_mlp=False,
        rms_norm=False,
        attention_projections=1,
        mlp_projections=1,
        eager_attention=True,
        softmax_fp32=False,
        attention_dropout=True,
        hidden_dropout=True,
    )
    sixteen_bit = ActivationDtypes(compute=2, stream=2, casts=False)
    assert layer_activation_bytes(gpt, s, sixteen_bit) == h * (34 + 5 * a * s / h)
    flash = layer_activation_bytes(replace(gpt, eager_attention=False), s, sixteen_bit)
    assert flash == h * 34  # sdpa and flash attention store no s x s scores: the 5as/h term goes


def test_activation_checkpointing_keeps_one_input_per_layer():
    spec = composed(["model=llama3_8b", "strategy=fsdp", "precision=bf16"])
    facts = facts_of(spec.model)
    dtypes = ActivationDtypes(compute=2, stream=2, casts=False)
    tokens = 8 * 256
    full = activation_bytes(facts, tokens, 256, dtypes, checkpointing=False)
    kept = activation_bytes(facts, tokens, 256, dtypes, checkpointing=True)
    per_layer = layer_activation_bytes(facts.layer, 256, dtypes)
    assert full - kept == tokens * (facts.layers * per_layer - facts.layers * 2 * 4096 - per_layer)


def test_precisions_change_what_is_counted_as_documented():
    def estimated(precision):
        spec = composed(["model=llama3_8b", "hardware=h100_80gb", f"precision={precision}"])
        return estimate(spec, facts_of(spec.model))

    facts = facts_of(composed(["model=llama3_8b"]).model)
    P, buffers = facts.parameters, facts.buffer_bytes
    fp32, bf16, pure, fp8 = (estimated(p) for p in ("fp32", "bf16", "pure_bf16", "fp8"))
    assert bf16.weights.bytes == fp32.weights.bytes == 4 * P + buffers  # fp32 master weights
    assert bf16.optimizer_states.bytes == fp32.optimizer_states.bytes == 8 * P
    # autocast's casts, and the chunked loss's one chunk of 16-bit logits (and their gradient) instead of fp32
    chunk_logits = 1024 * facts.vocab
    assert (
        bf16.backward_start.bytes - fp32.backward_start.bytes
        == 2 * facts.linear_parameters + 2 * (2 - 4) * chunk_logits
    )
    assert (pure.weights.bytes - buffers, pure.gradients.bytes, pure.optimizer_states.bytes) == (2 * P, 2 * P, 4 * P)
    assert fp8.activations.bytes < bf16.activations.bytes < fp32.activations.bytes  # fp8 linears keep 1-byte inputs
    assert fp8.backward_start.bytes < bf16.backward_start.bytes  # fp8 weight casts, 1 byte


def test_estimates_of_8b_and_70b_answer_without_weights():
    """The models are built on the meta device: the estimate's peak memory is not the weights' (8B in bf16 is 15
    GiB, 70B 131 GiB), measured as the process's peak resident memory (the runner's own reading) from a reset
    (Linux's clear_refs, 5), which sets the peak to what the process holds now."""
    from runner.engine.metrics import peak_resident_kib

    for name, parameters in (("llama3_8b", 8_030_261_248), ("llama3_70b", 70_553_706_496)):
        spec = composed([f"model={name}", "hardware=8xh100_80gb", "strategy=fsdp", "precision=bf16"])
        model_facts._FACTS.clear()
        Path("/proc/self/clear_refs").write_text("5")
        before = peak_resident_kib()
        text = report(spec)
        assert (peak_resident_kib() - before) / 2**20 < 1, name
        assert f"({parameters:,} parameters)" in text
        assert all(p.device.type == "meta" for p in meta_model(spec.model).parameters())


# ---- the fit check


SEED_SCENARIO = ["model=llama3_8b", "hardware=2xrtx4090", "strategy=fsdp", "precision=bf16"]


def test_fit_check_refuses_llama3_8b_full_shard_on_two_rtx4090_and_names_what_fits():
    with pytest.raises(SpecError) as refused:
        check_fit(composed(SEED_SCENARIO))
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("the run does not fit: an estimated ") and "GiB per device of the 23.6 GiB" in message
    assert "it fits with: strategy.offload_params=true (" in message
    assert "task.fit_check=false" in message


def test_fit_check_accepts_it_with_offload_params():
    spec = composed([*SEED_SCENARIO, "strategy.offload_params=true"])
    check_fit(spec)
    result = estimate(spec, facts_of(spec.model))
    assert result.peak < 23.6 * GIB
    assert fit(spec, result).host_needs < 128 * GIB  # the sharded fp32 states, in the node's RAM


def test_every_proposed_change_fits_when_estimated_again():
    spec = composed(
        [
            "model=llama3_8b",
            "hardware=8xh100_80gb",
            "strategy=fsdp",
            "precision=bf16",
            "strategy.sharding_strategy=NO_SHARD",
            "train.micro_batch_size=1",
            "data.seq_len=2048",
        ]
    )
    facts = facts_of(spec.model)
    fixes = cheapest_fits(spec, facts)
    assert fixes and fixes[0][0].overrides == ("strategy.sharding_strategy=FULL_SHARD",)
    for change, _ in fixes:
        changed = change.apply(spec)
        assert fit(changed, estimate(changed, facts)).fits, change.overrides


def test_the_default_runs_pass_the_fit_check_and_it_can_be_skipped():
    resolved_spec(QUICK)
    resolved_spec([*QUICK, "strategy=fsdp", "hardware.nproc_per_node=2"])
    tight = [*QUICK, "hardware=cpu", "hardware.device_memory_gib=0.01"]
    with pytest.raises(SpecError, match=r"^the run does not fit: an estimated .* for 1 process of this machine's RAM"):
        resolved_spec(tight)
    resolved_spec([*tight, "task.fit_check=false"])


# ---- the command


@pytest.mark.slow
def test_run_task_estimate_prints_the_table_in_one_process_and_writes_nothing(workdir):
    probe = textwrap.dedent(
        """
        import sys
        sys.argv = ["run", "task=estimate", "model=bert_base_cased"]
        from runner.cli.main import main
        main()
        print("launched:", "runner.processes.launch" in sys.modules or "runner.engine.job" in sys.modules)
        """
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=workdir, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "float32   413.18 MB   413.18 MB   826.36 MB       1.61 GB" in out
    assert "float16   413.18 MB   619.77 MB   826.36 MB       826.36 MB" in out
    for row in ("weights", "gradients", "optimizer states", "activations", "transient buffers", "peak"):
        assert f"\n  {row} " in out or f"\n  {row}\n" in out, row
    assert "launched: False" in out
    assert not (workdir / "outputs").exists()


def test_run_task_estimate_plans_for_gpus_this_machine_lacks(workdir):
    result = run_cli("task=estimate", *SEED_SCENARIO, "task.accelerate_view=false", cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "per device (NVIDIA GeForce RTX 4090, 23.6 GiB)" in result.stdout
    assert "fits: NO" in result.stdout and "cheapest changes that fit: strategy.offload_params=true" in result.stdout
    assert not (workdir / "outputs").exists()


def test_any_local_config_json_is_estimated_without_weights(tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model(
        "qwen2",
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
    ).save_pretrained(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    spec = composed(["task=estimate", "model=pretrained", f"model.pretrained={tmp_path}"])
    text = spec.task.before_launch(spec)
    assert "Qwen2ForCausalLM (" in text and "Qwen2Model, no LM head" in text


# ---- what each rank's tensors hold, against the estimate

# A tiny Llama wide enough for ZeRO-3 to partition its MLP matrices and keep the small ones whole, with an
# embedding of 259 rows that FSDP pads to equal shards.
TINY = [
    *QUICK,
    "train.micro_batch_size=2",
    "model.architecture.hidden_size=192",
    "model.architecture.intermediate_size=640",
]
TWO_RANKS = {
    "ddp": ["strategy=ddp"],
    "ddp, SGD with momentum": ["strategy=ddp", "optim=sgd"],
    "fsdp FULL_SHARD": ["strategy=fsdp"],
    "fsdp SHARD_GRAD_OP": ["strategy=fsdp", "strategy.sharding_strategy=SHARD_GRAD_OP"],
    "fsdp NO_SHARD, SGD without momentum": [
        "strategy=fsdp",
        "strategy.sharding_strategy=NO_SHARD",
        "optim=sgd",
        "optim.momentum=0",
    ],
    "deepspeed ZeRO-1": ["strategy=deepspeed", "strategy.zero_stage=1"],
    "deepspeed ZeRO-2, bf16": ["strategy=deepspeed", "strategy.zero_stage=2", "precision=bf16"],
    "deepspeed ZeRO-3": ["strategy=deepspeed", "strategy.zero_stage=3"],
}
FOUR_RANKS = {
    "fsdp HYBRID_SHARD (2 x 2)": [
        "strategy=fsdp",
        "strategy.sharding_strategy=HYBRID_SHARD",
        "strategy.hybrid_shard_size=2",
    ]
}


def _compare(cases, nproc, measured_by_rank):
    specs = {
        name: resolved_spec([*TINY, *overrides, f"hardware.nproc_per_node={nproc}"])
        for name, overrides in cases.items()
    }
    assert_estimate_holds(specs, measured_by_rank)


@pytest.fixture(scope="module")
def held_on_two_ranks():
    specs = {
        name: resolved_spec([*TINY, *overrides, "hardware.nproc_per_node=2"]) for name, overrides in TWO_RANKS.items()
    }
    return run_in_workers(held_bytes, specs, nproc=2)


def test_single_process_holds_what_the_estimate_says():
    spec = resolved_spec(TINY)
    held = held_bytes_single(spec)
    _compare({"single": []}, 1, [{"single": held}])


def held_bytes_single(spec):
    return held_bytes(Ranks(), {"single": spec})["single"]


@pytest.mark.distributed
@pytest.mark.parametrize("case", TWO_RANKS, ids=list(TWO_RANKS))
def test_each_rank_holds_what_the_estimate_says(case, held_on_two_ranks):
    _compare({case: TWO_RANKS[case]}, 2, held_on_two_ranks)


@pytest.mark.distributed
def test_hybrid_shard_shards_within_its_group_only():
    specs = {
        name: resolved_spec([*TINY, *overrides, "hardware.nproc_per_node=4"]) for name, overrides in FOUR_RANKS.items()
    }
    held = run_in_workers(held_bytes, specs, nproc=4)
    _compare(FOUR_RANKS, 4, held)
    full_copy = resolved_spec([*TINY, "strategy=ddp", "hardware.nproc_per_node=4"])
    whole = estimate(full_copy, facts_of(full_copy.model)).gradients.bytes
    assert math.isclose(held[0]["fsdp HYBRID_SHARD (2 x 2)"]["gradients"], whole / 2, rel_tol=0.01)


def test_hybrid_shard_groups_the_processes_of_a_node_as_torch_and_accelerate_do():
    """On one node of 8 GPUs, HYBRID_SHARD is FULL_SHARD (mesh 1 x 8) and says how to get replicas; across
    nodes it shards within each node; an explicit group size gives replicas on one node."""
    base = ["model=llama3_8b", "strategy=fsdp", "precision=bf16", "hardware=8xh100_80gb"]
    hybrid = composed([*base, "strategy.sharding_strategy=HYBRID_SHARD"])
    full = composed(base)
    assert hybrid.layout.shape == (1, 1, 8, 1, 1)
    assert estimate(hybrid, facts_of(hybrid.model)).peak == estimate(full, facts_of(full.model)).peak
    assert hybrid.strategy.describe(hybrid).endswith(
        "mesh 1 x 8 (dp_replicate x dp_shard), TRANSFORMER_BASED_WRAP; one shard group of the node's 8 data-parallel "
        "ranks is FULL_SHARD: strategy.hybrid_shard_size=<a divisor of 8> gives replicas"
    )
    two_nodes = composed([*base, "strategy.sharding_strategy=HYBRID_SHARD_ZERO2", "hardware.nnodes=2"])
    assert two_nodes.layout.shape == (1, 2, 8, 1, 1)
    assert "gives replicas" not in two_nodes.strategy.describe(two_nodes)
    in_fours = composed([*base, "strategy.sharding_strategy=HYBRID_SHARD", "strategy.hybrid_shard_size=4"])
    assert in_fours.layout.shape == (1, 2, 4, 1, 1)
    assert estimate(in_fours, facts_of(in_fours.model)).peak > estimate(full, facts_of(full.model)).peak
