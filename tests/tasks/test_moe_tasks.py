"""Every task on a MoE model (tiny_qwen3_moe), as a user runs it: task=dpo and task=grpo train with the router's
terms logged, and task=evaluate and task=generate read what a run trained."""

import json

import pytest

from tests.support import DATA
from tests.support.command import run_cli
from tests.support.runs import logged, run_dirs

pytestmark = pytest.mark.slow

MOE = ["model=tiny_qwen3_moe", "model.router_z_loss_coef=0.001"]
SHORT = ["train.max_steps=2", "train.log_every=1", "train.eval_every=0", "train.eval_batches=1"]
TASKS = {
    "dpo": [
        "recipe=cpu_dpo",
        f"data.files={DATA / 'llama_factory' / 'dpo_en_demo.json'}",
        "data.seq_len=128",
        "train.micro_batch_size=2",
        "train.save_model=false",
    ],
    "grpo": [
        "recipe=cpu_grpo",
        "task.num_generations=4",
        "task.sampling_batch_size=4",
        "train.micro_batch_size=8",
        "train.save_model=false",
    ],
}


def ran(workdir, *args: str):
    before = run_dirs(workdir)
    result = run_cli(*args, cwd=workdir)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    (new,) = [run for run in run_dirs(workdir) if run not in before]
    return new


@pytest.mark.parametrize("task", TASKS)
def test_preference_and_policy_tasks_train_a_moe_model_with_its_router_terms(task, tmp_path):
    run_dir = ran(tmp_path, *TASKS[task], *MOE, *SHORT)
    for key in ("router/aux_loss", "router/z_loss", "router/load_max_over_mean", "router/dead_experts"):
        assert list(logged(run_dir, key)) == [1, 2], key
    assert all(aux > 0 for aux in logged(run_dir, "router/aux_loss").values())


def test_evaluate_and_generate_read_a_trained_moe_model(tmp_path):
    """Generation reads it whole on one process, as data-parallel replicas on two, and placed by device_map=auto
    (big-model inference): the same greedy completions each way."""
    trained = ran(tmp_path, "recipe=cpu_quick", *MOE, *SHORT, "data.seq_len=64")
    evaluated = ran(tmp_path, "task=evaluate", f"task.trained={trained}")
    final = json.loads((trained / "summary.json").read_text())["eval_loss"]
    assert json.loads((evaluated / "eval.json").read_text())["eval_loss"] == pytest.approx(final, abs=1e-6)
    (tmp_path / "prompts.txt").write_text("def \nimport os\nclass \n")
    greedy = ["task=generate", f"task.trained={trained}", "task.prompts=prompts.txt", "task.max_new_tokens=8"]
    completions = [
        (ran(tmp_path, *greedy, *placement) / "completions.jsonl").read_text().splitlines()
        for placement in ([], ["strategy=ddp", "hardware.nproc_per_node=2"], ["task.device_map=auto"])
    ]
    assert len(completions[0]) == 3
    assert completions[1] == completions[2] == completions[0]
