"""strategy.config_file with DeepSpeed JSONs as Hugging Face users write them (tests/support/data/accelerate_corpus/,
origins in SOURCES.md): what the file decides is read into the spec, "auto" is filled from the spec as the Trainer
and accelerate fill it, and only a real contradiction is refused, naming both values."""

import json

import pytest

from runner.config.precision import Dtype
from runner.config.scheduler import Decay
from runner.config.spec import validate
from runner.errors import SpecError
from runner.memory.model_shapes import facts_of
from runner.strategies.deepspeed_json import deepspeed_config
from tests.support import DATA
from tests.support.command import run_cli
from tests.support.specs import QUICK, composed, resolved_spec

CORPUS = DATA / "accelerate_corpus"
TRANSFORMERS_ZERO3 = CORPUS / "huggingface__transformers__tests__deepspeed__ds_config_zero3.json"
ACCELERATE_ZERO3_OFFLOAD = (
    CORPUS / "huggingface__accelerate__examples__deepspeed_config_templates__zero_stage3_offload_config.json"
)
TWO_CPU_RANKS = ["strategy=deepspeed", "hardware=cpu", "hardware.nproc_per_node=2"]


def leaves(config, path=""):
    for key, value in config.items():
        if isinstance(value, dict):
            yield from leaves(value, f"{path}{key}.")
        else:
            yield f"{path}{key}", value


def test_a_file_full_of_auto_is_read_into_the_spec_and_filled_from_it():
    spec = resolved_spec([*TWO_CPU_RANKS, f"strategy.config_file={TRANSFORMERS_ZERO3}"])
    assert (spec.strategy.zero_stage, spec.strategy.offload_optimizer.value, spec.strategy.offload_param.value) == (
        3,
        "cpu",
        "cpu",
    )
    assert spec.precision.loss_scale_growth_interval == 1000 and spec.precision.compute_dtype is Dtype.fp32
    assert spec.scheduler.decay is Decay.constant  # WarmupLR: warmup, then constant
    config = deepspeed_config(spec)
    assert not [path for path, value in leaves(config) if value == "auto"]
    hidden = facts_of(spec.model).layer.hidden
    zero = config["zero_optimization"]
    assert (
        zero["reduce_bucket_size"],
        zero["stage3_prefetch_bucket_size"],
        zero["stage3_param_persistence_threshold"],
    ) == (hidden * hidden, int(0.9 * hidden * hidden), 10 * hidden)
    assert config["gradient_clipping"] == spec.train.max_grad_norm
    assert config["train_batch_size"] == spec.train.micro_batch_size * spec.train.grad_accum_steps * 2
    assert config["fp16"]["enabled"] is False and config["steps_per_print"] == 2000
    assert "optimizer" not in config and "scheduler" not in config  # the runner's own, built from the same values


def test_accelerates_fp16_template_makes_an_fp16_spec_with_its_schedule():
    spec = validate(
        composed(["strategy=deepspeed", "hardware=8xh100_80gb", f"strategy.config_file={ACCELERATE_ZERO3_OFFLOAD}"]),
        on_this_machine=False,
    )
    assert spec.precision.compute_dtype is Dtype.fp16 and spec.strategy.zero_stage == 3
    assert (spec.scheduler.decay, spec.scheduler.min_lr_ratio) == (Decay.linear, 0.0)  # WarmupDecayLR: to zero
    assert deepspeed_config(spec)["fp16"]["enabled"] is True


@pytest.mark.parametrize(
    "overrides,content,message",
    [
        (
            ["strategy.zero_stage=1"],
            {"zero_optimization": {"stage": 3}},
            "sets zero_optimization.stage=3 but the spec gives strategy.zero_stage=1",
        ),
        (
            [],
            {"gradient_accumulation_steps": 10, "train_micro_batch_size_per_gpu": "auto"},
            "sets gradient_accumulation_steps=10 but the spec gives train.grad_accum_steps=1",
        ),
        ([], {"gradient_clipping": 0.5}, "sets gradient_clipping=0.5 but the spec gives train.max_grad_norm=1.0"),
        (
            ["precision=bf16"],
            {"fp16": {"enabled": True}},
            "sets fp16.enabled=True but the spec gives precision.compute_dtype='bf16'",
        ),
        (
            [],
            {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}},
            "sets optimizer.params.lr=0.1 but the spec gives optim.lr=",
        ),
        (
            ["optim=sgd"],
            {"optimizer": {"type": "AdamW"}},
            "sets optimizer.type='AdamW' but the spec's optimizer is optim=sgd",
        ),
        ([], {"scheduler": {"type": "OneCycle"}}, "the runner's schedules are a linear warmup"),
        (
            [],
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "log"}}},
            "sets scheduler.params.warmup_type='log' but the spec gives the runner's warmup='linear'",
        ),
        (
            [],
            {"zero_optimization": {"stage": 2, "round_robin_gradients": "auto"}},
            'sets zero_optimization.round_robin_gradients="auto", which nothing in the spec fills',
        ),
        (
            [],
            {"zero_optimization": {"stage": "three"}},
            "sets zero_optimization.stage='three', which strategy.zero_stage cannot take",
        ),
    ],
)
def test_only_a_real_contradiction_is_refused_naming_both(overrides, content, message, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(content))
    with pytest.raises(SpecError) as refused:
        resolved_spec([*TWO_CPU_RANKS, f"strategy.config_file={path}", *overrides])
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("name", sorted(p.name for p in CORPUS.glob("*.json")))
def test_every_real_deepspeed_json_is_read_or_refused_in_one_line(name):
    try:
        spec = validate(
            composed(["strategy=deepspeed", "hardware=8xh100_80gb", f"strategy.config_file={CORPUS / name}"]),
            on_this_machine=False,
        )
    except SpecError as refusal:
        assert "\n" not in str(refusal)
        return
    assert not [path for path, value in leaves(deepspeed_config(spec)) if value == "auto"]


SHORT = [
    *QUICK,
    "train.max_steps=4",
    "train.log_every=2",
    "train.eval_every=0",
    "train.eval_batches=2",
    "train.save_model=false",
]


@pytest.mark.distributed
@pytest.mark.parametrize("json_file", [TRANSFORMERS_ZERO3.name.replace("zero3", "zero2"), TRANSFORMERS_ZERO3.name])
def test_a_real_json_full_of_auto_trains_on_cpus_through_the_spec_and_through_accelerate(json_file, workdir):
    (workdir / "accelerate.yaml").write_text(
        f"distributed_type: DEEPSPEED\nuse_cpu: true\nnum_processes: 2\nmixed_precision: 'no'\n"
        f"deepspeed_config:\n  deepspeed_config_file: {CORPUS / json_file}\n  zero3_init_flag: false\n"
    )
    converted = run_cli("--from-accelerate", "accelerate.yaml", "from_accelerate", cwd=workdir)
    assert converted.returncode == 0, converted.stderr
    stage = 3 if "zero3" in json_file else 2
    for overrides in ([*TWO_CPU_RANKS, f"strategy.config_file={CORPUS / json_file}"], ["recipe=from_accelerate"]):
        result = run_cli(*overrides, *SHORT, cwd=workdir)
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"deepspeed ZeRO-{stage}, 2 processes" in result.stdout and "done: train loss" in result.stdout
