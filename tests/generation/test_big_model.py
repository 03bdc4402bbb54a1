"""Big-model placement for inference: layers split between RAM and an offload folder on disk give exactly the tokens
of the model held whole, from random init and from a saved model; the memory limits; the placement's report."""

import logging
import resource
import time

import pytest
import torch
import yaml

from runner.components.modeling import build_model, build_tokenizer
from runner.config.hardware import GIB
from runner.config.model import ModelConfig
from runner.config.task import MaxMemory
from runner.errors import SpecError
from runner.generation.big_model import place_for_inference, placement_lines
from runner.generation.decoding import prompt_batches
from runner.memory.device_map import memory_limits
from tests.support import REPO

CONF = REPO / "conf" / "model"
# tiny_llama's architecture, with a larger init than the default 0.02: its greedy tokens then vary from step to
# step instead of repeating one token, so a wrong weight would show in them.
TINY = ModelConfig(
    tokenizer="bytes",
    architecture={**yaml.safe_load((CONF / "tiny_llama.yaml").read_text())["architecture"], "initializer_range": 0.2},
)
# Half the decoder layers and the final norm on disk, the rest in RAM; lm_head stays with the embeddings it is tied to.
HALF_ON_DISK = {
    "model.embed_tokens": "cpu",
    "model.rotary_emb": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "cpu",
    "model.layers.2": "disk",
    "model.layers.3": "disk",
    "model.norm": "disk",
    "lm_head": "cpu",
}
PROMPTS = ["Hello, world", "def add(a, b):", "The"]
SEED = 3


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TINY)


@pytest.fixture(scope="module")
def batch(tokenizer):
    (batch,) = prompt_batches([tokenizer.encode(prompt) for prompt in PROMPTS], len(PROMPTS), tokenizer.pad_token_id)
    return batch


@pytest.fixture(scope="module")
def whole_model(tokenizer):
    torch.manual_seed(SEED)
    return build_model(TINY, tokenizer).eval()


@pytest.fixture(scope="module")
def whole_tokens(whole_model, tokenizer, batch):
    tokens = greedy(whole_model, tokenizer, batch)
    assert len(set(tokens[:, -16:].flatten().tolist())) > 10  # varied enough to tell models apart
    return tokens


def greedy(model, tokenizer, batch, max_new_tokens=16):
    return model.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)


def test_random_init_is_transformers_init_of_every_weight(whole_model):
    """Each weight as transformers initialises it (torch's own init of each layer is skipped, not kept): linear and
    embedding weights drawn from N(0, initializer_range), the norms one."""
    for name, weight in whole_model.state_dict().items():
        if name.endswith("norm.weight"):
            assert torch.equal(weight, torch.ones_like(weight)), name
        elif name.endswith("weight"):
            assert abs(weight.mean().item()) < 0.02 and weight.std().item() == pytest.approx(0.2, rel=0.1), name


