"""Tokenizing: every document once, on `data.num_proc` processes, into the token store's document arrays.

Each process reads and tokenizes whole work items (runner/data/read.py) and hands back numpy arrays; this process
appends them to the store's files in the items' order, so that the tokens are the same whatever the number of
processes, and memory holds a few items at a time, whatever the corpus's size.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple, Optional

from runner.data.chat import ChatRenderer, chat_template, conversation, template_or_none
from runner.data.preference import PairEncoder, pair
from runner.data.read import HUB_ROWS, WorkItem, error_source, fields, read_item, read_records, values, work_items
from runner.errors import WorkerFailed

if TYPE_CHECKING:
    from pathlib import Path

    import numpy as np
    from transformers import PreTrainedTokenizerBase

    from runner.config.data import DataConfig

log = logging.getLogger("runner")
# The longest a tokenizing process may take over one work item (ITEM_BYTES of text: seconds) before the job ends.
STALL_S = 600


class Encoded(NamedTuple):
    """A work item's documents: their tokens one after another, each one's length and (examples: instruction pairs
    and conversations) each token's mask, 1 where it trains."""

    tokens: np.ndarray
    lengths: np.ndarray
    trained: Optional[np.ndarray]
    size: int


class Encoder:
    """Reads a work item and tokenizes its documents: text with the tokenizer's end-of-sequence token after each
    document; instruction data as prompt, response and end-of-sequence token, the response and the end trained;
    conversations with the chat template (runner/data/chat.py), the turns of data.train_on trained; preference
    pairs as two sequences, the chosen and the rejected (runner/data/preference.py)."""

    def __init__(self, data: DataConfig, tokenizer: PreTrainedTokenizerBase, dtype: Any):
        from runner.config.data import DataFormat

        self.fields = fields(data)
        self.chat_format = data.chat_format.value
        self.chat = (
            ChatRenderer(tokenizer, chat_template(data, tokenizer), data.train_on.value)
            if data.format is DataFormat.chat
            else None
        )
        self.pairs = (
            PairEncoder(tokenizer, template_or_none(data, tokenizer), self.ids)
            if data.format is DataFormat.preference
            else None
        )
        self.pair_fields = (data.prompt_field, data.chosen_field, data.rejected_field)
        self.source = error_source(data)
        self.tokenizer = tokenizer
        self.dtype = dtype

    def __call__(self, item: WorkItem) -> Encoded:
        if item.kind == "text":
            return self.encode(read_item(item, self.fields, self.source), item.size)
        return self.encode_records(read_records(item, self.source), item.size)

    def encode_records(self, records: list[tuple[Any, str]], size: int = 0) -> Encoded:
        """Records, each with where it was read (a file and line), as the data's format reads them."""
        if self.chat is None and self.pairs is None:
            return self.encode([values(record, self.fields, self.source, where) for record, where in records], size)
        size = size or sum(len(json.dumps(record, default=str)) for record, _ in records)
        if self.pairs is not None:
            encoded = [
                sequence
                for record, where in records
                for sequence in self.pairs(pair(record, self.pair_fields, self.source, where), self.source, where)
            ]
        else:
            encoded = [
                self.chat(conversation(record, self.chat_format, self.source, where), self.source, where)
                for record, where in records
            ]
        return self.encoded([ids for ids, _ in encoded], [mask for _, mask in encoded], size)

    def encode(self, documents: list[tuple[str, ...]], size: int = 0) -> Encoded:
        """Documents, each the tuple of its fields' strings; `size`: their bytes, where known."""
        eos = self.tokenizer.eos_token_id
        columns = [self.ids([document[i] for document in documents]) for i in range(len(self.fields))]
        size = size or sum(len(text.encode()) for document in documents for text in document)
        if len(columns) == 2:
            prompts, responses = columns
            return self.encoded(
                [prompt + response + [eos] for prompt, response in zip(prompts, responses)],
                [[0] * len(prompt) + [1] * (len(response) + 1) for prompt, response in zip(prompts, responses)],
                size,
            )
        return self.encoded([ids + [eos] for ids in columns[0]], None, size)

    def encoded(self, sequences: list[list[int]], masks: Optional[list[list[int]]], size: int) -> Encoded:
        import numpy as np

        lengths = np.array([len(ids) for ids in sequences], dtype=np.int64)
        count = int(lengths.sum())
        tokens = (
            np.concatenate([np.array(ids, dtype=self.dtype) for ids in sequences])
            if sequences
            else np.zeros(0, self.dtype)
        )
        trained = (
            None if masks is None else np.fromiter((bit for mask in masks for bit in mask), dtype=np.uint8, count=count)
        )
        return Encoded(tokens, lengths, trained, size)

    def ids(self, texts: list[str]) -> list[list[int]]:
        """The texts' token ids, as tokenizer(texts, add_special_tokens=False) gives them. A fast tokenizer's own
        encode_batch_fast, which works out no character offsets, is 4x as fast (byte-level BPE, 1 MB documents)."""
        if not texts:
            return []
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and hasattr(backend, "encode_batch_fast"):
            return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=False)]
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]


ENCODER: Optional[Encoder] = None  # a tokenizing process's own
PR_SET_PDEATHSIG = 1  # prctl(2)'s option for the signal a process gets when its parent ends


