"""Real accelerate config files, collected from public repositories (tests/support/data/accelerate_corpus/SOURCES.md
gives each file's repository, path and commit): each converts to a recipe that passes the checks of
`run --cfg job` and `run task=estimate` (a GPU's values standing in where the file leaves them to the machine),
or is refused in one line for one of the reasons docs/accelerate.md lists."""

import importlib.util

import pytest
import yaml

from runner.cli.compose import RECIPES_DIR, checked_recipe, compose_config, register
from runner.config.spec import load_spec, to_plain
from runner.errors import SpecError
from runner.memory.report import report
from runner.tools.accelerate.reader import convert, recipe_of
from runner.tools.accelerate.sections import SECTIONS
from runner.tools.accelerate.writer import accelerate_file
from tests.support import DATA

CORPUS = DATA / "accelerate_corpus"
FILES = sorted(p.name for p in CORPUS.glob("*.y*ml"))
HAS_TRANSFORMER_ENGINE = importlib.util.find_spec("transformer_engine") is not None

# The files refused, and why: each reason is one docs/accelerate.md lists.
REFUSED = {
    **dict.fromkeys(
        [
            "huggingface__accelerate__docs__source__usage_guides__megatron_lm.md__block7.yaml",
            "huggingface__accelerate__tests__test_configs__megatron.yaml",
            # accelerate's own: MEGATRON_LM, despite its name
            "huggingface__accelerate__tests__test_configs__fsdp.yaml",
        ],
        "distributed_type: MEGATRON_LM cannot be expressed here",
    ),
    **dict.fromkeys(
        [
            "huggingface__accelerate__examples__config_yaml_templates__multi_xpu.yaml",
            "huggingface__peft__examples__int8_training__config.yaml",
        ],
        "distributed_type: MULTI_XPU cannot be expressed here",
    ),
    "huggingface__accelerate__docs__source__usage_guides__sagemaker.md__block8.yaml": (
        "distributed_type: DATA_PARALLEL cannot be expressed here"
    ),
    "huggingface__accelerate__tests__test_configs__0_30_0_sagemaker.yaml": "SageMaker jobs are not supported",
    "huggingface__accelerate__tests__test_configs__invalid_keys.yaml": "unknown key invalid_key",
    # a typo accelerate refuses too
    "huggingface__diffusers__examples__dreambooth__README_flux2.md__block11.yaml": (
        "fsdp_auto_wrap_policy: TRANSFOMER_BASED_WRAP cannot be converted"
    ),
    # The DeepSpeed JSON each names is not where the file says (a doc author's home directory, or beside the
    # original file): the run would not find it either.
    **dict.fromkeys(
        [
            "huggingface__accelerate__docs__source__concept_guides__sequence_parallelism.md__block4.yaml",
            "huggingface__accelerate__docs__source__usage_guides__deepspeed.md__block10.yaml",
            "huggingface__accelerate__docs__source__usage_guides__deepspeed.md__block13.yaml",
            "huggingface__accelerate__docs__source__usage_guides__deepspeed.md__block19.yaml",
            "huggingface__accelerate__docs__source__usage_guides__deepspeed.md__block23.yaml",
            "huggingface__accelerate__examples__alst_ulysses_sequence_parallelism__sp-alst.accelerate-config.yml",
            "huggingface__accelerate__examples__config_yaml_templates__deepspeed.yaml",
            "huggingface__transformers__docs__source__en__trainer.md__block25.yaml",
        ],
        "does not exist",
    ),
    **(
        {}
        if HAS_TRANSFORMER_ENGINE
        else dict.fromkeys(
            [
                "huggingface__accelerate__examples__config_yaml_templates__fp8.yaml",
                "huggingface__accelerate__tests__test_configs__0_34_0_fp8.yaml",
            ],
            "needs TransformerEngine",
        )
    ),
}


def test_the_corpus_holds_real_files_of_every_kind():
    assert len(FILES) >= 30 and not set(REFUSED) - set(FILES)
    listed = (CORPUS / "SOURCES.md").read_text()
    assert all(f"`{name}`" in listed for name in FILES)
    kinds = {str(yaml.safe_load((CORPUS / name).read_text())["distributed_type"]) for name in FILES}
    assert {"NO", "MULTI_GPU", "MULTI_CPU", "FSDP", "DEEPSPEED"} <= kinds