def test_split_between_ram_and_disk_gives_the_whole_models_tokens(tokenizer, batch, whole_tokens, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    model, device_map = place_for_inference(
        TINY,
        tokenizer,
        memory_limits(None, 0, 1.0, MaxMemory()),
        tmp_path / "offload",
        seed=SEED,
        device_map=HALF_ON_DISK,
    )

    assert device_map == HALF_ON_DISK
    assert model.model.layers[3].mlp.up_proj.weight.device.type == "meta"  # held on disk, not in RAM
    assert (tmp_path / "offload" / "model.layers.3.mlp.up_proj.weight.dat").is_file()
    assert torch.equal(greedy(model, tokenizer, batch), whole_tokens)
    assert not [record for record in caplog.records if "offloaded" in record.getMessage()]
    assert placement_lines(model, device_map, tmp_path / "offload") == [
        "cpu: model.embed_tokens, layers 0-1, model.rotary_emb, lm_head (1.53 MiB)",
        f"disk: layers 2-3, model.norm (1.41 MiB) in {tmp_path / 'offload'}",
    ]


def test_a_saved_model_split_between_ram_and_disk_gives_the_whole_models_tokens(
    whole_model, tokenizer, batch, whole_tokens, tmp_path, caplog
):
    caplog.set_level(logging.WARNING)
    whole_model.save_pretrained(tmp_path / "saved")
    limits = memory_limits(None, 0, 1.0, MaxMemory())

    model, _ = place_for_inference(
        TINY, tokenizer, limits, tmp_path / "offload", weights_dir=tmp_path / "saved", device_map=HALF_ON_DISK
    )

    assert model.model.layers[3].mlp.up_proj.weight.device.type == "meta"
    assert torch.equal(greedy(model, tokenizer, batch), whole_tokens)
    assert not [record for record in caplog.records if "offloaded" in record.getMessage()]


def test_an_automatic_placement_over_the_cpu_limit_puts_layers_on_disk(tokenizer, batch, whole_tokens, tmp_path):
    limits = memory_limits(None, 0, 1 / 1024, MaxMemory())  # 1 MiB of the model's 3 MiB

    model, device_map = place_for_inference(TINY, tokenizer, limits, tmp_path / "offload", seed=SEED)

    assert set(device_map.values()) == {"cpu", "disk"}
    assert torch.equal(greedy(model, tokenizer, batch), whole_tokens)
    lines = placement_lines(model, device_map, tmp_path / "offload", limits)
    assert [line.split(":")[0] for line in lines] == ["cpu", "disk"]
    assert "of 1.00 MiB" in lines[0] and "layers 0-3" in lines[1]


def test_a_model_within_the_cpu_limit_stays_whole_in_ram(tokenizer, tmp_path):
    limits = memory_limits(None, 0, 1.0, MaxMemory())
    model, device_map = place_for_inference(TINY, tokenizer, limits, tmp_path / "offload")

    assert device_map == {"": "cpu"}
    assert placement_lines(model, device_map) == ["cpu: the whole model (2.94 MiB)"]
    assert not (tmp_path / "offload").exists()


def test_weights_left_in_the_offload_folder_by_an_earlier_placement_are_not_reused(tokenizer, batch, tmp_path):
    place_for_inference(TINY, tokenizer, {}, tmp_path, seed=SEED + 1, device_map=HALF_ON_DISK)

    model, _ = place_for_inference(TINY, tokenizer, {}, tmp_path, seed=SEED, device_map=HALF_ON_DISK)

    torch.manual_seed(SEED)
    assert torch.equal(greedy(model, tokenizer, batch, 4), greedy(build_model(TINY, tokenizer), tokenizer, batch, 4))


def test_a_device_map_that_splits_tied_weights_is_refused(tokenizer, tmp_path):
    with pytest.raises(SpecError, match="tied weights .*embed_tokens.* between"):
        place_for_inference(TINY, tokenizer, {}, tmp_path, device_map={**HALF_ON_DISK, "lm_head": "disk"})


def test_memory_limits_per_device_with_overrides():
    assert memory_limits(None, 0, 24.0, MaxMemory()) == {"cpu": 24 * GIB}
    assert memory_limits(80.0, 2, 64.0, MaxMemory()) == {0: 80 * GIB, 1: 80 * GIB, "cpu": 64 * GIB}
    assert memory_limits(80.0, 2, 64.0, MaxMemory(gpu=40, cpu=16.5)) == {
        0: 40 * GIB,
        1: 40 * GIB,
        "cpu": int(16.5 * GIB),
    }
    assert memory_limits(None, 1, 64.0, MaxMemory(gpu=20)) == {0: 20 * GIB, "cpu": 64 * GIB}


def test_memory_limits_refuse_gpus_of_unknown_memory():
    with pytest.raises(SpecError, match="the GPUs' memory is unknown"):
        memory_limits(None, 1, 24.0, MaxMemory())


@pytest.mark.slow
def test_llama_3_2_1b_with_less_ram_than_the_model_generates_from_ram_and_disk(tmp_path):
    """Llama-3.2-1B's architecture in bf16 (2.3 GiB of weights) with 1 GiB of RAM for them: the rest goes to disk."""
    started = time.perf_counter()
    config = ModelConfig(
        tokenizer="bytes", architecture=yaml.safe_load((CONF / "llama3_2_1b.yaml").read_text())["architecture"]
    )
    tokenizer = build_tokenizer(config)
    limits = memory_limits(None, 0, 24.0, MaxMemory(cpu=1.0))

    model, device_map = place_for_inference(config, tokenizer, limits, tmp_path, dtype=torch.bfloat16)
    (batch,) = prompt_batches([tokenizer.encode(prompt) for prompt in PROMPTS[:2]], 2, tokenizer.pad_token_id)
    tokens = greedy(model, tokenizer, batch, max_new_tokens=3)
    with torch.no_grad():
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss

    assert "disk" in device_map.values() and "cpu" in device_map.values()
    assert tokens.shape == (2, batch["input_ids"].shape[1] + 3)
    assert torch.isfinite(loss)
    peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
    print(*placement_lines(model, device_map, tmp_path, limits), sep="\n")
    print(f"1B placement, generation and loss: {time.perf_counter() - started:.1f} s, peak RSS {peak_rss_gib:.2f} GiB")
