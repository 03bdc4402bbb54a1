"""Each precision under each strategy that runs it, seen from inside the job after a few real steps: master
weights and optimizer states stay fp32 (pure bf16 aside), the forward runs in the low dtype, fp16's loss scale
skips an overflowing step without advancing the schedule, and the loss falls."""

import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from runner.components.fp8 import fp8_layer_names
from runner.components.modeling import build_model, build_tokenizer
from runner.config.float8 import Float8Config
from runner.config.spec import check_combination, validate
from runner.distributed import Ranks
from runner.engine.job import prepare_job
from runner.engine.loop import train
from runner.errors import SpecError
from runner.strategies.deepspeed_json import deepspeed_config
from runner.strategies.strategy_protocol import unwrapped
from tests.support.specs import QUICK, composed, resolved_spec
from tests.support.workers import run_in_workers

STEPS = 6
OVERFLOW_STEP = 3
BASE = [
    *QUICK,
    f"train.max_steps={STEPS}",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.save_model=false",
    "train.micro_batch_size=2",
    "data.seq_len=64",
    "scheduler=constant",
    "scheduler.warmup_steps=0",
]
TWO_RANKS = ["hardware.nproc_per_node=2"]
# A small initial loss scale, so that the only overflow is the one the test injects.
FP16 = ["precision=fp16", "precision.initial_loss_scale=1024"]
FP8 = ["precision=fp8", "precision.fp8.emulate=true", "precision.fp8.min_features=16"]
PRECISIONS = {"fp16": FP16, "bf16": ["precision=bf16"], "pure_bf16": ["precision=pure_bf16"], "fp8": FP8}
# tiny_llama's first 2 blocks (QUICK): 2 x 7 projections of width 128 / 352 / 64 go to fp8; the LM head stays in bf16.
FP8_LAYERS = 14
CASES = {
    "single": {
        **PRECISIONS,
        "fp8 rowwise": [*FP8, "precision.fp8.recipe=rowwise"],
        "fp8 with fp32 elsewhere": [*FP8, "precision.compute_dtype=fp32"],
    },
    "ddp": {name: ["strategy=ddp", *TWO_RANKS, *overrides] for name, overrides in PRECISIONS.items()},
    "fsdp": {
        **{name: ["strategy=fsdp", *TWO_RANKS, *overrides] for name, overrides in PRECISIONS.items()},
        # float8 all-gather weights are tensor subclasses: checkpoints and the saved model must still be plain.
        "fp8 float8 all-gather": [
            "strategy=fsdp",
            *TWO_RANKS,
            *FP8,
            "precision.fp8.all_gather=true",
            "strategy.state_dict_type=SHARDED",
            "train.save_model=true",
        ],
        "bf16 reduced in bf16": ["strategy=fsdp", *TWO_RANKS, "precision=bf16", "precision.reduce_dtype=bf16"],
    },
    # DeepSpeed's fp16 needs a GPU and it keeps fp32 master weights itself (pure bf16 is refused); see below.
    "deepspeed": {
        "bf16 ZeRO-2": ["strategy=deepspeed", "strategy.zero_stage=2", *TWO_RANKS, "precision=bf16"],
        "bf16 ZeRO-3": ["strategy=deepspeed", "strategy.zero_stage=3", *TWO_RANKS, "precision=bf16"],
        "fp8 ZeRO-2": ["strategy=deepspeed", "strategy.zero_stage=2", *TWO_RANKS, *FP8],
    },
}
LOW = {"fp16": torch.float16, "bf16": torch.bfloat16, "pure_bf16": torch.bfloat16}


def _train_and_inspect(ranks, specs, run_dirs):
    facts = {}
    for (name, spec), run_dir in zip(specs.items(), run_dirs):
        job = prepare_job(spec, Path(run_dir), ranks)
        mlp = unwrapped(job.model).model.layers[0].mlp
        forward_dtypes = []
        mlp.register_forward_hook(lambda module, args, output: forward_dtypes.append(output.dtype))
        if name.startswith("fp16"):
            # An infinite activation gradient at one step: every gradient after it overflows.
            backward_calls = itertools.count(1)
            mlp.register_full_backward_pre_hook(
                lambda module, grads: (
                    tuple(g * math.inf for g in grads) if next(backward_calls) == OVERFLOW_STEP else None
                )
            )
        summary = train(job)
        facts[name] = {
            "forward_dtype": forward_dtypes[-1],
            # DeepSpeed's fp32 copies; ZeRO-3 lends them to the optimizer's groups only during its step.
            "master_dtypes": {p.dtype for group in job.optimizer.param_groups for p in group["params"]}
            | {p.dtype for p in job.optimizer.state},
            "state_dtypes": {v.dtype for state in job.optimizer.state.values() for v in state.values() if v.ndim},
            "fp8_layers": sum(type(m).__name__ == "Float8Linear" for m in job.model.modules()),
            # On a GPU, _scaled_mm needs the weight gradient's inner dimension, the tokens, in multiples of 16.
            "fp8_pads_tokens": all(
                m.config.pad_inner_dim for m in job.model.modules() if type(m).__name__ == "Float8Linear"
            ),
            "scheduler_steps": job.scheduler.last_epoch,
            "summary": summary,
            "records": [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()],
        }
    return facts


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(strategy, marks=pytest.mark.slow if strategy == "single" else pytest.mark.distributed)
        for strategy in CASES
    ],
)
def strategy_facts(request, tmp_path_factory):
    strategy = request.param
    specs = {name: resolved_spec([*BASE, *overrides]) for name, overrides in CASES[strategy].items()}
    run_dirs = [str(tmp_path_factory.mktemp(strategy)) for _ in specs]
    if strategy == "single":
        return strategy, _train_and_inspect(Ranks(), specs, run_dirs)
    return strategy, run_in_workers(_train_and_inspect, specs, run_dirs, nproc=2)[0]


