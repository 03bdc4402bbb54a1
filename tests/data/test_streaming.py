"""Streaming (data.streaming): each rank reads and tokenizes its own shard as training goes, through datasets'
IterableDataset, and a run killed with SIGKILL resumes from each rank's exact position in its stream."""

import itertools
import json
import sysconfig
from pathlib import Path

import pytest

from runner.components.modeling import byte_tokenizer
from runner.config.data import DataConfig, DataFormat
from runner.data.pack import GROUP
from runner.data.read import read_item, values, work_items
from runner.data.stream import StreamedRows, StreamPosition, held_out_every, shard
from tests.support.command import run_cli
from tests.support.runs import killed_and_resumed, run_dirs
from tests.support.specs import QUICK

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def stdlib_lines(count: int) -> list[str]:
    lines = (line.strip() for path in sorted(STDLIB.glob("*.py")) for line in path.read_text().splitlines())
    return list(itertools.islice(dict.fromkeys(line for line in lines if len(line) > 8), count))  # each once


@pytest.fixture(scope="module")
def lines_corpus(tmp_path_factory) -> Path:
    """2.5 groups of short documents (the standard library's lines), in two JSON Lines files."""
    folder = tmp_path_factory.mktemp("lines")
    lines = stdlib_lines(GROUP * 5 // 2)
    for part in range(2):
        with (folder / f"part{part}.jsonl").open("w") as out:
            out.writelines(json.dumps({"text": line}) + "\n" for line in lines[part::2])
    return folder


def each_kind(folder: Path, kind: str) -> DataConfig:
    """The standard library's email package as documents, in a file kind of data.files."""
    sources = sorted((STDLIB / "email").glob("*.py"))
    texts = [path.read_text() for path in sources]
    if kind == "text":
        return DataConfig(files=str(STDLIB / "email" / "*.py"))
    if kind == "instruction":
        with (folder / "pairs.jsonl").open("w") as out:
            out.writelines(json.dumps({"prompt": text[:200], "response": text[200:400]}) + "\n" for text in texts)
        return DataConfig(files=str(folder / "pairs.jsonl"), format=DataFormat.instruction)
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": texts}), folder / "texts.parquet", row_group_size=10)
        return DataConfig(files=str(folder / "texts.parquet"))
    with (folder / "texts.jsonl").open("w") as out:
        out.writelines(json.dumps({"text": text}) + "\n" for text in texts)
    return DataConfig(files=str(folder / "texts.jsonl"))


@pytest.mark.parametrize("kind", ["text", "jsonl", "parquet", "instruction"])
def test_the_ranks_shards_hold_every_document_once_as_the_token_store_reads_them(kind, tmp_path):
    """datasets' streaming readers and the store's own reader (runner/data/read.py) agree, document for
    document; two ranks' shards split the documents between them."""
    data = each_kind(tmp_path, kind)
    fields = ("prompt", "response") if kind == "instruction" else ("text",)
    stored = [document for item in work_items(data) for document in read_item(item, fields, "data.files")]

    def documents(rank: int, size: int) -> list[tuple[str, ...]]:
        return [values(record, fields, "data.files", where) for record, where in shard(data, rank, size)]

    assert documents(0, 1) == stored
    halves = [documents(rank, 2) for rank in range(2)]
    assert sorted(halves[0] + halves[1]) == sorted(stored)
    assert halves[0] and halves[1]


def test_a_stream_goes_on_from_any_saved_position_exactly(lines_corpus):
    """Mid-chunk, at a chunk's start, and past the end of the shard (the next epoch): the rows that follow a
    position are the rows that followed it when the stream ran on."""
    data = DataConfig(files=str(lines_corpus), seq_len=16, eval_fraction=0.1)
    stream = StreamedRows(data, byte_tokenizer(), seed=5, rank=0, size=1)
    rows = list(itertools.islice(stream.rows(StreamPosition()), 12_000))
    positions = [position for _, position in rows]
    epochs_and_chunks = sorted({(p.epoch, p.document) for p in positions})
    assert epochs_and_chunks[:4] == [(0, 0), (0, GROUP), (0, 2 * GROUP), (1, 0)]  # 2 full groups and a part, again
    chunk_ends = [i for i in range(1, len(rows)) if positions[i].document != positions[i - 1].document]
    for taken in [1, 777, chunk_ends[0], chunk_ends[2] + 3]:
        again = list(itertools.islice(stream.rows(positions[taken - 1]), 50))
        assert again == rows[taken : taken + 50]
    # An epoch's rows come from the same documents in a new order.
    first_epoch = [row for row, position in rows if position.epoch == 0]
    second_epoch = [row for row, position in rows if position.epoch == 1][: len(first_epoch)]
    assert first_epoch != second_epoch[: len(first_epoch)]


def test_the_held_out_documents_never_train(lines_corpus):
    data = DataConfig(files=str(lines_corpus), seq_len=16, eval_fraction=0.2)
    assert held_out_every(data) == 5
    stream = StreamedRows(data, byte_tokenizer(), seed=0, rank=1, size=2)
    evaluation, training = ([record["text"] for record, _ in stream.documents(held_out)] for held_out in (True, False))
    assert len(training) == 4 * len(evaluation)
    assert not set(evaluation) & set(training)
    assert len(stream.eval_rows(10)) == 10


STREAMED = [
    *(arg for arg in QUICK if not arg.startswith("data.files=")),
    "data.streaming=true",
    "data.seq_len=32",
    "data.eval_fraction=0.25",
    "train.max_steps=12",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=2",
    "train.micro_batch_size=2",
    "train.checkpoint_every=3",
    "train.keep_checkpoints=4",
    "hardware.nproc_per_node=2",
    "strategy=ddp",
]


@pytest.mark.distributed
@pytest.mark.signals
def test_a_streamed_run_on_two_ranks_killed_and_resumed_has_the_uninterrupted_losses(tmp_path, tmp_path_factory):
    """Each rank's shard is shorter than the run (the stream starts again), and the kill comes mid-chunk."""
    folder = tmp_path_factory.mktemp("streamed")
    with (folder / "lines.jsonl").open("w") as out:
        out.writelines(json.dumps({"text": line}) + "\n" for line in stdlib_lines(40))
    args = [*STREAMED, f"data.files={folder / 'lines.jsonl'}"]
    expected, resumed = killed_and_resumed(args, tmp_path, 7, tmp_path_factory)
    assert resumed == expected  # exactly, step for step
    assert sorted(expected) == list(range(1, 13))
    [run_dir] = run_dirs(tmp_path)
    killed_at = json.loads((run_dir / "checkpoints" / "step_00000006" / "stream-rank1.json").read_text())
    assert killed_at["epoch"] == 0 and killed_at["rows"] > 0  # resumed mid-chunk
    ended_at = json.loads((run_dir / "checkpoints" / "step_00000012" / "stream-rank1.json").read_text())
    assert ended_at["epoch"] == 1


def test_streamed_input_problems_are_one_line_before_any_process(tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"body": "no text field"}) + "\n")
    cases = {
        (f"data.files={broken}", "data.streaming=true"): "has no field 'text' (it has: body); set data.text_field",
        ("--prepare-data", "data.streaming=true"): "--prepare-data has nothing to do",
        ("task=evaluate", "data.streaming=true"): "task=evaluate reads the token store's rows",
    }
    for args, message in cases.items():
        result = run_cli(*args, cwd=tmp_path)
        assert result.returncode == 2, (args, result.stderr[-1500:])
        assert message in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.jsonl"]  # nothing written, no outputs/


@pytest.mark.slow  # may wait up to 10 s for the hub's host before launch (runner/data/stream.py: hub_unreachable)
def test_a_hub_dataset_that_cannot_be_streamed_is_one_line(tmp_path):
    result = run_cli("data.hub_dataset=nobody/nothing", "data.files=null", "data.streaming=true", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("run: error: data.hub_dataset=nobody/nothing could not be streamed: ")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_unreachable_hub_is_named_before_its_client_retries(monkeypatch):
    """A refused connection is named at once (huggingface_hub would retry it for 23 s); a host that accepts, a
    proxy (only the client can tell) and offline mode (datasets refuses at once itself) leave it to datasets."""
    import socket

    import datasets

    from runner.data.stream import hub_unreachable

    for name in ("http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setattr(datasets.config, "HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert hub_unreachable() is None
    assert hub_unreachable() == "127.0.0.1 cannot be reached (Connection refused)"  # the same port, now closed
    monkeypatch.setenv("http_proxy", "http://proxy.invalid:3128")
    assert hub_unreachable() is None
    monkeypatch.delenv("http_proxy")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    assert hub_unreachable() is None
