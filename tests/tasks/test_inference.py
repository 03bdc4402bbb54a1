"""task=evaluate and task=generate as a user runs them, on a model the runner trained: the run's own eval loss
reproduced, and the same greedy completions from one process, two data-parallel ranks, two pipeline stages and a
device_map that puts the blocks on disk. Bad input ends in one line with nothing written."""

import json
from pathlib import Path

import pytest

from tests.support.command import run_cli
from tests.support.runs import run_dirs
from tests.support.specs import TWO_BLOCKS

pytestmark = pytest.mark.slow

# Long enough for greedy completions that differ from prompt to prompt (a shorter run completes every prompt
# with spaces, which would hide a mix-up of rows).
TRAIN = [
    "recipe=cpu_quick",
    "train.max_steps=100",
    "train.micro_batch_size=4",
    "train.eval_batches=3",
    "optim.lr=2e-3",
    *TWO_BLOCKS,
]
# Five prompts of different lengths: batches of two leave the last one alone, and two ranks take 2 and 1 batches.
PROMPTS = ["def ", "import os", "class Parser:  def __init__(self", "for i in range(", "return "]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("inference")
    result = run_cli(*TRAIN, cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    (workdir / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return workdir, run_dirs(workdir)[0]


def newest_run(workdir: Path, before: list[Path]) -> Path:
    (new,) = [run for run in run_dirs(workdir) if run not in before]
    return new


def task(workdir: Path, *args: str) -> tuple[Path, str]:
    before = run_dirs(workdir)
    result = run_cli(*args, cwd=workdir)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return newest_run(workdir, before), result.stdout


def completions(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]


def test_evaluate_reproduces_the_runs_last_eval_loss(trained):
    workdir, run_dir = trained
    final = json.loads((run_dir / "summary.json").read_text())["eval_loss"]
    eval_dir, stdout = task(workdir, "task=evaluate", f"task.trained={run_dir}")
    evaluated = json.loads((eval_dir / "eval.json").read_text())
    assert abs(evaluated["eval_loss"] - final) < 1e-6
    assert "perplexity" in stdout and "eval loss" in stdout
    # The last checkpoint holds the same weights.
    checkpoint = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    eval_dir, _ = task(workdir, "task=evaluate", f"task.trained={checkpoint}")
    assert abs(json.loads((eval_dir / "eval.json").read_text())["eval_loss"] - final) < 1e-6


@pytest.fixture(scope="module")
def evaluated_in_one_process(trained) -> dict:
    workdir, run_dir = trained
    single, _ = task(workdir, "task=evaluate", f"task.trained={run_dir}", "train.eval_batches=4")
    return json.loads((single / "eval.json").read_text())


@pytest.mark.distributed
@pytest.mark.parametrize(
    "strategy",
    [["strategy=ddp"], ["strategy=fsdp"], ["strategy=fsdp", "strategy.tp_size=2"]],
    ids=["ddp", "fsdp", "fsdp tp 2"],
)
def test_evaluate_sums_exactly_across_ranks(trained, evaluated_in_one_process, strategy):
    """Two data-parallel ranks each evaluate half the rows; under tp 2 both ranks run all of them, split, and count
    once."""
    workdir, run_dir = trained
    shared, _ = task(
        workdir,
        "task=evaluate",
        f"task.trained={run_dir}",
        "train.eval_batches=4",
        *strategy,
        "hardware.nproc_per_node=2",
    )
    one, two = evaluated_in_one_process, json.loads((shared / "eval.json").read_text())
    assert two["processes"] == 2 and two["label_tokens"] == one["label_tokens"]
    assert abs(two["eval_loss"] - one["eval_loss"]) < 1e-5


GREEDY = ["task=generate", "task.prompts=prompts.txt", "task.max_new_tokens=12", "task.batch_size=2"]


@pytest.fixture(scope="module")
def one_process(trained):
    workdir, run_dir = trained
    out, stdout = task(workdir, *GREEDY, f"task.trained={run_dir}")
    rows = completions(out)
    assert [row["prompt"] for row in rows] == PROMPTS
    assert all(row["new_tokens"] > 0 for row in rows)
    assert len({row["completion"] for row in rows}) >= 3
    assert "completions.jsonl" in stdout
    return rows


@pytest.mark.distributed
@pytest.mark.parametrize(
    "parallel", [["strategy=ddp"], ["strategy=ddp", "task.pipeline_stages=2"]], ids=["data_parallel", "pipeline"]
)
def test_two_processes_generate_what_one_does(trained, one_process, parallel):
    workdir, run_dir = trained
    out, _ = task(workdir, *GREEDY, f"task.trained={run_dir}", "hardware.nproc_per_node=2", *parallel)
    assert completions(out) == one_process


def test_device_map_with_the_blocks_on_disk_generates_what_the_whole_model_does(trained, one_process):
    workdir, run_dir = trained
    # The two-block model's weights are 1.54 MiB in fp32: 1 MiB of RAM holds the embeddings and leaves its blocks
    # to the offload folder (accelerate keeps room for one block beside those it places, so a block more needs the
    # whole model's room).
    out, stdout = task(workdir, *GREEDY, f"task.trained={run_dir}", "task.device_map=auto", "task.max_memory.cpu=0.001")
    assert "disk: layers 0-1" in stdout and "cpu: model.embed_tokens" in stdout
    assert completions(out) == one_process
    assert not (out / "offload").exists()  # the offloaded weights are removed at the end


@pytest.mark.parametrize(
    "args, message",
    [
        (["task.prompts=missing.txt"], "missing.txt is not a file"),
        (["task.prompts=empty.txt"], "holds no prompt"),
        (["task.prompts=prompts.jsonl"], "line 2 has no field 'prompt'"),
        (["task.prompts=prompts.txt", "task.max_new_tokens=0"], "task.max_new_tokens=0 must be at least 1"),
        (["task.prompts=prompts.txt", "strategy=fsdp", "hardware.nproc_per_node=2"], "does not shard a model"),
    ],
)
def test_bad_generate_input_is_one_line_and_writes_nothing(tmp_path, args, message):
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "prompts.txt").write_text("hello\n")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "a"}\n{"text": "b"}\n')
    result = run_cli("task=generate", *args, cwd=tmp_path)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr, result.stderr
    assert not (tmp_path / "outputs").exists()


