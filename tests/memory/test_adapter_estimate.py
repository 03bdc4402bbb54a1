"""The memory estimate of adapter runs (adapter=lora, qlora): only the adapters have gradients and optimizer
states, the frozen base counts in its stored dtype (NF4 for qlora's adapted weights) under each strategy's
sharding, the LoRA recipes fit one or two 24 GB GPUs where a full fine-tune does not, and the fit check proposes
adapters to a full fine-tune that does not fit."""

import json
import math

import pytest
import torch
import yaml

from runner.cli.compose import CONF_DIR
from runner.config.adapter import NF4_BYTES_PER_WEIGHT
from runner.errors import SpecError
from runner.memory.advice import changes, cheapest_fits, check_fit, fit
from runner.memory.breakdown import estimate, sharded_elements
from runner.memory.model_shapes import facts_of
from runner.memory.parameters import parameters_of
from runner.memory.report import report
from tests.support.specs import QUICK, composed, resolved_spec

GIB = 1024**3
P_8B = 8_030_261_248
P_70B = 70_553_706_496
RANK = 16


def llama_adapters(hidden: int, kv: int, intermediate: int, layers: int, rank: int = RANK) -> int:
    """rank x (in + out) over every linear layer of a Llama block (q, k, v, o, gate, up, down), by hand."""
    shapes = [
        (hidden, hidden),
        (hidden, kv),
        (hidden, kv),
        (hidden, hidden),
        (hidden, intermediate),
        (hidden, intermediate),
        (intermediate, hidden),
    ]
    return layers * rank * sum(fan_in + fan_out for fan_in, fan_out in shapes)


def llama_block_linears(hidden: int, kv: int, intermediate: int, layers: int) -> int:
    """The weights of the blocks' linear layers: what qlora stores in NF4."""
    return layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * intermediate)


T_8B = llama_adapters(4096, 1024, 14336, 32)
NF4_8B = llama_block_linears(4096, 1024, 14336, 32)
T_70B = llama_adapters(8192, 1024, 28672, 80)
NF4_70B = llama_block_linears(8192, 1024, 28672, 80)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """What model.pretrained points at, as far as the estimate reads it: the published model's config.json, from
    the architecture the model group of the same name describes (nothing is downloaded)."""
    made = {}
    for name in ("llama3_8b", "llama3_70b"):
        directory = tmp_path_factory.mktemp(name)
        architecture = yaml.safe_load((CONF_DIR / "model" / f"{name}.yaml").read_text())["architecture"]
        (directory / "config.json").write_text(json.dumps(architecture))
        made[name] = directory
    return made


def recipe(name, checkpoints, *overrides):
    model = checkpoints["llama3_70b" if "70b" in name else "llama3_8b"]
    return composed([f"recipe={name}", f"model.pretrained={model}", "data.files=pairs.jsonl", *overrides])


def estimated(spec):
    return estimate(spec, facts_of(spec.model))


# ---- the recipes


def test_llama3_8b_lora_fits_one_4090_where_the_full_fine_tune_does_not(checkpoints):
    assert T_8B == 41_943_040
    spec = recipe("llama3_8b_lora_1x4090", checkpoints)
    assert (
        spec.strategy.name,
        spec.adapter.kind.value,
        spec.strategy.activation_checkpointing,
        spec.data.seq_len,
        spec.hardware.nproc_per_node,
    ) == ("single", "lora", True, 2048, 1)
    facts = facts_of(spec.model)
    parameters = parameters_of(spec, facts)
    assert (parameters.trained, parameters.frozen_parameters) == (T_8B, P_8B)
    result = estimated(spec)
    # The frozen base in bf16, the adapters in fp32 with their fp32 gradients and AdamW's two states.
    assert result.weights.bytes == 2 * P_8B + 4 * T_8B + facts.buffer_bytes
    assert (result.gradients.bytes, result.optimizer_states.bytes, result.step.bytes) == (4 * T_8B, 8 * T_8B, 4 * T_8B)
    verdict = fit(spec, result)
    assert verdict.fits and 17 * GIB < result.peak < 22 * GIB
    # A pretrained bf16 base is memory-mapped: the process's own RAM holds the adapters.
    assert result.host_loading.bytes == 4 * T_8B
    full = estimated(recipe("llama3_8b_lora_1x4090", checkpoints, "adapter=none"))
    assert full.peak > 100 * GIB and not fit(spec, full).device_fits


