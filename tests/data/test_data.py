"""The data package (runner/data/): a corpus tokenized once, on every core, into the token store that every later
run reads; the same tokens whatever the number of processes; writers that meet take turns and say so."""

import fcntl
import json
import os
import shutil
import sysconfig
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from runner.components.modeling import byte_tokenizer
from runner.config.data import DataConfig, DataFormat
from runner.data import read
from runner.data.pack import GROUP, GROUP_TOKENS, groups
from runner.data.splits import token_splits
from runner.data.store import documents_key, size_on_disk
from tests.support.command import run_cli, start_cli
from tests.support.runs import wait_until

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    """Prompt/response pairs from the standard library's lines, in two JSON Lines files."""
    lines = [
        line
        for path in sorted((STDLIB / "json").glob("*.py"))
        for line in path.read_text().splitlines()
        if line.strip()
    ]
    folder = tmp_path_factory.mktemp("pairs")
    for part in range(2):
        with (folder / f"part{part}.jsonl").open("w") as out:
            for at in range(part, len(lines) - 3, 2):
                out.write(json.dumps({"prompt": lines[at], "response": "\n".join(lines[at + 1 : at + 3])}) + "\n")
    return folder


def all_rows(data: DataConfig) -> list:
    train, evaluation = token_splits(data, byte_tokenizer(), seed=0)
    return [list(evaluation), list(train)]


@pytest.mark.parametrize(
    "format_,packing", [("text", False), ("text", True), ("instruction", False), ("instruction", True)]
)
def test_the_tokens_are_the_same_whatever_the_number_of_processes(format_, packing, pairs, tmp_path, monkeypatch):
    monkeypatch.setattr(read, "ITEM_BYTES", 8192)  # many work items, for the processes to share
    files = str(pairs / "*.jsonl") if format_ == "instruction" else str(STDLIB / "json" / "*.py")
    data = DataConfig(files=files, format=DataFormat(format_), packing=packing, seq_len=128)
    one = all_rows(replace(data, num_proc=1, cache_dir=str(tmp_path / "one")))
    two = all_rows(replace(data, num_proc=2, cache_dir=str(tmp_path / "two")))
    assert one == two and len(one[1]) > 10
    assert len(list(read.work_items(data))) >= 4


def test_the_store_is_written_once_and_read_by_every_later_run(tmp_path, caplog):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for path in sorted((STDLIB / "json").glob("*.py")):
        (corpus / path.name).write_text(path.read_text())
    data = DataConfig(files=str(corpus), seq_len=64, cache_dir=str(tmp_path / "cache"))
    caplog.set_level("INFO", logger="runner")

    first = all_rows(data)
    assert "tokenizing" in caplog.text
    [documents] = (tmp_path / "cache").glob("*/documents")
    written = (documents / "tokens.bin").stat().st_mtime_ns
    caplog.clear()
    assert all_rows(data) == first
    assert all_rows(replace(data, seq_len=32))[1][0]["tokens"] == 32  # new rows, from the same documents
    assert "tokenizing" not in caplog.text and (documents / "tokens.bin").stat().st_mtime_ns == written
    assert len([p for p in documents.parent.glob("rows-*") if p.is_dir()]) == 2

    (corpus / "decoder.py").write_text((corpus / "decoder.py").read_text() + "\n# changed\n")
    all_rows(data)  # a changed file is a new corpus
    assert "tokenizing" in caplog.text and len(list((tmp_path / "cache").glob("*/documents"))) == 2


