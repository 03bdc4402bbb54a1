"""Packing (data.packing), the chunked loss (train.loss) and per-block compile (train.compile).

Packed rows hold several examples, each with its own positions and attending only to itself, so each example's
loss is the one it has alone in a padded row; the chunked loss is the full one without the whole batch's logits;
neither, nor compiling, changes the losses of a run under any strategy, or its exact resume.
"""

import json
import random
import sysconfig
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from runner.components.modeling import build_model, byte_tokenizer
from runner.config.data import DataConfig, DataFormat
from runner.config.model import ModelConfig
from runner.config.training import LossKind
from runner.data.batches import collate
from runner.data.pack import best_fit_rows
from runner.data.rows import IGNORE
from runner.data.splits import token_splits
from runner.engine.job import prepare_job
from runner.engine.loop import train
from runner.engine.loss import with_summed_loss
from runner.errors import SpecError
from tests.support import DATA
from tests.support.command import run_cli
from tests.support.runs import killed_and_resumed, logged, run_dirs, step_losses
from tests.support.specs import QUICK, TWO_BLOCKS, resolved_spec
from tests.support.workers import run_in_workers, train_in_workers

STDLIB = Path(sysconfig.get_paths()["stdlib"])
LLAMA_FACTORY_ALPACA = DATA / "llama_factory" / "alpaca_en_demo.json"
DOLLY_HHRLHF = DATA / "llm_foundry" / "dolly_hhrlhf_train_small.jsonl"


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    """Prompt/response pairs of very different lengths, from the standard library's own lines: a line, then the
    next 1 to 6 lines."""
    lines = [
        line
        for path in sorted((STDLIB / "email").glob("*.py"))
        for line in path.read_text().splitlines()
        if line.strip()
    ]
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    with path.open("w") as out:
        for _ in range(240):
            at, length = rng.randrange(len(lines) - 13), rng.choice([1, 1, 2, 3, 6])
            out.write(json.dumps({"prompt": lines[at], "response": "\n".join(lines[at + 1 : at + 1 + length])}) + "\n")
    return path


def instruction_data(pairs: Path, packing: bool, seq_len: int = 512) -> DataConfig:
    return DataConfig(files=str(pairs), format=DataFormat.instruction, seq_len=seq_len, packing=packing)


def tiny_model(loss: LossKind = LossKind.full, chunk_tokens: int = 1024):
    spec = resolved_spec(QUICK)
    torch.manual_seed(0)
    model = build_model(spec.model, byte_tokenizer())
    with_summed_loss(model, loss, chunk_tokens)
    return model


def summed_loss(model, rows: dict, pad_token_id: int) -> torch.Tensor:
    batch = collate(rows, pad_token_id)
    return model(**batch.inputs, loss_labels=batch.labels)


def segments(row: dict) -> list[tuple[int, int]]:
    """A packed row's segments, as (start, end)."""
    starts = [i for i, position in enumerate(row["position_ids"]) if position == 0] + [row["tokens"]]
    return list(zip(starts, starts[1:]))


def test_packed_rows_keep_every_example_whole_with_its_own_positions(pairs):
    tokenizer = byte_tokenizer()
    padded, _ = token_splits(instruction_data(pairs, packing=False), tokenizer, seed=0)
    packed, _ = token_splits(instruction_data(pairs, packing=True), tokenizer, seed=0)
    assert len(packed) < len(padded) / 2
    assert packed.label_tokens.sum() == padded.label_tokens.sum()
    assert packed.tokens.sum() == padded.tokens.sum()
    examples: dict[tuple, list] = {}  # the unpacked examples, by their tokens
    for example in padded:
        examples.setdefault(tuple(example["input_ids"]), []).append(example)
    for row in packed:
        assert len(row["input_ids"]) == len(row["labels"]) == len(row["position_ids"]) == row["tokens"] <= 512
        for start, end in segments(row):
            example = examples[tuple(row["input_ids"][start:end])].pop()  # each example whole, once
            assert row["position_ids"][start:end] == list(range(end - start))
            assert row["labels"][start] == IGNORE  # nothing before it in its segment predicts it
            assert row["labels"][start + 1 : end] == example["labels"][1:]
    assert not any(examples.values())