def test_llama3_8b_qlora_holds_its_base_in_nf4(checkpoints):
    spec = recipe("llama3_8b_qlora_1x4090", checkpoints)
    assert spec.adapter.quantized and spec.strategy.name == "single"
    facts = facts_of(spec.model)
    parameters = parameters_of(spec, facts)
    assert {group.dtype: group.elements for group in parameters.frozen} == {"bf16": P_8B - NF4_8B, "NF4": NF4_8B}
    result = estimated(spec)
    expected = NF4_BYTES_PER_WEIGHT * NF4_8B + 2 * (P_8B - NF4_8B) + 4 * T_8B + facts.buffer_bytes
    assert abs(result.weights.bytes - expected) <= 1
    assert 5 * GIB < result.weights.bytes < 6 * GIB  # LoRA's bf16 base is 15 GiB
    assert (result.gradients.bytes, result.optimizer_states.bytes) == (4 * T_8B, 8 * T_8B)
    assert fit(spec, result).fits and 10 * GIB < result.peak < 14 * GIB
    # Loading quantizes the memory-mapped bf16 checkpoint: the process holds the NF4 copies and the adapters.
    assert abs(result.host_loading.bytes - (NF4_BYTES_PER_WEIGHT * NF4_8B + 4 * T_8B)) <= 1


def test_llama3_70b_qlora_fits_two_4090s_with_its_sharded_base_in_cpu_ram(checkpoints):
    spec = recipe("llama3_70b_qlora_2x4090", checkpoints)
    strategy = spec.strategy
    assert (strategy.name, strategy.sharding_strategy.value, spec.hardware.world_size, spec.adapter.kind.value) == (
        "fsdp",
        "FULL_SHARD",
        2,
        "qlora",
    )
    assert strategy.activation_checkpointing and strategy.offload_params
    assert not strategy.cpu_ram_efficient_loading  # each process quantizes its own base
    facts = facts_of(spec.model)
    assert facts.parameters == P_70B and parameters_of(spec, facts).trained == T_70B
    result = estimated(spec)
    verdict = fit(spec, result)
    assert verdict.fits and 10 * GIB < result.peak < 20 * GIB
    frozen = NF4_BYTES_PER_WEIGHT * NF4_70B + 2 * (P_70B - NF4_70B)
    # Half the base and of the adapters' weights, gradients and states per process, in the node's RAM.
    assert math.isclose(result.host_offload.bytes, frozen + 16 * T_70B, rel_tol=1e-3)
    # Two processes each quantize a whole base (33 GiB of NF4) while loading.
    assert math.isclose(result.host_loading.bytes, 2 * (NF4_BYTES_PER_WEIGHT * NF4_70B + 4 * T_70B), rel_tol=1e-6)
    assert verdict.host_fits and result.host_peak < 128 * GIB
    # On the GPUs the sharded base alone is 18.8 GiB: what the recipe's offload avoids.
    on_device = estimated(recipe("llama3_70b_qlora_2x4090", checkpoints, "strategy.offload_params=false"))
    assert math.isclose(on_device.weights.bytes, frozen / 2 + 4 * T_70B / 2, rel_tol=1e-3)
    assert not fit(spec, on_device).device_fits


# ---- what trains and what is frozen


TINY = ["model=tiny_llama", "hardware=h100_80gb", "precision=bf16", "adapter.rank=4"]


def hand_count(model, rank, names=None) -> tuple[list, int]:
    """The adapters' shapes beside each linear layer of the blocks (model.layers.*), counted from the modules."""
    shapes = []
    for name, module in model.named_modules():
        suffix = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Linear) and ".layers." in name and (names is None or suffix in names):
            shapes += [(rank, module.in_features), (module.out_features, rank)]
    return shapes, sum(math.prod(shape) for shape in shapes)


