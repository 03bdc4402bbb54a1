"""The rows of a token store (runner/data/pack.py's layout), memory-mapped: the eval rows, then the train rows;
tokens.bin, trained.bin (examples: each token's mask), and each row's and segment's arrays."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

if TYPE_CHECKING:
    import numpy as np

    from runner.data.pack import Rows

IGNORE = -100
ARRAYS = ("row_lengths", "segments_per_row", "segment_starts", "segment_ignored", "label_tokens")


class RowWriter:
    """Appends groups of rows to a store's files."""

    def __init__(self, path: Path, dtype: Any):
        self.path = path
        self.tokens = open(path / "tokens.bin", "wb")
        self.trained = open(path / "trained.bin", "wb")
        self.dtype = dtype
        self.parts: dict[str, list[np.ndarray]] = {name: [] for name in ARRAYS}
        self.rows = 0

    def add(self, rows: Rows) -> None:
        self.tokens.write(rows.tokens.astype(self.dtype).tobytes())
        if rows.trained is not None:
            self.trained.write(rows.trained.astype("uint8").tobytes())
        for name in ARRAYS:
            self.parts[name].append(getattr(rows, name))
        self.rows += len(rows.row_lengths)

    def close(self) -> None:
        import numpy as np

        self.tokens.close()
        self.trained.close()
        if not (self.path / "trained.bin").stat().st_size:  # text: every token trains
            (self.path / "trained.bin").unlink()
        for name, parts in self.parts.items():
            np.save(
                self.path / f"{name}.npy", np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
            )


class RowStore:
    """A store's rows: each row's tokens, labels and (packed) positions, computed from its segments when read."""

    def __init__(self, path: Path):
        import numpy as np

        self.path = path
        self.meta = json.loads((path / "meta.json").read_text())
        self.tokens = np.memmap(path / "tokens.bin", dtype=self.meta["dtype"], mode="r")
        trained = path / "trained.bin"
        self.trained = np.memmap(trained, dtype=np.uint8, mode="r") if trained.exists() else None
        arrays = {name: np.load(path / f"{name}.npy", mmap_mode="r") for name in ARRAYS}
        self.row_lengths = arrays["row_lengths"]
        self.label_tokens = arrays["label_tokens"]
        self.row_offsets = np.concatenate([[0], np.cumsum(self.row_lengths)])
        self.segment_offsets = np.concatenate([[0], np.cumsum(arrays["segments_per_row"])])
        self.segment_starts = arrays["segment_starts"]
        self.segment_ignored = arrays["segment_ignored"]
        self.packed = bool(self.meta["packing"])

    def row(self, index: int) -> dict[str, Any]:
        first, last = self.segment_offsets[index], self.segment_offsets[index + 1]
        tokens = slice(self.row_offsets[index], self.row_offsets[index + 1])
        return row_inputs(
            self.tokens[tokens],
            None if self.trained is None else self.trained[tokens],
            self.segment_starts[first:last],
            self.segment_ignored[first:last],
            int(self.label_tokens[index]),
            self.packed,
        )


def row_inputs(
    tokens: np.ndarray,
    trained: Optional[np.ndarray],
    segment_starts: Any,
    segment_ignored: Any,
    label_tokens: int,
    packed: bool,
) -> dict[str, Any]:
    """A row's input_ids, labels and (packed) position_ids, from its tokens, their mask and its segments, with its
    counts."""
    import numpy as np

    ids = np.asarray(tokens, dtype=np.int64)
    labels = ids.copy()
    if trained is not None:
        labels[np.asarray(trained) == 0] = IGNORE
    starts = [*segment_starts, len(ids)]
    positions = np.empty_like(ids)
    for start, end, ignored in zip(starts, starts[1:], segment_ignored):
        labels[start : start + ignored] = IGNORE
        positions[start:end] = np.arange(end - start)
    row = {"input_ids": ids.tolist(), "labels": labels.tolist(), "tokens": len(ids), "label_tokens": label_tokens}
    if packed:
        row["position_ids"] = positions.tolist()
    return row


class HeldRows:
    """Rows held in memory (a chunk of a stream, runner/data/stream.py), each read as a store's row is."""

    def __init__(self, rows: Rows, packed: bool):
        import numpy as np

        self.rows, self.packed = rows, packed
        self.row_offsets = np.concatenate([[0], np.cumsum(rows.row_lengths)])
        self.segment_offsets = np.concatenate([[0], np.cumsum(rows.segments_per_row)])

    def __len__(self) -> int:
        return len(self.rows.row_lengths)

    def row(self, index: int) -> dict[str, Any]:
        first, last = self.segment_offsets[index], self.segment_offsets[index + 1]
        tokens = slice(self.row_offsets[index], self.row_offsets[index + 1])
        return row_inputs(
            self.rows.tokens[tokens],
            None if self.rows.trained is None else self.rows.trained[tokens],
            self.rows.segment_starts[first:last],
            self.rows.segment_ignored[first:last],
            int(self.rows.label_tokens[index]),
            self.packed,
        )


def columns(rows: list[dict[str, Any]]) -> dict[str, list]:
    """Rows, column by column."""
    return {key: [row[key] for row in rows] for key in rows[0]} if rows else {}


class RowSet:
    """Rows [start, stop) of a store: a split, or the whole store (the eval rows, then the train rows)."""

    def __init__(self, store: RowStore, start: int, stop: int):
        self.store, self.start, self.stop = store, start, stop
        self.tokens = store.row_lengths[start:stop]
        self.label_tokens = store.label_tokens[start:stop]

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.store.row(self.start + index)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[i] for i in range(len(self)))

    def batch(self, indices: Any) -> dict[str, list]:
        """The rows at `indices`, column by column."""
        return columns([self[int(i)] for i in indices])


class RowList(list):
    """Rows held in memory (a streamed run's eval rows), read by batch as a RowSet's are."""

    def batch(self, indices: Any) -> dict[str, list]:
        return columns([self[int(i)] for i in indices])
