"""Batches (runner/data/batches.py, runner/data/prefetch.py): the same rows in the same order as a plain collate
gives them, no attention mask where no row is padded (transformers would read an all-ones one back to the host),
and the next global batch built on a thread while the step runs, which ends with the loop and raises its errors
in it."""

import os
import subprocess
import sys
import sysconfig
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from runner.components.modeling import byte_tokenizer
from runner.config.data import DataConfig, DataFormat
from runner.data.batches import MicroBatch, collate, eval_batches, train_batches
from runner.data.prefetch import ahead
from runner.data.rows import IGNORE
from runner.data.splits import token_splits
from tests.support import DATA

STDLIB = Path(sysconfig.get_paths()["stdlib"])
ALPACA = DATA / "llama_factory" / "alpaca_en_demo.json"
CHATS = DATA / "torchtune" / "alpaca_tiny.json"
LLAMA3 = DATA / "trl_chat_templates" / "llama3.jinja"


def reference_collate(rows: dict, pad_token_id: int) -> MicroBatch:
    """Each column padded row by row in Python lists, then made a tensor: an attention mask only where a row is
    padded."""
    length = max(len(ids) for ids in rows["input_ids"])

    def padded(seqs, value):
        return torch.tensor([list(seq) + [value] * (length - len(seq)) for seq in seqs])

    inputs = {"input_ids": padded(rows["input_ids"], pad_token_id)}
    if "position_ids" in rows:
        inputs["position_ids"] = torch.tensor([list(p) + list(range(length - len(p))) for p in rows["position_ids"]])
    elif any(len(ids) < length for ids in rows["input_ids"]):
        inputs["attention_mask"] = padded([[1] * len(ids) for ids in rows["input_ids"]], 0)
    return MicroBatch(
        inputs, padded(rows["labels"], IGNORE), sum(rows["tokens"]), sum(rows["label_tokens"]), rows.get("store_row")
    )


def assert_same(got: MicroBatch, expected: MicroBatch) -> None:
    assert got.inputs.keys() == expected.inputs.keys()
    for key in expected.inputs:
        assert got.inputs[key].dtype == expected.inputs[key].dtype == torch.int64
        assert torch.equal(got.inputs[key], expected.inputs[key]), key
    assert got.labels.dtype == torch.int64 and torch.equal(got.labels, expected.labels)
    assert (got.tokens, got.label_tokens, got.store_rows) == (
        expected.tokens,
        expected.label_tokens,
        expected.store_rows,
    )


def data(kind: str, packing: bool) -> DataConfig:
    if kind == "text":
        return DataConfig(files=str(STDLIB / "email" / "*.py"), seq_len=128, packing=packing)
    if kind == "instruction":
        return DataConfig(
            files=str(ALPACA),
            format=DataFormat.instruction,
            prompt_field="instruction",
            response_field="output",
            seq_len=256,
            packing=packing,
        )
    return DataConfig(files=str(CHATS), format=DataFormat.chat, chat_template=str(LLAMA3), seq_len=256, packing=packing)


def chat_tokenizer(template: str):
    """The byte tokenizer with the template's special tokens as tokens of their own (tests/data/test_chat.py's)."""
    import re

    tokenizer = byte_tokenizer()
    markers = sorted(set(re.findall(r"<\|[^<>|\s]{1,40}\|>", template)))
    tokenizer.add_special_tokens({"additional_special_tokens": markers})
    return tokenizer


KINDS = [(kind, packing) for kind in ("text", "instruction", "chat") for packing in (False, True)]


@pytest.fixture(scope="module", params=KINDS, ids=lambda p: f"{p[0]}-{'packed' if p[1] else 'padded'}")
def splits(request):
    kind, packing = request.param
    tokenizer = chat_tokenizer(LLAMA3.read_text()) if kind == "chat" else byte_tokenizer()
    train, evaluated = token_splits(data(kind, packing), tokenizer, seed=0)
    return kind, packing, tokenizer.pad_token_id, train, evaluated


