"""The runner's task=grpo against TRL's GRPOTrainer on the same work, side by side on this machine (not a test).

    python bench/grpo_vs_trl.py                      # 20 steps of 64-token completions: about 4 minutes on 2 cores
    python bench/grpo_vs_trl.py --steps 10 --completion 32 --reward regex

The work: recipe=cpu_grpo with completions of --completion tokens and 4 prompts x 8 completions a step. Both
start from the runner's initial weights of the default tiny model (its seed, its byte tokenizer), take their prompts
(of 1 to 80 tokens) from the same split of the standard library's json package, score them with one reward
(--reward: `lowercase`, the share of lowercase letters in the completion, which every token of it moves; `regex`,
the recipe's two regex rewards, which only the first two characters move), and train with the same loss (dapo,
clipped at 0.2, no KL), optimizer (AdamW, lr 3e-3, betas 0.9/0.95, weight decay 0.1, clipping at 1.0) and schedule
(10% warmup, cosine to 0.1 x lr). Each draws its own prompts and completions.

What it prints, for each: the held-out reward (the mean reward of greedy completions of the eval split's prompts,
every one decoded alone with transformers' generate, the same function for both) of the initial and the trained
model, and the median seconds of a step after the first (the runner's from its metrics.jsonl, TRL's from a
callback); then TRL's per-step time over the runner's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = [
    "recipe=cpu_grpo",
    "train.micro_batch_size=32",
    "train.eval_every=0",
    "train.log_every=1",
    "train.checkpoint_every=0",
]


def lowercase_share(completions, **_):
    return [sum(c.islower() for c in text) / max(1, len(text)) for text in completions]


def lowercase(completions, **_):
    return [float(re.match("[a-z]", text, re.DOTALL) is not None) for text in completions]


def two_lowercase(completions, **_):
    return [float(re.match("[a-z]{2}", text, re.DOTALL) is not None) for text in completions]


REWARDS = {"lowercase": [lowercase_share], "regex": [lowercase, two_lowercase]}


def held_out_reward(model, tokenizer, prompts: list[list[int]], new_tokens: int, rewards: list) -> float:
    """The mean summed reward of each prompt's greedy completion, decoded alone (no padding to mask)."""
    import torch

    total = 0.0
    model.eval()
    with torch.no_grad():
        for ids in prompts:
            output = model.generate(
                torch.tensor([ids]),
                do_sample=False,
                max_new_tokens=new_tokens,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            text = tokenizer.decode(output[0, len(ids) :], skip_special_tokens=True)
            total += sum(reward([text])[0] for reward in rewards)
    return total / len(prompts)


def run_runner(overrides: list[str], workdir: Path) -> tuple[Path, list[float]]:
    """`run` itself in its own process: its saved model and its steps' seconds."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "runner", *overrides], cwd=workdir, env=env, capture_output=True, text=True
    )
    if result.returncode:
        sys.exit(f"the runner failed:\n{result.stderr[-3000:]}")
    [run_dir] = [path.parent for path in (workdir / "outputs").glob("*/*/spec.yaml")]
    times = [
        json.loads(line)["time"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line
    ]
    return run_dir / "model", [later - earlier for earlier, later in zip(times, times[1:])]


def run_trl(spec, model, tokenizer, prompts: list[str], rewards: list, workdir: Path) -> list[float]:
    """TRL's GRPOTrainer with the runner's settings; its steps' seconds."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    task, train, optim, scheduler = spec.task, spec.train, spec.optim, spec.scheduler
    args = GRPOConfig(
        output_dir=str(workdir / "trl"),
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=spec.seed,
        max_steps=train.max_steps,
        per_device_train_batch_size=train.micro_batch_size,
        num_generations=task.num_generations,
        max_completion_length=task.max_completion_length,
        temperature=task.temperature,
        top_p=task.top_p,
        loss_type=task.loss.value,
        epsilon=task.epsilon,
        beta=task.beta,
        scale_rewards=task.scale_rewards.value,
        learning_rate=optim.lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        adam_epsilon=optim.eps,
        max_grad_norm=train.max_grad_norm,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": scheduler.min_lr_ratio},
        warmup_steps=round(scheduler.warmup_ratio * train.max_steps),
        logging_steps=1,
        save_strategy="no",
        activation_checkpointing=False,
        disable_dropout=True,
    )
    ends: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, *_, **__):
            ends.append(time.perf_counter())

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=rewards,
        args=args,
        train_dataset=Dataset.from_list([{"prompt": text} for text in prompts]),
        processing_class=tokenizer,
        callbacks=[StepTimes()],
    )
    trainer.train()
    return [later - earlier for earlier, later in zip(ends, ends[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--completion", type=int, default=64, help="task.max_completion_length")
    parser.add_argument("--reward", choices=sorted(REWARDS), default="lowercase")
    args = parser.parse_args()
    rewards = REWARDS[args.reward]
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import AutoModelForCausalLM

    from runner.cli.compose import compose_config
    from runner.components.modeling import build_model
    from runner.config.spec import load_spec, validate
    from runner.engine.job import load_data

    overrides = [*RECIPE, f"train.max_steps={args.steps}", f"task.max_completion_length={args.completion}"]
    if args.reward == "lowercase":
        overrides.append(f"task.rewards=[{{function: '{Path(__file__).resolve()}:lowercase_share'}}]")
    spec = validate(load_spec(compose_config(overrides)))
    tokenizer, train_set, eval_set = load_data(spec)
    held_out = [prompt.ids for prompt in eval_set.prompts]
    torch.manual_seed(spec.seed)
    initial = build_model(spec.model, tokenizer)
    with tempfile.TemporaryDirectory() as scratch:
        workdir = Path(scratch)
        initial.save_pretrained(workdir / "initial")
        start = held_out_reward(initial, tokenizer, held_out, args.completion, rewards)
        runner_model, runner_steps = run_runner(overrides, workdir)
        runner_end = held_out_reward(
            AutoModelForCausalLM.from_pretrained(runner_model), tokenizer, held_out, args.completion, rewards
        )
        trl_model = AutoModelForCausalLM.from_pretrained(workdir / "initial")
        trl_steps = run_trl(
            spec, trl_model, tokenizer, [prompt.shown for prompt in train_set.prompts], rewards, workdir
        )
        trl_end = held_out_reward(trl_model, tokenizer, held_out, args.completion, rewards)
    runner_s, trl_s = statistics.median(runner_steps[1:]), statistics.median(trl_steps[1:])
    print(
        f"{args.steps} steps, 4 prompts x 8 completions of up to {args.completion} tokens a step, reward "
        f"{args.reward}; held-out reward (greedy, {len(held_out)} prompts, at most {len(rewards)})"
    )
    print(f"  runner  {start:.3f} -> {runner_end:.3f}   {runner_s:.2f} s a step")
    print(f"  trl     {start:.3f} -> {trl_end:.3f}   {trl_s:.2f} s a step")
    print(f"TRL's step time / the runner's: {trl_s / runner_s:.2f}")


if __name__ == "__main__":
    main()