def start_worker(parent: int, state: bytes) -> None:
    """`state`: the encoder and the hub datasets, pickled, so that reading them (importing transformers: seconds)
    comes after this process has tied its end to its parent's."""
    import ctypes
    import pickle
    import signal

    # A process whose `run` has ended (killed, Ctrl-C) ends with it, rather than tokenizing on for no one.
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it ended while this process was starting
        os._exit(1)
    global ENCODER
    ENCODER, hub_rows = pickle.loads(state)
    HUB_ROWS.update(hub_rows)  # a hub dataset pickles as its memory-mapped cache files
    # Each process is one core: the tokenizer's own threads would only compete with the other processes.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def encode_in_worker(item: WorkItem) -> Encoded:
    return ENCODER(item)


def encoded_items(data: DataConfig, encoder: Encoder, num_proc: int) -> Iterator[Encoded]:
    """The work items' tokens in the items' order: tokenized here on one process, else by `num_proc` new ones
    (spawned: a process forked from this one, whose libraries run threads, could deadlock). At most two items a
    process are in flight, so that memory holds a few items whatever the corpus. A process that dies ends the job
    with one line, and so does one that finishes no item in STALL_S seconds."""
    items = work_items(data)
    if num_proc == 1:
        yield from map(encoder, items)
        return
    import multiprocessing
    import pickle
    from collections import deque
    from concurrent.futures import ProcessPoolExecutor, TimeoutError
    from concurrent.futures.process import BrokenProcessPool

    pool = ProcessPoolExecutor(
        num_proc,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=start_worker,
        initargs=(os.getpid(), pickle.dumps((encoder, HUB_ROWS))),
    )
    pending: deque = deque()
    try:
        for item in items:
            pending.append(pool.submit(encode_in_worker, item))
            if len(pending) >= 2 * num_proc:
                yield pending.popleft().result(timeout=STALL_S)
        while pending:
            yield pending.popleft().result(timeout=STALL_S)
    except BrokenProcessPool:
        raise WorkerFailed(
            f"a tokenizing process died (killed, or out of memory?); try fewer data.num_proc than {num_proc}"
        ) from None
    except TimeoutError:
        raise WorkerFailed(f"tokenizing stalled: no work item finished in {STALL_S} s") from None
    finally:
        # Not shutdown(wait=True): a stalled process would keep this one waiting. Python 3.11 has no public way to
        # end the pool's processes.
        processes = list((pool._processes or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.kill()
            process.join()


def tokenize_documents(
    data: DataConfig, tokenizer: PreTrainedTokenizerBase, num_proc: int, into: Path, total_bytes: int
) -> dict[str, int]:
    """Writes the documents' tokens to `into` (tokens.bin, lengths.npy; examples: trained.bin, each token's mask);
    returns their counts."""
    import numpy as np

    dtype = token_dtype(tokenizer)
    encoder = Encoder(data, tokenizer, dtype)
    lengths: list[np.ndarray] = []
    progress = Progress(total_bytes, num_proc)
    with open(into / "tokens.bin", "wb") as tokens, open(into / "trained.bin", "wb") as trained:
        for encoded in encoded_items(data, encoder, num_proc):
            tokens.write(encoded.tokens.tobytes())
            if encoded.trained is not None:
                trained.write(encoded.trained.tobytes())
            lengths.append(encoded.lengths)
            progress.advance(encoded.size, int(encoded.lengths.sum()))
    progress.close()
    if data.format.value == "text":
        (into / "trained.bin").unlink()
    np.save(into / "lengths.npy", np.concatenate(lengths) if lengths else np.zeros(0, np.int64))
    return {"documents": sum(len(part) for part in lengths), "tokens": progress.tokens, "bytes": progress.done}


def token_dtype(tokenizer: PreTrainedTokenizerBase) -> Any:
    """uint16 where every token id fits, uint32 otherwise."""
    import numpy as np

    return np.uint16 if len(tokenizer) <= 1 << 16 else np.uint32


class Progress:
    """Tokenizing's progress, MB/s and time left: a bar on a terminal, a log line every 30 s elsewhere."""

    def __init__(self, total_bytes: int, num_proc: int):
        self.total, self.done, self.tokens = total_bytes, 0, 0
        self.started = self.logged = time.monotonic()
        log.info(
            "tokenizing %s on %d process(es), once: later runs read the token store", amount(total_bytes), num_proc
        )
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", leave=False)

    def advance(self, size: int, tokens: int) -> None:
        self.done += size
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(size)
        elif time.monotonic() - self.logged >= 30:
            self.logged = time.monotonic()
            log.info("tokenizing: %s", self.rate())

    def rate(self) -> str:
        seconds = max(time.monotonic() - self.started, 1e-6)
        speed = self.done / seconds
        left = (self.total - self.done) / speed if speed and self.total > self.done else 0
        return (
            f"{amount(self.done)} of {amount(self.total)}, {speed / 1e6:.1f} MB/s, {self.tokens:,} tokens, "
            f"{left:.0f} s left"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        log.info(
            "tokenized %s (%s tokens) in %.1f s", amount(self.done), f"{self.tokens:,}", time.monotonic() - self.started
        )


def amount(size: int) -> str:
    return f"{size / 1e6:,.1f} MB" if size >= 100_000 else f"{size / 1e3:,.1f} kB"
