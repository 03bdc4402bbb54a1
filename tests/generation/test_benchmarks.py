"""Benchmarks (runner/generation/benchmarks.py, benchmark_model.py): lm-evaluation-harness tasks scored on the model
as the runner placed it, with lm-eval's own HFLM on the saved model as the oracle (lm-eval 0.4.13): the same
answers request by request, and the same scores from a run's loop, under single and fsdp on 2 processes.

The tasks: the runner's own local_copa (recipes/benchmarks/, llm-foundry's COPA records) and three task files
over the same records (tests/support/data/benchmarks/), one for each other kind of request lm-eval makes: a
log-likelihood alone, a rolling log-likelihood (perplexity) and a greedy generation."""

import json
from pathlib import Path

import pytest

from tests.support import DATA
from tests.support.command import run_cli
from tests.support.specs import TWO_BLOCKS

TASK_FILES = DATA / "benchmarks"
BENCHMARKS = [
    "local_copa",
    *(str(TASK_FILES / f"copa_{kind}.yaml") for kind in ("loglikelihood", "rolling", "generate")),
]
DOCUMENTS = 12
# Weights drawn wider than the default's: greedy answers that differ from query to query, where the default's, a
# few steps in, repeat one token whatever the query (and so would hide a query that attends to its padding).
VARIED_GENERATIONS = ["+model.architecture.initializer_range=0.2"]
SEQ_LEN = 256


def hflm_results(model_dir: Path, tasks: dict, samples: bool = False) -> dict:
    """lm-eval's own HFLM on the saved model, on the same tasks: its results (and answers)."""
    from lm_eval import evaluator
    from lm_eval.models.huggingface import HFLM

    model = HFLM(pretrained=str(model_dir), batch_size=4, device="cpu", dtype="float32", max_length=SEQ_LEN)
    return evaluator.evaluate(model, tasks, limit=DOCUMENTS, bootstrap_iters=0, log_samples=samples)


def answers(results: dict) -> dict[str, list]:
    return {task: [sample["resps"] for sample in samples] for task, samples in results["samples"].items()}


def assert_same_answers(mine: dict[str, list], theirs: dict[str, list]) -> None:
    assert mine.keys() == theirs.keys()
    for task in mine:
        for ours, lm_eval_s in zip(mine[task], theirs[task], strict=True):
            for our_answer, their_answer in zip(ours, lm_eval_s, strict=True):
                [ours_one], [theirs_one] = our_answer, their_answer
                if isinstance(ours_one, str):  # a generation
                    assert ours_one == theirs_one, task
                elif isinstance(ours_one, tuple):  # a log-likelihood and whether it is greedy
                    assert ours_one[0] == pytest.approx(theirs_one[0], abs=1e-4), task
                    assert ours_one[1] == theirs_one[1], task
                else:  # a rolling log-likelihood
                    assert ours_one == pytest.approx(theirs_one, abs=1e-4), task


def test_each_request_is_answered_as_lm_evals_hflm_answers_it(tmp_path):
    """Log-likelihoods, their greedy flags, rolling log-likelihoods and greedy generations of a random tiny Llama,
    with the attention training gives it (causal, no mask built), request by request, against HFLM on the same
    weights saved with save_pretrained: the generations' left padding is masked."""
    import contextlib

    import torch
    from lm_eval import evaluator
    from transformers import LlamaConfig, LlamaForCausalLM

    from runner.components.modeling import byte_tokenizer
    from runner.engine.attention import attend_causally_unmasked
    from runner.generation.benchmark_model import PlacedModelLM, Shard
    from runner.generation.benchmarks import load_benchmarks

    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    ).eval()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    attend_causally_unmasked(model)
    tasks = load_benchmarks(BENCHMARKS, "train.benchmarks", DOCUMENTS).tasks
    placed = PlacedModelLM(model, tokenizer, torch.device("cpu"), contextlib.nullcontext, SEQ_LEN, 4, Shard(0, 1, True))
    mine = evaluator.evaluate(placed, tasks, limit=DOCUMENTS, bootstrap_iters=0, log_samples=True)
    theirs = hflm_results(tmp_path / "model", tasks, samples=True)
    assert_same_answers(answers(mine), answers(theirs))
    for metric in ("exact_match,none", "chrf,none"):
        assert mine["results"]["copa_generate"][metric] == theirs["results"]["copa_generate"][metric]


