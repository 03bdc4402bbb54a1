"""Reading: the documents of `data.files` or `data.hub_dataset`, in their order, as work items small enough to
describe in a few words (a list of files, a byte range of a JSON Lines file, a row group of a parquet file), which
each tokenizing process reads on its own. Bad input is named in one line: the file, the line, the field.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple

from runner.config.data import file_kind, resolve_files
from runner.errors import SpecError

if TYPE_CHECKING:
    import datasets

    from runner.config.data import DataConfig

# A work item holds about this much text: enough to keep a process busy for a while, little enough to bound its
# memory and to share the work evenly among the processes.
ITEM_BYTES = 1 << 20
# The hub datasets that work items' rows come from, by name: read once, handed to each tokenizing process.
HUB_ROWS: dict[str, datasets.Dataset] = {}


class WorkItem(NamedTuple):
    kind: str  # "text" (whole files, a document each), "jsonl" (a byte range), "json" (one array), "parquet", "hub"
    paths: tuple[str, ...]  # the text files, or the one file the item is part of
    start: int = 0  # jsonl: first byte and line number (1-based); parquet: row group; hub: first row
    end: int = 0  # jsonl: the byte after the range; hub: the row after the range
    first_line: int = 1
    size: int = 0  # bytes of text, for the progress


def work_items(data: DataConfig) -> Iterator[WorkItem]:
    """The data's documents as work items, in the order the documents come."""
    if data.hub_dataset:
        rows = HUB_ROWS[data.hub_dataset]
        for start in range(0, len(rows), 1000):
            yield WorkItem("hub", (data.hub_dataset,), start, min(start + 1000, len(rows)))
        return
    files = resolve_files(data.files)
    if file_kind(files[0]) == "text":
        batch: list[str] = []
        size = 0
        for path in files:
            batch.append(path)
            size += os.path.getsize(path)
            if size >= ITEM_BYTES:
                yield WorkItem("text", tuple(batch), size=size)
                batch, size = [], 0
        if batch:
            yield WorkItem("text", tuple(batch), size=size)
        return
    for path in files:
        if file_kind(path) == "parquet":
            import pyarrow.parquet as pq

            groups = pq.ParquetFile(path).metadata.num_row_groups
            size = os.path.getsize(path)
            yield from (WorkItem("parquet", (path,), group, size=size // groups) for group in range(groups))
        elif json_array(path):
            yield WorkItem("json", (path,), size=os.path.getsize(path))
        else:
            yield from jsonl_ranges(path)


def json_array(path: str) -> bool:
    """A .json file holds one JSON value (an array of records, or an object of columns) or JSON Lines: a first
    line that is not JSON on its own ("{" or "[" alone, pretty-printed) means one value."""
    with open(path, "rb") as file:
        first = file.readline().strip()
    if first.startswith(b"["):
        return True
    try:
        json.loads(first)
        return False
    except ValueError:
        return True


def jsonl_ranges(path: str) -> Iterator[WorkItem]:
    """Byte ranges of about ITEM_BYTES that end at a line's end, with the number of each range's first line."""
    size = os.path.getsize(path)
    line = 1
    with open(path, "rb") as file:
        start = 0
        while start < size:
            file.seek(start)
            block = file.read(ITEM_BYTES)
            cut = block.rfind(b"\n") + 1 if start + len(block) < size else len(block)
            if cut == 0:  # one line longer than the block: take the whole line
                rest = file.readline()
                block, cut = block + rest, len(block) + len(rest)
            yield WorkItem("jsonl", (path,), start, start + cut, line, cut)
            line += block.count(b"\n", 0, cut)
            start += cut


def read_item(item: WorkItem, fields: tuple[str, ...], source: str) -> list[tuple[str, ...]]:
    """The item's documents, each the tuple of its `fields`' strings."""
    if item.kind == "text":
        return [(read_text(path, source),) for path in item.paths]
    return [values(record, fields, source, where) for record, where in read_records(item, source)]


def read_records(item: WorkItem, source: str) -> list[tuple[Any, str]]:
    """The item's records (not of text files), each with where it was read: a file and its line, record or row."""
    if item.kind == "hub":
        rows = HUB_ROWS[item.paths[0]][item.start : item.end]
        return [(dict(zip(rows, row)), f"row {item.start + i}") for i, row in enumerate(zip(*rows.values()))]
    [path] = item.paths
    if item.kind == "parquet":
        import pyarrow.parquet as pq

        return [
            (record, f"{path} row {i}")
            for i, record in enumerate(pq.ParquetFile(path).read_row_group(item.start).to_pylist())
        ]
    if item.kind == "json":
        return [(record, f"{path} record {i}") for i, record in enumerate(load_json(path, source))]
    with open(path, "rb") as file:
        file.seek(item.start)
        block = file.read(item.end - item.start)
    records = []
    for number, line in enumerate(block.splitlines(), item.first_line):
        if not line.strip():
            continue
        try:
            records.append((json.loads(line), f"{path} line {number}"))
        except ValueError as error:
            raise SpecError(f"{source}: {path} line {number} is not valid JSON ({error})") from None
    return records


def error_source(data: DataConfig) -> str:
    """What a one-line error about the data's records starts with."""
    return f"data.hub_dataset={data.hub_dataset}" if data.hub_dataset else "data.files"


def fields(data: DataConfig) -> tuple[str, ...]:
    """The fields a text or instruction record's documents are read from."""
    if data.format.value == "instruction":
        return data.prompt_field, data.response_field
    return (data.text_field,)


def record_where(data: DataConfig, index: int) -> str:
    """Where the `index`-th record of the data was read (its file and line, record or row), read again to say so."""
    source = error_source(data)
    seen = 0
    for item in work_items(data):
        records = read_records(item, source)
        if index < seen + len(records):
            return records[index - seen][1]
        seen += len(records)
    return f"record {index}"


def read_text(path: str, source: str) -> str:
    with open(path, "rb") as file:
        raw = file.read()
    nul = raw.find(b"\0")
    if nul >= 0:
        raise SpecError(f"{source}: {path} is not text (a NUL byte at offset {nul}: a binary file?); leave it out")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise SpecError(
            f"{source}: {path} is not UTF-8 text (byte 0x{raw[error.start]:02x} at offset {error.start}); "
            "convert it to UTF-8 or leave it out"
        ) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")  # as text mode reads it


def load_json(path: str, source: str) -> list[Any]:
    try:
        with open(path, encoding="utf-8") as file:
            value = json.load(file)
    except (ValueError, UnicodeDecodeError) as error:
        raise SpecError(f"{source}: {path} is not valid JSON ({error})") from None
    if isinstance(value, dict):  # an object of columns
        if not all(isinstance(column, list) for column in value.values()):
            raise SpecError(f"{source}: {path} is a JSON object whose values are not all lists (columns)")
        return [dict(zip(value, row)) for row in zip(*value.values())]
    return value


def values(record: Any, fields: tuple[str, ...], source: str, where: str) -> tuple[str, ...]:
    if not isinstance(record, dict):
        raise SpecError(f"{source}: {where} is a JSON {type(record).__name__}, not an object of fields")
    check_columns(list(record), fields, source, where)
    found = tuple(record[field] for field in fields)
    for field, value in zip(fields, found):
        if not isinstance(value, str):
            raise SpecError(f"{source}: {where} has field '{field}' = {json.dumps(value)[:40]}, not a string")
    return found


def check_columns(names: list[str], fields: tuple[str, ...], source: str, where: str) -> None:
    for field in fields:
        if field not in names:
            key = "text_field" if len(fields) == 1 else ("prompt_field" if field == fields[0] else "response_field")
            raise SpecError(f"{source}: {where} has no field '{field}' (it has: {', '.join(names)}); set data.{key}")
