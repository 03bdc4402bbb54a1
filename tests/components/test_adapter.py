"""adapter=lora and adapter=qlora: only the adapters train, under every strategy, with the losses of one process;
checkpoints hold the adapters and resume exactly; the exported adapter (read by peft) and the merged model (read
by transformers) give the trained model's logits."""

import pytest
import torch
from safetensors import safe_open

from runner.engine.job import prepare_job
from runner.engine.loop import train
from runner.errors import SpecError
from tests.support.command import run_cli
from tests.support.exports import exported_logits
from tests.support.runs import killed_and_resumed, step_losses
from tests.support.specs import QUICK, resolved_spec
from tests.support.workers import train_in_workers

STEPS = 8
BASE = [
    *QUICK,
    f"train.max_steps={STEPS}",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=2",
    "train.micro_batch_size=2",
    "data.seq_len=64",
]
LORA = [*BASE, "adapter=lora", "adapter.rank=4", "train.save_model=false"]
# A tiny model wide enough for every adapted weight to split into whole NF4 scale blocks on two processes.
QLORA = [
    *BASE,
    "adapter=qlora",
    "adapter.rank=4",
    "train.save_model=false",
    "model.architecture.hidden_size=256",
    "model.architecture.intermediate_size=1024",
]


def stored(tensor: torch.Tensor) -> list[torch.Tensor]:
    """A tensor's stored data: an NF4 tensor's 4-bit codes and scales, or the tensor."""
    tensor = tensor.detach()
    if type(tensor).__name__ == "NF4Tensor":
        names, _ = tensor.__tensor_flatten__()
        return [getattr(tensor, name).clone() for name in names]
    return [tensor.clone()]


def base_and_adapters(model: torch.nn.Module) -> tuple[dict[str, list], dict[str, torch.nn.Parameter]]:
    base = {name: stored(p) for name, p in model.named_parameters() if not p.requires_grad}
    adapters = {name: p for name, p in model.named_parameters() if p.requires_grad}
    return base, adapters


@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_only_the_adapters_train_and_the_base_stays_bit_identical(kind, tmp_path):
    overrides = LORA if kind == "lora" else QLORA
    job = prepare_job(resolved_spec([*overrides, "train.checkpoint_every=4"]), tmp_path)
    base, adapters = base_and_adapters(job.model)
    assert adapters and all(".lora_" in name for name in adapters)
    assert {id(p) for group in job.optimizer.param_groups for p in group["params"]} == {
        id(p) for p in adapters.values()
    }
    before = {name: p.detach().clone() for name, p in adapters.items()}
    summary = train(job)
    assert summary["train_loss"] < summary["first_eval_loss"] + 1.0
    for name, parameter in job.model.named_parameters():
        if not parameter.requires_grad:
            assert parameter.grad is None
            assert all(map(torch.equal, stored(parameter), base[name])), name
    assert any(not torch.equal(before[name], p.detach()) for name, p in adapters.items())
    nf4 = [name for name, p in job.model.named_parameters() if len(stored(p)) > 1]
    assert (len(nf4) == 14) if kind == "qlora" else not nf4  # 2 blocks x 7 adapted linear layers
    checkpoint = tmp_path / "checkpoints" / f"step_{STEPS:08d}"
    with safe_open(checkpoint / "model.safetensors", "pt") as written:
        assert set(written.keys()) == set(adapters)
    with safe_open(checkpoint / "optimizer.safetensors", "pt") as written:
        assert {key.split("/")[1] for key in written.keys()} == set(adapters)


def test_the_exported_adapter_and_merged_model_give_the_trained_logits(tmp_path):
    job = prepare_job(resolved_spec([*BASE, "adapter=lora", "adapter.rank=4", "adapter.merge=true"]), tmp_path)
    train(job)
    tokens = torch.randint(3, 200, (2, 64), generator=torch.Generator().manual_seed(1))
    job.model.eval()
    with torch.no_grad():
        trained = job.model(input_ids=tokens).logits
    from_adapter, merged = exported_logits(tmp_path / "model")
    assert merged.dtype == torch.float32
    torch.testing.assert_close(from_adapter, trained, atol=1e-5, rtol=0)
    torch.testing.assert_close(merged, trained, atol=1e-5, rtol=0)