def test_master_weights_and_optimizer_states_stay_fp32(strategy_facts):
    for name, facts in strategy_facts[1].items():
        expected = {torch.bfloat16} if name == "pure_bf16" else {torch.float32}
        assert facts["master_dtypes"] == expected, name
        assert facts["state_dtypes"] == expected, name
        reported = "bf16" if name == "pure_bf16" else "fp32"
        assert facts["summary"]["precision"]["master_weights"] == reported, name
        assert facts["summary"]["precision"]["optimizer_states"] == reported, name


def test_forward_runs_in_the_low_dtype(strategy_facts):
    for name, facts in strategy_facts[1].items():
        kind = name.split()[0]
        if kind == "fp8":
            assert facts["fp8_layers"] == FP8_LAYERS, name
            assert facts["fp8_pads_tokens"], name
            assert facts["summary"]["precision"]["fp8_linear_layers"] == FP8_LAYERS, name
            expected = torch.float32 if "fp32" in name else torch.bfloat16
        else:
            assert facts["fp8_layers"] == 0, name
            expected = LOW[kind]
        assert facts["forward_dtype"] == expected, name


def test_loss_falls(strategy_facts):
    for name, facts in strategy_facts[1].items():
        summary = facts["summary"]
        assert summary["eval_loss"] < summary["first_eval_loss"] - 0.3, name


def test_fp16_overflow_skips_the_step_and_the_schedule(strategy_facts):
    strategy, all_facts = strategy_facts
    if "fp16" not in all_facts:
        pytest.skip(f"no fp16 case under {strategy}")
    facts = all_facts["fp16"]
    assert facts["summary"]["skipped_steps"] == 1
    assert facts["scheduler_steps"] == STEPS - 1
    scales = {r["step"]: r["loss_scale"] for r in facts["records"] if "loss_scale" in r}
    assert scales[OVERFLOW_STEP - 1] == 1024 and scales[OVERFLOW_STEP] == 512
    assert all(math.isfinite(r["loss"]) for r in facts["records"] if "loss" in r)


def test_float8_all_gather_saves_plain_checkpoints_and_model(strategy_facts):
    strategy, all_facts = strategy_facts
    if strategy != "fsdp":
        pytest.skip("float8 all-gather is FSDP's")
    summary = all_facts["fp8 float8 all-gather"]["summary"]
    checkpoint = Path(summary["run_dir"]) / "checkpoints" / f"step_{STEPS:08d}"
    # Each rank's shards, as safetensors' own reader opens them: plain fp32 tensors, the float8 layers' too.
    shards = sorted((checkpoint / "model").glob("*.safetensors"))
    assert len(shards) == 2
    for shard in shards:
        tensors = load_file(shard)
        assert "model.layers.0.mlp.up_proj.weight" in tensors
        assert all(type(t) is torch.Tensor and t.dtype is torch.float32 for t in tensors.values())
    model = AutoModelForCausalLM.from_pretrained(summary["model_dir"])
    assert type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # Read back into the float8 weights (a resume): the trained model's weights again.
    spec = resolved_spec(
        [*BASE, *CASES["fsdp"]["fp8 float8 all-gather"], f"resume={checkpoint}", f"train.max_steps={STEPS + 1}"]
    )
    resumed = run_in_workers(_resumed_weights, spec, summary["run_dir"], nproc=2)[0]
    for name, weight in model.state_dict().items():
        torch.testing.assert_close(resumed[name], weight, rtol=0, atol=0, msg=name)


def _resumed_weights(ranks, spec, run_dir):
    return prepare_job(spec, Path(run_dir), ranks).stepper.full_state_dict()


@pytest.mark.slow
def test_fp16_loss_scale_survives_a_checkpoint(tmp_path):
    # The scale doubles after every step without overflow: 1024 -> 4096 after two.
    growing = [*BASE, *FP16, "precision.loss_scale_growth_interval=1"]
    job = prepare_job(resolved_spec([*growing, "train.max_steps=2"]), tmp_path)
    train(job)
    assert job.stepper.scaler.get_scale() == 4096
    resumed = prepare_job(resolved_spec([*growing, f"resume={tmp_path}/checkpoints/step_00000002"]), tmp_path)
    assert resumed.stepper.scaler.state_dict() == job.stepper.scaler.state_dict()


