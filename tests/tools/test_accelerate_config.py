"""accelerate config files both ways: the seed files convert to recipes whose specs carry what the files say,
validate for training, and convert back to equivalent accelerate files; what cannot be converted is refused."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir

from runner.cli.compose import CONF_DIR, RECIPES_DIR, register
from runner.config.spec import RunSpec, load_spec, to_plain, validate
from runner.errors import SpecError
from runner.memory.advice import fit
from runner.memory.breakdown import estimate
from runner.memory.model_shapes import facts_of
from runner.tools.accelerate.reader import convert
from runner.tools.accelerate.writer import accelerate_file
from tests.support import DATA, REPO
from tests.support.command import run_cli

SEEDS = DATA / "accelerate"

# What each seed file says, as the composed spec must carry it.
EXPECTED = {
    "ddp_config": {
        "strategy": "DDPStrategy",
        "compute_dtype": "bf16",
        "accelerator": "cuda",
        "nnodes": 1,
        "nproc_per_node": 8,
    },
    "fsdp_config": {
        "strategy": "FSDPStrategy",
        "compute_dtype": "bf16",
        "accelerator": "cuda",
        "nnodes": 1,
        "nproc_per_node": 8,
        "sharding_strategy": "FULL_SHARD",
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "backward_prefetch": 1,
        "forward_prefetch": 0,
        "offload_params": False,
        "cpu_ram_efficient_loading": True,
        "sync_module_states": True,
        "state_dict_type": "SHARDED",
    },
}
# FSDP2, which the runner runs, always keeps the original parameters, and the runner's optimizer groups matrices
# apart from the rest, which FSDP1 allows only with use_orig_params: so the file written back says true.
DIFFERS_ON_PURPOSE = {"fsdp_use_orig_params"}


def composed(recipe_dir: Path, overrides: list[str]) -> RunSpec:
    register(RECIPES_DIR, recipe_dir)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return load_spec(compose("config", overrides=overrides))


def carried(spec: RunSpec) -> dict:
    plain = to_plain(spec)
    facts = {
        "strategy": type(spec.strategy).__name__,
        "compute_dtype": plain["precision"]["compute_dtype"],
        **{key: plain["hardware"][key] for key in ("accelerator", "nnodes", "nproc_per_node")},
    }
    return facts | plain["strategy"]


def assert_every_key_has_a_line(file: dict, printed: list[str]) -> None:
    """A line per key, a section's keys indented under its name."""
    for key, value in file.items():
        if isinstance(value, dict):
            assert f"{key}:" in printed
        for prefix in [f"  {inner}: " for inner in value] if isinstance(value, dict) else [f"{key}: "]:
            assert any(line.startswith(prefix) and " -> " in line for line in printed), f"no line for {prefix}"


@pytest.mark.parametrize("seed", sorted(EXPECTED))
def test_seed_converts_to_an_equivalent_recipe_and_back(seed, workdir):
    source = SEEDS / f"{seed}.yaml"
    result = run_cli("--from-accelerate", str(source), cwd=workdir)
    assert result.returncode == 0, result.stderr
    recipe = workdir / "recipes" / f"{seed}.yaml"
    assert recipe.read_text().startswith("# @package _global_\n# ")
    assert f"converted from the accelerate config {seed}.yaml" in recipe.read_text().splitlines()[1]
    file = yaml.safe_load(source.read_text())
    printed = result.stdout.splitlines()
    assert_every_key_has_a_line(file, printed)
    assert "main_training_function: main -> no meaning here: the runner's training loop is its own" in printed

    spec = composed(workdir / "recipes", [f"recipe={seed}"])
    facts = carried(spec)
    assert {key: facts[key] for key in EXPECTED[seed]} == EXPECTED[seed]

    back = run_cli("--to-accelerate", f"recipe={seed}", cwd=workdir)
    assert back.returncode == 0, back.stderr
    written = yaml.safe_load(back.stdout)
    for key, value in file.items():
        if isinstance(value, dict):
            assert {k: v for k, v in written[key].items() if k in value and k not in DIFFERS_ON_PURPOSE} == {
                k: v for k, v in value.items() if k not in DIFFERS_ON_PURPOSE
            }
        else:
            assert written[key] == value, key


