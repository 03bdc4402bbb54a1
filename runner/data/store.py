"""The token store: a corpus tokenized once, on disk, read by every later run, every job of a sweep, every rank
and every node that shares the directory.

    <data.cache_dir>/<documents key>/documents/   tokens.bin, lengths.npy[, trained.bin], meta.json
    <data.cache_dir>/<documents key>/rows-<rows key>/   the eval rows, then the train rows (runner/data/pack.py)

The documents key covers what decides the tokens: the files (path, size, modification time), the tokenizer, the
format and its fields, and STORE_VERSION, raised whenever the documents' tokens change; the rows key adds what
decides the rows: seq_len, packing, the eval fraction, the seed of the split, whether preference pairs whose prompt
fills seq_len are left out, and ROWS_VERSION, raised whenever the packing changes. Beside a preference store's
rows, `reference-<key>.npy` keeps a reference model's log-probs of them (task.precompute_reference). A store is
written under a temporary name and renamed into place whole, so that a reader finds a complete store or none;
writers of the same store take turns under a lock, and one that waits says for whom.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from runner.config.data import resolve_files
from runner.data.chat import chat_template, template_or_none
from runner.data.read import HUB_ROWS
from runner.errors import WorkerFailed

if TYPE_CHECKING:
    import numpy as np
    from transformers import PreTrainedTokenizerBase

    from runner.config.data import DataConfig

log = logging.getLogger("runner")

STORE_VERSION = 2  # 2: examples' masks (trained.bin) for their prompt lengths
ROWS_VERSION = 2  # 2: packed instruction rows best-fit-decreasing; groups bounded by their tokens
DEFAULT_CACHE_DIR = "~/.cache/runner/tokens"
# How often a writer waiting for another one's lock says so, and how long it waits for one that writes nothing.
WAIT_REPORT_S = 30
STALL_S = 600


def cache_dir(data: DataConfig) -> Path:
    return Path(os.path.expanduser(data.cache_dir or os.environ.get("RUNNER_TOKEN_CACHE", DEFAULT_CACHE_DIR)))


def documents_key(data: DataConfig, tokenizer: PreTrainedTokenizerBase) -> str:
    if data.hub_dataset:
        source: Any = {
            "hub": data.hub_dataset,
            "split": data.hub_split,
            "fingerprint": HUB_ROWS[data.hub_dataset]._fingerprint,
        }
    else:
        source = [
            (path, found.st_size, found.st_mtime_ns) for path in resolve_files(data.files) for found in [os.stat(path)]
        ]
    if data.format.value == "chat":  # what renders the conversations and masks them
        fields: Any = [data.chat_format.value, chat_template(data, tokenizer), data.train_on.value]
    elif data.format.value == "preference":
        fields = [data.prompt_field, data.chosen_field, data.rejected_field, template_or_none(data, tokenizer)]
    else:
        fields = [data.prompt_field, data.response_field] if data.format.value == "instruction" else [data.text_field]
    return digest(
        {
            "version": STORE_VERSION,
            "source": source,
            "tokenizer": tokenizer_identity(tokenizer),
            "format": data.format.value,
            "fields": fields,
        }
    )


def rows_key(data: DataConfig, seed: int) -> str:
    return digest(
        {
            "version": ROWS_VERSION,
            "seq_len": data.seq_len,
            "packing": data.packing,
            "eval_fraction": data.eval_fraction,
            "seed": seed,
            **({"drop_long_prompts": True} if data.drop_long_prompts else {}),
        }
    )


def digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:20]


def tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> str:
    """What decides a tokenizer's ids: its whole definition where it has one (fast tokenizers), else its class,
    vocabulary and special tokens."""
    if getattr(tokenizer, "is_fast", False):
        definition = tokenizer.backend_tokenizer.to_str()
    else:
        definition = json.dumps([type(tokenizer).__name__, sorted(tokenizer.get_vocab().items())])
    specials = json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str)
    return hashlib.sha256((definition + specials + str(tokenizer.eos_token_id)).encode()).hexdigest()


def size_on_disk(path: Path) -> int:
    """The bytes under `path`, other writers' partial stores left out: they may be renamed or removed meanwhile."""
    total = 0
    for folder, subfolders, files in os.walk(path):  # a folder gone meanwhile is skipped
        subfolders[:] = [name for name in subfolders if ".partial-" not in name]
        for name in files:
            try:
                total += os.stat(os.path.join(folder, name)).st_size
            except FileNotFoundError:
                pass
    return total