def test_deepspeed_precision_blocks_come_from_the_spec():
    fp16 = composed(
        [
            "strategy=deepspeed",
            "precision=fp16",
            "precision.initial_loss_scale=4096",
            "precision.loss_scale_growth_interval=500",
        ]
    )
    config = deepspeed_config(fp16)
    assert config["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500}
    assert config["bf16"] == {"enabled": False}
    assert config["communication_data_type"] == "fp32"
    bf16 = deepspeed_config(composed(["strategy=deepspeed", "precision=bf16"]))
    assert bf16["bf16"] == {"enabled": True} and not bf16["fp16"]["enabled"]


def test_fp8_leaves_small_layers_and_the_lm_head_alone():
    spec = resolved_spec([*BASE, *FP8])
    model = build_model(spec.model, build_tokenizer(spec.model), weights=False)
    names = fp8_layer_names(model, spec.precision.fp8)
    assert len(names) == FP8_LAYERS and "lm_head" not in names
    # From 100 features on, the key and value projections (128 -> 64) stay in bf16.
    larger = fp8_layer_names(model, Float8Config(min_features=100))
    assert len(larger) == 2 * 5 and not any(name.endswith(("k_proj", "v_proj")) for name in larger)
    assert fp8_layer_names(model, Float8Config(min_features=16, skip=["mlp.up_proj", "lm_head"])) == [
        name for name in names if not name.endswith("up_proj")
    ]
    with pytest.raises(SpecError, match="no linear layer to convert"):
        fp8_layer_names(model, Float8Config(min_features=4096))


REFUSED = {
    "fp8 on a CPU": (["precision=fp8"], "needs a GPU with fp8 tensor cores (CUDA compute capability 8.9+"),
    "fp16 weights": (["precision=fp16", "precision.param_dtype=fp16"], "precision.param_dtype=fp16 is not supported"),
    "DeepSpeed fp16 on a CPU": (["strategy=deepspeed", "precision=fp16"], "DeepSpeed's CPU accelerator has no fp16"),
    "DeepSpeed pure bf16": (["strategy=deepspeed", "precision=pure_bf16"], "keeps fp32 master weights itself"),
    "float8 all-gather without FSDP": ([*FP8, "precision.fp8.all_gather=true"], "needs strategy=fsdp"),
    "float8 all-gather rowwise": (
        ["strategy=fsdp", *TWO_RANKS, *FP8, "precision.fp8.all_gather=true", "precision.fp8.recipe=rowwise"],
        "needs precision.fp8.recipe=tensorwise",
    ),
    "TransformerEngine missing": ([*FP8, "precision.fp8.backend=transformer_engine"], "needs TransformerEngine"),
    "loss scale not a power of two": ([*FP16[:1], "precision.initial_loss_scale=1000"], "must be a power of two"),
    "DDP bf16 reduce on a CPU": (
        ["strategy=ddp", *TWO_RANKS, "precision=bf16", "precision.reduce_dtype=bf16"],
        "needs NCCL",
    ),
}


def test_fp8_needs_compute_capability_8_9():
    """What validation says of the declared GPU (this machine has none, so the detection step is left out)."""
    with pytest.raises(SpecError, match=r"NVIDIA A100-SXM4-80GB \(compute capability 8.0\)"):
        check_combination(composed(["hardware=a100_80gb", "precision=fp8"]))
    check_combination(composed(["hardware=h100_80gb", "precision=fp8"]))
    check_combination(composed(["hardware=2xrtx4090", "strategy=fsdp", "precision=fp8"]))


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_impossible_precisions_are_refused(case):
    overrides, message = REFUSED[case]
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace("+", r"\+")):
        resolved_spec(overrides)


def test_transformer_engines_delayed_scaling_comes_from_the_spec_and_torchao_refuses_it():
    from runner.config.float8 import delayed_scaling

    spec = composed(
        [
            "precision=fp8",
            "precision.fp8.format=e4m3",
            "precision.fp8.amax_history_len=16",
            "precision.fp8.amax_compute_algo=most_recent",
            "precision.fp8.margin=1",
        ]
    )
    assert delayed_scaling(spec.precision.fp8) == {
        "fp8_format": "E4M3",
        "amax_history_len": 16,
        "amax_compute_algo": "most_recent",
        "margin": 1,
    }
    with pytest.raises(
        SpecError,
        match="precision.fp8.format, precision.fp8.amax_history_len, "
        "precision.fp8.amax_compute_algo, precision.fp8.margin set Transformer "
        "Engine's delayed scaling; torchao scales each tensor from its current amax",
    ):
        validate(replace(spec, precision=replace(spec.precision, fp8=replace(spec.precision.fp8, emulate=True))))
