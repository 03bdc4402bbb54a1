"""Every shipped recipe composes and validates, the GPU ones fit their hardware, the CPU ones train; recipes can
be listed, copied and edited, and a project's own recipes are found."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from runner.cli import recipes
from runner.cli.compose import CONF_DIR, RECIPES_DIR
from runner.config.hardware import Accelerator
from runner.config.spec import RunSpec, validate
from runner.memory.advice import check_fit, fit
from runner.memory.breakdown import estimate
from runner.memory.model_shapes import facts_of
from tests.support import DATA
from tests.support.command import run_cli
from tests.support.specs import composed

RECIPES = sorted(path.stem for path in RECIPES_DIR.glob("*.yaml"))
CPU_RECIPES = [name for name in RECIPES if name.startswith("cpu_")]
GPU_RECIPES = [name for name in RECIPES if name not in CPU_RECIPES]
# The data of the recipes that name none: LLaMA-Factory's preference demo (tests/support/data/llama_factory/SOURCE.md).
RECIPE_DATA = {"cpu_dpo": [f"data.files={DATA / 'llama_factory' / 'dpo_en_demo.json'}"]}


def local_checkpoint(tmp: Path, spec: RunSpec) -> Path:
    """What `model.pretrained` points at, as far as validation reads it: the config.json of the published model
    (the architecture the model group of the same name describes)."""
    model = Path(spec.model.pretrained).name.lower().replace("meta-", "").replace("-", "")
    name = {
        "llama38b": "llama3_8b",
        "llama38binstruct": "llama3_8b",
        "llama370b": "llama3_70b",
        "llama3.170b": "llama3_1_70b",
        "llama3.21binstruct": "llama3_2_1b",
        "qwen330ba3b": "qwen3_30b_a3b",
        "gptoss20b": "gpt_oss_20b",
        "mixtral8x7bv0.1": "mixtral_8x7b",
    }[model]
    architecture = yaml.safe_load((CONF_DIR / "model" / f"{name}.yaml").read_text())["architecture"]
    (tmp / "config.json").write_text(json.dumps(architecture))
    return tmp


PARAMETERS = {
    "meta-llama/Meta-Llama-3-8B": 8_030_261_248,
    "meta-llama/Meta-Llama-3-8B-Instruct": 8_030_261_248,
    "meta-llama/Meta-Llama-3-70B": 70_553_706_496,
    "meta-llama/Llama-3.1-70B": 70_553_706_496,
    "meta-llama/Llama-3.2-1B-Instruct": 1_235_814_400,
    "Qwen/Qwen3-30B-A3B": 30_532_122_624,
    "openai/gpt-oss-20b": 20_914_757_184,
    "mistralai/Mixtral-8x7B-v0.1": 46_702_792_704,
}


@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_gpu_recipe_validates_and_fits_its_hardware(recipe, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "2 + 2 =", "response": " 4"}\n')
    planned = composed([f"recipe={recipe}"])
    assert planned.hardware.accelerator is Accelerator.cuda and planned.precision.compute_dtype.value == "bf16"
    assert planned.model.pretrained in PARAMETERS
    checkpoint = local_checkpoint(tmp_path, planned)
    # An estimate validates everything but the presence of the GPUs, which this machine may not have: task=estimate,
    # or the recipe's own task's estimate_only where it sets that task's keys.
    estimate_only = "task.estimate_only=true" if hasattr(planned.task, "estimate_only") else "task=estimate"
    spec = validate(
        composed([f"recipe={recipe}", f"model.pretrained={checkpoint}", f"data.files={pairs}", estimate_only])
    )
    assert facts_of(spec.model).parameters == PARAMETERS[planned.model.pretrained]
    trained = replace(spec, task=planned.task)  # the recipe's task (train, dpo), as the launch checks it
    check_fit(trained)  # the check every launch runs: raises if it does not fit
    assert fit(trained, estimate(trained, facts_of(spec.model))).fits


def test_the_70b_recipe_splits_its_blocks_because_fsdp_alone_would_not_fit(tmp_path):
    """Its 64k-token sequences' activations exceed an H100 under FSDP alone, offloaded and checkpointed as it is:
    the fit check, asked without the split, proposes it first."""
    from runner.errors import SpecError

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "2 + 2 =", "response": " 4"}\n')
    recipe = "recipe=llama3_1_70b_fsdp_tp_8xh100"
    checkpoint = local_checkpoint(tmp_path, composed([recipe]))
    spec = validate(
        composed(
            [recipe, f"model.pretrained={checkpoint}", f"data.files={pairs}", "task=estimate", "strategy.tp_size=1"]
        )
    )
    with pytest.raises(SpecError, match=r"it fits with: strategy\.tp_size=2 \("):
        check_fit(replace(spec, task=composed([recipe]).task))


def test_recipes_set_what_their_names_say():
    two_cards = composed(["recipe=llama3_8b_full_2x4090"])
    assert (
        two_cards.strategy.sharding_strategy.value,
        two_cards.strategy.offload_params,
        two_cards.strategy.cpu_ram_efficient_loading,
        two_cards.hardware.nproc_per_node,
    ) == ("FULL_SHARD", True, True, 2)
    one_h100 = composed(["recipe=llama3_8b_full_1xh100"])
    assert (one_h100.hardware.nproc_per_node, one_h100.strategy.offload_optimizer.value) == (1, "cpu")
    assert composed(["recipe=llama3_8b_fsdp_8xh100"]).hardware.nproc_per_node == 8
    zero3 = composed(["recipe=llama3_8b_zero3_offload_2x4090"])
    assert (zero3.strategy.zero_stage, zero3.strategy.offload_optimizer.value) == (3, "cpu")


def trained_recipe(recipe: str, workdir: Path) -> Path:
    """`run recipe=<recipe>` as a user types it (with the data of the recipes that name none), checked to have
    run its steps and learned; its run directory."""
    data = RECIPE_DATA.get(recipe, [])
    result = run_cli(f"recipe={recipe}", *data, cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    [summary_file] = workdir.glob("outputs/*/*/summary.json")
    summary = json.loads(summary_file.read_text())
    planned = composed([f"recipe={recipe}", *data])
    assert summary["steps"] == planned.train.max_steps
    evaluations = [
        json.loads(line)
        for line in summary_file.with_name("metrics.jsonl").read_text().splitlines()
        if "eval_loss" in line
    ]
    if planned.data.format.value == "prompt":  # the held-out prompts' greedy completions earn more
        assert evaluations[-1]["eval_reward"] >= evaluations[0]["eval_reward"] + 1.0
    elif planned.data.format.value == "preference":  # the held-out pairs' rewards rank chosen over rejected
        assert evaluations[0]["eval_loss"] == pytest.approx(0.6931, abs=1e-4)  # log 2: the policy is its reference
        assert evaluations[-1]["eval_rewards/accuracies"] > 0.5 and evaluations[-1]["eval_rewards/margins"] > 0
    else:  # adapters on a frozen random-init base learn less in a few steps than a full fine-tune
        progress = 0.5 if planned.adapter.active else 1.0
        assert summary["eval_loss"] < summary["first_eval_loss"] - progress
    return summary_file.parent


# cpu_fsdp trains in the test of its checkpoints below.
@pytest.mark.distributed
@pytest.mark.parametrize("recipe", [recipe for recipe in CPU_RECIPES if recipe != "cpu_fsdp"])
def test_cpu_recipe_trains(recipe, workdir):
    trained_recipe(recipe, workdir)


@pytest.mark.distributed
def test_cpu_fsdp_trains_and_its_sharded_checkpoint_evaluates_in_any_layout(workdir):
    """recipe=cpu_fsdp writes SHARDED checkpoints (two ranks' shards): its last one, evaluated in one process and
    by fsdp on two, gives the run's last eval loss."""
    run_dir = trained_recipe("cpu_fsdp", workdir)
    final = json.loads((run_dir / "summary.json").read_text())["eval_loss"]
    checkpoint = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    assert (checkpoint / "model").is_dir() and not (checkpoint / "model.safetensors").exists()
    for layout in ([], ["strategy=fsdp", "hardware.nproc_per_node=2"]):
        result = run_cli("task=evaluate", f"task.trained={checkpoint}", *layout, cwd=workdir)
        assert result.returncode == 0, result.stderr[-3000:]
        [evaluated] = workdir.glob("outputs/*/*/eval.json")
        assert abs(json.loads(evaluated.read_text())["eval_loss"] - final) < 1e-5, layout
        evaluated.unlink()


def test_recipes_are_listed_with_what_they_are_for(workdir):
    result = run_cli("--recipes", cwd=workdir)
    assert result.returncode == 0, result.stderr
    for name in RECIPES:
        line = next(line for line in result.stdout.splitlines() if line.strip().startswith(name + " "))
        assert recipes.first_comment(RECIPES_DIR / f"{name}.yaml") in line
    assert "hardware=2xrtx4090 strategy=fsdp precision=bf16 model=pretrained data=instruction_files" in result.stdout
    assert "llama3_8b_full_2x4090" in run_cli("--help", cwd=workdir).stdout


def test_a_copied_recipe_is_edited_and_run_in_place_of_the_original(workdir):
    result = run_cli("--copy-recipe", "cpu_quick", "my_quick", cwd=workdir)
    assert result.returncode == 0, result.stderr
    copy = workdir / "recipes" / "my_quick.yaml"
    assert copy.read_text() == (RECIPES_DIR / "cpu_quick.yaml").read_text()
    copy.write_text(copy.read_text().replace("max_steps: 30", "max_steps: 12"))
    shown = run_cli("recipe=my_quick", "--cfg", "job", cwd=workdir)
    assert shown.returncode == 0, shown.stderr
    assert "max_steps: 12" in shown.stdout
    listed = run_cli("--recipes", cwd=workdir).stdout
    assert f"[{Path('recipes') / 'my_quick.yaml'}]" in listed
    # Never overwrites: copying again onto the same name is refused, the edit kept.
    again = run_cli("--copy-recipe", "cpu_quick", "my_quick", cwd=workdir)
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "exists already" in again.stderr
    assert "max_steps: 12" in copy.read_text()


def test_a_project_recipe_shadows_the_bundled_one_and_a_search_path_adds_more(workdir, tmp_path_factory):
    (workdir / "recipes").mkdir()
    (workdir / "recipes" / "cpu_quick.yaml").write_text(
        "# @package _global_\n# my own quick run\ntrain:\n  max_steps: 5\n"
    )
    elsewhere = tmp_path_factory.mktemp("team_recipes")
    (elsewhere / "team.yaml").write_text("# @package _global_\n# the team's run\ndefaults:\n  - override /optim: sgd\n")
    env = {recipes.SEARCH_PATH_VARIABLE: str(elsewhere)}
    assert "max_steps: 5" in run_cli("recipe=cpu_quick", "--cfg", "job", cwd=workdir).stdout
    shown = run_cli("recipe=team", "--cfg", "job", cwd=workdir, env=env)
    assert shown.returncode == 0, shown.stderr
    assert "momentum" in shown.stdout  # SGD's schema
    assert "team " in run_cli("--recipes", cwd=workdir, env=env).stdout


DDP_SEED = str(DATA / "accelerate" / "ddp_config.yaml")


@pytest.mark.parametrize("command", [["--copy-recipe", "cpu_quick"], ["--from-accelerate", DDP_SEED]])
@pytest.mark.parametrize("name", ["../../somewhere/x", "sub/x", ".hidden"])
@pytest.mark.parametrize("recipes_exist", [True, False])
def test_a_command_writes_recipes_only_under_plain_names_in_recipes(command, name, recipes_exist, tmp_path):
    workdir = tmp_path / "a" / "b"
    (workdir / "recipes" if recipes_exist else workdir).mkdir(parents=True)
    result = run_cli(*command, name, cwd=workdir)
    assert result.returncode == 2
    assert (
        result.stderr.startswith(
            f"run: error: {name} cannot name a recipe: use letters, digits, _ and -; run {command[0]} "
        )
        and result.stderr.count("\n") == 1
    ), result.stderr
    assert [p.relative_to(tmp_path) for p in tmp_path.rglob("*")] == (
        [Path("a"), Path("a/b"), Path("a/b/recipes")] if recipes_exist else [Path("a"), Path("a/b")]
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["recipe=no_such"],
            "recipe=no_such is not an option; choose one of: cpu_ddp, cpu_dpo, cpu_fsdp, cpu_grpo, "
            "cpu_lora, cpu_qlora, cpu_quick",
        ),
        (["--copy-recipe", "no_such"], "no recipe named no_such"),
        (["--copy-recipe"], "usage: run --copy-recipe <name> [<new name>]"),
    ],
)
def test_recipe_errors_are_one_line(args, message, workdir):
    result = run_cli(*args, cwd=workdir)
    assert result.returncode == 2
    assert result.stderr.startswith(f"run: error: {message}") and result.stderr.count("\n") == 1, result.stderr
    assert not (workdir / "outputs").exists() and not (workdir / "recipes").exists()