@pytest.mark.parametrize("name", FILES)
def test_a_real_file_converts_to_a_recipe_that_passes_the_checks_or_is_refused_in_one_line(name):
    register(RECIPES_DIR)
    source = CORPUS / name
    try:
        text, lines = recipe_of(source, "converted")
        spec = checked_recipe(text)
    except SpecError as refusal:
        assert name in REFUSED, f"refused: {refusal}"
        assert REFUSED[name] in str(refusal) and "\n" not in str(refusal)
        return
    assert name not in REFUSED, "converted, where it should be refused"
    file = yaml.safe_load(source.read_text())
    for key, value in file.items():
        keys = [f"  {inner}: " for inner in value] if key in SECTIONS and value else [f"{key}: "]
        assert all(any(line.startswith(k) and " -> " in line for line in lines) for k in keys), key
    assert all("\n" not in line for line in lines)
    assert "per device" in report(spec)


def strategy_of(name: str) -> dict:
    settings, _ = convert(yaml.safe_load((CORPUS / name).read_text()))
    return {key: value for key, value in settings.items() if key.startswith("strategy")}


def test_what_real_files_mean_is_what_accelerate_makes_of_them():
    # fsdp_version 2 reads fsdp_reshard_after_forward, not fsdp_sharding_strategy: this HYBRID_SHARD file shards
    # across all processes under accelerate, and here.
    z_image = strategy_of("huggingface__diffusers__examples__dreambooth__README_z_image.md__block9.yaml")
    assert z_image["strategy.sharding_strategy"] == "FULL_SHARD" and "strategy.forward_prefetch" not in z_image
    # The older name of fsdp_backward_prefetch, from accelerate's own FSDP guide.
    guide = strategy_of("huggingface__accelerate__docs__source__usage_guides__fsdp.md__block3.yaml")
    assert guide["strategy.backward_prefetch"] == 1
    # accelerate adds fsdp_ to section keys given without it (its 2022 docs).
    old_docs = strategy_of("huggingface__accelerate__docs__source__fsdp.mdx__block3.yaml")
    assert old_docs["strategy.sharding_strategy"] == "FULL_SHARD" and old_docs["strategy.offload_params"] is False
    # DeepSpeed ignores parameter offload below ZeRO-3: dropped with a note, never written to fail later.
    settings, lines = convert(
        yaml.safe_load(
            (
                CORPUS / "huggingface__diffusers__examples__research_projects__flux_lora_quantization__ds2.yaml"
            ).read_text()
        )
    )
    assert "strategy.offload_param" not in settings and settings["strategy.offload_optimizer"] == "cpu"
    assert (
        "  offload_param_device: cpu -> dropped: DeepSpeed offloads parameters at ZeRO-3 only and ignores the "
        "setting at lower stages (zero_stage: 2)" in lines
    )
    # distributed_type NO runs one process, whatever num_processes says.
    single = convert(
        yaml.safe_load((CORPUS / "huggingface__trl__trl__accelerate_configs__single_gpu.yaml").read_text())
    )
    assert single[0]["hardware.nproc_per_node"] == 1


def test_accelerates_fp8_templates_set_transformer_engines_delayed_scaling():
    for name in (
        "huggingface__accelerate__examples__config_yaml_templates__fp8.yaml",
        "huggingface__accelerate__tests__test_configs__0_34_0_fp8.yaml",
    ):
        settings, lines = convert(yaml.safe_load((CORPUS / name).read_text()))
        assert (
            settings.items()
            >= {
                "precision.fp8.backend": "transformer_engine",
                "precision.fp8.format": "e4m3",
                "precision.fp8.amax_history_len": 1024,
                "precision.fp8.margin": 0,
            }.items()
        )
        assert any(
            line.startswith("mixed_precision: fp8 -> precision=fp8 (Transformer Engine float8") for line in lines
        )
    # accelerate's AO backend reads none of Transformer Engine's keys.
    settings, lines = convert(
        yaml.safe_load("distributed_type: NO\nmixed_precision: fp8\nfp8_config:\n  backend: AO\n  fp8_format: E4M3\n")
    )
    assert "precision.fp8.format" not in settings
    assert (
        "  fp8_format: E4M3 -> no meaning here: a Transformer Engine setting, which accelerate's AO backend "
        "does not read" in lines
    )
    with pytest.raises(SpecError, match="Transformer Engine refuses pure E5M2"):
        convert(
            yaml.safe_load(
                "distributed_type: NO\nmixed_precision: fp8\nfp8_config:\n  backend: TE\n  fp8_format: E5M2\n"
            )
        )


def test_a_converted_hybrid_file_shards_within_each_node(tmp_path):
    """HYBRID_SHARD as torch and accelerate mean it: one shard group per node, so 1 x 8 on one node of 8 GPUs
    (the same as FULL_SHARD, which the run says) and 2 x 8 on two."""
    register(RECIPES_DIR)
    source = tmp_path / "hybrid.yaml"
    for nodes, mesh in ((1, (1, 8)), (2, (2, 8))):
        source.write_text(
            f"distributed_type: FSDP\nnum_machines: {nodes}\nnum_processes: {8 * nodes}\n"
            "main_process_ip: 10.0.0.1\nfsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\n"
        )
        spec = checked_recipe(recipe_of(source, "hybrid")[0])
        assert to_plain(spec)["strategy"]["hybrid_shard_size"] is None
        assert spec.layout.shape == (1, *mesh, 1, 1)


