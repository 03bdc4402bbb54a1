"""task=dpo (runner/tasks/dpo.py, runner/engine/dpo_loss.py) on preference pairs (runner/data/preference.py): the
losses, log-probs, rewards and gradients of TRL's DPOTrainer (the oracle), the layouts users have, the same losses
under every strategy, an exact resume, and bad input refused in one line."""

import copy
import json
import os
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support import DATA
from tests.support.command import run_cli
from tests.support.runs import run_dirs
from tests.support.specs import TWO_BLOCKS

TEMPLATES = DATA / "trl_chat_templates"
STACK_EXCHANGE = DATA / "torchtune" / "stack_exchange_paired_tiny.json"  # tests/support/data/torchtune/SOURCE.md
DPO_DEMO = DATA / "llama_factory" / "dpo_en_demo.json"  # tests/support/data/llama_factory/SOURCE.md
TRL_TEXT = DATA / "trl" / "preference_standard.jsonl"  # TRL's documented layouts, written here: tests/support/data/trl
TRL_CONVERSATIONS = DATA / "trl" / "preference_conversational.jsonl"

PAIRS = [  # prompt, chosen and rejected token ids: the first completion token is predicted from the prompt's last
    {"prompt_ids": [5, 9, 12], "chosen_ids": [20, 21, 22, 1], "rejected_ids": [30, 1]},
    {"prompt_ids": [7, 8], "chosen_ids": [40, 1], "rejected_ids": [41, 42, 43, 44, 45, 46, 1]},
    {"prompt_ids": [3, 4, 5, 6, 7], "chosen_ids": [50, 51, 1], "rejected_ids": [52, 53, 54, 1]},
]


