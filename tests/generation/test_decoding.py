"""Decoding on the model as training placed it (runner/generation/rollout.py's sample: GRPO's rollout and held-out
reward, generated benchmark answers): prompts of different lengths, left-padded into one batch, give the greedy
completions each gives alone, under every strategy; and the log-probs the rollout records for the tokens it drew
are the loss forward's log-probs of the same tokens, so that the policy that samples is the policy that is trained.

Training gives the model a kernel that builds no mask (runner/engine/attention.py): a sampler that kept it would
let each shorter prompt's completion attend to its padding."""

from pathlib import Path

import pytest

from tests.support.specs import TWO_BLOCKS, resolved_spec
from tests.support.workers import run_in_workers

# Prompts of 2 to 40 tokens: batched, most rows are mostly padding.
PROMPTS = [
    "x",
    "import sys, os",
    "class Parser:  def __init__(self, text, *, strict=True):",
    "    return self._scanner.match(string, idx)",
]
NEW_TOKENS = 8
GRPO = [
    "recipe=cpu_grpo",
    "task.num_generations=4",
    "task.max_completion_length=8",
    "task.temperature=0.8",
    "train.micro_batch_size=8",
    "train.max_steps=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.save_model=false",
    "+model.architecture.initializer_range=0.2",
    *TWO_BLOCKS,
]
LORA = ["adapter=lora", "adapter.rank=4"]
SINGLE = {"single": [], "lora": LORA, "qlora": ["adapter=qlora", "adapter.rank=4"]}
TWO_PROCESSES = {
    "ddp": ["strategy=ddp"],
    "fsdp": ["strategy=fsdp"],
    "zero2": ["strategy=deepspeed", "strategy.zero_stage=2"],
    "zero3": ["strategy=deepspeed", "strategy.zero_stage=3"],
    "lora, fsdp": ["strategy=fsdp", *LORA],
}
# task=grpo keeps the policy whole or sharded by FSDP or ZeRO; tensor parallelism decodes benchmark answers.
TENSOR_PARALLEL = [
    "recipe=cpu_quick",
    "train.max_steps=1",
    "train.save_model=false",
    "+model.architecture.initializer_range=0.2",
    *TWO_BLOCKS,
    "strategy=fsdp",
    "strategy.tp_size=2",
]


def decoded(ranks, specs, run_dirs) -> list[dict]:
    """For each spec, on its placed model: the prompts' greedy completions in one batch and each alone, and for
    task=grpo the largest difference between a rollout's recorded log-probs and the loss forward's."""
    import torch

    from runner.engine.grpo_loss import completion_mask, token_logps
    from runner.engine.job import prepare_job
    from runner.generation.decoding import Decoding
    from runner.generation.rollout import sample
    from runner.strategies.strategy_protocol import unwrapped

    results = []
    for spec, run_dir in zip(specs, run_dirs):
        job = prepare_job(spec, Path(run_dir), ranks)
        prompts = [job.tokenizer.encode(text) for text in PROMPTS]
        greedy = Decoding(NEW_TOKENS, pad_token_id=job.tokenizer.pad_token_id)
        job.model.eval()

        def decode(batch: list[list[int]]) -> list[list[int]]:
            return sample(unwrapped(job.model), batch, [None] * len(batch), greedy, job.device, job.autocast).tokens

        result = {
            "lengths": [len(prompt) for prompt in prompts],
            "batched": decode(prompts),
            "alone": [decode([prompt])[0] for prompt in prompts],
        }
        job.model.train()
        if spec.task.step_kind == "grpo":
            drawn = next(job.train_batches(1, None))
            rows = spec.task.objective(job).rollout(job, drawn, 1)
            differences = []
            with torch.no_grad(), job.autocast():
                for micro_batch in rows.micro_batches:
                    micro_batch = micro_batch.to(job.device)
                    mask = completion_mask(micro_batch)
                    logps = token_logps(job.model, micro_batch, spec.task.temperature)
                    differences.append(((logps - micro_batch.row_values["sample_logps"]).abs() * mask).max().item())
            result |= {
                "prompt_lengths": sorted({len(prompt.ids) for prompt in drawn.prompts}),
                "logp_difference": max(differences),
            }
        results.append(result)
    return results


def check(name: str, result: dict) -> None:
    assert len(set(result["lengths"])) == len(PROMPTS), name
    assert result["batched"] == result["alone"], name
    assert len({tuple(tokens) for tokens in result["alone"]}) > 2, f"{name}: completions too alike to prove much"
    if "logp_difference" in result:
        assert len(result["prompt_lengths"]) > 1, name
        assert result["logp_difference"] < 1e-5, name


@pytest.mark.slow
def test_batched_greedy_completions_are_each_prompts_alone_under_single_lora_and_qlora(tmp_path):
    from runner.distributed import Ranks

    specs = [resolved_spec([*GRPO, "hardware.nproc_per_node=1", *more]) for more in SINGLE.values()]
    results = decoded(Ranks(), specs, [str(tmp_path)] * len(specs))
    for name, result in zip(SINGLE, results):
        check(name, result)


@pytest.mark.distributed
def test_batched_greedy_completions_are_each_prompts_alone_under_every_strategy_on_two_processes(tmp_path):
    specs = [resolved_spec([*GRPO, "hardware.nproc_per_node=2", *more]) for more in TWO_PROCESSES.values()]
    specs.append(resolved_spec([*TENSOR_PARALLEL, "hardware.nproc_per_node=2"]))
    for rank, results in enumerate(run_in_workers(decoded, specs, [str(tmp_path)] * len(specs), nproc=2)):
        for name, result in zip([*TWO_PROCESSES, "fsdp, tp 2"], results):
            check(f"{name}, rank {rank}", result)