def test_transformer_engines_scaling_goes_back_to_accelerate_and_returns():
    spec = load_spec(
        compose_config(
            [
                "precision=fp8",
                "precision.fp8.backend=transformer_engine",
                "precision.fp8.format=e4m3",
                "precision.fp8.amax_history_len=16",
                "precision.fp8.amax_compute_algo=most_recent",
                "precision.fp8.margin=1",
            ]
        )
    )
    text, _ = accelerate_file(spec)
    settings, _ = convert(yaml.safe_load(text))
    assert (
        settings.items()
        >= {
            "precision.fp8.format": "e4m3",
            "precision.fp8.amax_history_len": 16,
            "precision.fp8.amax_compute_algo": "most_recent",
            "precision.fp8.margin": 1,
        }.items()
    )


def test_accelerates_tensor_parallel_hsdp_example_is_the_same_mesh_here_and_back():
    """accelerate's torch_native_parallelism example: 8 processes as dp_replicate 2 x dp_shard 2 x tp 2. It converts
    to HYBRID_SHARD in groups of 2 with strategy.tp_size=2, the same mesh, and goes back to the same sizes."""
    register(RECIPES_DIR)
    name = "huggingface__accelerate__examples__torch_native_parallelism__configs__tp_hsdp.yaml"
    spec = checked_recipe(recipe_of(CORPUS / name, "tp_hsdp")[0])
    assert spec.layout.shape == (1, 2, 2, 1, 2)
    text, _ = accelerate_file(spec)
    assert (
        yaml.safe_load(text)["parallelism_config"] == yaml.safe_load((CORPUS / name).read_text())["parallelism_config"]
    )
    assert {
        key: value for key, value in convert(yaml.safe_load(text))[0].items() if key.startswith("strategy")
    }.items() >= {
        "strategy.sharding_strategy": "HYBRID_SHARD",
        "strategy.hybrid_shard_size": 2,
        "strategy.tp_size": 2,
    }.items()


@pytest.mark.parametrize(
    "name,cp",
    [
        ("huggingface__accelerate__examples__torch_native_parallelism__configs__cp.yaml", 8),
        ("huggingface__trl__examples__accelerate_configs__context_parallel_2gpu.yaml", 2),
    ],
)
def test_context_parallel_examples_split_each_sequence_here_and_back(name, cp):
    """accelerate's and TRL's context-parallel files: every process one slice of each sequence (strategy.cp_size),
    no data-parallel split, and the same sizes written back."""
    register(RECIPES_DIR)
    spec = checked_recipe(recipe_of(CORPUS / name, "cp")[0])
    assert spec.strategy.cp_size == cp and spec.layout.shape == (1, 1, 1, cp, 1)
    text, _ = accelerate_file(spec)
    written = yaml.safe_load(text)["parallelism_config"]
    assert {key: written[key] for key in written if key.endswith("_size")} == {
        key: value
        for key, value in yaml.safe_load((CORPUS / name).read_text())["parallelism_config"].items()
        if key.endswith("_size")
    }


@pytest.mark.parametrize(
    "name",
    [
        "huggingface__trl__examples__accelerate_configs__alst_ulysses_4gpu.yaml",
        "huggingface__trl__docs__source__distributing_training.md__block7.yaml",
    ],
)
def test_ulysses_examples_split_each_sequence_under_deepspeed_here_and_back(name):
    """TRL's ALST/Ulysses files: DeepSpeed ZeRO-3 over 4 processes, each sequence split over 2 of them
    (strategy.sp_size), the gradients reduced in bf16 as DeepSpeed reduces them under sequence parallelism; the same
    sizes written back."""
    register(RECIPES_DIR)
    spec = checked_recipe(recipe_of(CORPUS / name, "ulysses")[0])
    assert (spec.strategy.name, spec.strategy.zero_stage, spec.strategy.sp_size) == ("deepspeed", 3, 2)
    assert spec.layout.shape == (1, 1, 2, 2, 1) and spec.precision.reduce_dtype.value == "bf16"
    text, _ = accelerate_file(spec)
    written = yaml.safe_load(text)
    assert {key: value for key, value in written["parallelism_config"].items() if key.endswith("_size")} == {
        key: value
        for key, value in yaml.safe_load((CORPUS / name).read_text())["parallelism_config"].items()
        if key.endswith("_size")
    }
    assert written["deepspeed_config"]["seq_parallel_communication_data_type"] == "bf16"