@pytest.mark.parametrize("chat", [False, True], ids=["instruction pairs", "chat"])
def test_a_packed_batch_gives_each_example_its_unpacked_loss(pairs, chat):
    """Instruction pairs, and LLaMA-Factory's Alpaca demo as conversations."""
    tokenizer = byte_tokenizer()
    data = (
        DataConfig(files=str(LLAMA_FACTORY_ALPACA), format=DataFormat.chat, seq_len=1024)
        if chat
        else instruction_data(pairs, packing=False)
    )
    padded, _ = token_splits(replace(data, packing=False), tokenizer, seed=0)
    packed, _ = token_splits(replace(data, packing=True), tokenizer, seed=0)
    rows = packed.batch(range(4))
    unpacked = {tuple(example["input_ids"]): i for i, example in enumerate(padded)}
    indices = [
        unpacked[tuple(ids[start:end])]
        for ids, tokens, positions in zip(rows["input_ids"], rows["tokens"], rows["position_ids"])
        for start, end in segments({"position_ids": positions, "tokens": tokens})
    ]
    assert len(indices) > 6
    model = tiny_model()
    pad = tokenizer.pad_token_id
    with torch.no_grad():
        packed_sum = summed_loss(model, rows, pad)
        one_per_row = sum(summed_loss(model, padded.batch(indices[i : i + 4]), pad) for i in range(0, len(indices), 4))
    assert packed_sum.item() == pytest.approx(one_per_row.item(), rel=1e-5)


# Instruction-like data as users have it (tests/support/data/*/SOURCE.md): pairs, and conversations rendered with the
# byte tokenizer's own chat template; each at row lengths that hold several of its examples (a byte is a token here:
# dolly's 2048-byte rows are about 512 tokens of a subword tokenizer).
INSTRUCTION_LIKE = {
    "LLaMA-Factory alpaca_en_demo, instruction": (
        DataConfig(
            files=str(LLAMA_FACTORY_ALPACA),
            format=DataFormat.instruction,
            prompt_field="instruction",
            response_field="output",
            packing=True,
        ),
        (512, 2048),
    ),
    "LLaMA-Factory alpaca_en_demo, chat": (
        DataConfig(files=str(LLAMA_FACTORY_ALPACA), format=DataFormat.chat, packing=True),
        (512, 2048),
    ),
    "llm-foundry dolly_hhrlhf_train_small, instruction": (
        DataConfig(files=str(DOLLY_HHRLHF), format=DataFormat.instruction, packing=True),
        (2048, 4096),
    ),
}


@pytest.mark.parametrize(
    "name,seq_len", [(name, seq_len) for name, (_, lengths) in INSTRUCTION_LIKE.items() for seq_len in lengths]
)
def test_packed_instruction_and_chat_rows_are_at_least_95_percent_full(name, seq_len):
    """Packed in order, LLaMA-Factory's Alpaca demo fills 83% of 512-token rows; best-fit-decreasing fills them.
    The rows of both splits together: a split of a few rows ends on a part-filled one."""
    train, evaluation = token_splits(replace(INSTRUCTION_LIKE[name][0], seq_len=seq_len), byte_tokenizer(), seed=0)
    rows = len(train) + len(evaluation)
    assert (train.tokens.sum() + evaluation.tokens.sum()) / (rows * seq_len) >= 0.95
    assert train.tokens.sum() / (len(train) * seq_len) >= 0.95


def test_best_fit_rows_hold_every_example_once_within_the_room_whatever_the_order():
    rng = random.Random(3)
    lengths = [rng.randint(1, 300) for _ in range(500)]
    rows = best_fit_rows(lengths, 512)
    assert sorted(i for row in rows for i in row) == list(range(500))
    assert all(sum(lengths[i] for i in row) <= 512 for row in rows)
    assert rows == sorted(rows) and all(row == sorted(row) for row in rows)  # in the examples' order
    assert best_fit_rows(lengths, 512) == rows
    assert len(rows) <= -(-sum(lengths) // 512) * 1.02  # within 2% of the fewest rows that could hold them


def test_without_the_boundaries_a_token_would_see_its_neighbour(pairs):
    """The second example's loss does not move when the first example's tokens change, while the boundaries are
    kept; with positions running on through the row (no boundaries) it does."""
    tokenizer = byte_tokenizer()
    packed, _ = token_splits(instruction_data(pairs, packing=True), tokenizer, seed=0)
    row = next(row for row in packed if row["position_ids"].count(0) >= 2)
    second = row["position_ids"].index(0, 1)
    labels = torch.tensor([[IGNORE] * second + row["labels"][second:]])
    changed = list(row["input_ids"])
    changed[:second] = [(token + 7) % len(tokenizer) for token in changed[:second]]
    model = tiny_model()

    def second_example_loss(input_ids, position_ids):
        with torch.no_grad():
            return model(
                input_ids=torch.tensor([input_ids]), position_ids=torch.tensor([position_ids]), loss_labels=labels
            ).item()

    kept = row["position_ids"]
    assert second_example_loss(changed, kept) == pytest.approx(second_example_loss(row["input_ids"], kept), rel=1e-6)
    running_on = list(range(len(kept)))
    assert second_example_loss(changed, running_on) != pytest.approx(
        second_example_loss(row["input_ids"], running_on), rel=1e-6
    )


def test_per_example_attention_is_the_block_diagonal_mask_without_its_cost(pairs, tmp_path):
    """On the CPU, packed rows attend one example at a time (runner/engine/attention.py): the same loss and
    gradients as sdpa under transformers' block-diagonal mask. A saved model does not name it: it loads anywhere."""
    from transformers import AutoConfig

    from runner.engine.attention import attend_within_examples

    tokenizer = byte_tokenizer()
    rows, _ = token_splits(instruction_data(pairs, packing=True), tokenizer, seed=0)
    batch = collate(rows.batch(range(4)), tokenizer.pad_token_id)
    block_mask, per_example = tiny_model(), tiny_model()
    attend_within_examples(per_example)
    results = []
    for model in (block_mask, per_example):
        loss = model(**batch.inputs, loss_labels=batch.labels)
        loss.backward()
        results.append((loss.item(), [p.grad for p in model.parameters()]))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-5)
    for expected, got in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-5)
    per_example.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path)._attn_implementation != "runner_packed_examples"


