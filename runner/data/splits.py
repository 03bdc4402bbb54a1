"""The train and eval splits of a spec's data, from the token store: read → tokenize → pack → store, each stage
a module of this package, each done once for a given corpus, tokenizer and layout."""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING, Any

from runner.config.data import DataFormat, resolve_files
from runner.data.pack import group_rows, groups
from runner.data.preference import PairSet, prompts_fit
from runner.data.read import HUB_ROWS, error_source, record_where
from runner.data.rows import RowSet, RowStore, RowWriter
from runner.data.store import Documents, cache_dir, documents_key, ensure, rows_key
from runner.data.tokenize import token_dtype, tokenize_documents
from runner.errors import SpecError

# Below this much text, starting tokenizing processes (their imports: seconds) costs more than it saves.
PROCESSES_FROM_BYTES = 32 << 20

if TYPE_CHECKING:
    from pathlib import Path

    from transformers import PreTrainedTokenizerBase

    from runner.config.data import DataConfig


def token_splits(data: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> tuple[Any, Any]:
    """The train and eval rows (preference data: pairs of rows); the eval split holds whole documents (pairs) the
    model never trains on."""
    store = prepared_rows(data, tokenizer, seed)
    evals = store.meta["eval_rows"]
    train, evaluation = RowSet(store, evals, len(store.row_lengths)), RowSet(store, 0, evals)
    if data.format is DataFormat.preference:
        return PairSet(train), PairSet(evaluation)
    return train, evaluation


def prepared_rows(data: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> RowStore:
    """The row store of this data, tokenizer, layout and split, written first where no run has written it."""
    if data.hub_dataset and data.hub_dataset not in HUB_ROWS:
        HUB_ROWS[data.hub_dataset] = read_hub(data)
    root = cache_dir(data) / documents_key(data, tokenizer)
    documents = root / "documents"
    if not (documents / "meta.json").exists():
        check_room(data, tokenizer, root)
    ensure(
        documents,
        lambda partial: {
            **tokenize_documents(data, tokenizer, num_proc(data), partial, source_bytes(data)),
            "dtype": token_dtype(tokenizer).__name__,
        },
    )
    rows = root / f"rows-{rows_key(data, seed)}"
    ensure(rows, lambda partial: write_rows(Documents(documents), data, seed, partial))
    return RowStore(rows)


def write_rows(documents: Documents, data: DataConfig, seed: int, into: Path) -> dict[str, Any]:
    """The eval rows, then the train rows, of the records split with the seed: the eval records are the first
    round(eval_fraction x records) (at least one) of a seeded permutation, the train records the rest. A record is
    a document, or a preference pair's two documents."""
    import numpy as np

    per_record = 2 if data.format is DataFormat.preference else 1
    records = len(documents) // per_record
    if records < 2:
        source = f"data.hub_dataset={data.hub_dataset}" if data.hub_dataset else f"data.files={data.files}"
        raise SpecError(
            f"{source} holds {records} {'pair' if per_record == 2 else 'document'}(s); training and "
            "evaluation need at least 2"
        )
    evals = max(1, round(records * data.eval_fraction))
    order = np.random.default_rng(seed).permutation(records)
    record_lengths = documents.lengths.reshape(records, per_record).sum(1)
    writer = RowWriter(into, documents.dtype)
    rows_before, dropped = [], 0
    for split in (order[:evals], order[evals:]):
        rows_before.append(writer.rows)
        for group in groups(split, record_lengths):
            tokens, masks = documents.group((group[:, None] * per_record + np.arange(per_record)).ravel())
            if data.format is DataFormat.preference:
                fit = prompts_fit(masks, data.seq_len)
                if not all(fit) and not data.drop_long_prompts:
                    raise SpecError(
                        f"{error_source(data)}: {record_where(data, int(group[fit.index(False)]))}: its "
                        f"prompt fills data.seq_len={data.seq_len}, leaving no room for a response; raise "
                        "data.seq_len, shorten the prompt, or leave such pairs out with "
                        "data.drop_long_prompts=true"
                    )
                dropped += fit.count(False)
                tokens, masks = (
                    [part for i, part in enumerate(tokens) if fit[i // 2]],
                    [part for i, part in enumerate(masks) if fit[i // 2]],
                )
            if data.train_on.value == "last_assistant" and data.format.value == "chat":
                check_something_trains(data, group, masks)
            writer.add(group_rows(data, tokens, masks))
    writer.close()
    eval_rows = rows_before[1]
    meta = {
        "dtype": documents.dtype.name,
        "packing": data.packing,
        "eval_rows": eval_rows,
        "rows": writer.rows,
        "documents": len(documents),
    }
    if documents.trained is not None:  # examples: how many seq_len cuts
        meta["cut"] = int((documents.lengths > data.seq_len).sum())
    if per_record == 2:
        meta["dropped_pairs"] = dropped
    return meta


def check_something_trains(data: DataConfig, indices: Any, masks: list[Any]) -> None:
    """Under data.train_on=last_assistant, refuses a conversation whose last assistant turn starts past
    data.seq_len, which would train nothing, naming its file and line."""
    for index, mask in zip(indices, masks):
        if not mask[1 : data.seq_len].any():
            raise SpecError(
                f"{error_source(data)}: {record_where(data, int(index))}: "
                "its last assistant turn starts past "
                f"data.seq_len={data.seq_len}, so under data.train_on=last_assistant it trains nothing; "
                "raise data.seq_len, shorten the conversation or train on every assistant turn"
            )


def check_room(data: DataConfig, tokenizer: PreTrainedTokenizerBase, root: Path) -> None:
    """Refuses a corpus whose store may not fit in the free disk: its documents and one layout of rows, at most a
    token per byte of text (byte-level tokenizers; others make fewer)."""
    text = source_bytes(data)
    needed = 2 * text * token_dtype(tokenizer)().itemsize
    existing = next(directory for directory in (root, *root.parents) if directory.exists())
    free = shutil.disk_usage(existing).free
    if needed > free:
        raise SpecError(
            f"the token store of {text / 1e9:,.1f} GB of text needs up to "
            f"{needed / 1e9:,.1f} GB in {cache_dir(data)}, which has {free / 1e9:,.1f} GB free; free "
            "space there or set data.cache_dir to a larger disk"
        )


def num_proc(data: DataConfig) -> int:
    """data.num_proc; unset, every core for a corpus worth starting processes for, else this one."""
    if data.num_proc:
        return data.num_proc
    return len(os.sched_getaffinity(0)) if source_bytes(data) >= PROCESSES_FROM_BYTES else 1


def source_bytes(data: DataConfig) -> int:
    if data.hub_dataset:
        return HUB_ROWS[data.hub_dataset].data.nbytes
    return sum(os.path.getsize(path) for path in resolve_files(data.files))


def read_hub(data: DataConfig) -> Any:
    import datasets

    try:
        return datasets.load_dataset(data.hub_dataset, split=data.hub_split)
    except Exception as error:  # datasets raises many kinds for unreachable or unknown datasets
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SpecError(f"data.hub_dataset={data.hub_dataset} could not be read: {first_line}") from None