def test_a_broken_recipe_is_a_one_line_error_where_a_recipe_is_chosen(workdir):
    (workdir / "recipes").mkdir()
    (workdir / "recipes" / "broken.yaml").write_text("train: [max_steps: 5\n")
    result = run_cli("recipe=cpu_quick", cwd=workdir)
    assert result.returncode == 2
    assert result.stderr.startswith("run: error: recipe recipes/broken.yaml is not valid YAML")
    assert result.stderr.count("\n") == 1
    # A command line that chooses no recipe does not read them (Hydra would copy them at every composition).
    plain = run_cli("--cfg", "job", cwd=workdir)
    assert plain.returncode == 0 and "max_steps: 200" in plain.stdout, plain.stderr


@pytest.mark.parametrize("flag", ["-sc", "--shell-completion"])
def test_tab_completion_offers_the_recipes(flag, workdir):
    (workdir / "recipes").mkdir()
    (workdir / "recipes" / "cpu_mine.yaml").write_text("# @package _global_\n# mine\n")
    typed = {"COMP_LINE": "run recipe=cpu_", "COMP_POINT": "15"}
    result = run_cli(flag, "query=bash", cwd=workdir, env=typed)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "recipe=cpu_ddp",
        "recipe=cpu_dpo",
        "recipe=cpu_fsdp",
        "recipe=cpu_grpo",
        "recipe=cpu_lora",
        "recipe=cpu_mine",
        "recipe=cpu_qlora",
        "recipe=cpu_quick",
    ]