def test_the_global_batches_are_a_plain_collates_in_the_same_order(splits):
    """Each step's micro batches: the rows of the seeded permutation's slice, collated as the reference does, whether
    built on the loop's thread or ahead of it on another; the eval batches too."""
    kind, packing, pad, rows, evaluated = splits
    size, accum, seed = 2, 2, 3
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).numpy()
    plain = train_batches(
        rows, micro_batch_size=size, grad_accum_steps=accum, dp_rank=1, dp_size=2, seed=seed, pad_token_id=pad
    )
    prefetched = ahead(
        train_batches(
            rows, micro_batch_size=size, grad_accum_steps=accum, dp_rank=1, dp_size=2, seed=seed, pad_token_id=pad
        )
    )
    for step in range(3):
        first = step * size * accum * 2 + size * accum  # rank 1's slice of the step's global batch
        everyone = order[step * size * accum * 2 : (step + 1) * size * accum * 2]
        for batch in (next(plain), next(prefetched)):
            assert (batch.tokens, batch.label_tokens) == (
                int(rows.tokens[everyone].sum()),
                int(rows.label_tokens[everyone].sum()),
            )
            for i, micro_batch in enumerate(batch.micro_batches):
                indices = order[first + i * size : first + (i + 1) * size]
                assert_same(micro_batch, reference_collate(rows.batch(indices), pad))
    prefetched.close()
    count = min(len(evaluated), 6)
    got = list(eval_batches(evaluated, micro_batch_size=3, max_batches=2, dp_rank=0, dp_size=1, pad_token_id=pad))
    assert len(got) == -(-count // 3)
    for batch, start in zip(got, range(0, count, 3)):
        assert_same(batch, reference_collate(evaluated.batch(range(start, min(start + 3, count))), pad))


def test_streamed_batches_built_ahead_are_the_streams_own():
    """A streamed rank's batches, from the thread as from the loop's: the same rows, and the same position in the
    stream for its checkpoint (the batch's own, however far ahead the thread has read)."""
    from runner.data.batches import streamed_batches
    from runner.data.stream import StreamedRows

    tokenizer = chat_tokenizer(LLAMA3.read_text())
    config = replace(data("chat", packing=False), streaming=True)
    plain, prefetched = (
        streamed_batches(
            StreamedRows(config, tokenizer, 0, 0, 1),
            micro_batch_size=2,
            grad_accum_steps=2,
            pad_token_id=tokenizer.pad_token_id,
        )
        for _ in range(2)
    )
    prefetched = ahead(prefetched)
    for _ in range(3):
        expected, got = next(plain), next(prefetched)
        assert (got.tokens, got.label_tokens, got.stream_position) == (
            expected.tokens,
            expected.label_tokens,
            expected.stream_position,
        )
        for a, b in zip(got.micro_batches, expected.micro_batches, strict=True):
            assert_same(a, b)
    prefetched.close()


def test_an_attention_mask_only_where_a_row_is_padded(splits):
    kind, packing, pad, rows, _ = splits
    lengths = rows.tokens
    full = [i for i in range(len(rows)) if lengths[i] == lengths.max()][:3]
    short = [i for i in range(len(rows)) if lengths[i] < lengths.max()][:1]
    if len(full) >= 2:
        unpadded = collate(rows.batch(full), pad)
        assert "attention_mask" not in unpadded.inputs
        assert_same(unpadded, reference_collate(rows.batch(full), pad))
    if short and full:
        mixed = collate(rows.batch(full[:1] + short), pad)
        assert ("attention_mask" in mixed.inputs) is (not packing)
        assert_same(mixed, reference_collate(rows.batch(full[:1] + short), pad))


def test_an_unpadded_batch_has_the_loss_and_gradients_it_has_with_an_all_ones_mask():
    """What transformers does with an all-ones mask is what it does with none: the same summed loss, exactly."""
    from runner.components.modeling import build_model
    from runner.config.training import LossKind
    from runner.engine.loss import with_summed_loss
    from tests.support.specs import QUICK, resolved_spec

    tokenizer = byte_tokenizer()
    rows, _ = token_splits(data("text", packing=False), tokenizer, seed=0)
    batch = collate(rows.batch(range(4)), tokenizer.pad_token_id)
    assert set(batch.inputs) == {"input_ids"}
    torch.manual_seed(0)
    model = build_model(resolved_spec(QUICK).model, tokenizer)
    with_summed_loss(model, LossKind.chunked, 1024)
    results = []
    for inputs in (batch.inputs, {**batch.inputs, "attention_mask": torch.ones_like(batch.inputs["input_ids"])}):
        model.zero_grad()
        loss = model(**inputs, loss_labels=batch.labels)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (without, without_grads), (with_mask, with_grads) = results
    assert torch.equal(without, with_mask)
    for a, b in zip(without_grads, with_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_pipeline_takes_an_unpadded_micro_batch_without_a_mask():
    """The pipeline pads every micro batch to one shape: an unpadded one's mask is ones, then the padding's zeros."""
    from runner.parallel.pipeline.schedule import Pipeline

    pipeline = Pipeline(
        None, first=True, last=True, microbatches=1, rows=2, length=5, pad_token_id=0, pp_group=None, leads_stage=True
    )
    unpadded = MicroBatch(
        {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 4]])},
        torch.tensor([[IGNORE, 6, 7], [IGNORE, 9, 4]]),
        tokens=6,
        label_tokens=4,
    )
    input_ids, labels, positions, mask = pipeline._stacked([unpadded])
    assert input_ids.tolist() == [[5, 6, 7, 0, 0], [8, 9, 4, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 0, 0]] * 2
    assert positions.tolist() == [list(range(5))] * 2


# --- the batches ahead of the loop ---


def _threads(name: str) -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == f"{name} ahead"]