@pytest.mark.parametrize("targets", [None, ["q_proj", "v_proj"]], ids=["every linear", "q and v"])
@pytest.mark.parametrize(
    "strategy",
    [
        ["strategy=single"],
        ["strategy=ddp", "hardware.nproc_per_node=2"],
        ["strategy=fsdp", "hardware.nproc_per_node=2"],
        ["strategy=deepspeed", "strategy.zero_stage=2", "hardware.nproc_per_node=2"],
    ],
    ids=["single", "ddp", "fsdp", "deepspeed ZeRO-2"],
)
def test_gradients_and_states_count_the_adapters_only(strategy, targets):
    chosen = [f"adapter.target_modules=[{','.join(targets)}]"] if targets else []
    spec = composed([*TINY, "adapter=lora", *chosen, *strategy])
    facts = facts_of(spec.model)
    shapes, adapters = hand_count(facts.model, 4, targets)
    parameters = parameters_of(spec, facts)
    assert parameters.trained == adapters and sorted(parameters.trained_shapes) == sorted(shapes)
    assert parameters.frozen_parameters == facts.parameters
    result = estimated(spec)
    k = 2  # AdamW
    match spec.strategy.name:
        case "single" | "ddp":
            assert (result.gradients.bytes, result.optimizer_states.bytes) == (4 * adapters, 4 * k * adapters)
            if spec.strategy.name == "ddp":
                assert result.buffers.bytes == 4 * adapters  # DDP buckets the trained gradients only
        case "fsdp":
            held = sharded_elements(shapes, 2)
            assert (result.gradients.bytes, result.optimizer_states.bytes) == (4 * held, 4 * k * held)
        case "deepspeed":
            partition = math.ceil(adapters / 2)
            assert result.optimizer_states.bytes == 4 * k * partition  # fp32 states of the adapters' partition
            assert result.weights.bytes == 2 * adapters + 4 * partition + 2 * facts.parameters + facts.buffer_bytes
    full = estimated(composed([*TINY, *strategy]))
    assert result.gradients.bytes < full.gradients.bytes and result.optimizer_states.bytes < full.optimizer_states.bytes


@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_the_placed_model_holds_what_the_estimate_counts(kind):
    """The runner's own pipeline places a tiny model with adapters (on the CPU, no step): its weights' bytes, and
    the parameters its optimizer holds, are the estimate's."""
    from runner.components.modeling import build_tokenizer
    from runner.distributed import Ranks
    from runner.engine.placement import place

    spec = resolved_spec([*QUICK, f"adapter={kind}", "adapter.rank=4", "precision=bf16"])
    placed = place(spec, Ranks(), torch.device("cpu"), build_tokenizer(spec.model))

    def stored(parameter) -> int:
        data = parameter.data
        if type(data).__name__ == "NF4Tensor":
            return sum(
                t.numel() * t.element_size()
                for t in (data.quantized_data, data.quantized_scalers, data.quantization_factor)
            )
        return data.numel() * data.element_size()

    model = placed.model
    held = sum(stored(p) for p in model.parameters()) + sum(b.numel() * b.element_size() for b in model.buffers())
    optimized = sum(p.numel() for group in placed.optimizer.param_groups for p in group["params"])
    result = estimated(spec)
    assert optimized == parameters_of(spec, facts_of(spec.model)).trained == result.gradients.bytes // 4
    assert math.isclose(held, result.weights.bytes, rel_tol=1e-9 if kind == "lora" else 1e-2), (held, result.weights)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}


def test_nf4_holds_the_weights_that_split_into_whole_blocks_on_every_process():
    """Tiny Llama's 128 x 128 attention weights are one NF4 scale block of blocks (64 x 256): NF4 on one process,
    not on two; its narrower ones stay in the compute dtype."""
    one = parameters_of(composed([*TINY, "adapter=qlora"]), facts_of(composed(TINY).model))
    two = parameters_of(composed([*TINY, "adapter=qlora", "hardware.nproc_per_node=2"]), facts_of(composed(TINY).model))
    nf4 = {group.dtype: group.shapes for group in one.frozen}["NF4"]
    assert nf4 == ((128, 128),) * 8  # q_proj and o_proj of 4 layers
    assert [group.dtype for group in two.frozen] == ["bf16"]


def test_qlora_under_fsdp_shards_the_nf4_base(checkpoints):
    single = recipe("llama3_8b_qlora_1x4090", checkpoints, "train.micro_batch_size=1")
    sharded = recipe(
        "llama3_8b_qlora_1x4090", checkpoints, "train.micro_batch_size=1", "hardware=2xrtx4090", "strategy=fsdp"
    )
    replicated = recipe(
        "llama3_8b_qlora_1x4090", checkpoints, "train.micro_batch_size=1", "hardware=2xrtx4090", "strategy=ddp"
    )
    facts = facts_of(single.model)
    whole = parameters_of(single, facts).frozen_bytes()
    halves = parameters_of(sharded, facts).frozen_bytes(2)
    assert whole / 2 <= halves < whole / 2 + 1  # every Llama-3-8B weight splits evenly in two
    adapters = 4 * sharded_elements(list(parameters_of(sharded, facts).trained_shapes), 2)
    assert estimated(sharded).weights.bytes == halves + adapters + facts.buffer_bytes
    assert (
        estimated(replicated).weights.bytes == estimated(single).weights.bytes == whole + 4 * T_8B + facts.buffer_bytes
    )
    # A unit's all-gather carries NF4 too: a qlora block gathers about a third of a lora block's bytes.
    lora = recipe(
        "llama3_8b_lora_1x4090", checkpoints, "train.micro_batch_size=1", "hardware=2xrtx4090", "strategy=fsdp"
    )
    assert estimated(sharded).backward_start.bytes < estimated(lora).backward_start.bytes
    assert "bf16 + NF4 base all-gathers" in estimated(sharded).backward_start.note


