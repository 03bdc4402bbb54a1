"""Streaming (data.streaming): documents read through datasets' IterableDataset and tokenized as training goes,
for a corpus that need not fit on the disk, or a hub dataset read without downloading it whole.

Each data-parallel rank reads its own shard: datasets' split_dataset_by_node gives it whole files where their
number divides by the ranks, else every n-th document. Of its shard, every k-th document (k = 1 / eval_fraction,
held_out_every) is held out for evaluation and the others train. The training documents go in chunks of GROUP, or
fewer that hold GROUP_TOKENS bytes of text, each tokenized (one chunk ahead, in a thread) and packed as the token
store packs a group (runner/data/pack.py); a chunk's rows are taken in a seeded order, and the shard starts again,
epoch after epoch.

A rank's position in its stream (epoch, the chunk's first training document, rows taken from the chunk) is saved
with each checkpoint, so that a resumed run reads on from exactly there: it skips the documents before the chunk
without tokenizing them. The
global batch is micro_batch_size x ranks x grad_accum_steps rows, as from the store, but its rows depend on how
many ranks read the stream; a strategy swapped at the same number of ranks trains on the same rows.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional

from runner.config.data import DataFormat, file_kind, resolve_files
from runner.data.chat import conversation
from runner.data.pack import GROUP, GROUP_TOKENS, group_rows
from runner.data.prefetch import ahead
from runner.data.read import fields, read_item, read_records, values, work_items
from runner.data.rows import HeldRows, RowList
from runner.data.tokenize import Encoder, token_dtype
from runner.errors import SpecError, WorkerFailed

if TYPE_CHECKING:
    import datasets
    import numpy as np
    from transformers import PreTrainedTokenizerBase

    from runner.config.data import DataConfig


@dataclass(frozen=True)
class StreamPosition:
    """Where a rank's stream goes on: the `rows`-th row (in the chunk's order) of the chunk that starts at training
    document `document` of its shard, in epoch `epoch`."""

    epoch: int = 0
    document: int = 0
    rows: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


# The hub client's own time limit for a request (huggingface_hub's DEFAULT_REQUEST_TIMEOUT).
HUB_WAIT_S = 10.0


def held_out_every(data: DataConfig) -> int:
    return max(2, round(1 / data.eval_fraction))


def source_name(data: DataConfig) -> str:
    return f"data.hub_dataset={data.hub_dataset}" if data.hub_dataset else f"data.files={data.files}"


def open_stream(data: DataConfig) -> datasets.IterableDataset:
    """The data's documents as datasets' IterableDataset; an unreachable source is refused in one line."""
    import datasets

    try:
        if data.hub_dataset:
            return datasets.load_dataset(data.hub_dataset, split=data.hub_split, streaming=True)
        files = resolve_files(data.files)
        kind = file_kind(files[0])
        options = {"sample_by": "document", "keep_linebreaks": True} if kind == "text" else {}
        return datasets.load_dataset(kind, data_files=files, split="train", streaming=True, **options)
    except Exception as error:  # datasets raises many kinds for unreachable or unknown datasets
        raise SpecError(f"{source_name(data)} could not be streamed: {first_line(error)}") from None


def first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def check_stream(data: DataConfig) -> None:
    """Before launch: the source streams, and its first document is one of the format's."""
    if data.hub_dataset and (reason := hub_unreachable()):
        raise SpecError(f"{source_name(data)} could not be streamed: {reason}")
    first = next(shard(data, rank=0, size=1), None)
    if first is None:
        raise SpecError(f"{source_name(data)} holds no document")
    record, where = first
    if data.format is DataFormat.chat:
        conversation(record, data.chat_format.value, source_name(data), where)
    else:
        values(record, fields(data), source_name(data), where)


def hub_unreachable() -> Optional[str]:
    """Why the hub's host cannot be reached (its name does not resolve, it refuses or drops the connection), asked
    before launch within HUB_WAIT_S; None when it can, or when only the hub client can tell: through a proxy, or
    offline (HF_HUB_OFFLINE), where datasets refuses at once. Unasked, huggingface_hub retries such a failure five
    times over 23 s, a warning each, before datasets gives up. Only before launch: a running stream keeps the
    client's retries for a moment's fault."""
    import socket
    import urllib.request
    from urllib.parse import urlsplit

    import datasets

    endpoint = urlsplit(datasets.config.HF_ENDPOINT)
    proxies = urllib.request.getproxies()
    if datasets.config.HF_HUB_OFFLINE or proxies.get(endpoint.scheme) or proxies.get("all") or not endpoint.hostname:
        return None
    try:
        socket.create_connection(
            (endpoint.hostname, endpoint.port or (443 if endpoint.scheme == "https" else 80)), timeout=HUB_WAIT_S
        ).close()
    except OSError as error:
        return f"{endpoint.hostname} cannot be reached ({error.strerror or f'no answer within {HUB_WAIT_S:g} s'})"
    return None