def test_text_packing_restarts_positions_at_each_document():
    tokenizer = byte_tokenizer()
    data = DataConfig(files=str(STDLIB / "email" / "*.py"), seq_len=128, packing=True)
    rows, _ = token_splits(data, tokenizer, seed=0)
    plain, _ = token_splits(replace(data, packing=False), tokenizer, seed=0)
    assert len(rows) == len(plain)  # the same blocks of the same stream
    for row, block in zip(rows, plain):
        assert row["input_ids"] == block["input_ids"]
        ends = [i + 1 for i, token in enumerate(row["input_ids"][:-1]) if token == tokenizer.eos_token_id]
        assert all(row["position_ids"][end] == 0 and row["labels"][end] == IGNORE for end in ends)
        assert row["label_tokens"] == 127 - len(ends)


def test_the_chunked_loss_is_the_full_loss_with_its_gradients(pairs):
    tokenizer = byte_tokenizer()
    rows, _ = token_splits(instruction_data(pairs, packing=True), tokenizer, seed=0)
    batch = collate(rows.batch(range(4)), tokenizer.pad_token_id)
    results = []
    for model in (tiny_model(LossKind.full), tiny_model(LossKind.chunked, chunk_tokens=97)):
        loss = model(**batch.inputs, loss_labels=batch.labels)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (full, full_grads), (chunked, chunked_grads) = results
    assert chunked.item() == pytest.approx(full.item(), rel=1e-5)
    for full_grad, chunked_grad in zip(full_grads, chunked_grads):
        torch.testing.assert_close(chunked_grad, full_grad, rtol=1e-3, atol=1e-5)


def test_the_loss_in_effect_follows_the_model_type_and_its_vocabulary():
    gpt2 = build_model(
        ModelConfig(
            architecture={"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 32_000},
            tokenizer="bytes",
        ),
        byte_tokenizer(),
    )
    assert with_summed_loss(gpt2, LossKind.auto, 1024) is LossKind.full  # not on the list of plain heads
    llama = tiny_model()
    assert llama.config.model_type == "llama"
    assert with_summed_loss(llama, LossKind.auto, 1024) is LossKind.full  # 259 byte tokens: no logits worth chunking
    large = build_model(
        ModelConfig(architecture={**resolved_spec(QUICK).model.architecture, "vocab_size": 32_000}, tokenizer="bytes"),
        byte_tokenizer(),
    )
    assert with_summed_loss(large, LossKind.auto, 1024) is LossKind.chunked


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.loss_chunk_tokens=0", "train.loss_chunk_tokens=0 must be a positive integer"),
        ("train.loss=fused", "train.loss"),
    ],
)
def test_bad_loss_settings_are_one_line(override, message):
    with pytest.raises(Exception, match=message):
        resolved_spec([*QUICK, override])


def test_compile_under_deepspeed_is_refused_in_one_line():
    with pytest.raises(SpecError, match="train.compile=true runs under strategy=single, ddp and fsdp"):
        resolved_spec([*QUICK, "strategy=deepspeed", "train.compile=true"])