def tiny_llama(seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def trained_further(model, steps: int = 3):
    """The model after a few SGD steps on random tokens: a reference that differs from the policy."""
    import torch

    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(3, 64, (2, 12), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def word_tokenizer(vocab_size: int):
    """TRL's trainer wants a tokenizer: token `t<i>` is id i (pad t0, end of sequence t1), built here offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t2"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1", unk_token="t2")


def trl_dpo(policy, reference, pairs, beta: float, loss_type: str, tmp_path: Path) -> dict:
    """TRL 1.16's DPOTrainer on one batch of pairs, through its own collator and _compute_loss: the loss, each pair's
    log-probs and rewards (TRL's compute_ref_log_probs, checked against what it logged) and the policy's gradients."""
    import numpy as np
    import torch
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    state = random.getstate(), np.random.get_state(), torch.get_rng_state()  # the trainer calls set_seed
    policy, reference = copy.deepcopy(policy), copy.deepcopy(reference)
    args = DPOConfig(
        output_dir=str(tmp_path / "trl"),
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        activation_checkpointing=False,
        save_strategy="no",
        beta=beta,
        loss_type=[loss_type],
        max_length=None,
        per_device_train_batch_size=len(pairs),
        disable_dropout=True,
    )
    # TRL tokenizes its dataset itself: one text pair stands in for it, and the batch goes in already tokenized.
    stand_in = Dataset.from_dict({"prompt": ["t3 t4"], "chosen": [" t5 "], "rejected": [" t6 "]})
    trainer = DPOTrainer(
        model=policy,
        ref_model=reference,
        args=args,
        train_dataset=stand_in,
        processing_class=word_tokenizer(policy.config.vocab_size),
    )
    inputs = trainer._prepare_inputs(trainer.data_collator([dict(pair) for pair in pairs]))
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    logged = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    chosen, rejected = trainer.compute_ref_log_probs(trainer.model, inputs)
    ref_chosen, ref_rejected = trainer.compute_ref_log_probs(trainer.ref_model, inputs)
    random.setstate(state[0]), np.random.set_state(state[1]), torch.set_rng_state(state[2])
    found = {
        "loss": loss.item(),
        "logps/chosen": chosen,
        "logps/rejected": rejected,
        "rewards/chosen": beta * (chosen - ref_chosen),
        "rewards/rejected": beta * (rejected - ref_rejected),
        "grads": {name: p.grad for name, p in trainer.model.named_parameters() if p.grad is not None},
    }
    for name in ("logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected"):
        assert logged[name] == pytest.approx(found[name].mean().item(), abs=1e-5), name
    return found


def runner_dpo(policy, reference, pairs, beta: float, loss_type: str, loss_kind: str) -> dict:
    """The runner's objective on the same pairs: rows as the token store reads them, collated as a batch of pairs
    (chosen rows, then rejected rows), the reference a frozen copy."""
    import numpy as np

    from runner.config.training import LossKind
    from runner.data.batches import collate
    from runner.data.rows import columns, row_inputs
    from runner.engine.dpo_loss import FrozenCopy, PreferenceLoss
    from runner.engine.loss import with_summed_loss

    policy, reference = copy.deepcopy(policy), copy.deepcopy(reference)
    for model in (policy, reference):  # 5 label tokens a chunk: a row's tokens span chunks
        with_summed_loss(model, LossKind(loss_kind), chunk_tokens=5)
    rows = []
    for response in ("chosen_ids", "rejected_ids"):
        for pair in pairs:
            tokens = np.array(pair["prompt_ids"] + pair[response])
            trained = np.array([0] * len(pair["prompt_ids"]) + [1] * len(pair[response]), dtype=np.uint8)
            rows.append(row_inputs(tokens, trained, [0], [0], len(pair[response]), packed=False))
    micro_batch = collate(columns(rows), pad_token_id=0)
    objective = PreferenceLoss(beta, loss_type, 0.0, 0.5, FrozenCopy(reference))
    losses, metrics = objective.pair_losses(SimpleNamespace(model=policy), micro_batch, lambda logps: logps)
    losses.mean().backward()
    return {
        "loss": losses.mean().item(),
        **metrics,
        "grads": {name: p.grad for name, p in policy.named_parameters() if p.grad is not None},
    }


@pytest.mark.parametrize("loss_kind", ["chunked", "full"])
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "robust"])
def test_the_loss_log_probs_rewards_and_gradients_are_trls(loss_type, loss_kind, tmp_path):
    import torch

    policy = tiny_llama(0)
    reference = trained_further(policy)
    beta = 2.0 if loss_type == "hinge" else 0.1  # a hinge whose margins all pass 1 would have no gradient
    expected = trl_dpo(policy, reference, PAIRS, beta, loss_type, tmp_path)
    found = runner_dpo(policy, reference, PAIRS, beta, loss_type, loss_kind)
    assert found["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    assert expected["loss"] > 0
    for name in ("logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected"):
        torch.testing.assert_close(found[name], expected[name], atol=1e-5, rtol=0)
    assert set(found["grads"]) == set(expected["grads"])
    for name, grad in expected["grads"].items():
        torch.testing.assert_close(found["grads"][name], grad, atol=1e-5, rtol=0, msg=name)
    assert max(grad.abs().max().item() for grad in expected["grads"].values()) > 1e-3


def test_evaluation_computes_the_references_log_probs_of_the_eval_rows_once():
    """The eval rows and the frozen reference are the same at every evaluation: the reference's forward runs at the
    first only, and later evaluations give what computing it again would."""
    import contextlib

    import numpy as np
    import torch

    from runner.config.training import LossKind
    from runner.data.batches import collate
    from runner.data.rows import columns, row_inputs
    from runner.engine.dpo_loss import FrozenCopy, PreferenceLoss
    from runner.engine.loss import with_summed_loss

    policy, reference = tiny_llama(0), trained_further(tiny_llama(0))
    for model in (policy, reference):
        with_summed_loss(model, LossKind.full, chunk_tokens=1024)
    rows = [
        row_inputs(
            np.array(pair["prompt_ids"] + pair[response]),
            np.array([0] * len(pair["prompt_ids"]) + [1] * len(pair[response]), dtype=np.uint8),
            [0],
            [0],
            len(pair[response]),
            packed=False,
        )
        for response in ("chosen_ids", "rejected_ids")
        for pair in PAIRS
    ]
    batches = [collate(columns(rows), pad_token_id=0)] * 2

    class Counted(FrozenCopy):
        calls = 0

        def logps(self, job, micro_batch, whole):
            Counted.calls += 1
            return super().logps(job, micro_batch, whole)

    job = SimpleNamespace(
        model=policy,
        device=torch.device("cpu"),
        sequence_split=None,
        counted=True,
        autocast=contextlib.nullcontext,
        eval_batches=lambda: iter(batches),
    )
    kept = PreferenceLoss(0.1, "sigmoid", 0.0, 0.5, Counted(reference))
    first, second = kept.evaluate(job), kept.evaluate(job)
    assert Counted.calls == len(batches)  # the first evaluation's, none after
    assert first == second == PreferenceLoss(0.1, "sigmoid", 0.0, 0.5, FrozenCopy(reference)).evaluate(job)


# ---- preference data


def encoder(tokenizer, **keys):
    from runner.config.data import DataConfig, DataFormat
    from runner.data.tokenize import Encoder

    return Encoder(DataConfig(files="x.jsonl", format=DataFormat.preference, **keys), tokenizer, "uint32")


def encoded_pairs(found) -> list[tuple[list[int], list[int]]]:
    """An Encoded's sequences, each with its mask: a pair's chosen, then its rejected."""
    import numpy as np

    ends = np.cumsum(found.lengths)
    return [
        (found.tokens[end - length : end].tolist(), found.trained[end - length : end].tolist())
        for end, length in zip(ends, found.lengths)
    ]


def trained_text(tokenizer, sequence) -> str:
    ids, mask = sequence
    return tokenizer.decode([token for token, bit in zip(ids, mask) if bit])


def test_the_layouts_users_have_become_the_same_pairs():
    """TRL's conversational layouts (explicit and implicit prompt) and LLaMA-Factory's ranking data give the same
    rows for the same conversation, its last assistant turn trained; torchtune's stack_exchange_paired is read through
    the field names."""
    from runner.components.modeling import byte_tokenizer
    from tests.data.test_chat import chat_tokenizer

    template = TEMPLATES / "llama3.jinja"
    tokenizer = chat_tokenizer(template.read_text())
    chat = encoder(tokenizer, chat_template=str(template))
    trl = [json.loads(line) for line in TRL_CONVERSATIONS.read_text().splitlines()]
    pairs = encoded_pairs(chat.encode_records([(record, f"line {i}") for i, record in enumerate(trl)]))
    assert trained_text(tokenizer, pairs[0]) == "It is blue.<|eot_id|>"
    assert trained_text(tokenizer, pairs[1]) == "It is green.<|eot_id|>"
    assert trained_text(tokenizer, pairs[2]) == "Eight.<|eot_id|>"  # an implicit prompt: the shared turns
    assert tokenizer.decode(pairs[2][0]).count("How many legs") == 1

    demo = json.loads(DPO_DEMO.read_text())[0]
    as_trl = {
        "prompt": [{"role": "user", "content": demo["conversations"][0]["value"]}],
        "chosen": [{"role": "assistant", "content": demo["chosen"]["value"]}],
        "rejected": [{"role": "assistant", "content": demo["rejected"]["value"]}],
    }
    assert encoded_pairs(chat.encode_records([(demo, "x")])) == encoded_pairs(chat.encode_records([(as_trl, "x")]))

    text = encoder(byte_tokenizer(), prompt_field="question", chosen_field="response_j", rejected_field="response_k")
    question = json.loads(STACK_EXCHANGE.read_text())[0]
    chosen, rejected = encoded_pairs(text.encode_records([(question, "x")]))
    prompt = byte_tokenizer()(question["question"], add_special_tokens=False)["input_ids"]
    assert chosen[0][: len(prompt)] == prompt and chosen[1] == [0] * len(prompt) + [1] * (len(chosen[0]) - len(prompt))
    assert trained_text(byte_tokenizer(), chosen) == question["response_j"] + byte_tokenizer().eos_token
    assert trained_text(byte_tokenizer(), rejected) == question["response_k"] + byte_tokenizer().eos_token


def test_text_pairs_are_the_tokens_trl_trains_on(tmp_path):
    """TRL's DPOTrainer tokenizes the standard layout as the runner does: prompt, then response and end of sequence."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from runner.components.modeling import byte_tokenizer

    tokenizer = byte_tokenizer()
    records = [json.loads(line) for line in TRL_TEXT.read_text().splitlines()]
    args = DPOConfig(
        output_dir=str(tmp_path),
        report_to="none",
        use_cpu=True,
        bf16=False,
        max_length=None,
        activation_checkpointing=False,
    )
    trainer = DPOTrainer(
        model=tiny_llama(0),
        ref_model=tiny_llama(0),
        args=args,
        train_dataset=Dataset.from_list(records),
        processing_class=tokenizer,
    )
    pairs = encoded_pairs(encoder(tokenizer).encode_records([(record, "x") for record in records]))
    for i, example in enumerate(trainer.train_dataset):
        for response, (ids, mask) in zip(("chosen", "rejected"), pairs[2 * i : 2 * i + 2]):
            assert ids == example["prompt_ids"] + example[f"{response}_ids"]
            assert mask == [0] * len(example["prompt_ids"]) + [1] * len(example[f"{response}_ids"])


def test_show_data_shows_each_pair_chosen_then_rejected(workdir):
    """The byte tokenizer's own plain template renders TRL's conversational pairs; each response's turn trains."""
    shown = run_cli(
        "--show-data", "2", "task=dpo", "data=preference_files", f"data.files={TRL_CONVERSATIONS}", cwd=workdir
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    blocks = shown.stdout.split("--- ")[1:]
    assert [block.split("\n")[0] for block in blocks[:4]] == [
        "train pair 0, chosen",
        "train pair 0, rejected",
        "train pair 1, chosen",
        "train pair 1, rejected",
    ]
    chosen, rejected = blocks[0].split("\n", 1)[1], blocks[1].split("\n", 1)[1]
    assert chosen.startswith("User: ") and chosen.split("[[")[0] == rejected.split("[[")[0]  # the same prompt
    assert chosen.split("[[")[0].endswith("Assistant: ") and "</s>" in chosen.split("[[")[1]
    assert "5 train and 1 eval pairs of up to 256 tokens" in shown.stdout


def pairs_file(folder: Path, records: list) -> str:
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


GOOD = {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
BAD_PAIRS = {
    "a missing rejected response": (
        [GOOD, {"prompt": "Bees make", "chosen": " honey."}],
        "pairs.jsonl line 2 has no rejected response",
    ),
    "the same response twice": (
        [GOOD, {"prompt": "Bees make", "chosen": " honey.", "rejected": " honey."}],
        "pairs.jsonl line 2 has the same chosen and rejected response",
    ),
    "a prompt that fills seq_len": (
        [GOOD, {"prompt": "x" * 80, "chosen": " a", "rejected": " b"}, GOOD],
        "pairs.jsonl line 2: its prompt fills data.seq_len=64",
    ),
    "text and messages mixed": (
        [GOOD, {"prompt": "Hi", "chosen": [{"role": "assistant", "content": "Hello"}], "rejected": " Bye"}],
        "pairs.jsonl line 2 mixes text and conversations",
    ),
}


@pytest.mark.parametrize("case", BAD_PAIRS, ids=list(BAD_PAIRS))
def test_bad_pairs_are_named_by_file_and_line_and_leave_nothing(case, workdir):
    records, error = BAD_PAIRS[case]
    path = pairs_file(workdir, records)
    result = run_cli("task=dpo", "data=preference_files", f"data.files={path}", "data.seq_len=64", cwd=workdir)
    assert result.returncode == 2
    assert result.stderr == f"run: error: data.files: {workdir / error}{result.stderr.split(error)[-1]}"
    assert result.stderr.count("\n") == 1 and error in result.stderr
    assert not (workdir / "outputs").exists()


BAD_RUNS = {
    "dpo on data without pairs": (
        ["data=text_files", "data.files=notes.txt"],
        "task=dpo trains on preference pairs, and data.format=text has none",
    ),
    "a loss that does not exist": (["task.loss=kto"], "task.loss"),
    "smoothing a loss that has none": (
        ["task.loss=ipo", "task.label_smoothing=0.1"],
        "task.label_smoothing is for the losses sigmoid, robust, simpo",
    ),
    "pairs packed": (["data.packing=true"], "set data.packing=false"),
    "train on pairs": (["task=train"], "data.format=preference holds pairs of responses, which task=dpo trains on"),
}


@pytest.mark.parametrize("case", BAD_RUNS, ids=list(BAD_RUNS))
def test_bad_dpo_runs_are_refused_in_one_line_before_anything_starts(case, workdir):
    (workdir / "notes.txt").write_text("some text\n")
    overrides, error = BAD_RUNS[case]
    result = run_cli("task=dpo", "data=preference_files", f"data.files={TRL_TEXT}", *overrides, cwd=workdir)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("run: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert error in result.stderr, result.stderr
    assert not (workdir / "outputs").exists()


# ---- training


@pytest.fixture(scope="module")
def short_pairs(tmp_path_factory) -> Path:
    """The pairs of LLaMA-Factory's dpo_en_demo whose prompts fit a row of 128 tokens (44 of its 300)."""
    records = [
        record
        for record in json.loads(DPO_DEMO.read_text())
        if sum(len(turn["value"].encode()) for turn in record["conversations"]) < 120
    ]
    path = tmp_path_factory.mktemp("dpo_en_demo") / "short.json"
    path.write_text(json.dumps(records))
    return path


@pytest.fixture(scope="module")
def llama3_tokenizer_dir(tmp_path_factory) -> Path:
    from tests.data.test_chat import chat_tokenizer

    folder = tmp_path_factory.mktemp("llama3_tokenizer")
    chat_tokenizer((TEMPLATES / "llama3.jinja").read_text()).save_pretrained(folder)
    return folder


def dpo_run(pairs: Path, tokenizer_dir: Path, steps: int = 3) -> list[str]:
    return [
        "task=dpo",
        "data=preference_files",
        f"data.files={pairs}",
        f"data.chat_template={TEMPLATES / 'llama3.jinja'}",
        f"model.tokenizer={tokenizer_dir}",
        "data.seq_len=128",
        "data.drop_long_prompts=true",
        "data.eval_fraction=0.1",
        f"train.max_steps={steps}",
        "train.log_every=1",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.save_model=false",
        "train.micro_batch_size=2",
        "optim.lr=1e-3",
        *TWO_BLOCKS,
    ]


@pytest.mark.distributed
def test_dpo_losses_are_the_same_under_every_strategy(short_pairs, llama3_tokenizer_dir, tmp_path):
    """One global batch of 8 pairs a step: 1 process x 4 accumulation steps, or 2 x 2, under ddp, fsdp and ZeRO-2
    and 3, the reference a frozen copy (under fsdp tp 2, and under ZeRO-2 with each sequence split over the 2 ranks
    by Ulysses: 1 data-parallel rank x 4, both models split); with LoRA (the reference: the adapters off) under
    single and fsdp; with the reference's log-probs precomputed once into the token store (from split sequences,
    under ZeRO-3 x sp 2), and read back. The gradient norms too: Adam and clipping would hide a gradient off by a
    constant factor in the losses."""
    from tests.support.runs import logged, step_losses
    from tests.support.specs import resolved_spec
    from tests.support.workers import train_in_workers

    base = dpo_run(short_pairs, llama3_tokenizer_dir)
    lora = ["adapter=lora", "adapter.rank=4"]
    two = ["hardware.nproc_per_node=2"]
    singles = {
        "full": resolved_spec([*base, "train.grad_accum_steps=4"]),
        "lora": resolved_spec([*base, *lora, "train.grad_accum_steps=4"]),
    }
    runs = {
        "ddp": ("full", ["strategy=ddp"]),
        "fsdp": ("full", ["strategy=fsdp"]),
        "zero2": ("full", ["strategy=deepspeed", "strategy.zero_stage=2"]),
        "zero3": ("full", ["strategy=deepspeed", "strategy.zero_stage=3"]),
        "lora-fsdp": ("lora", ["strategy=fsdp", *lora]),
        # each sequence split over the 2 ranks (Ulysses): the preference loss of the whole rows' log-probs
        "zero2-sp": ("full", ["strategy=deepspeed", "strategy.zero_stage=2", "strategy.sp_size=2"]),
        # the reference's log-probs computed once by the first (from split sequences), read back from the token
        # store by the others
        "zero3-sp-precomputed": (
            "full",
            ["strategy=deepspeed", "strategy.zero_stage=3", "strategy.sp_size=2", "task.precompute_reference=true"],
        ),
        "ddp-precomputed": ("full", ["strategy=ddp", "task.precompute_reference=true"]),
        "zero3-precomputed": (
            "full",
            ["strategy=deepspeed", "strategy.zero_stage=3", "task.precompute_reference=true"],
        ),
        "fsdp-tp": ("full", ["strategy=fsdp", "strategy.tp_size=2"]),
    }
    train_in_workers(list(singles.values()), [tmp_path / name for name in singles], nproc=1)
    one_data_parallel_rank = {"strategy.tp_size=2", "strategy.sp_size=2"}
    accumulation = {
        name: f"train.grad_accum_steps={4 if one_data_parallel_rank & set(more) else 2}"
        for name, (_, more) in runs.items()
    }
    train_in_workers(
        [resolved_spec([*base, *two, accumulation[name], *more]) for name, (_, more) in runs.items()],
        [tmp_path / name for name in runs],
    )
    expected = {name: step_losses(tmp_path / name) for name in singles}
    assert len(list(Path(os.environ["RUNNER_TOKEN_CACHE"]).glob("*/rows-*/reference-*.npy"))) == 1
    assert len(expected["full"]) == 3 and expected["full"] != expected["lora"]
    assert expected["full"][0] == pytest.approx(0.6931, abs=1e-4)  # the policy starts as its reference: log 2
    norms = {name: list(logged(tmp_path / name, "grad_norm").values()) for name in [*singles, *runs]}
    for name, (single, _) in runs.items():
        assert step_losses(tmp_path / name) == pytest.approx(expected[single], rel=1e-5, abs=1e-6), name
        assert norms[name] == pytest.approx(norms[single], rel=1e-5, abs=1e-6), name
    records = [json.loads(line) for line in (tmp_path / "fsdp" / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "loss" in record]
    evaluations = [record for record in records if "eval_loss" in record]
    for name in (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    ):
        assert name in steps[-1] and f"eval_{name}" in evaluations[-1]
    assert evaluations[0]["eval_loss"] == pytest.approx(0.6931, abs=1e-4)


@pytest.mark.signals
def test_a_dpo_run_killed_and_resumed_has_the_uninterrupted_losses(
    short_pairs, llama3_tokenizer_dir, tmp_path, tmp_path_factory
):
    from tests.support.runs import killed_and_resumed

    args = [*dpo_run(short_pairs, llama3_tokenizer_dir, steps=8), "train.checkpoint_every=2"]
    expected, resumed = killed_and_resumed(args, tmp_path, 5, tmp_path_factory)
    assert resumed == expected


# ---- the estimate


def test_the_estimate_counts_the_reference_model_and_both_rows_of_a_pair():
    """A frozen copy of the weights (a 1/2 shard under FSDP on two processes), none with adapters (their base is the
    reference), with simpo or once precomputed; twice the activations of a micro batch of rows."""
    from dataclasses import replace

    from runner.config.spec import validate
    from runner.memory.breakdown import estimate
    from runner.memory.model_shapes import facts_of
    from runner.memory.report import report
    from tests.support.specs import composed

    def planned(*overrides):
        spec = validate(
            composed(["model=llama3_8b", "hardware=2xrtx4090", "precision=bf16", *overrides]), on_this_machine=False
        )
        return spec, estimate(spec, facts_of(spec.model))

    dpo = ["task=dpo", "data=preference_files", f"data.files={TRL_TEXT}"]
    train, trained = planned("strategy=fsdp")
    spec, found = planned("strategy=fsdp", *dpo)
    assert found.reference.bytes == trained.weights.bytes and "1/2 shard" in found.reference.note
    assert found.activations.bytes == 2 * trained.activations.bytes
    assert found.peak > trained.peak
    assert "reference model" in report(spec) and "a frozen copy of the model, fp32, a 1/2 shard" in report(spec)
    for more in (["adapter=lora"], ["task.loss=simpo"], ["task.precompute_reference=true"]):
        _, found = planned("strategy=fsdp", *dpo, *more)
        assert found.reference.bytes == 0 and found.reference.note, more
    _, zero3 = planned("strategy=deepspeed", "strategy.zero_stage=3", *dpo)
    assert "1/2 shard" in zero3.reference.note
    _, zero2 = planned("strategy=deepspeed", "strategy.zero_stage=2", *dpo)
    assert zero2.reference.bytes == 2 * zero3.reference.bytes - facts_of(spec.model).buffer_bytes
    single, _ = planned("strategy=single", "hardware=h100_80gb", *dpo)
    assert (
        estimate(single, facts_of(single.model)).reference.bytes
        == estimate(replace(single, task=train.task), facts_of(single.model)).weights.bytes
    )


@pytest.mark.slow
def test_a_dpo_sweep_reports_the_held_out_rewards(workdir):
    result = run_cli(
        "-m",
        "task=dpo",
        "data=preference_files",
        f"data.files={TRL_TEXT}",
        "task.loss=sigmoid,simpo",
        "train.max_steps=2",
        "train.micro_batch_size=2",
        "train.eval_batches=1",
        "data.eval_fraction=0.2",
        cwd=workdir,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    [report] = workdir.glob("outputs/multirun/*/*/report.md")
    header, _, *rows = report.read_text().strip().splitlines()[2:]
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    assert columns[5:8] == ["eval_loss", "eval_rewards/accuracies", "eval_rewards/margins"]
    assert len(rows) == 2 and all(row.split("|")[7].strip() for row in rows)


@pytest.mark.slow
def test_the_trackers_record_trls_metrics_of_a_dpo_run(workdir, monkeypatch):
    """wandb (offline), TensorBoard and MLflow, each read back by its own reader, have every step's and every
    evaluation's rewards and log-probs that metrics.jsonl has."""
    from runner.engine.dpo_loss import METRICS
    from tests.components.test_trackers import each_tracker_logged

    result = run_cli(
        "task=dpo",
        "data=preference_files",
        f"data.files={TRL_TEXT}",
        "train.max_steps=2",
        "train.log_every=1",
        "train.micro_batch_size=2",
        "train.eval_batches=1",
        "data.eval_fraction=0.2",
        "tracker=[wandb,tensorboard,mlflow]",
        cwd=workdir,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    [run_dir] = run_dirs(workdir)
    each_tracker_logged(run_dir, [*METRICS, *(f"eval_{name}" for name in METRICS)], monkeypatch)
