"""task=grpo (runner/tasks/grpo.py, runner/engine/grpo_loss.py, runner/generation/rollout.py): the advantages,
log-probs, loss and gradients of TRL's GRPOTrainer (the oracle, TRL 1.16) for fixed completions, rewards and
sampling log-probs; the built-in rewards on GSM8K's own answers."""

import copy
import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support import DATA
from tests.support.command import run_cli
from tests.support.runs import logged, run_dirs
from tests.support.specs import TWO_BLOCKS
from tests.tasks.test_dpo import tiny_llama, word_tokenizer

GSM8K = DATA / "gsm8k" / "test_head.jsonl"  # tests/support/data/gsm8k/SOURCE.md

PROMPTS = [[5, 9, 12], [7, 8, 3]]  # of one length: TRL left-pads prompts, the runner right-pads whole rows
COMPLETIONS = [  # two prompts x three generations; t1 ends a completion, the fourth of the first runs to the limit
    [20, 21, 22, 1],
    [30, 1],
    [20, 1],
    [40, 41, 1],
    [42, 43, 44, 45, 46, 47],
    [20, 48, 1],
]
MAX_COMPLETION = 6


def starts_with_t20(completions, **_):
    return [float(text.split()[0] == "t20") if text.split() else 0.0 for text in completions]


def length_bonus(completions, kind, **_):
    return [None if k == "skip" else len(text.split()) / 4 for text, k in zip(completions, kind)]


def fixed_logps(rows: int, seed: int, scale: float):
    """Sampling-policy or reference log-probs near the policy's own: each completion token's, [rows, MAX]."""
    import torch

    return -1.5 * scale * torch.rand(rows, MAX_COMPLETION, generator=torch.Generator().manual_seed(seed)) - 3.5