def test_a_writer_that_finds_another_at_work_says_whom_it_waits_for_then_reads_its_store(workdir):
    """The lock is held here, as another run tokenizing the same data would hold it: `run --prepare-data` waits,
    says so, and goes on once the lock is free, removing what a writer killed mid-way left behind."""
    cache = workdir / "cache"
    overrides = [f"data.cache_dir={cache}", "data=text_files", f"data.files={STDLIB / 'json' / '*.py'}"]
    data = DataConfig(files=str(STDLIB / "json" / "*.py"), cache_dir=str(cache))
    root = cache / documents_key(data, byte_tokenizer())
    root.mkdir(parents=True)
    with open(root / "documents.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.write("process 1 on the other node")
        lock.flush()
        (root / "documents.partial-1").mkdir()  # what that writer leaves if it is killed
        (root / "documents.partial-1" / "tokens.bin").write_bytes(b"half")
        waiting = start_cli("--prepare-data", *overrides, cwd=workdir)
        wait_until(
            lambda: "waiting for process 1 on the other node, which is writing the token store" in waiting.stderr(),
            "the waiting writer's report",
            job=waiting,
        )
        assert not (root / "documents").exists()
        fcntl.flock(lock, fcntl.LOCK_UN)
    stdout, stderr = waiting.communicate(timeout=300)
    assert waiting.returncode == 0, stderr
    assert stdout.startswith(f"token store {root}: ") and " 0 eval rows" not in stdout
    [rows] = [p.name for p in root.glob("rows-*") if p.is_dir()]
    assert sorted(p.name for p in root.iterdir()) == ["documents", "documents.lock", rows, f"{rows}.lock"]
    again = run_cli("--prepare-data", *overrides, cwd=workdir)
    assert again.returncode == 0 and again.stdout == stdout and "tokenizing" not in again.stderr


def test_a_corpus_whose_store_would_not_fit_on_the_disk_is_refused_before_tokenizing(workdir):
    corpus = workdir / "corpus"
    corpus.mkdir()
    free = shutil.disk_usage(workdir).free
    with open(corpus / "huge.txt", "wb") as huge:  # a sparse file: half the free space as its size says, no block
        huge.truncate(free // 2 + 1)
    result = run_cli("data=text_files", f"data.files={corpus}", "data.cache_dir=cache", cwd=workdir)
    assert result.returncode == 2
    assert result.stderr.startswith(
        f"run: error: the token store of {(free // 2 + 1) / 1e9:,.1f} GB of text needs up to "
    )
    assert f" GB in {workdir / 'cache'}, which has " in result.stderr
    assert result.stderr.endswith(" GB free; free space there or set data.cache_dir to a larger disk\n")
    assert result.stderr.count("\n") == 1
    assert not (workdir / "outputs").exists() and not list((workdir / "cache").rglob("documents*"))


def test_the_stores_tokens_are_the_tokenizers_own(tmp_path):
    """The store holds what the tokenizer makes of each document, and its end-of-sequence token after it."""
    tokenizer = byte_tokenizer()
    files = sorted((STDLIB / "json").glob("*.py"))
    data = DataConfig(files=str(STDLIB / "json" / "*.py"), cache_dir=str(tmp_path), num_proc=2)
    token_splits(data, tokenizer, seed=0)
    [documents] = tmp_path.glob("*/documents")
    meta = json.loads((documents / "meta.json").read_text())
    stored = np.fromfile(documents / "tokens.bin", dtype=meta["dtype"])
    expected = [
        token
        for path in files
        for token in tokenizer(path.read_text(), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ]
    assert meta["dtype"] == "uint16" and stored.tolist() == expected
    assert np.load(documents / "lengths.npy").tolist() == [len(path.read_bytes()) + 1 for path in files]
    assert os.path.getsize(documents / "tokens.bin") == 2 * len(expected)


def test_the_rows_are_those_of_datasets_own_split_and_map(tmp_path):
    """datasets as the oracle: its text reader (a document per file), its seeded train_test_split, and its batched
    map (1,000 documents a batch) cutting each batch's token stream into blocks, as the runner did before the store."""
    import datasets

    tokenizer = byte_tokenizer()
    data = DataConfig(files=str(STDLIB / "email" / "*.py"), seq_len=128, cache_dir=str(tmp_path / "store"))
    documents = datasets.load_dataset(
        "text",
        data_files=sorted(map(str, (STDLIB / "email").glob("*.py"))),
        split="train",
        sample_by="document",
        cache_dir=str(tmp_path / "datasets"),
    )
    splits = documents.train_test_split(
        test_size=max(1, round(len(documents) * data.eval_fraction)), shuffle=True, seed=0
    )

    def blocks(batch):
        stream = [
            token
            for ids in tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
            for token in ids + [tokenizer.eos_token_id]
        ]
        return {"input_ids": [stream[i : i + 128] for i in range(0, len(stream) // 128 * 128, 128)]}

    expected = [
        split.map(blocks, batched=True, remove_columns=["text"])["input_ids"]
        for split in (splits["train"], splits["test"])
    ]
    train, evaluation = token_splits(data, tokenizer, seed=0)
    assert [[row["input_ids"] for row in rows] for rows in (train, evaluation)] == expected


@pytest.mark.slow  # waits on a real timeout
def test_a_writer_that_holds_the_lock_and_writes_nothing_ends_the_wait(tmp_path, monkeypatch, caplog):
    """Waiting for a stuck writer is reported, and ends: here after 1 s of no progress (600 s in a run)."""
    from runner.data import store
    from runner.errors import WorkerFailed

    monkeypatch.setattr(store, "WAIT_REPORT_S", 0.2)
    monkeypatch.setattr(store, "STALL_S", 1)
    final = tmp_path / "documents"
    with open(tmp_path / "documents.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.write("process 1 on the other node")
        lock.flush()
        with pytest.raises(
            WorkerFailed,
            match=rf"^process 1 on the other node has held the token store {final} for "
            r"\d+ s, writing nothing for the last 1 s; if it is stuck, end it",
        ):
            with store.turn(final):
                pass
    assert "waiting for process 1 on the other node, which is writing the token store" in caplog.text


def test_the_size_of_a_store_leaves_out_what_other_writers_have_not_finished(tmp_path):
    """A run reports its store's size while another run may be writing another layout of the same documents
    beside it, and renames it into place mid-count: partial stores are not counted, so never half-walked."""
    (tmp_path / "documents").mkdir()
    (tmp_path / "documents" / "tokens.bin").write_bytes(b"\0" * 1000)
    (tmp_path / "rows-b.partial-123").mkdir()
    (tmp_path / "rows-b.partial-123" / "tokens.bin").write_bytes(b"\0" * 500)
    assert size_on_disk(tmp_path) == 1000
    assert size_on_disk(tmp_path / "rows-b.partial-123") == 500  # a writer's own progress


def test_rows_are_packed_in_groups_that_bound_memory_whatever_the_corpus():
    """At most GROUP documents and GROUP_TOKENS tokens a group, in the split's order; a longer document alone."""
    lengths = np.array([GROUP_TOKENS // 3] * 7 + [GROUP_TOKENS * 2] + [1] * 2500)
    order = np.arange(len(lengths))[::-1].copy()
    found = list(groups(order, lengths))
    assert np.concatenate(found).tolist() == order.tolist()
    assert all(len(group) <= GROUP and lengths[group].sum() <= GROUP_TOKENS or len(group) == 1 for group in found)
    assert [len(group) for group in found] == [1000, 1000, 500, 1, 3, 3, 1]


@pytest.mark.signals
def test_the_tokenizing_processes_end_with_the_run_that_started_them(workdir):
    """`run --prepare-data` killed mid-way (kill -9, out of memory) leaves no process tokenizing for no one."""
    import psutil

    corpus = workdir / "corpus"
    corpus.mkdir()
    text = "".join(path.read_text() for path in sorted((STDLIB / "email").glob("*.py")))
    for part in range(12):  # a few seconds of work a process: they are at work when the run is killed
        (corpus / f"part{part}.txt").write_text(text * 2)
    job = start_cli(
        "--prepare-data",
        "data=text_files",
        f"data.files={corpus}",
        "data.num_proc=2",
        f"data.cache_dir={workdir / 'cache'}",
        cwd=workdir,
    )
    run = psutil.Process(job.pid)

    def both_tokenizing_processes():  # the pool starts them one after the other: wait for the second too
        workers = [p for p in run.children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]
        return workers if len(workers) == 2 and "tokenizing" in job.stderr() else None

    workers = wait_until(both_tokenizing_processes, "the two tokenizing processes", job=job)
    os.kill(job.pid, 9)
    gone, alive = psutil.wait_procs(workers, timeout=60)  # at once, in fact: the kernel signals them
    assert alive == [] and len(gone) == 2