def test_the_merged_qlora_model_gives_the_trained_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    job = prepare_job(
        resolved_spec([*QLORA, "train.max_steps=4", "train.save_model=true", "adapter.merge=true"]), tmp_path
    )
    train(job)
    tokens = torch.randint(3, 200, (2, 64), generator=torch.Generator().manual_seed(1))
    job.model.eval()
    with torch.no_grad():
        trained = job.model(input_ids=tokens).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "model" / "merged").eval()(input_ids=tokens).logits
    torch.testing.assert_close(merged, trained, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["adapter=lora", "adapter.target_modules=[q_proj,qkv]"],
            "adapter.target_modules: qkv is not a linear layer of the model's blocks, which has q_proj",
        ),
        (["adapter=lora", "adapter.rank=0"], "adapter.rank=0 must be >= 1"),
        (["adapter=qlora", "strategy=deepspeed"], "adapter=qlora runs under strategy=single, ddp and fsdp"),
        (
            ["adapter=qlora", "strategy=fsdp", "strategy.cpu_ram_efficient_loading=true"],
            "adapter=qlora with strategy.cpu_ram_efficient_loading=true",
        ),
    ],
)
def test_bad_adapter_settings_are_one_line(overrides, message):
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("=", "=")):
        resolved_spec([*BASE, *overrides])


def test_an_unknown_target_stops_the_command_in_one_line_writing_nothing(tmp_path):
    result = run_cli("adapter=lora", "adapter.target_modules=[q_prj]", cwd=tmp_path)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "run: error: adapter.target_modules: q_prj is not a linear layer of the model's blocks, which has q_proj, "
        "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; did you mean q_proj?"
    ]
    assert not (tmp_path / "outputs").exists()


EXPORTED = ["train.save_model=true", "adapter.merge=true"]
LORA_VARIANTS = {
    "ddp": ["strategy=ddp"],
    "fsdp": ["strategy=fsdp", *EXPORTED],
    "deepspeed ZeRO-2": ["strategy=deepspeed", "strategy.zero_stage=2"],
    "deepspeed ZeRO-3": ["strategy=deepspeed", "strategy.zero_stage=3", *EXPORTED],
}
QLORA_VARIANTS = {"qlora ddp": ["strategy=ddp"], "qlora fsdp": ["strategy=fsdp"]}


@pytest.mark.distributed
def test_lora_and_qlora_have_the_losses_of_one_process_under_every_strategy(tmp_path):
    references = {}
    for name, overrides in {"lora": LORA, "qlora": QLORA}.items():
        (tmp_path / name).mkdir()
        train(prepare_job(resolved_spec([*overrides, "train.grad_accum_steps=4"]), tmp_path / name))
        references[name] = step_losses(tmp_path / name)
        assert references[name][-1] < references[name][0]
    # QLoRA first: once DeepSpeed ZeRO-3 has run in a worker, its own F.linear stays in place there.
    runs = {
        **{name: [*QLORA, *o] for name, o in QLORA_VARIANTS.items()},
        **{name: [*LORA, *o] for name, o in LORA_VARIANTS.items()},
    }
    specs = [
        resolved_spec([*overrides, "hardware.nproc_per_node=2", "train.grad_accum_steps=2"])
        for overrides in runs.values()
    ]
    dirs = [tmp_path / str(i) for i in range(len(specs))]
    train_in_workers(specs, dirs)
    for name, run_dir in zip(runs, dirs):
        reference = references["qlora" if name.startswith("qlora") else "lora"]
        assert step_losses(run_dir) == pytest.approx(reference, abs=1e-4), name
        if EXPORTED[-1] in runs[name]:  # the adapters gathered from their shards: both exports agree
            adapter_logits, merged_logits = exported_logits(run_dir / "model")
            torch.testing.assert_close(adapter_logits, merged_logits, atol=1e-5, rtol=0)


@pytest.mark.signals
@pytest.mark.parametrize("strategy", ["single", pytest.param("fsdp", marks=pytest.mark.distributed)])
def test_a_lora_run_killed_and_resumed_has_the_uninterrupted_losses(strategy, tmp_path, tmp_path_factory):

    args = [
        *BASE,
        "adapter=lora",
        "adapter.rank=4",
        "train.max_steps=10",
        "train.checkpoint_every=2",
        "train.save_model=false",
        f"strategy={strategy}",
        *(["hardware.nproc_per_node=2", "strategy.state_dict_type=SHARDED"] if strategy == "fsdp" else []),
    ]
    expected, resumed = killed_and_resumed(args, tmp_path, 5, tmp_path_factory)
    assert resumed == expected
    refused = run_cli("resume=auto", "adapter=none", cwd=tmp_path)
    assert refused.returncode != 0 and "written with adapter=lora" in refused.stderr
