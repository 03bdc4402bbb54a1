"""Real short training runs: the loss falls, the run directory holds what it promises, the model reloads."""

import json
import random
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from runner.components.modeling import build_tokenizer
from runner.data.rows import IGNORE
from runner.data.splits import token_splits
from runner.engine.job import prepare_job
from runner.engine.loop import train
from tests.support.command import run_cli
from tests.support.runs import run_dirs
from tests.support.specs import QUICK, QUICK_STEPS, resolved_spec


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """One short run of the `run` command, in a new interpreter (what it prints is checked too), shared by the
    checks on its outputs."""
    workdir = tmp_path_factory.mktemp("cli")
    result = run_cli(*QUICK, cwd=workdir, fresh=True)
    assert result.returncode == 0, result.stderr[-3000:]
    [run_dir] = run_dirs(workdir)
    return workdir, run_dir, result


@pytest.mark.slow
def test_eval_loss_falls(cli_run):
    _, run_dir, result = cli_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_loss"] < summary["first_eval_loss"] - 1.0
    assert summary["steps"] == 30 and summary["tokens_per_s"] > 0 and summary["peak_memory_gib"] > 0
    assert "done: train loss" in result.stdout + result.stderr


@pytest.mark.slow
def test_a_run_that_saves_its_model_prints_no_library_noise(cli_run):
    _, _, result = cli_run
    output = result.stdout + result.stderr
    # transformers' save_pretrained imports deepspeed when it is installed, which announces its accelerator
    for noise in ("Setting accelerator", "font cache", "Warning", "Traceback"):
        assert noise not in output, noise


@pytest.mark.distributed
def test_a_deepspeed_run_on_two_processes_prints_no_library_noise(tmp_path):
    """In a new interpreter, as a user starts it: DeepSpeed's first look at the ops it can build logs a test
    compile's commands. Its CPU collectives would compile a shared-memory op that training never uses (and print
    that they built it): nothing is compiled."""
    extensions = tmp_path / "torch_extensions"
    result = run_cli(
        "strategy=deepspeed",
        "hardware.nproc_per_node=2",
        *QUICK,
        "train.max_steps=2",
        "train.eval_every=0",
        "train.save_model=false",
        cwd=tmp_path,
        fresh=True,
        env={"TORCH_EXTENSIONS_DIR": str(extensions)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "done: train loss" in output
    for noise in ("gcc", "built successfully", "Setting accelerator", "Warning", "Traceback"):
        assert noise not in output, noise
    assert not extensions.exists() or not any(extensions.iterdir())


@pytest.mark.slow
def test_run_directory_contract(cli_run):
    _, run_dir, _ = cli_run
    for name in ("spec.yaml", "run.log", "metrics.jsonl", "summary.json", ".hydra/overrides.yaml", "model"):
        assert (run_dir / name).exists(), name
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "loss" in r]
    eval_records = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in train_records] == [10, 20, 30]
    assert [r["step"] for r in eval_records] == [0, 15, 30]
    assert all({"step", "loss", "lr", "tokens_per_s", "grad_norm"} <= r.keys() for r in train_records)
    assert "step 30/30" in (run_dir / "run.log").read_text()
    assert (run_dir / "model" / "model.safetensors").exists()
    assert not list(run_dir.glob("*.partial"))


@pytest.mark.slow
def test_spec_file_is_resolved_and_recomposes_into_the_same_job(cli_run):
    workdir, run_dir, _ = cli_run
    text = (run_dir / "spec.yaml").read_text()
    written = yaml.safe_load(text)
    assert written["train"]["max_steps"] == 30 and written["hardware"]["accelerator"] == "cpu"
    assert "${" not in text
    again = run_cli("--config-dir", str(run_dir), "--config-name", "spec", "--cfg", "job", cwd=workdir)
    assert again.returncode == 0, again.stderr
    original = run_cli(*QUICK, "--cfg", "job", cwd=workdir)
    assert yaml.safe_load(again.stdout) == yaml.safe_load(original.stdout)
    # A group's section holds what differs from its option: the file composes with another option of the group.
    assert "task" not in written and written["model"] == {"architecture": {"num_hidden_layers": 2}}
    for other in (["task=estimate"], ["strategy=ddp", "hardware.nproc_per_node=2", "task=estimate"]):
        estimate = run_cli("--config-dir", str(run_dir), "--config-name", "spec", *other, cwd=workdir)
        assert estimate.returncode == 0, estimate.stderr
        assert estimate.stdout.startswith("memory estimate: LlamaForCausalLM")


@pytest.mark.slow
def test_saved_model_continues_as_a_pretrained_model(cli_run):
    """from_pretrained of the saved model, on the same eval split, starts at the loss the first run ended on."""
    workdir, run_dir, _ = cli_run
    first = json.loads((run_dir / "summary.json").read_text())
    result = run_cli(
        *QUICK_STEPS,
        "model=pretrained",
        f"model.pretrained={run_dir / 'model'}",
        "train.max_steps=2",
        "train.log_every=1",
        "train.eval_every=0",
        cwd=workdir,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    second_dir = [d for d in run_dirs(workdir) if d != run_dir][0]
    second = json.loads((second_dir / "summary.json").read_text())
    assert second["first_eval_loss"] == pytest.approx(first["eval_loss"], rel=1e-5)


def test_reloaded_model_gives_the_same_logits(tmp_path):
    job = prepare_job(resolved_spec([*QUICK, "train.max_steps=5", "train.eval_every=0"]), tmp_path)
    summary = train(job)
    reloaded = AutoModelForCausalLM.from_pretrained(summary["model_dir"])
    tokenizer = AutoTokenizer.from_pretrained(summary["model_dir"])
    ids = tokenizer("def main():\n    return 0\n", return_tensors="pt").input_ids
    job.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, job.model(ids).logits, rtol=0, atol=0)
    assert reloaded.dtype == torch.float32