def test_a_run_directory_without_a_model_is_refused(tmp_path):
    result = run_cli("recipe=cpu_quick", "train.max_steps=2", "train.save_model=false", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    (run_dir,) = run_dirs(tmp_path)
    result = run_cli("task=evaluate", f"task.trained={run_dir}", cwd=tmp_path)
    assert result.returncode == 2 and "without a saved model" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert run_dirs(tmp_path) == [run_dir]


def test_a_model_larger_than_its_memory_limit_evaluates_and_generates(tmp_path):
    """Llama-3.2-1B's architecture cut to 4 of its 16 layers (random weights, 0.94 GiB in bf16, half of it the
    tied 128k embedding) with 0.75 GiB of RAM allowed: the estimate is printed before the model is placed, and the
    layers that do not fit go to disk. (tests/generation/test_big_model.py places the whole 1B model.)"""
    (tmp_path / "prompts.txt").write_text("def \nimport os\n")
    big = [
        "model=llama3_2_1b",
        "model.architecture.num_hidden_layers=4",
        "precision=pure_bf16",
        "task.device_map=auto",
        "task.max_memory.cpu=0.75",
    ]
    out, stdout = task(tmp_path, "task=generate", "task.prompts=prompts.txt", "task.max_new_tokens=3", *big)
    assert stdout.index("inference memory estimate") < stdout.index("placed cpu")
    assert "placed disk: layers" in stdout
    assert [row["new_tokens"] for row in completions(out)] == [3, 3]
    out, stdout = task(
        tmp_path, "task=evaluate", "data.seq_len=32", "train.micro_batch_size=2", "train.eval_batches=1", *big
    )
    assert stdout.index("inference memory estimate") < stdout.index("placed cpu")
    assert json.loads((out / "eval.json").read_text())["label_tokens"] == 2 * 31