def test_deepspeed_zero3_partitions_the_frozen_base_and_zero2_keeps_it_whole(checkpoints):
    def weights(stage):
        spec = recipe(
            "llama3_8b_lora_1x4090",
            checkpoints,
            "hardware=2xrtx4090",
            "strategy=deepspeed",
            f"strategy.zero_stage={stage}",
        )
        return estimated(spec).weights.bytes

    assert weights(2) > 2 * P_8B  # the bf16 base on each GPU
    assert P_8B < weights(3) < 1.1 * P_8B  # half of it, 2 bytes a parameter


def test_adapter_activations_are_the_rank_sized_intermediates_and_dropout_copies(checkpoints):
    """Per token and adapted layer: lora_B's input (rank x 2 bytes in bf16); with dropout, lora_A's own input
    (the dropout's output) and the mask (in-features x 3 bytes)."""
    base = ["hardware=2xrtx4090", "strategy=fsdp", "strategy.activation_checkpointing=false"]
    tokens = 2 * 2048

    def activations(*overrides):
        return estimated(recipe("llama3_8b_lora_1x4090", checkpoints, *base, *overrides)).activations.bytes

    without = activations("adapter=none")
    assert activations() - without == tokens * 32 * 7 * RANK * 2
    in_features = 6 * 4096 + 14336  # q, k, v, o, gate, up read the hidden state; down the intermediate
    assert activations("adapter.dropout=0.1") - activations() == tokens * 32 * in_features * 3
    # With checkpointing, one layer's worth is recomputed at a time.
    checkpointed = ["strategy.activation_checkpointing=true"]
    assert activations(*checkpointed) - activations(*checkpointed, "adapter=none") == tokens * 7 * RANK * 2


def test_a_random_init_base_is_built_in_the_compute_dtype_by_each_process():
    spec = composed(["model=llama3_8b", "hardware=2xrtx4090", "strategy=fsdp", "precision=bf16", "adapter=lora"])
    assert estimated(spec).host_loading.bytes == 2 * (2 * P_8B + 4 * T_8B)


# ---- the fit check's advice and the report


def test_fit_check_proposes_adapters_for_a_full_fine_tune_of_8b_on_one_4090(checkpoints):
    spec = recipe("llama3_8b_lora_1x4090", checkpoints, "adapter=none")
    with pytest.raises(SpecError) as refused:
        check_fit(spec)
    message = str(refused.value)
    assert "GiB per device of the 23.6 GiB of NVIDIA GeForce RTX 4090" in message
    assert "it fits with: adapter=lora (" in message and " | adapter=qlora (" in message
    facts = facts_of(spec.model)
    fixes = cheapest_fits(spec, facts)
    assert [change.overrides for change, _ in fixes][:2] == [("adapter=lora",), ("adapter=qlora",)]
    for change, _ in fixes:
        changed = change.apply(spec)
        assert fit(changed, estimate(changed, facts)).fits, change.overrides


def test_adapter_changes_stay_valid():
    full = composed(["model=llama3_8b", "hardware=2xrtx4090", "strategy=fsdp", "precision=bf16"])
    proposed = {change.overrides for change in changes(full)}
    assert {("adapter=lora",), ("adapter=qlora",)} <= proposed
    # DeepSpeed cannot hold qlora's NF4 base: only lora is proposed there.
    deepspeed = composed(["model=llama3_8b", "hardware=2xrtx4090", "strategy=deepspeed", "precision=bf16"])
    proposed = {change.overrides for change in changes(deepspeed)}
    assert ("adapter=lora",) in proposed and ("adapter=qlora",) not in proposed
    # A lora run may go on to qlora; nothing proposes an adapter to an adapter run otherwise.
    lora = composed(["model=llama3_8b", "hardware=rtx4090", "precision=bf16", "adapter=lora"])
    assert [c.overrides for c in changes(lora) if c.overrides[0].startswith("adapter=")] == [("adapter=qlora",)]
    qlora = composed(["model=llama3_8b", "hardware=rtx4090", "precision=bf16", "adapter=qlora"])
    assert not [c for c in changes(qlora) if c.overrides[0].startswith("adapter=")]
    # qlora under FSDP: each process quantizes its own base, so rank 0 alone cannot load it.
    fsdp_qlora = composed(["model=llama3_8b", "hardware=2xrtx4090", "strategy=fsdp", "precision=bf16", "adapter=qlora"])
    assert ("strategy.cpu_ram_efficient_loading=true",) not in {c.overrides for c in changes(fsdp_qlora)}


