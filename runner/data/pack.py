"""Packing: the tokenized documents into rows of at most seq_len tokens.

Plain text is cut into fixed-length blocks. Examples (instruction pairs, chat conversations) keep one example per
row, padded to the longest row of its batch, and train on the tokens their mask marks (a response, the
assistant's turns): the others carry the label IGNORE. Packed, the examples fill rows best-fit-decreasing.

With `packing`, each row of seq_len tokens holds several documents or examples, each with its own positions
(restarting at 0) and attending only to itself: the rows carry position_ids and no attention mask, and the
model's attention confines each token to its segment (on GPUs transformers' block-diagonal mask under sdpa, or
variable-length kernels under flash and flex attention; on the CPU runner/engine/attention.py, one example at a
time). A segment's first token is not predicted, so each example's loss is the one it has alone in a row.

A row is stored as its tokens, their mask (examples), and its segments, each segment a start and the number of its
first tokens that are not predicted (a packed segment's first token); labels and positions follow from them. Every
row stores its token and label counts, so that a step knows its global batch's counts without asking the other
ranks.

The documents go in groups of GROUP, or fewer where they hold GROUP_TOKENS tokens, in the split's order; a block
or a packed row never spans two groups. Memory holds a group at a time, whatever the corpus.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, NamedTuple, Optional

if TYPE_CHECKING:
    import numpy as np

    from runner.config.data import DataConfig

GROUP = 1000
GROUP_TOKENS = 1 << 24


def groups(order: np.ndarray, lengths: np.ndarray) -> Iterator[np.ndarray]:
    """`order` (document indices) cut into runs of at most GROUP documents and GROUP_TOKENS tokens (a longer
    document alone)."""
    start, tokens = 0, 0
    for end, index in enumerate(order):
        if end > start and (end - start == GROUP or tokens + lengths[index] > GROUP_TOKENS):
            yield order[start:end]
            start, tokens = end, 0
        tokens += int(lengths[index])
    if len(order) > start:
        yield order[start:]


class Rows(NamedTuple):
    """Rows of a group of documents: tokens one after another, each row's length, each row's segments (their
    starts in the row and how many of their first tokens are not predicted), predicted labels, and (examples) each
    token's mask: 1 where it trains."""

    tokens: np.ndarray
    row_lengths: np.ndarray
    segments_per_row: np.ndarray
    segment_starts: np.ndarray
    segment_ignored: np.ndarray
    label_tokens: np.ndarray
    trained: Optional[np.ndarray] = None


def text_rows(documents: list[np.ndarray], seq_len: int, packing: bool) -> Rows:
    """Documents one after another, cut every seq_len tokens; the last, partial row is left out. Packed, a
    document cut at a row's end goes on as the next row's first segment."""
    import numpy as np

    stream = np.concatenate(documents) if documents else np.zeros(0, np.int64)
    rows = len(stream) // seq_len
    usable = rows * seq_len
    row_starts = np.arange(0, usable, seq_len)
    if not packing:  # a block is one segment whose every token is predicted but the first
        return Rows(
            stream[:usable],
            np.full(rows, seq_len),
            np.ones(rows, np.int64),
            np.zeros(rows, np.int64),
            np.zeros(rows, np.int64),
            np.full(rows, seq_len - 1),
        )
    document_starts = np.cumsum([0] + [len(document) for document in documents[:-1]])
    starts = np.union1d(row_starts, document_starts[document_starts < usable])
    segments_per_row = np.bincount(starts // seq_len, minlength=rows)
    return Rows(
        stream[:usable],
        np.full(rows, seq_len),
        segments_per_row,
        starts % seq_len,
        np.ones(len(starts), np.int64),
        seq_len - segments_per_row,
    )


def example_rows(examples: list[np.ndarray], masks: list[np.ndarray], seq_len: int, packing: bool) -> Rows:
    """Each example cut to seq_len tokens; one that then has nothing to train on after its first token is left
    out. Packed, the examples go into rows best-fit-decreasing (best_fit_rows), each whole, with its first token
    not predicted: nothing before it in its segment."""
    import numpy as np

    kept = [(example[:seq_len], mask[:seq_len]) for example, mask in zip(examples, masks) if mask[1:seq_len].any()]
    if packing:
        rows = [[kept[i] for i in row] for row in best_fit_rows([len(example) for example, _ in kept], seq_len)]
    else:
        rows = [[example] for example in kept]
    lengths = [[len(example) for example, _ in row] for row in rows]
    segments = [example for row in rows for example in row]
    return Rows(
        np.concatenate([example for example, _ in segments]) if rows else np.zeros(0, np.int64),
        np.array([sum(row) for row in lengths], np.int64),
        np.array([len(row) for row in rows], np.int64),
        np.array([start for row in lengths for start in np.cumsum([0, *row[:-1]])], np.int64),
        np.full(len(segments), int(packing), np.int64),
        np.array([sum(int(mask[1:].sum()) for _, mask in row) for row in rows], np.int64),
        np.concatenate([mask for _, mask in segments]) if rows else np.zeros(0, np.uint8),
    )


def best_fit_rows(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Rows of at most seq_len tokens, as the indices of the examples each holds: the longest example first, each
    into the fullest row it fits in (best-fit-decreasing, as TRL's "bfd" packing; about 1 to 5% of the room is left,
    where packing in order leaves about a fifth). The rows come in the order of their first examples, which keep
    their order within a row: nothing depends on chance."""
    import bisect

    rows: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # (room left, row), the least room first
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: equal lengths in their order
        at = bisect.bisect_left(rooms, (lengths[i], -1))
        if at == len(rooms):
            rows.append([i])
            room, row = seq_len - lengths[i], len(rows) - 1
        else:
            room, row = rooms.pop(at)
            rows[row].append(i)
            room -= lengths[i]
        bisect.insort(rooms, (room, row))
    return sorted(sorted(row) for row in rows)


def group_rows(data: DataConfig, documents: list[np.ndarray], masks: Optional[list[np.ndarray]]) -> Rows:
    if masks is None:
        return text_rows(documents, data.seq_len, data.packing)
    return example_rows(documents, masks, data.seq_len, data.packing)