def test_the_thread_builds_the_next_batch_while_the_loop_uses_this_one():
    built = []

    def items():
        for i in range(10):
            built.append(i)
            yield i

    batches = ahead(items(), name="test-ahead")
    assert not _threads("test-ahead")  # nothing runs before the first batch is asked for
    assert next(batches) == 0
    deadline = time.monotonic() + 10
    while len(built) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert built == [0, 1, 2]  # one waits in the queue, one more is built: no further
    assert list(batches) == list(range(1, 10))
    for thread in _threads("test-ahead"):
        thread.join(5)
        assert not thread.is_alive()


@pytest.mark.parametrize("end", ["closed", "raised"])
def test_the_thread_ends_with_the_loop_and_closes_the_batches(end):
    closed = threading.Event()

    def items():
        try:
            yield from range(1000)
        finally:
            closed.set()

    def loop():
        batches = ahead(items(), name=f"test-{end}")
        next(batches)
        next(batches)
        if end == "closed":
            batches.close()
        else:  # once the exception is handled, the loop's frame, and the batches with it, are gone
            raise ValueError("the step failed")

    if end == "closed":
        loop()
    else:
        with pytest.raises(ValueError):
            loop()
    assert closed.wait(5)
    for thread in _threads(f"test-{end}"):
        thread.join(5)
        assert not thread.is_alive()


def test_an_error_in_the_batches_is_raised_in_the_loop_with_where_it_happened():
    def a_broken_row_reader():
        yield 1
        raise KeyError("row 7 has no input_ids")

    batches = ahead(a_broken_row_reader(), name="test-error")
    assert next(batches) == 1
    with pytest.raises(KeyError, match="row 7") as raised:
        next(batches)
    frames = [frame.name for frame in traceback.extract_tb(raised.value.__traceback__)]
    assert "a_broken_row_reader" in frames
    with pytest.raises(StopIteration):
        next(batches)


ONE_CORE_PROBE = """
import os, threading, torch
from runner.data.prefetch import ahead

threads = lambda: len(os.listdir("/proc/self/task"))
counted = threading.Event()

def permutations():
    yield torch.randperm(100_000).numpy()  # filled in parallel: past ATen's grain of 32,768
    yield torch.get_num_threads()
    counted.wait(30)

torch.set_num_threads(2)  # the main thread has run no parallel kernel yet, as a rank before its first step may not
first = ahead(permutations())
next(first)
on_the_first = next(first)
torch.ones(100_000).add_(1)  # the main thread's first parallel kernel
on_the_loop = torch.get_num_threads()
before = threads()
second = ahead(permutations())
next(second)
on_the_second = next(second)
print(threads() - before, on_the_first, on_the_second, on_the_loop)
counted.set()
"""


@pytest.mark.slow  # a new interpreter that imports torch
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts a process's threads in /proc")
def test_the_thread_ahead_runs_torch_on_one_core_and_leaves_the_loops_threads_alone():
    """A permutation of 100,000 rows on the thread ahead starts no OpenMP team beside the loop's: with two, a CPU
    step took 1.5 times as long (runner/data/prefetch.py's `ahead`). The loop's thread keeps its two threads, even
    when its first parallel kernel comes after the thread ahead lowered torch's default."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    done = subprocess.run(
        [sys.executable, "-c", ONE_CORE_PROBE], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    # The second thread ahead adds itself alone, no OpenMP worker of its own.
    new_threads, on_the_first, on_the_second, on_the_loop = map(int, done.stdout.split())
    assert (new_threads, on_the_first, on_the_second, on_the_loop) == (1, 1, 1, 2)


@pytest.mark.slow  # waits on a real stall report
def test_a_wait_for_a_batch_that_stalls_is_reported_with_where_both_threads_are(tmp_path):
    from runner.processes.stall_watch import StallWatch

    release = threading.Event()

    def rows_on_a_slow_disk():
        yield 0
        release.wait(30)
        yield 1

    watch = StallWatch(0, 0.3, tmp_path / "stalls.txt")
    batches = ahead(rows_on_a_slow_disk(), name="test-stall")
    assert next(batches) == 0
    watch.entering("in step 2")
    threading.Timer(1.5, release.set).start()
    try:
        assert next(batches) == 1
    finally:
        watch.close()
        release.set()
    report = (tmp_path / "stalls.txt").read_text()
    assert "in step 2: no progress" in report
    assert "in ahead" in report and "in rows_on_a_slow_disk" in report  # the loop's wait, and the thread's


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_on_cuda_batches_are_pinned_and_copied_without_waiting():
    tokenizer = byte_tokenizer()
    rows, _ = token_splits(data("instruction", packing=False), tokenizer, seed=0)
    batch = collate(rows.batch(range(4)), tokenizer.pad_token_id, pin=True)
    assert all(t.is_pinned() for t in [*batch.inputs.values(), batch.labels])
    on_device = batch.to(torch.device("cuda"))
    assert_same(
        MicroBatch(
            {k: v.cpu() for k, v in on_device.inputs.items()},
            on_device.labels.cpu(),
            batch.tokens,
            batch.label_tokens,
            batch.store_rows,
        ),
        reference_collate(rows.batch(range(4)), tokenizer.pad_token_id),
    )
