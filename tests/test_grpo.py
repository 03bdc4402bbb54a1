"""task=grpo (runner/tasks/grpo.py, runner/engine/grpo_loss.py, runner/generation/rollout.py): the advantages,
log-probs, loss and gradients of TRL's GRPOTrainer (the oracle, TRL 1.16) for fixed completions, rewards and
sampling log-probs; the built-in rewards on GSM8K's own answers."""

import copy
import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_dpo import tiny_llama, word_tokenizer

DATA = Path(__file__).parent / "data"
GSM8K = DATA / "gsm8k" / "test_head.jsonl"  # tests/data/gsm8k/SOURCE.md

PROMPTS = [[5, 9, 12], [7, 8, 3]]  # of one length: TRL left-pads prompts, the runner right-pads whole rows
COMPLETIONS = [  # two prompts x three generations; t1 ends a completion, the fourth of the first runs to the limit
    [20, 21, 22, 1], [30, 1], [20, 1], [40, 41, 1], [42, 43, 44, 45, 46, 47], [20, 48, 1]]
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
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, bf16=False,
                      activation_checkpointing=False, per_device_train_batch_size=len(COMPLETIONS),
                      num_generations=generations,
                      max_completion_length=MAX_COMPLETION, disable_dropout=True, reward_weights=[1.0, 0.5],
                      **settings)

    def rollout(prompts, trainer):
        return {"prompt_ids": [PROMPTS[i // generations] for i in range(len(prompts))],
                "completion_ids": COMPLETIONS, "logprobs": None}

    records = [{"prompt": " ".join(f"t{t}" for t in PROMPTS[i // generations]), "kind": "skip" if i == 1 else "x"}
               for i in range(len(COMPLETIONS))]
    trainer = GRPOTrainer(model=policy, reward_funcs=[starts_with_t20, length_bonus], args=args,
                          train_dataset=Dataset.from_list(records[:1]), rollout_func=rollout,
                          processing_class=word_tokenizer(policy.config.vocab_size))
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
    return {"loss": loss.item(), "advantages": inputs["advantages"], "logps": logps * inputs["completion_mask"],
            "grads": {name: p.grad for name, p in trainer.model.named_parameters() if p.grad is not None}}


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
    scores = torch.tensor(rewards_of([("starts", starts_with_t20), ("length", length_bonus)], [], texts,
                                     COMPLETIONS, {"kind": kinds}))
    rewards = (scores * torch.tensor([[1.0], [0.5]])).nansum(0)
    advantages, _ = group_advantages(rewards, generations, settings.get("scale_rewards", "group"),
                                     batch_std=rewards.std())
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
            laid[i, start:start + len(completion)] = per_completion[i, :len(completion)]
        return laid

    micro_batch.row_values = {"advantages": advantages, "old_logps": at_positions(old), "ref_logps": at_positions(ref)}
    objective = GroupPolicyLoss(PolicyLoss(settings.get("loss_type", "dapo"), settings.get(
        "importance_sampling_level", "token"), settings.get("epsilon", 0.2), settings.get("epsilon_high") or 0.2,
        settings.get("beta", 0.0), MAX_COMPLETION), evaluate_rewards=None)
    job = SimpleNamespace(model=policy, global_batch_size=len(COMPLETIONS))
    batch = SimpleNamespace(label_tokens=sum(len(c) for c in COMPLETIONS))
    loss, _ = objective.loss(job, micro_batch, batch, lambda value: value)
    loss.backward()
    with torch.no_grad():
        logps = token_logps(policy, micro_batch)
    completion_logps = torch.zeros(len(COMPLETIONS), MAX_COMPLETION)
    for i, completion in enumerate(COMPLETIONS):
        start = len(PROMPTS[i // generations]) - 1
        completion_logps[i, :len(completion)] = logps[i, start:start + len(completion)]
    return {"loss": loss.item(), "advantages": advantages, "logps": completion_logps,
            "grads": {name: p.grad for name, p in policy.named_parameters() if p.grad is not None}}


CASES = {
    "grpo": {"loss_type": "grpo"},
    "dapo, clip-higher": {"loss_type": "dapo", "epsilon_high": 0.28},
    "dr_grpo, unscaled": {"loss_type": "dr_grpo", "scale_rewards": "none"},
    "grpo, sequence-level (GSPO), KL": {"loss_type": "grpo", "importance_sampling_level": "sequence", "beta": 0.04},
    "dapo, batch-scaled, KL": {"loss_type": "dapo", "scale_rewards": "batch", "beta": 0.1},
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
    wrong = [answer.rsplit("####", 1)[0] + f"#### {float(final.replace(',', '')) + 1}"
             for answer, final in zip(answers, finals)]
    assert answer_matches(wrong, answers) == [0.0] * len(answers)
    spoken = [f"So the answer is ${final}." for final in finals]  # no ####: the last number, $ and . aside
    assert answer_matches(spoken, answers) == [1.0] * len(answers)
    assert answer_matches([[{"role": "assistant", "content": spoken[0]}]], answers[:1]) == [1.0]