def trl_grpo(policy, settings: dict, old, ref, tmp_path: Path) -> dict:
    """TRL's GRPOTrainer on the fixed completions (its documented rollout_func hands them over), its rewards and
    advantages from its own _generate_and_score_completions, its loss from _compute_loss with the given sampling and
    reference log-probs; the policy's log-probs of the completion tokens and its gradients."""
    import os

    import numpy as np
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    state = random.getstate(), np.random.get_state(), torch.get_rng_state()  # the trainer calls set_seed
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    policy = copy.deepcopy(policy)
    policy.save_pretrained(tmp_path / "policy")  # where TRL loads its reference model from, with beta > 0
    policy.config._name_or_path = str(tmp_path / "policy")
    generations = len(COMPLETIONS) // len(PROMPTS)
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        report_to="none",
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,
        per_device_train_batch_size=len(COMPLETIONS),
        num_generations=generations,
        max_completion_length=MAX_COMPLETION,
        disable_dropout=True,
        reward_weights=[1.0, 0.5],
        **settings,
    )

    def rollout(prompts, trainer):
        return {
            "prompt_ids": [PROMPTS[i // generations] for i in range(len(prompts))],
            "completion_ids": COMPLETIONS,
            "logprobs": None,
        }

    records = [
        {"prompt": " ".join(f"t{t}" for t in PROMPTS[i // generations]), "kind": "skip" if i == 1 else "x"}
        for i in range(len(COMPLETIONS))
    ]
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=[starts_with_t20, length_bonus],
        args=args,
        train_dataset=Dataset.from_list(records[:1]),
        rollout_func=rollout,
        processing_class=word_tokenizer(policy.config.vocab_size),
    )
    trainer.current_gradient_accumulation_steps = 1  # what its training loop sets before a step
    inputs = trainer._generate_and_score_completions(records)
    inputs["old_per_token_logps"] = old.clone()
    inputs["ref_per_token_logps"] = ref.clone()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    prompt_completion = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, prompt_completion, mask, MAX_COMPLETION)
    random.setstate(state[0]), np.random.set_state(state[1]), torch.set_rng_state(state[2])
    return {
        "loss": loss.item(),
        "advantages": inputs["advantages"],
        "logps": logps * inputs["completion_mask"],
        "grads": {name: p.grad for name, p in trainer.model.named_parameters() if p.grad is not None},
    }


def runner_grpo(policy, settings: dict, old, ref, loss_kind: str) -> dict:
    """The runner's objective on the same completions: rows collated as a rollout makes them, the rewards of the
    same functions combined and turned into advantages by the runner's own code."""
    import numpy as np
    import torch

    from runner.components.rewards import rewards_of
    from runner.config.training import LossKind
    from runner.data.batches import collate
    from runner.data.rows import columns, row_inputs
    from runner.engine.grpo_loss import GroupPolicyLoss, PolicyLoss, group_advantages, token_logps
    from runner.engine.loss import with_summed_loss

    policy = copy.deepcopy(policy)
    with_summed_loss(policy, LossKind(loss_kind), chunk_tokens=5)  # a row's tokens span chunks
    generations = len(COMPLETIONS) // len(PROMPTS)
    texts = [" ".join(f"t{t}" for t in ids if t != 1) for ids in COMPLETIONS]
    kinds = ["skip" if i == 1 else "x" for i in range(len(COMPLETIONS))]
    scores = torch.tensor(
        rewards_of([("starts", starts_with_t20), ("length", length_bonus)], [], texts, COMPLETIONS, {"kind": kinds})
    )
    rewards = (scores * torch.tensor([[1.0], [0.5]])).nansum(0)
    advantages, _ = group_advantages(
        rewards, generations, settings.get("scale_rewards", "group"), batch_std=rewards.std()
    )
    rows = []
    for i, completion in enumerate(COMPLETIONS):
        prompt = PROMPTS[i // generations]
        trained = np.array([0] * len(prompt) + [1] * len(completion), dtype=np.uint8)
        rows.append(row_inputs(np.array(prompt + completion), trained, [0], [0], len(completion), packed=False))
    micro_batch = collate(columns(rows), pad_token_id=0)

    def at_positions(per_completion):  # completion token k is predicted at position len(prompt) - 1 + k
        laid = torch.zeros(micro_batch.labels.shape)
        for i, completion in enumerate(COMPLETIONS):
            start = len(PROMPTS[i // generations]) - 1
            laid[i, start : start + len(completion)] = per_completion[i, : len(completion)]
        return laid

    micro_batch.row_values = {"advantages": advantages, "old_logps": at_positions(old), "ref_logps": at_positions(ref)}
    objective = GroupPolicyLoss(
        PolicyLoss(
            settings.get("loss_type", "dapo"),
            settings.get("importance_sampling_level", "token"),
            settings.get("epsilon", 0.2),
            settings.get("epsilon_high") or 0.2,
            settings.get("beta", 0.0),
            MAX_COMPLETION,
            settings.get("temperature", 1.0),
        )
    )
    job = SimpleNamespace(model=policy, global_batch_size=len(COMPLETIONS), dp_size=1)
    batch = SimpleNamespace(label_tokens=sum(len(c) for c in COMPLETIONS), micro_batches=[micro_batch])
    loss, _ = objective.loss(job, micro_batch, batch, lambda value: value)
    loss.backward()
    with torch.no_grad():
        logps = token_logps(policy, micro_batch, settings.get("temperature", 1.0))
    completion_logps = torch.zeros(len(COMPLETIONS), MAX_COMPLETION)
    for i, completion in enumerate(COMPLETIONS):
        start = len(PROMPTS[i // generations]) - 1
        completion_logps[i, : len(completion)] = logps[i, start : start + len(completion)]
    return {
        "loss": loss.item(),
        "advantages": advantages,
        "logps": completion_logps,
        "grads": {name: p.grad for name, p in policy.named_parameters() if p.grad is not None},
    }


CASES = {
    "grpo": {"loss_type": "grpo"},
    "dapo, clip-higher": {"loss_type": "dapo", "epsilon_high": 0.28},
    "dr_grpo, unscaled": {"loss_type": "dr_grpo", "scale_rewards": "none"},
    "grpo, sequence-level (GSPO), KL": {"loss_type": "grpo", "importance_sampling_level": "sequence", "beta": 0.04},
    "dapo, batch-scaled, KL": {"loss_type": "dapo", "scale_rewards": "batch", "beta": 0.1},
    "dapo, KL, temperature 0.7": {"loss_type": "dapo", "beta": 0.04, "temperature": 0.7},
}


@pytest.mark.parametrize("loss_kind", ["chunked", "full"])
@pytest.mark.parametrize("case", CASES)
def test_the_advantages_log_probs_loss_and_gradients_are_trls(case, loss_kind, tmp_path):
    import torch

    policy = tiny_llama(seed=0)
    # Sampling log-probs within and outside the clip range of the policy's own (about -4 for 64 tokens).
    old, ref = fixed_logps(len(COMPLETIONS), 1, 0.3), fixed_logps(len(COMPLETIONS), 2, 1.0)
    expected = trl_grpo(policy, CASES[case], old, ref, tmp_path)
    found = runner_grpo(policy, CASES[case], old, ref, loss_kind)
    torch.testing.assert_close(found["advantages"], expected["advantages"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(found["logps"], expected["logps"], atol=1e-5, rtol=1e-5)
    assert found["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    assert found["grads"].keys() == expected["grads"].keys()
    for name, grad in expected["grads"].items():
        torch.testing.assert_close(found["grads"][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_the_answer_reward_reads_gsm8k_answers_as_numbers():
    from runner.components.rewards import answer_matches, final_answer

    records = [json.loads(line) for line in GSM8K.read_text().splitlines()]
    answers = [record["answer"] for record in records]
    finals = [final_answer(answer) for answer in answers]
    assert all(finals) and finals[0] == answers[0].rsplit("####", 1)[1].strip()
    # GSM8K's own solutions score 1; the same working ending in another number, 0.
    assert answer_matches(answers, answers) == [1.0] * len(answers)
    wrong = [
        answer.rsplit("####", 1)[0] + f"#### {float(final.replace(',', '')) + 1}"
        for answer, final in zip(answers, finals)
    ]
    assert answer_matches(wrong, answers) == [0.0] * len(answers)
    spoken = [f"So the answer is ${final}." for final in finals]  # no ####: the last number, $ and . aside
    assert answer_matches(spoken, answers) == [1.0] * len(answers)
    assert answer_matches([[{"role": "assistant", "content": spoken[0]}]], answers[:1]) == [1.0]


# ---- prompts and bad input

PROMPTS_DATA = [
    "data=prompt_files",
    f"data.files={GSM8K}",
    "data.prompt_field=question",
    "data.seq_len=512",
    "data.eval_fraction=0.25",
    "train.micro_batch_size=4",
]
GRPO = ["task=grpo", *PROMPTS_DATA, "task.max_completion_length=8"]


def test_show_data_shows_the_prompts_as_the_model_reads_them_with_the_fields_the_rewards_get(workdir):
    result = run_cli("--show-data", "1", *GRPO, "data.prompt_as_chat=true", cwd=workdir)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"--- train prompt 0 ({GSM8K} line ")
    first = json.loads(GSM8K.read_text().splitlines()[int(lines[0].split(" line ")[1].split(")")[0]) - 1])
    # the byte tokenizer's plain template: the question as the user's turn, then the assistant's, open
    assert lines[1] == f"User: {first['question']}" and lines[2] == "Assistant: "
    assert json.loads(lines[3].removeprefix("    fields: "))["answer"] == first["answer"]
    assert lines[-1] == "--- 6 train and 2 eval prompts, the longest 305 tokens; completions end at '</s>'"


BAD_RUNS = {
    "an unknown reward function": (
        ["task.rewards=[{function: 'runner.components.rewards:no_such'}]"],
        "task.rewards: runner.components.rewards has no function no_such",
    ),
    "a reward file that does not import": (
        ["task.rewards=[{function: 'broken.py:score'}]"],
        "task.rewards: {cwd}/broken.py does not import (ZeroDivisionError: ",
    ),
    "one generation": (["task.num_generations=1"], "task.num_generations=1 must be at least 2"),
    "groups that do not divide": (
        ["task.num_generations=3"],
        "each rank's 4 completions a step (train.micro_batch_size 4 x "
        "train.grad_accum_steps 1) do not divide into groups",
    ),
    "prompts without the reward's field": (
        ["data.prompt_field=answer"],
        "has no field answer, which task.rewards read",
    ),
    "a prompt too long for a completion": (
        ["data.seq_len=300"],
        "leaves no room in data.seq_len=300 for a completion of task.max_completion_length=8",
    ),
    "chat prompts without a template": (
        ["model.tokenizer={cwd}/plain_tokenizer", "data.prompt_as_chat=true"],
        "needs a chat template, and the tokenizer has none",
    ),
    "text data": (
        ["data=text_files", "data.files={cwd}/notes.txt"],
        "task=grpo samples completions of prompts, and data.format=text has none",
    ),
    "train on prompts": (["task=train"], "data.format=prompt holds prompts, whose completions task=grpo samples"),
    "a sampling batch that splits a group": (
        ["task.sampling_batch_size=2"],
        "task.sampling_batch_size=2 must be 0 or a multiple of task.num_generations=4",
    ),
    "a negative KL weight": (["task.beta=-0.1"], "task.beta=-0.1 must be >= 0"),
    "two rewards of one name": (
        [
            "task.rewards=[{function: 'runner.components.rewards:answer_matches'}, "
            "{function: 'runner.components.rewards:answer_matches', weight: 0.5}]"
        ],
        "two rewards are called answer_matches; give each its own `name`",
    ),
}


@pytest.mark.parametrize("case", BAD_RUNS, ids=list(BAD_RUNS))
def test_bad_grpo_runs_are_refused_in_one_line_before_anything_starts(case, workdir):
    from tests.tasks.test_dpo import word_tokenizer

    (workdir / "notes.txt").write_text("some text\n")
    (workdir / "broken.py").write_text("1 / 0\n")
    word_tokenizer(64).save_pretrained(workdir / "plain_tokenizer")
    overrides, error = BAD_RUNS[case]
    task = [] if "task=train" in overrides else GRPO[:1] + GRPO[-1:]
    result = run_cli(
        *task, *PROMPTS_DATA, *[override.replace("{cwd}", str(workdir)) for override in overrides], cwd=workdir
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("run: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert error.replace("{cwd}", str(workdir)) in result.stderr, result.stderr
    assert not (workdir / "outputs").exists()


# ---- training


def grpo_run(steps: int = 3, model: tuple[str, ...] = tuple(TWO_BLOCKS)) -> list[str]:
    """recipe=cpu_grpo, shorter: groups of 4 completions, 16 a step (4 prompts), a KL to the reference; each
    prompt's group sampled on its own, whatever the layout."""
    return [
        "recipe=cpu_grpo",
        "task.num_generations=4",
        "task.sampling_batch_size=4",
        "task.beta=0.04",
        f"train.max_steps={steps}",
        "train.log_every=1",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.save_model=false",
        "train.micro_batch_size=8",
        *model,
    ]


@pytest.fixture(scope="module")
def stopping_policy(tmp_path_factory) -> Path:
    """A saved two-block default model whose end-of-sequence token has 25 times its output weights (tied to its
    input's): its completions stop after 1 to 8 tokens, where a random model's all run to the length limit."""
    import torch

    from runner.components.modeling import build_model, build_tokenizer
    from tests.support.specs import resolved_spec

    spec = resolved_spec(grpo_run())
    tokenizer = build_tokenizer(spec.model)
    torch.manual_seed(0)
    model = build_model(spec.model, tokenizer)
    with torch.no_grad():
        model.get_output_embeddings().weight[tokenizer.eos_token_id] *= 25
    folder = tmp_path_factory.mktemp("stopping_policy")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.distributed
def test_grpo_losses_are_the_same_under_every_strategy(stopping_policy, tmp_path):
    """One global batch of 16 completions (4 prompts x 4) a step: 1 process x 2 accumulation steps, or 2 x 1 under
    ddp, fsdp and ZeRO-2 and 3, the reference a frozen copy of the initial model placed as each strategy places it;
    with LoRA (the reference: the adapters off) under single and fsdp; two steps on each rollout under ZeRO-3. Each
    completion draws from its own seeded generator, each prompt's group sampled on its own: the same completions,
    rewards, losses and gradient norms whatever the layout. The completions stop at the end-of-sequence token
    after 1 to 8 tokens, at different steps on each rank: the shortest and longest are the global batch's."""
    from tests.support.runs import step_losses
    from tests.support.specs import resolved_spec
    from tests.support.workers import train_in_workers

    base = grpo_run(model=("model=pretrained", f"model.pretrained={stopping_policy}"))
    lora = ["adapter=lora", "adapter.rank=4"]
    singles = {
        "full": resolved_spec([*base, "train.grad_accum_steps=2"]),
        "lora": resolved_spec([*base, *lora, "train.grad_accum_steps=2"]),
    }
    runs = {
        "ddp": ("full", ["strategy=ddp"]),
        "fsdp": ("full", ["strategy=fsdp"]),
        "zero2": ("full", ["strategy=deepspeed", "strategy.zero_stage=2"]),
        "zero3": ("full", ["strategy=deepspeed", "strategy.zero_stage=3"]),
        "lora-fsdp": ("lora", ["strategy=fsdp", *lora]),
        "zero3-two-iterations": (
            "two-iterations",
            ["strategy=deepspeed", "strategy.zero_stage=3", "task.num_iterations=2"],
        ),
    }
    singles["two-iterations"] = resolved_spec([*base, "train.grad_accum_steps=2", "task.num_iterations=2"])
    train_in_workers(list(singles.values()), [tmp_path / name for name in singles], nproc=1)
    train_in_workers(
        [resolved_spec([*base, "hardware.nproc_per_node=2", *more]) for _, more in runs.values()],
        [tmp_path / name for name in runs],
    )
    expected = {name: step_losses(tmp_path / name) for name in singles}
    rewards = {name: list(logged(tmp_path / name, "reward").values()) for name in [*singles, *runs]}
    norms = {name: list(logged(tmp_path / name, "grad_norm").values()) for name in [*singles, *runs]}
    assert len(expected["full"]) == 3 and min(norms["full"]) > 0 and len(set(rewards["full"])) > 1
    lengths = {
        name: [list(logged(tmp_path / name, f"completions/{kind}_length").values()) for kind in ("min", "mean", "max")]
        for name in [*singles, *runs]
    }
    shortest, mean, longest = lengths["full"]
    assert all(low <= middle <= high for low, middle, high in zip(shortest, mean, longest)) and shortest[0] < longest[0]
    assert 0 < min(logged(tmp_path / "full", "completions/clipped_ratio").values()) < 1
    for name, (single, _) in runs.items():
        assert rewards[name] == rewards[single], name  # the same completions, scored alike
        assert lengths[name] == lengths[single], name  # the extremes over both ranks' completions
        assert step_losses(tmp_path / name) == pytest.approx(expected[single], rel=1e-5, abs=1e-6), name
        assert norms[name] == pytest.approx(norms[single], rel=1e-5, abs=1e-6), name
    steps = [json.loads(line) for line in (tmp_path / "fsdp" / "metrics.jsonl").read_text().splitlines()]
    for name in (
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "rewards/lowercase/mean",
        "completions/mean_length",
        "completions/clipped_ratio",
        "clip_ratio/region_mean",
        "kl",
        "time/sampling_s",
    ):
        assert name in steps[-1] or name in steps[-2], name
    for name in [*singles, *runs]:  # the sampler draws from the policy that is trained
        assert max(logged(tmp_path / name, "sampling/sampling_logp_difference/mean").values()) < 1e-6, name
    sampled = logged(tmp_path / "two-iterations", "time/sampling_s")
    assert sampled[1] > 0 and sampled[2] == 0 and sampled[3] > 0  # the second step on a rollout samples nothing


@pytest.mark.signals
def test_a_grpo_run_killed_and_resumed_samples_the_same_completions(tmp_path, tmp_path_factory):
    """Two optimizer steps on each rollout (task.num_iterations=2), the second clipped against the sampling policy's
    log-probs: the checkpoint of step 3, between a rollout's two steps, keeps its rows, which the resumed step 4
    trains on again; step 5 samples anew, as the uninterrupted run did."""
    from tests.support.runs import killed_and_resumed

    args = [*grpo_run(steps=6), "task.num_iterations=2", "train.checkpoint_every=3"]
    expected, resumed = killed_and_resumed(args, tmp_path, 4, tmp_path_factory)
    assert resumed == expected
    [run_dir] = run_dirs(tmp_path)
    assert not list((run_dir / "checkpoints" / "step_00000006").glob("rows-rank*"))  # no step after it


@pytest.mark.slow
def test_a_reward_that_raises_stops_the_run_in_one_line_after_a_checkpoint(workdir):
    """Its fourth call (the evaluation before the first step makes the first) raises: step 3's rollout. The run
    keeps step 2's checkpoint and names the reward; with the reward fixed, it continues from there."""
    reward = workdir / "flaky.py"
    reward.write_text(
        "calls = 0\n\ndef score(completions, **_):\n    global calls\n    calls += 1\n"
        "    if calls == 4:\n        raise ValueError('no answer today')\n"
        "    return [float(text[:1].islower()) for text in completions]\n"
    )
    args = [*grpo_run(steps=4), "task.beta=0", "task.rewards=[{function: 'flaky.py:score'}]"]
    result = run_cli(*args, cwd=workdir)
    assert result.returncode == 1, result.stderr[-2000:]
    [run_dir] = run_dirs(workdir)
    [line] = result.stderr.strip().splitlines()
    assert line == (
        f"run: error: reward score raised ValueError: no answer today in step 3; the checkpoint of step "
        f"2, {run_dir / 'checkpoints' / 'step_00000002'}, holds the run so far; fix the reward, then "
        f"continue with: run resume={run_dir}"
    )
    reward.write_text("def score(completions, **_):\n    return [float(text[:1].islower()) for text in completions]\n")
    resumed = run_cli(f"resume={run_dir}", cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert sorted(logged(run_dir, "loss")) == [1, 2, 3, 4]


@pytest.mark.slow
def test_the_held_out_greedy_reward_rises_with_32_token_completions_of_prompts_of_many_lengths(workdir):
    """recipe=cpu_grpo's prompts, lines of the json package of 1 to 80 tokens (a batch's rows are mostly left
    padding), 32-token completions and a reward that each of their tokens moves (its share of lowercase letters):
    the held-out greedy reward rises in 10 steps, as TRL's GRPOTrainer's does on the same work (bench/grpo_vs_trl.py,
    docs/grpo.md)."""
    (workdir / "share.py").write_text(
        "def lowercase(completions, **_):\n"
        "    return [sum(c.islower() for c in t) / max(1, len(t)) "
        "for t in completions]\n"
    )
    result = run_cli(
        "recipe=cpu_grpo",
        "task.max_completion_length=32",
        "train.micro_batch_size=16",
        "train.max_steps=10",
        "train.eval_every=10",
        "train.eval_batches=1",
        "train.save_model=false",
        "train.checkpoint_every=0",
        "task.rewards=[{function: 'share.py:lowercase'}]",
        cwd=workdir,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    [run_dir] = run_dirs(workdir)
    held_out = logged(run_dir, "eval_reward")
    assert sorted(held_out) == [0, 10] and held_out[10] > held_out[0] + 0.3, held_out


@pytest.mark.slow
def test_a_grpo_sweep_reports_the_held_out_reward(workdir):
    result = run_cli("-m", *grpo_run(steps=2), "task.loss=grpo,dr_grpo", cwd=workdir)
    assert result.returncode == 0, result.stderr[-2000:]
    [report] = workdir.glob("outputs/multirun/*/*/report.md")
    header, _, *rows = report.read_text().strip().splitlines()[2:]
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    assert columns[5:7] == ["eval_loss", "eval_reward"]
    rewards = [float(row.split("|")[7]) for row in rows]
    losses = [float(row.split("|")[6]) for row in rows]
    assert len(rows) == 2 and losses == [-reward for reward in rewards]


# ---- the estimate


def test_the_estimate_counts_the_sampling_kv_cache_and_the_reference():
    """Llama-3-8B on two 4090s: the KV cache of the completions sampled at once (each rank's share of a step, or
    task.sampling_batch_size), with the last position's logits, at a peak of its own; a reference (beta > 0) as for
    DPO, a 1/2 shard under FSDP, none with adapters."""
    from runner.config.spec import validate
    from runner.memory.breakdown import Phase, estimate
    from runner.memory.model_shapes import facts_of
    from runner.memory.report import report
    from tests.support.specs import composed

    def planned(*overrides):
        spec = validate(
            composed(
                [
                    "model=llama3_8b",
                    "hardware=2xrtx4090",
                    "precision=bf16",
                    "strategy=fsdp",
                    *GRPO,
                    "train.micro_batch_size=8",
                    "task.max_completion_length=64",
                    *overrides,
                ]
            ),
            on_this_machine=False,
        )
        return spec, estimate(spec, facts_of(spec.model))

    spec, found = planned("data.seq_len=4096", "task.num_generations=8")
    # 2 (keys, values) x 32 layers x 8 rows x 4096 positions x 8 KV heads x 128 dims x 2 bytes (bf16)
    cache = 2 * 32 * 8 * 4096 * 8 * 128 * 2
    assert found.sampling.bytes == cache + 8 * 128_256 * (2 + 4)
    kept = found.weights.bytes + found.optimizer_states.bytes + found.buffers.bytes
    assert found.phases()[Phase.SAMPLING] == kept + found.sampling.bytes and found.reference.bytes == 0
    shown = report(spec)
    assert "sampling" in shown and "the KV cache of the 8 completions sampled at once, 4096 tokens" in shown
    _, smaller = planned(
        "data.seq_len=4096", "task.num_generations=8", "task.sampling_batch_size=8", "train.grad_accum_steps=4"
    )
    assert smaller.sampling.bytes == found.sampling.bytes  # 32 completions a step, 8 at a time
    _, kl = planned("task.beta=0.04")
    assert "a frozen copy of the model, fp32, a 1/2 shard" in kl.reference.note
    assert kl.reference.bytes == kl.weights.bytes
    _, lora = planned("task.beta=0.04", "adapter=lora")
    assert lora.reference.bytes == 0 and "adapters off" in lora.reference.note


@pytest.mark.slow
def test_the_trackers_record_the_reward_and_completion_metrics(workdir, monkeypatch):
    """wandb (offline), TensorBoard and MLflow, each read back by its own reader, have every step's reward and
    completion metrics and every evaluation's reward that metrics.jsonl has."""
    from tests.components.test_trackers import each_tracker_logged

    result = run_cli(*grpo_run(steps=2), "tracker=[wandb,tensorboard,mlflow]", cwd=workdir)
    assert result.returncode == 0, result.stderr[-2000:]
    [run_dir] = run_dirs(workdir)
    names = [
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "rewards/lowercase/mean",
        "completions/mean_length",
        "completions/min_length",
        "completions/max_length",
        "completions/clipped_ratio",
        "clip_ratio/region_mean",
        "kl",
        "eval_reward",
        "eval_rewards/lowercase/mean",
    ]
    each_tracker_logged(run_dir, names, monkeypatch)
    sampled = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert [record["step"] for record in sampled] == [1] * 4 + [2] * 4
    assert all(set(record) == {"step", "prompt", "completion", "reward"} for record in sampled)