def test_the_estimate_counts_one_chunk_of_logits_under_the_chunked_loss():
    from runner.memory.breakdown import estimate
    from runner.memory.model_shapes import facts_of
    from tests.support.specs import composed

    def estimated(loss):
        spec = composed(
            [
                "model=llama3_8b",
                "hardware=h100_80gb",
                "precision=bf16",
                f"train.loss={loss}",
                "train.micro_batch_size=2",
                "data.seq_len=4096",
            ]
        )
        return estimate(spec, facts_of(spec.model))

    full, chunked = estimated("full"), estimated("chunked")
    vocab, tokens = 128_256, 2 * 4096
    assert full.activations.bytes - chunked.activations.bytes == tokens * ((2 + 4) * vocab - 4 * 4096)
    assert full.backward_start.bytes - chunked.backward_start.bytes == (tokens * 8 - 1024 * (2 * 2 + 12)) * vocab
    assert "chunked loss" in chunked.activations.note
    assert max(chunked.phases().values()) < max(full.phases().values())


# --- training runs ---

STEPS = 8
BASE = [
    f"train.max_steps={STEPS}",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=2",
    "train.save_model=false",
    "train.micro_batch_size=2",
    "data.eval_fraction=0.1",
    *TWO_BLOCKS,
]


def packed_run(pairs: Path) -> list[str]:
    return [*BASE, "data=instruction_files", f"data.files={pairs}", "data.seq_len=256", "data.packing=true"]


PACKED_VARIANTS = {
    "ddp": ["strategy=ddp"],
    "fsdp": ["strategy=fsdp"],
    "deepspeed ZeRO-2": ["strategy=deepspeed", "strategy.zero_stage=2"],
    "deepspeed ZeRO-3": ["strategy=deepspeed", "strategy.zero_stage=3"],
    "fsdp, the full loss": ["strategy=fsdp", "train.loss=full"],
}


@pytest.mark.distributed
def test_packed_training_has_the_losses_of_one_process_under_every_strategy(pairs, tmp_path):
    reference_dir = tmp_path / "single"
    reference_dir.mkdir()
    train(prepare_job(resolved_spec([*packed_run(pairs), "train.grad_accum_steps=4"]), reference_dir))
    reference = step_losses(reference_dir)
    specs = [
        resolved_spec([*packed_run(pairs), "hardware.nproc_per_node=2", "train.grad_accum_steps=2", *overrides])
        for overrides in PACKED_VARIANTS.values()
    ]
    dirs = [tmp_path / str(i) for i in range(len(specs))]
    train_in_workers(specs, dirs)
    for name, run_dir in zip(PACKED_VARIANTS, dirs):
        assert step_losses(run_dir) == pytest.approx(reference, rel=1e-4), name
    # Two pipeline stages: the rows' positions pass from the first to the second with the hidden states.
    pipelined = resolved_spec(
        [
            *packed_run(pairs),
            "hardware.nproc_per_node=2",
            "train.grad_accum_steps=4",
            "strategy=fsdp",
            "strategy.pp_size=2",
        ]
    )
    train_in_workers([pipelined], [tmp_path / "pp 2"])
    assert step_losses(tmp_path / "pp 2") == pytest.approx(reference, rel=1e-4)
    assert reference[-1] < reference[0]


@pytest.mark.signals
def test_a_packed_run_killed_and_resumed_has_the_uninterrupted_losses(pairs, tmp_path, tmp_path_factory):

    args = [*packed_run(pairs), "train.max_steps=10", "train.checkpoint_every=2"]
    expected, resumed = killed_and_resumed(args, tmp_path, 5, tmp_path_factory)
    assert resumed == expected


COMPILE_VARIANTS = {"ddp": ["strategy=ddp"], "fsdp": ["strategy=fsdp"]}


@pytest.mark.distributed
def test_compiled_blocks_keep_the_eager_losses_and_report_the_compile_time(tmp_path):
    args = [*QUICK, *BASE, "train.max_steps=10"]
    eager_dir, compiled_dir = tmp_path / "eager", tmp_path / "compiled"
    eager_dir.mkdir(), compiled_dir.mkdir()
    train(prepare_job(resolved_spec([*args, "train.grad_accum_steps=2"]), eager_dir))
    summary = train(prepare_job(resolved_spec([*args, "train.grad_accum_steps=2", "train.compile=true"]), compiled_dir))
    eager = step_losses(eager_dir)
    assert step_losses(compiled_dir) == pytest.approx(eager, rel=1e-4, abs=1e-4)
    assert summary["compile_time_s"] > 0
    specs = [
        resolved_spec([*args, "hardware.nproc_per_node=2", "train.compile=true", *overrides])
        for overrides in COMPILE_VARIANTS.values()
    ]
    dirs = [tmp_path / name for name in COMPILE_VARIANTS]
    summaries = train_in_workers(specs, dirs)
    for name, run_dir, run_summary in zip(COMPILE_VARIANTS, dirs, summaries):
        assert step_losses(run_dir) == pytest.approx(eager, rel=1e-4, abs=1e-4), name
        assert run_summary["compile_time_s"] > 0