@pytest.mark.distributed
def test_scores_in_the_loop_are_lm_evals_on_the_saved_model_under_single_and_fsdp(tmp_path):
    """A short run scores the four tasks every two steps on the model as its strategy placed it (one process, or
    FSDP2 over two, each rank answering half the requests); the last scores are HFLM's on the saved model, and
    train.keep_best keeps the checkpoint of the best local_copa accuracy besides the last one; task=evaluate gives
    the saved model the same scores. The run's time plan counts the benchmarks' forwards."""
    from runner.components.modeling import build_tokenizer
    from runner.generation.benchmarks import forward_tokens, load_benchmarks
    from runner.planning.time_plan import flops_per_token, plan
    from tests.support.specs import resolved_spec
    from tests.support.workers import train_in_workers

    overrides = [
        "train.max_steps=6",
        "train.log_every=2",
        "train.eval_every=2",
        "train.eval_batches=2",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=1",
        "train.benchmark_every=2",
        f"train.benchmarks=[{','.join(BENCHMARKS)}]",
        f"train.benchmark_limit={DOCUMENTS}",
        "train.keep_best=bench/local_copa/acc",
        "optim.lr=0.01",
        "hardware.peak_bf16_tflops=1",
        f"hardware.measured_runs={tmp_path / 'no runs'}",
        *TWO_BLOCKS,
        *VARIED_GENERATIONS,
    ]
    spec = resolved_spec(overrides)
    train_in_workers([spec], [tmp_path / "single"], nproc=1)
    predicted = json.loads((tmp_path / "single" / "summary.json").read_text())["predicted"]
    benchmarks = load_benchmarks(BENCHMARKS, "train.benchmarks", DOCUMENTS)
    tokens = forward_tokens(benchmarks, build_tokenizer(spec.model))
    assert predicted["flops"] == pytest.approx(plan(spec, benchmark_tokens=tokens).flops)
    # scored at steps 2, 4 and 6, each a forward (a third of a trained token's work) of every request's tokens
    assert predicted["flops"] - plan(spec).flops == pytest.approx(3 * tokens * flops_per_token(spec) / 3)
    train_in_workers([resolved_spec([*overrides, "strategy=fsdp", "hardware.nproc_per_node=2"])], [tmp_path / "fsdp"])
    tasks = load_benchmarks(BENCHMARKS, "train.benchmarks", DOCUMENTS).tasks
    for run in ("single", "fsdp"):
        run_dir = tmp_path / run
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        scored = {r["step"]: r for r in records if "bench/local_copa/acc" in r}
        assert sorted(scored) == [2, 4, 6], run
        summary = json.loads((run_dir / "summary.json").read_text())
        theirs = hflm_results(run_dir / "model", tasks)["results"]
        for task, values in theirs.items():
            for key, value in values.items():
                metric, _, kept = key.partition(",")
                if kept == "none" and not metric.endswith("_stderr") and isinstance(value, float):
                    name = f"bench/{task}/{metric}"
                    assert scored[6][name] == pytest.approx(value, rel=1e-4), (run, name)
                    assert summary[name] == scored[6][name]
        best_step = max(sorted(scored), key=lambda step: (scored[step]["bench/local_copa/acc"], -step))
        assert summary["best"]["step"] == best_step and summary["best"]["metric"] == "bench/local_copa/acc"
        kept = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
        assert kept == sorted({f"step_{best_step:08d}", "step_00000006"}), run
    # task=evaluate scores what the run saved as the loop scored it last
    result = run_cli(
        "task=evaluate",
        f"task.trained={tmp_path / 'single' / 'model'}",
        f"task.benchmarks=[{','.join(BENCHMARKS)}]",
        f"task.benchmark_limit={DOCUMENTS}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    [evaluated] = (tmp_path / "outputs").glob("*/*/eval.json")
    scores = {key: value for key, value in json.loads(evaluated.read_text()).items() if key.startswith("bench/")}
    summary = json.loads((tmp_path / "single" / "summary.json").read_text())
    assert len(scores) == 9 and scores == pytest.approx({key: summary[key] for key in scores}, rel=1e-6)


BAD_RUNS = {
    "a task lm-eval does not know": (
        ["train.benchmarks=[no_such_benchmark]"],
        "train.benchmarks: no_such_benchmark is neither a task YAML file nor a task lm-eval knows",
    ),
    "a task file that is not there": (
        ["train.benchmarks=[missing.yaml]"],
        "train.benchmarks: missing.yaml: no such task file",
    ),
    "a task file lm-eval cannot load": (
        ["train.benchmarks=[{cwd}/broken.yaml]"],
        "train.benchmarks: lm-eval cannot load {cwd}/broken.yaml",
    ),
    "prompts longer than data.seq_len": (
        ["train.benchmarks=[local_boolq]"],
        "more than data.seq_len=256; raise data.seq_len, or limit the documents",
    ),
    "a metric never logged": (
        ["train.benchmarks=[local_copa]", "train.keep_best=bench/local_copa/f1"],
        "train.keep_best=bench/local_copa/f1 is not a metric this run logs; it logs "
        "bench/local_copa/acc, bench/local_copa/acc_norm, eval_loss",
    ),
    "no benchmark under pipeline parallelism": (
        [
            "train.benchmarks=[local_copa]",
            "hardware.nproc_per_node=2",
            "strategy=fsdp",
            "strategy.pp_size=2",
            "strategy.pp_schedule=GPipe",
        ],
        "train.benchmarks with strategy.pp_size=2",
    ),
    "a negative limit": (
        ["train.benchmarks=[local_copa]", "train.benchmark_limit=-1"],
        "train.benchmark_limit=-1 must be a positive number of documents",
    ),
}


# Indexing lm-eval's registry of 14,000 tasks takes about 6 s: the one case that needs it is in the slow tier.
INDEXES_THE_REGISTRY = "a task lm-eval does not know"


@pytest.mark.parametrize(
    "case",
    [pytest.param(case, marks=[pytest.mark.slow] if case == INDEXES_THE_REGISTRY else []) for case in BAD_RUNS],
    ids=list(BAD_RUNS),
)
def test_bad_benchmarks_are_refused_in_one_line_before_anything_starts(case, workdir):
    (workdir / "broken.yaml").write_text("task: broken\ndataset_path: json\noutput_type: no_such_type\n")
    overrides, error = BAD_RUNS[case]
    result = run_cli(*[override.replace("{cwd}", str(workdir)) for override in overrides], cwd=workdir)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("run: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert error.replace("{cwd}", str(workdir)) in result.stderr, result.stderr
    assert not (workdir / "outputs").exists()


def test_without_lm_eval_benchmarks_are_refused_naming_the_extra(monkeypatch):
    import sys

    from runner.errors import SpecError
    from runner.generation.benchmarks import load_benchmarks

    for name in [name for name in sys.modules if name == "lm_eval" or name.startswith("lm_eval.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as where it is not installed: its import fails
    with pytest.raises(SpecError, match=r"pip install 'runner\[benchmarks\]'"):
        load_benchmarks(["local_copa"], "train.benchmarks", None)


@pytest.mark.distributed
def test_the_scores_are_the_same_under_zero3_tensor_parallelism_and_lora(tmp_path):
    """One step, then the scores of the model as each strategy placed it: ZeRO-3 and tensor parallelism over two
    processes against one; LoRA under FSDP against LoRA alone. The same step gives the same model, and so the same
    answers, whichever ranks hold its shards."""
    from tests.support.specs import resolved_spec
    from tests.support.workers import train_in_workers

    base = [
        "train.max_steps=1",
        "train.eval_batches=1",
        "train.save_model=false",
        f"train.benchmark_limit={DOCUMENTS}",
        f"train.benchmarks=[{','.join(BENCHMARKS[:3])}]",
        "train.micro_batch_size=4",
        *TWO_BLOCKS,
    ]
    twice = [*base, "train.grad_accum_steps=2"]
    singles = {"full": resolved_spec(twice), "lora": resolved_spec([*twice, "adapter=lora"])}
    runs = {
        "zero3": ("full", ["strategy=deepspeed", "strategy.zero_stage=3"]),
        "tp": ("full", ["strategy=fsdp", "strategy.tp_size=2", "train.grad_accum_steps=2"]),
        "lora-fsdp": ("lora", ["strategy=fsdp", "adapter=lora"]),
    }
    train_in_workers(list(singles.values()), [tmp_path / name for name in singles], nproc=1)
    train_in_workers(
        [resolved_spec([*base, "hardware.nproc_per_node=2", *more]) for _, more in runs.values()],
        [tmp_path / name for name in runs],
    )
    scores = {
        name: {
            key: value
            for key, value in json.loads((tmp_path / name / "summary.json").read_text()).items()
            if key.startswith("bench/")
        }
        for name in [*singles, *runs]
    }
    assert len(scores["full"]) == 7
    for name, (single, _) in runs.items():
        assert scores[name] == pytest.approx(scores[single], rel=1e-4), name