def shard(data: DataConfig, rank: int, size: int) -> Iterator[tuple[Any, str]]:
    """This rank's records, in their order, each with where it was read."""
    from datasets.distributed import split_dataset_by_node

    stream = split_dataset_by_node(open_stream(data), rank=rank, world_size=size)
    records = iter(stream)
    for index in itertools.count():
        try:
            record = next(records)
        except StopIteration:
            return
        except Exception as error:  # a file datasets cannot parse, met as the stream gets to it
            raise unreadable(data, rank, index, error) from None
        yield record, f"document {index} of rank {rank}'s shard"


def unreadable(data: DataConfig, rank: int, index: int, error: Exception) -> SpecError:
    """The one-line error of a source that datasets could not read: in local files, the file and line that the
    token store's reader (runner/data/read.py) finds at fault, which datasets' error does not name."""
    source = source_name(data)
    if data.files:
        try:
            for item in work_items(data):
                read_item(item, (), source) if item.kind == "text" else read_records(item, source)
        except SpecError as named:
            return named
    return SpecError(f"{source}: rank {rank}'s shard could not be read after {index} documents: {first_line(error)}")


class StreamedRows:
    """A rank's rows, read and tokenized from its shard as they are needed."""

    def __init__(self, data: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int, rank: int, size: int):
        self.data, self.seed, self.rank, self.size = data, seed, rank, size
        self.encoder = Encoder(data, tokenizer, token_dtype(tokenizer))
        self.every = held_out_every(data)

    def documents(self, held_out: bool) -> Iterator[tuple[Any, str]]:
        return (
            document
            for index, document in enumerate(shard(self.data, self.rank, self.size))
            if (index % self.every == 0) == held_out
        )

    def rows_of(self, documents: list[tuple[Any, str]]) -> HeldRows:
        encoded = self.encoder.encode_records(documents)
        ends = encoded.lengths.cumsum()
        split = [encoded.tokens[end - length : end] for end, length in zip(ends, encoded.lengths)]
        masks = (
            None
            if encoded.trained is None
            else [encoded.trained[end - length : end] for end, length in zip(ends, encoded.lengths)]
        )
        return HeldRows(group_rows(self.data, split, masks), self.data.packing)

    def eval_rows(self, count: int) -> RowList:
        """The first `count` rows of this rank's held-out documents."""
        rows = RowList()
        chunks = self.chunked(self.documents(held_out=True))
        while len(rows) < count:
            chunk = next(chunks, None)
            if chunk is None:
                raise SpecError(
                    f"rank {self.rank}'s shard of {source_name(self.data)} holds {len(rows)} eval rows, "
                    f"fewer than its share of {count}; lower train.eval_batches or raise "
                    "data.eval_fraction"
                )
            held = self.rows_of(chunk)
            rows.extend(held.row(i) for i in range(min(len(held), count - len(rows))))
        return rows

    @staticmethod
    def chunked(documents: Iterator[tuple[Any, str]]) -> Iterator[list[tuple[Any, str]]]:
        """The documents in runs of GROUP, or fewer that hold about GROUP_TOKENS bytes (a longer one alone)."""
        chunk: list[tuple[Any, str]] = []
        size = 0
        for document in documents:
            length = len(json.dumps(document[0], default=str))
            if chunk and (len(chunk) == GROUP or size + length > GROUP_TOKENS):
                yield chunk
                chunk, size = [], 0
            chunk.append(document)
            size += length
        if chunk:
            yield chunk

    def chunks(self, start: StreamPosition) -> Iterator[tuple[int, int, HeldRows, np.ndarray]]:
        """(epoch, the chunk's first document, its rows, their seeded order) from `start` on, for ever."""
        import numpy as np

        for epoch in itertools.count(start.epoch):
            first = start.document if epoch == start.epoch else 0
            resumed_mid_epoch = first > 0
            documents = itertools.islice(self.documents(held_out=False), first, None)
            rows_in_epoch = 0
            for group in self.chunked(documents):
                rows = self.rows_of(group)
                rows_in_epoch += len(rows)
                order = np.random.default_rng([self.seed, epoch, first]).permutation(len(rows))
                yield epoch, first, rows, order
                first += len(group)
            if not rows_in_epoch and not resumed_mid_epoch:
                raise WorkerFailed(
                    f"rank {self.rank}'s shard of {source_name(self.data)} holds no training row of "
                    f"data.seq_len={self.data.seq_len} tokens"
                )

    def rows(self, start: StreamPosition) -> Iterator[tuple[dict[str, Any], StreamPosition]]:
        """Each row from `start` on, with the position after it; the next chunk is tokenized while this one trains."""
        for epoch, first, rows, order in ahead(self.chunks(start), name="documents"):
            skip = start.rows if (epoch, first) == (start.epoch, start.document) else 0
            for taken in range(skip, len(rows)):
                yield rows.row(order[taken]), StreamPosition(epoch, first, taken + 1)


def position_of(saved: Optional[dict[str, int]]) -> StreamPosition:
    return StreamPosition(**saved) if saved else StreamPosition()