@pytest.mark.parametrize("seed", sorted(EXPECTED))
def test_converted_recipe_validates_for_training_on_its_hardware(seed, workdir):
    run_cli("--from-accelerate", str(SEEDS / f"{seed}.yaml"), cwd=workdir)
    # The recipe's GPUs are read from the machine it runs on; declaring their memory checks it anywhere, as a job
    # submitted to a cluster is checked: everything for training but the presence of the GPUs.
    spec = validate(
        composed(workdir / "recipes", [f"recipe={seed}", "hardware.device_memory_gib=79.1"]), on_this_machine=False
    )
    assert fit(spec, estimate(spec, facts_of(spec.model))).fits


def test_estimate_of_a_converted_recipe_runs_on_a_machine_without_gpus(workdir):
    run_cli("--from-accelerate", str(SEEDS / "fsdp_config.yaml"), cwd=workdir)
    result = run_cli("task=estimate", "recipe=fsdp_config", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert "fsdp FULL_SHARD, 8 processes" in result.stdout


BAD_FILES = {
    "xla": ("distributed_type: XLA\n", "distributed_type: XLA cannot be expressed here"),
    "megatron": ("distributed_type: MEGATRON_LM\n", "distributed_type: MEGATRON_LM cannot be expressed here"),
    "unknown key": ("distributed_type: MULTI_GPU\nnum_processes: 2\nlearning_rate: 1\n", "unknown key learning_rate"),
    "unknown fsdp key": (
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_shardng_strategy: FULL_SHARD\n",
        "unknown key fsdp_config.fsdp_shardng_strategy",
    ),
    "unsupported value": (
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_activation_checkpointing_offload: true\n",
        "the runner does not offload activations",
    ),
    "uneven processes": ("distributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 3\n", "do not split evenly"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_what_cannot_be_converted_is_a_one_line_error_and_writes_nothing(case, workdir):
    content, message = BAD_FILES[case]
    (workdir / "accelerate.yaml").write_text(content)
    result = run_cli("--from-accelerate", "accelerate.yaml", cwd=workdir)
    assert result.returncode == 2
    assert result.stderr.startswith("run: error: accelerate.yaml: ") and result.stderr.count("\n") == 1
    assert message in result.stderr
    assert not (workdir / "recipes").exists()


def test_an_existing_recipe_is_never_overwritten(workdir):
    (workdir / "recipes").mkdir()
    (workdir / "recipes" / "mine.yaml").write_text("# mine\n")
    result = run_cli("--from-accelerate", str(SEEDS / "ddp_config.yaml"), "mine", cwd=workdir)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "recipes/mine.yaml exists already" in result.stderr
    assert (workdir / "recipes" / "mine.yaml").read_text() == "# mine\n"


def test_from_accelerate_does_not_import_torch(workdir):
    probe = textwrap.dedent(
        f"""
        import sys
        sys.argv = ["run", "--from-accelerate", "{SEEDS / "fsdp_config.yaml"}"]
        from runner.cli.main import main
        main()
        print("torch imported:", "torch" in sys.modules)
        """
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=workdir, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "torch imported: False" in result.stdout


def converted(text: str) -> dict:
    settings, _ = convert(yaml.safe_load(text))
    return settings


def test_fsdp_values_in_every_form_accelerate_takes():
    assert (
        converted("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: 3\n")["strategy.sharding_strategy"]
        == "NO_SHARD"
    )
    assert (
        converted("distributed_type: FSDP\nfsdp_config:\n  fsdp_reshard_after_forward: HYBRID_SHARD\n")[
            "strategy.sharding_strategy"
        ]
        == "HYBRID_SHARD"
    )
    assert (
        converted("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: false\n")[
            "strategy.sharding_strategy"
        ]
        == "SHARD_GRAD_OP"
    )
    for prefetch, blocks in (("BACKWARD_PRE", 1), ("BACKWARD_POST", 1), ("NO_PREFETCH", 0)):
        assert (
            converted(f"distributed_type: FSDP\nfsdp_config:\n  fsdp_backward_prefetch: {prefetch}\n")[
                "strategy.backward_prefetch"
            ]
            == blocks
        )
    for kind, runner_kind in (
        ("FULL_STATE_DICT", "FULL"),
        ("SHARDED_STATE_DICT", "SHARDED"),
        ("LOCAL_STATE_DICT", "SHARDED"),
    ):
        assert (
            converted(f"distributed_type: FSDP\nfsdp_config:\n  fsdp_state_dict_type: {kind}\n")[
                "strategy.state_dict_type"
            ]
            == runner_kind
        )
    size = converted(
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n"
        "  fsdp_min_num_params: 1000\n  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n"
    )
    assert size["strategy.min_num_params"] == 1000 and "strategy.transformer_layer_cls" not in size
    with pytest.raises(SpecError, match="disagree"):
        converted(
            "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n"
            "  fsdp_reshard_after_forward: SHARD_GRAD_OP\n"
        )


def test_cpu_deepspeed_and_multi_node_files():
    cpu = converted("distributed_type: MULTI_CPU\nnum_processes: 4\nmixed_precision: 'no'\nuse_cpu: true\n")
    assert cpu == {"strategy": "ddp", "hardware": "cpu", "hardware.nproc_per_node": 4, "precision": "fp32"}
    deepspeed = converted(
        textwrap.dedent("""\
        distributed_type: DEEPSPEED
        deepspeed_config:
          zero_stage: 3
          offload_optimizer_device: nvme
          offload_optimizer_nvme_path: /nvme
          offload_param_device: cpu
          gradient_accumulation_steps: 4
          gradient_clipping: 0.5
          zero3_init_flag: true
        mixed_precision: bf16
        num_machines: 2
        num_processes: 16
        machine_rank: 1
        main_process_ip: 10.0.0.1
        main_process_port: 29501
        rdzv_backend: static
        """)
    )
    assert deepspeed == {
        "strategy": "deepspeed",
        "hardware": "auto",
        "hardware.accelerator": "cuda",
        "strategy.zero_stage": 3,
        "strategy.offload_optimizer": "nvme",
        "strategy.nvme_path": "/nvme",
        "strategy.offload_param": "cpu",
        "train.grad_accum_steps": 4,
        "train.max_grad_norm": 0.5,
        "precision": "bf16",
        "hardware.nnodes": 2,
        "hardware.nproc_per_node": 8,
        "hardware.node_rank": 1,
        "hardware.rdzv_endpoint": "10.0.0.1:29501",
    }


def test_the_docs_show_the_mapping_the_fsdp_seed_really_prints():
    readme = (REPO / "docs" / "accelerate.md").read_text()
    block = readme.split("# accelerate config files", 1)[1].split("an FSDP file:\n\n", 1)[1].split("\n\n", 1)[0]
    shown_lines = [line.removeprefix("    ") for line in block.splitlines()]
    _, lines = convert(yaml.safe_load((SEEDS / "fsdp_config.yaml").read_text()))
    assert shown_lines == [*lines, "wrote recipes/fsdp_config.yaml; run it with: run recipe=fsdp_config"]


@pytest.mark.parametrize("recipe", ["llama3_8b_full_2x4090", "llama3_8b_zero3_offload_2x4090"])
def test_bundled_recipes_go_to_accelerate_and_come_back(recipe, tmp_path):
    spec = composed(tmp_path, [f"recipe={recipe}"])
    text, notes = accelerate_file(spec)
    settings, _ = convert(yaml.safe_load(text))
    strategy = to_plain(spec)["strategy"]
    assert {key: settings[f"strategy.{key}"] for key in strategy if f"strategy.{key}" in settings} == {
        key: value for key, value in strategy.items() if f"strategy.{key}" in settings
    }
    assert (settings["hardware.nproc_per_node"], settings["precision"]) == (2, "bf16")
    assert any(note.startswith("hardware.device_name=NVIDIA GeForce RTX 4090") for note in notes)