@pytest.fixture
def arithmetic_pairs(tmp_path):
    rng = random.Random(0)
    path = tmp_path / "pairs.jsonl"
    with path.open("w") as f:
        for _ in range(400):
            a, b = rng.randrange(50), rng.randrange(50)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "response": str(a + b)}) + "\n")
    return path


def test_instruction_data_trains_on_the_response_only(arithmetic_pairs):
    spec = resolved_spec(["data=instruction_files", f"data.files={arithmetic_pairs}", "data.seq_len=16"])
    tokenizer = build_tokenizer(spec.model)
    train_set, eval_set = token_splits(spec.data, tokenizer, spec.seed)
    assert len(train_set) + len(eval_set) == 400
    row = train_set[0]
    prompt_length = row["labels"].index(next(label for label in row["labels"] if label != IGNORE))
    prompt = tokenizer.decode(row["input_ids"][:prompt_length])
    response = tokenizer.decode(row["labels"][prompt_length:-1])
    a, b = prompt.rstrip("=").split("+")
    assert int(response) == int(a) + int(b)
    assert row["labels"][-1] == tokenizer.eos_token_id


@pytest.mark.slow
def test_instruction_training_loss_falls(arithmetic_pairs, tmp_path):
    spec = resolved_spec(
        [
            "data=instruction_files",
            f"data.files={arithmetic_pairs}",
            "data.seq_len=16",
            "data.eval_fraction=0.1",
            "train.max_steps=40",
            "train.eval_every=0",
            "train.eval_batches=4",
            "train.save_model=false",
        ]
    )
    summary = train(prepare_job(spec, tmp_path))
    assert summary["eval_loss"] < summary["first_eval_loss"] - 1.0
    assert summary["model_dir"] is None


def test_parquet_text_is_packed_into_blocks(tmp_path):
    import datasets

    rows = [{"body": f"def f{i}(x):\n    return x * {i}\n"} for i in range(40)]
    datasets.Dataset.from_list(rows).to_parquet(tmp_path / "code.parquet")
    spec = resolved_spec(
        ["data=text_files", f"data.files={tmp_path / 'code.parquet'}", "data.text_field=body", "data.seq_len=32"]
    )
    train_set, eval_set = token_splits(spec.data, build_tokenizer(spec.model), spec.seed)
    assert len(train_set) > 0 and len(eval_set) > 0
    assert {len(row["input_ids"]) for row in train_set} == {32}
    assert all(row["labels"] == row["input_ids"] for row in train_set)


@pytest.mark.slow
def test_the_start_shows_what_the_run_is_at_a_glance(cli_run):
    _, run_dir, result = cli_run
    lines = [line.split(" ", 1)[1] for line in (run_dir / "run.log").read_text().splitlines()]
    tree = lines[lines.index(f"run {run_dir}") :][:9]
    assert [line.split()[:2] for line in tree[1:]] == [
        ["├─", "model"],
        ["├─", "data"],
        ["├─", "optimizer"],
        ["├─", "batch"],
        ["├─", "loss"],
        ["├─", "strategy"],
        ["├─", "precision"],
        ["└─", "trackers"],
    ]
    assert "LlamaForCausalLM, 0.40M parameters, random init (model.architecture: llama); tokenizer bytes" in tree[1]
    assert "email/*.py (20 files): " in tree[2] and "train sequences of 128 tokens" in tree[2]
    assert "AdamW lr 0.003, weight decay 0.1; 3 warmup steps, then cosine decay to 0.1 x lr" in tree[3]
    assert (
        "global batch 2 = micro batch 2 x 1 data-parallel ranks x 1 accumulation steps; 30 steps of 256 "
        "tokens" in tree[4]
    )
    assert "full logits (train.loss=auto)" in tree[5]  # a 259-token vocabulary: nothing to chunk
    assert tree[6].endswith("single, 1 process") and tree[8].endswith("metrics.jsonl")


@pytest.mark.slow
def test_relative_paths_are_absolute_in_the_spec_and_survive_a_change_of_directory(tmp_path):
    import shutil
    import sysconfig

    project = tmp_path / "project"
    shutil.copytree(
        Path(sysconfig.get_paths()["stdlib"]) / "email",
        project / "corpus",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    tiny = [
        "data.seq_len=64",
        "train.max_steps=2",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.save_model=false",
    ]
    result = run_cli("data.files=corpus/*.py", *tiny, "hydra.job.chdir=true", cwd=project)
    assert result.returncode == 0, result.stderr[-3000:]
    [run_dir] = run_dirs(project)
    assert f"files: {project / 'corpus' / '*.py'}" in (run_dir / "spec.yaml").read_text()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    again = run_cli(
        "--config-dir",
        str(run_dir),
        "--config-name",
        "spec",
        "train.max_steps=1",
        f"hydra.run.dir={tmp_path / 'again'}",
        cwd=elsewhere,
    )
    assert again.returncode == 0, again.stderr[-3000:]