def ensure(final: Path, write: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """The store at `final`, written by `write(partial directory)` unless it is there already; its meta data."""
    meta = final / "meta.json"
    if meta.exists():
        return json.loads(meta.read_text())
    final.parent.mkdir(parents=True, exist_ok=True)
    with turn(final):
        if meta.exists():  # written by the writer this one waited for
            return json.loads(meta.read_text())
        for stale in final.parent.glob(f"{final.name}.partial-*"):  # a writer that was killed: no one holds its lock
            shutil.rmtree(stale, ignore_errors=True)
        partial = final.with_name(f"{final.name}.partial-{os.getpid()}")
        partial.mkdir()
        try:
            written = write(partial)
            (partial / "meta.json").write_text(json.dumps(written, indent=2) + "\n")
            os.rename(partial, final)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    return written


@contextmanager
def turn(final: Path) -> Iterator[None]:
    """This process's turn to write the store at `final`. Another writer of it holds the lock until it is done, or
    until it ends (the kernel releases a dead process's lock); the wait is logged, with that writer, every
    WAIT_REPORT_S seconds."""
    with open(final.with_name(final.name + ".lock"), "a+") as lock:
        if not locked_within(lock, 0):
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            started = progressed = time.monotonic()
            written = partial_size(final)
            while True:
                log.warning(
                    "waiting for %s, which is writing the token store %s (%.0f s so far)",
                    holder,
                    final,
                    time.monotonic() - started,
                )
                if locked_within(lock, WAIT_REPORT_S):
                    break
                if partial_size(final) != written:
                    written, progressed = partial_size(final), time.monotonic()
                elif time.monotonic() - progressed > STALL_S:
                    held = time.monotonic() - started
                    raise WorkerFailed(
                        f"{holder} has held the token store {final} for {held:.0f} s, writing nothing "
                        f"for the last {STALL_S} s; if it is stuck, end it (its lock goes with it)"
                    )
        lock.seek(0)
        lock.truncate()
        lock.write(f"process {os.getpid()} on {os.uname().nodename}")
        lock.flush()
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def partial_size(final: Path) -> int:
    """What the writers of the store at `final` have written so far."""
    return sum(size_on_disk(partial) for partial in final.parent.glob(f"{final.name}.partial-*"))


def locked_within(lock: Any, seconds: float) -> bool:
    """Whether this process got the lock on the open file `lock` within `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


class Documents:
    """The tokenized documents, each read from the file when asked for: memory holds the groups being packed, not
    the pages of a mapping that grows with what has been read."""

    def __init__(self, path: Path):
        import numpy as np

        self.meta = json.loads((path / "meta.json").read_text())
        self.dtype = np.dtype(self.meta["dtype"])
        self.path = path / "tokens.bin"
        self.lengths = np.load(path / "lengths.npy")
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        self.trained = path / "trained.bin" if (path / "trained.bin").exists() else None

    def __len__(self) -> int:
        return len(self.lengths)

    def group(self, indices: np.ndarray) -> tuple[list[np.ndarray], Optional[list[np.ndarray]]]:
        """The documents at `indices`, and (examples) their masks."""
        import numpy as np

        documents = self.read(self.path, indices, self.dtype)
        return documents, None if self.trained is None else self.read(self.trained, indices, np.dtype(np.uint8))

    def read(self, path: Path, indices: np.ndarray, dtype: np.dtype) -> list[np.ndarray]:
        import numpy as np

        with open(path, "rb") as file:
            return [
                np.frombuffer(
                    os.pread(
                        file.fileno(), int(self.lengths[i]) * dtype.itemsize, int(self.offsets[i]) * dtype.itemsize
                    ),
                    dtype=dtype,
                )
                for i in indices
            ]
