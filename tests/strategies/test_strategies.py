"""Each FSDP key does what it says, seen from inside real gloo workers."""

from pathlib import Path

import pytest
import torch

from runner.components.modeling import build_model, build_tokenizer
from runner.engine.job import prepare_job
from runner.strategies.strategy_protocol import unwrapped
from tests.support.specs import QUICK, QUICK_STEPS, TWO_BLOCKS, resolved_spec
from tests.support.workers import run_in_workers

pytestmark = pytest.mark.distributed

BASE = [
    *QUICK_STEPS,
    "hardware.nproc_per_node=2",
    "strategy=fsdp",
    "train.micro_batch_size=2",
    "train.save_model=false",
]


def _inspect(ranks, cases, run_dir):
    """Facts about the prepared model of each case, as this rank sees them."""
    import transformers.modeling_utils as loading
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    # Records the weight files transformers opens, and opens them as usual (safetensors reads them in Rust,
    # where Python's audit hooks do not reach).
    opened = []
    real_safe_open = loading.safe_open

    def recording_safe_open(filename, *args, **kwargs):
        opened.append(str(filename))
        return real_safe_open(filename, *args, **kwargs)

    loading.safe_open = recording_safe_open
    facts = {}
    for name, spec in cases.items():
        opened.clear()
        job = prepare_job(spec, Path(run_dir), ranks)
        model = job.model
        layer = unwrapped(model).model.layers[0]
        facts[name] = {
            "local_numel": sum(p.to_local().numel() for p in model.parameters()),
            "numel": sum(p.numel() for p in model.parameters()),
            "units": sum(isinstance(m, FSDPModule) for m in model.modules()),
            "checkpointing": unwrapped(model).is_gradient_checkpointing,
            # FSDP2 keeps the explicit forward-prefetch list in its (private) per-module state.
            "forward_prefetch": len(layer._get_fsdp_state()._states_to_forward_prefetch)
            if isinstance(layer, FSDPModule)
            else 0,
            "devices": {p.device.type for p in model.parameters()},
            "opened_weights": bool(opened),
            "embed_sum": float(unwrapped(model).model.embed_tokens.weight.full_tensor().sum()),
        }
        batch = next(job.eval_batches())
        model(**batch.inputs)  # forward only: no backward yet
        facts[name]["sharded_after_forward"] = isinstance(layer.self_attn.q_proj.weight, DTensor)
    return facts


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pretrained")
    spec = resolved_spec(QUICK)
    tokenizer = build_tokenizer(spec.model)
    torch.manual_seed(7)
    build_model(spec.model, tokenizer).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def facts(pretrained, tmp_path_factory):
    from_pretrained = ["model=pretrained", f"model.pretrained={pretrained}"]
    random_init = {
        "FULL_SHARD": [],
        "SHARD_GRAD_OP": ["strategy.sharding_strategy=SHARD_GRAD_OP"],
        "NO_SHARD": ["strategy.sharding_strategy=NO_SHARD"],
        "NO_WRAP": ["strategy.auto_wrap_policy=NO_WRAP"],
        "SIZE_BASED_WRAP": ["strategy.auto_wrap_policy=SIZE_BASED_WRAP", "strategy.min_num_params=40000"],
        "activation_checkpointing": ["strategy.activation_checkpointing=true"],
        # three blocks: the first has two to prefetch
        "forward_prefetch": ["strategy.forward_prefetch=2", "model.architecture.num_hidden_layers=3"],
        "offload_params": ["strategy.offload_params=true"],
    }
    cases = {name: [*TWO_BLOCKS, *overrides] for name, overrides in random_init.items()} | {
        "loading everywhere": from_pretrained,
        "cpu_ram_efficient_loading": [*from_pretrained, "strategy.cpu_ram_efficient_loading=true"],
    }
    specs = {name: resolved_spec([*BASE, *overrides]) for name, overrides in cases.items()}
    return run_in_workers(_inspect, specs, str(tmp_path_factory.mktemp("run")), nproc=2)


def test_full_shard_gives_each_rank_half_the_parameters(facts):
    ranks = [f["FULL_SHARD"] for f in facts]
    assert sum(r["local_numel"] for r in ranks) == ranks[0]["numel"]
    assert all(abs(r["local_numel"] - r["numel"] / 2) < 0.02 * r["numel"] for r in ranks)


def test_no_shard_keeps_a_full_copy_on_each_rank(facts):
    assert all(f["NO_SHARD"]["local_numel"] == f["NO_SHARD"]["numel"] for f in facts)


def test_full_shard_reshards_after_forward_and_shard_grad_op_does_not(facts):
    assert all(f["FULL_SHARD"]["sharded_after_forward"] for f in facts)
    assert not any(f["SHARD_GRAD_OP"]["sharded_after_forward"] for f in facts)


def test_wrap_policies_choose_the_units(facts):
    layers = 2
    assert facts[0]["FULL_SHARD"]["units"] == layers + 1  # each decoder layer, and the root
    assert facts[0]["NO_WRAP"]["units"] == 1
    assert layers + 1 < facts[0]["SIZE_BASED_WRAP"]["units"]  # each large linear layer becomes a unit


def test_forward_prefetch_issues_the_next_blocks_all_gathers_early(facts):
    assert facts[0]["forward_prefetch"]["forward_prefetch"] == 2
    assert facts[0]["FULL_SHARD"]["forward_prefetch"] == 0


def test_activation_checkpointing_is_on(facts):
    assert all(f["activation_checkpointing"]["checkpointing"] for f in facts)
    assert not any(f["FULL_SHARD"]["checkpointing"] for f in facts)


def test_offloaded_parameters_live_on_the_cpu(facts):
    assert all(f["offload_params"]["devices"] == {"cpu"} for f in facts)


def test_cpu_ram_efficient_loading_reads_the_weights_on_rank_0_only(facts):
    assert [f["loading everywhere"]["opened_weights"] for f in facts] == [True, True]
    assert [f["cpu_ram_efficient_loading"]["opened_weights"] for f in facts] == [True, False]
    loaded = {f["cpu_ram_efficient_loading"]["embed_sum"] for f in facts}
    assert loaded == {facts[0]["loading everywhere"]["embed_sum"]}


def _ddp_allreduce_calls(ranks, specs, run_dir):
    """How many gradient buckets DDP all-reduces over a run, counted by a comm hook that then all-reduces them."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from runner.engine.loop import train

    counts = []
    for spec in specs:
        job = prepare_job(spec, Path(run_dir), ranks)
        calls = []

        def counting_hook(state, bucket):
            calls.append(bucket.index())
            return allreduce_hook(state, bucket)

        job.model.register_comm_hook(None, counting_hook)
        train(job)
        counts.append(len(calls))
    return counts


def test_ddp_accumulation_synchronises_gradients_only_at_the_boundary(tmp_path):
    ddp = [
        *QUICK,
        "strategy=ddp",
        "hardware.nproc_per_node=2",
        "train.micro_batch_size=1",
        "train.max_steps=3",
        "train.eval_every=0",
        "train.save_model=false",
    ]
    specs = [resolved_spec([*ddp, f"train.grad_accum_steps={accumulation}"]) for accumulation in (1, 4)]
    without, with_accumulation = run_in_workers(_ddp_allreduce_calls, specs, str(tmp_path), nproc=2)[0]
    assert without > 0
    assert with_accumulation == without  # four backward passes a step, one all-reduce of each bucket