def test_the_report_says_what_trains_and_what_is_frozen(checkpoints):
    text = report(recipe("llama3_8b_qlora_1x4090", checkpoints))
    assert (
        f"parameters: {T_8B:,} train (qlora adapters of rank 16 on 224 linear layers: q_proj, k_proj, v_proj, "
        f"o_proj, gate_proj, up_proj, down_proj; fp32); {P_8B:,} frozen ({P_8B - NF4_8B:,} in bf16, "
        f"{NF4_8B:,} in NF4)"
    ) in text
    assert "frozen bf16 + NF4 base, fp32 adapters, whole" in text
    assert "fits: yes" in text and "the NF4 base; the bf16 base is memory-mapped" in text
    assert f"parameters: all {P_8B:,} train" in report(recipe("llama3_8b_qlora_1x4090", checkpoints, "adapter=none"))


# ---- what two ranks hold (slow tier: worker processes, one step)

# Wide enough (256) for the attention and MLP weights to split into whole NF4 blocks on two ranks.
TWO_RANK_LLAMA = [
    *QUICK,
    "model.architecture.hidden_size=256",
    "model.architecture.intermediate_size=512",
    "precision=bf16",
    "hardware.nproc_per_node=2",
    "adapter.rank=4",
]
TWO_RANK_CASES = {
    "fsdp lora": ["strategy=fsdp", "adapter=lora"],
    "fsdp qlora": ["strategy=fsdp", "adapter=qlora"],
    "deepspeed ZeRO-3 lora": ["strategy=deepspeed", "strategy.zero_stage=3", "adapter=lora"],
}


def held_bytes(tensors) -> int:
    """Bytes of the distinct storages behind the tensors (an FSDP shard's local tensor; NF4's packed weights and
    scales)."""
    storages = {}
    for tensor in tensors:
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        inner = (
            (tensor.quantized_data, tensor.quantized_scalers, tensor.quantization_factor)
            if type(tensor).__name__ == "NF4Tensor"
            else (tensor,)
        )
        for t in inner:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _held_after_a_step(ranks, specs):
    from runner.components.modeling import build_tokenizer
    from runner.engine.placement import place

    held = {}
    for name, spec in specs.items():
        placed = place(spec, ranks, torch.device("cpu"), build_tokenizer(spec.model))
        model = placed.model
        batch = torch.randint(0, 259, (spec.train.micro_batch_size, 64))
        placed.stepper.backward(model(input_ids=batch).logits.float().square().mean())
        placed.stepper.step()
        params = list(model.parameters())
        weights, states = [p.data for p in params], placed.optimizer.state
        if spec.strategy.name == "deepspeed":  # ZeRO-3: the partitions, and the fp32 master of the adapters
            zero = model.optimizer
            weights += [p.ds_tensor for p in params] + list(zero.fp32_partitioned_groups_flat)
            states = zero.optimizer.state
        held[name] = {
            "weights": held_bytes([*weights, *model.buffers()]),
            "optimizer states": held_bytes(
                t for state in states.values() for t in state.values() if torch.is_tensor(t) and t.dim() > 0
            ),
        }
    return held


@pytest.mark.distributed
def test_each_rank_holds_what_the_estimate_says_of_an_adapter_run():
    from tests.support.workers import run_in_workers

    specs = {name: resolved_spec([*TWO_RANK_LLAMA, *overrides]) for name, overrides in TWO_RANK_CASES.items()}
    held = run_in_workers(_held_after_a_step, specs, nproc=2)
    for name, spec in specs.items():
        result = estimated(spec)
        for part, value in {"weights": result.weights.bytes, "optimizer states": result.optimizer_states.bytes}.items():
            measured = max(rank[name][part] for rank in held)  # rank 0 holds the largest shards
            assert measured <= value <= measured * 1.01 + 1, (name, part, value, measured)