@pytest.mark.slow
def test_a_128k_vocabulary_step_peaks_lower_with_the_chunked_loss_as_the_estimate_says(tmp_path):
    """Peak resident memory of a step of the default model with Llama 3's vocabulary (128,256), each loss in its
    own process: the chunked loss saves most of what the estimate says the logits cost. (A step's peak is its
    forward and backward, where the logits live; the optimizer's states, made at the step's end, add the same to
    both losses.)"""
    from runner.memory.breakdown import estimate
    from runner.memory.model_shapes import facts_of

    args = [
        *QUICK,
        "+model.architecture.vocab_size=128256",
        "train.max_steps=1",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.save_model=false",
        "train.micro_batch_size=8",
        "train.loss_chunk_tokens=256",
        "hardware=cpu",
    ]
    measured, estimated = {}, {}
    for loss in ("full", "chunked"):
        cwd = tmp_path / loss
        cwd.mkdir()
        result = run_cli(*args, f"train.loss={loss}", cwd=cwd)
        assert result.returncode == 0, result.stderr[-2000:]
        measured[loss] = json.loads((run_dirs(cwd)[0] / "summary.json").read_text())["peak_memory_gib"]
        spec = resolved_spec([*args, f"train.loss={loss}"])
        estimated[loss] = max(estimate(spec, facts_of(spec.model)).phases().values()) / 2**30
    saved, expected = measured["full"] - measured["chunked"], estimated["full"] - estimated["chunked"]
    print(f"peak GiB measured {measured}, estimated {estimated}")
    assert expected > 1.0
    assert 0.5 * expected < saved < 1.5 * expected


def _collectives_in_steps(ranks, spec, run_dir):
    """The all-reduces the runner itself issues in 3 training steps under DDP (DDP's gradient buckets go through
    its C++ reducer, not this function): the step's own, and the loop's sum of the loss."""
    import torch.distributed as dist

    from runner.engine.step import train_step

    job = prepare_job(spec, Path(run_dir), ranks)
    calls = []
    real_all_reduce = dist.all_reduce

    def counted(*args, **kwargs):
        calls.append(1)
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counted
    try:
        batches = job.train_batches(0, None)
        in_steps = 0
        for _ in range(3):
            before = len(calls)
            train_step(job, next(batches))
            in_steps += len(calls) - before
    finally:
        dist.all_reduce = real_all_reduce
    return in_steps


@pytest.mark.distributed
def test_a_step_issues_no_collective_of_its_own(pairs, tmp_path):
    """The label count that divides the loss comes with the rows: before the forward, no rank waits for another."""
    spec = resolved_spec([*packed_run(pairs), "strategy=ddp", "hardware.nproc_per_node=2"])
    assert run_in_workers(_collectives_in_steps, spec, str(tmp_path), nproc=2) == [0, 0]


@pytest.mark.distributed
def test_padded_rows_through_a_pipeline_have_the_losses_of_one_process(pairs, tmp_path):
    """Instruction rows padded to their micro batch's longest (and, in the pipeline, to seq_len, with an attention
    mask that hides the padding): 2 pipeline stages train and evaluate as one process does."""
    padded = [
        *BASE,
        "data=instruction_files",
        f"data.files={pairs}",
        "data.seq_len=256",
        "data.packing=false",
        "train.eval_every=4",
        "train.eval_batches=3",
        "train.grad_accum_steps=4",
    ]
    (tmp_path / "single").mkdir()
    train(prepare_job(resolved_spec(padded), tmp_path / "single"))
    train_in_workers(
        [resolved_spec([*padded, "hardware.nproc_per_node=2", "strategy=fsdp", "strategy.pp_size=2"])],
        [tmp_path / "pp 2"],
    )
    assert step_losses(tmp_path / "pp 2") == pytest.approx(step_losses(tmp_path / "single"), rel=1e-4)
    evaluated, expected = logged(tmp_path / "pp 2", "eval_loss"), logged(tmp_path / "single", "eval_loss")
    assert list(evaluated) == list(expected) == [0, 4, 8]
    assert list(evaluated.values()) == pytest.approx(list(expected.values()), rel=1e-4)
