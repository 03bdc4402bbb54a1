"""The `data` group: documents read through `datasets`, tokenized, split, and served to each rank.

Plain text is cut into fixed-length blocks. Instruction data (prompt/response pairs) keeps one example per row,
padded to the longest row of its batch, and trains on the response tokens only: prompt positions carry the label
IGNORE.

With `packing`, each row of seq_len tokens holds several documents or examples, each with its own positions
(restarting at 0) and attending only to itself: the rows carry position_ids and no attention mask, and the
model's attention confines each token to its segment (on GPUs transformers' block-diagonal mask under sdpa, or
variable-length kernels under flash and flex attention; on the CPU runner/engine/attention.py, one example at a
time). A segment's first token is not predicted, so each
example's loss is the one it has alone in a row.

Every row stores its token and label counts, so that a step knows its global batch's counts without asking the
other ranks.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

from runner.errors import SpecError, require
from runner.files import absolute_path

if TYPE_CHECKING:
    import datasets
    import torch
    from transformers import PreTrainedTokenizerBase

IGNORE = -100
Batch = dict[str, "torch.Tensor"]  # the model's inputs and the labels


class DataFormat(str, Enum):
    text = "text"
    instruction = "instruction"


@dataclass
class DataConfig:
    # A local file, directory or glob (plain text, .json/.jsonl or .parquet) ...
    files: Optional[str] = None
    # ... or a dataset name on the hub, read with datasets.load_dataset.
    hub_dataset: Optional[str] = None
    hub_split: str = "train"
    format: DataFormat = DataFormat.text
    text_field: str = "text"
    prompt_field: str = "prompt"
    response_field: str = "response"
    seq_len: int = 256
    # Share of the documents held out for evaluation.
    eval_fraction: float = 0.05
    # Several documents or examples per row, each attending only to itself (see above); no padding to train on.
    packing: bool = False


BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def check(data: DataConfig) -> None:
    require(bool(data.files) != bool(data.hub_dataset),
            "set exactly one of data.files (a local file, directory or glob) and data.hub_dataset (a hub name)")
    require(data.seq_len >= 2, f"data.seq_len={data.seq_len} must be at least 2")
    require(0 < data.eval_fraction < 1, f"data.eval_fraction={data.eval_fraction} must be between 0 and 1")
    if data.files:
        files = resolve_files(data.files)
        require(bool(files), f"data.files={data.files} matches no file; give an existing file, directory or glob")
        kinds = {BUILDERS.get(os.path.splitext(f)[1].lower(), "text") for f in files}
        require(len(kinds) == 1, f"data.files={data.files} mixes file kinds ({', '.join(sorted(kinds))}); pick one")


def with_absolute_paths(data: DataConfig, base: Path) -> DataConfig:
    """`data.files` as an absolute path or pattern from `base`: the spec then means the same from any directory."""
    return replace(data, files=absolute_path(data.files, base))


def resolve_files(pattern: str) -> list[str]:
    """The files a `data.files` value names, sorted so that every rank and every run sees the same order."""
    pattern = os.path.expanduser(pattern)
    if os.path.isdir(pattern):
        pattern = os.path.join(pattern, "**", "*")
    return sorted(path for path in glob.glob(pattern, recursive=True) if os.path.isfile(path))


def load_documents(data: DataConfig) -> datasets.Dataset:
    """The documents, checked for the columns the format reads; unreadable data is a SpecError naming the key."""
    source = f"data.hub_dataset={data.hub_dataset}" if data.hub_dataset else f"data.files={data.files}"
    try:
        documents = _read(data)
    except Exception as error:  # datasets raises many kinds for unreadable or unreachable data
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SpecError(f"{source} could not be read: {first_line}") from error
    if data.format is DataFormat.text:
        needed = {"text_field": data.text_field}
    else:
        needed = {"prompt_field": data.prompt_field, "response_field": data.response_field}
    for key, column in needed.items():
        if column not in documents.column_names:
            raise SpecError(
                f"{source} has no column '{column}' (it has: {', '.join(documents.column_names)}); set data.{key}"
            )
    if len(documents) < 2:
        raise SpecError(f"{source} holds {len(documents)} document(s); training and evaluation need at least 2")
    return documents


def _read(data: DataConfig) -> datasets.Dataset:
    import datasets

    if data.hub_dataset:
        return datasets.load_dataset(data.hub_dataset, split=data.hub_split)
    files = resolve_files(data.files)
    builder = BUILDERS.get(os.path.splitext(files[0])[1].lower(), "text")
    if builder == "text":
        # One document per file, in the column the text format reads.
        documents = datasets.load_dataset("text", data_files=files, split="train", sample_by="document")
        return documents.rename_column("text", data.text_field) if data.text_field != "text" else documents
    return datasets.load_dataset(builder, data_files=files, split="train")


def build_datasets(
    data: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Tokenized train and eval splits; the eval split holds whole documents the model never trains on."""
    documents = load_documents(data)
    n_eval = max(1, round(len(documents) * data.eval_fraction))
    splits = documents.train_test_split(test_size=n_eval, shuffle=True, seed=seed)
    if data.format is DataFormat.text:
        encode = _text_blocks(data, tokenizer)
    else:
        encode = _instruction_rows(data, tokenizer)
    return tuple(
        split.map(encode, batched=True, remove_columns=split.column_names) for split in (splits["train"], splits["test"])
    )


Segment = tuple[list[int], list[int]]  # one document's or example's input ids and labels


def _text_blocks(data: DataConfig, tokenizer: PreTrainedTokenizerBase):
    def encode(batch: dict[str, list[Any]]) -> dict[str, list]:
        documents = [ids + [tokenizer.eos_token_id]
                     for ids in tokenizer(batch[data.text_field], add_special_tokens=False)["input_ids"]]
        if data.packing:
            return _rows(_cut_into_rows(documents, data.seq_len), packed=True)
        stream = [token for document in documents for token in document]
        usable = len(stream) // data.seq_len * data.seq_len
        blocks = [stream[i : i + data.seq_len] for i in range(0, usable, data.seq_len)]
        return _rows([[(block, block)] for block in blocks], packed=False)

    return encode


def _instruction_rows(data: DataConfig, tokenizer: PreTrainedTokenizerBase):
    def encode(batch: dict[str, list[Any]]) -> dict[str, list]:
        prompts = tokenizer(batch[data.prompt_field], add_special_tokens=False)["input_ids"]
        responses = tokenizer(batch[data.response_field], add_special_tokens=False)["input_ids"]
        examples: list[Segment] = []
        for prompt, response in zip(prompts, responses):
            response = response + [tokenizer.eos_token_id]
            labels = ([IGNORE] * len(prompt) + response)[: data.seq_len]
            if all(label == IGNORE for label in labels[1:]):
                continue  # the prompt alone fills the sequence: nothing to learn from this row
            examples.append(((prompt + response)[: data.seq_len], labels))
        if data.packing:
            return _rows(_fill_rows(examples, data.seq_len), packed=True)
        return _rows([[example] for example in examples], packed=False)

    return encode


def _cut_into_rows(documents: list[list[int]], seq_len: int) -> list[list[Segment]]:
    """The documents one after another, cut every seq_len tokens; a document cut at a row's end goes on as the
    next row's first segment."""
    rows: list[list[Segment]] = [[]]
    room = seq_len
    for document in documents:
        while document:
            piece, document = document[:room], document[room:]
            rows[-1].append((piece, piece))
            room -= len(piece)
            if room == 0:
                rows.append([])
                room = seq_len
    return [row for row in rows if sum(len(ids) for ids, _ in row) == seq_len]  # the last, partial row is left out


def _fill_rows(examples: list[Segment], seq_len: int) -> list[list[Segment]]:
    """Whole examples in their order, as many to a row as fit in seq_len tokens."""
    rows: list[list[Segment]] = []
    used = seq_len
    for example in examples:
        if used + len(example[0]) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(example)
        used += len(example[0])
    return rows


def _rows(rows: list[list[Segment]], packed: bool) -> dict[str, list]:
    """The dataset's columns for rows of segments: input ids, labels (a packed segment's first token is not
    predicted: nothing before it in its segment), position ids when packed, and each row's counts."""
    columns: dict[str, list] = {"input_ids": [], "labels": [], "tokens": [], "label_tokens": []}
    if packed:
        columns["position_ids"] = []
    for segments in rows:
        ids = [token for segment_ids, _ in segments for token in segment_ids]
        labels = [label for _, segment_labels in segments
                  for label in ([IGNORE, *segment_labels[1:]] if packed else segment_labels)]
        columns["input_ids"].append(ids)
        columns["labels"].append(labels)
        columns["tokens"].append(len(ids))
        columns["label_tokens"].append(sum(label != IGNORE for label in labels[1:]))
        if packed:
            columns["position_ids"].append([position for segment_ids, _ in segments
                                            for position in range(len(segment_ids))])
    return columns


@dataclass
class MicroBatch:
    inputs: Batch  # the forward's: input_ids, with attention_mask (padded rows) or position_ids (packed rows)
    labels: torch.Tensor
    tokens: int  # its tokens, padding aside
    label_tokens: int  # its predicted labels: every label but each row's (and packed segment's) first, not IGNORE

    def to(self, device: torch.device) -> MicroBatch:
        return replace(self, inputs={k: v.to(device) for k, v in self.inputs.items()}, labels=self.labels.to(device))


@dataclass
class GlobalBatch:
    """This rank's micro batches of one optimizer step, and the counts of the whole global batch (every rank's),
    read from the rows: nothing to sum across ranks before the forward."""

    micro_batches: list[MicroBatch]
    tokens: int
    label_tokens: int


def collate(rows: dict[str, list], pad_token_id: int) -> MicroBatch:
    """Right-pads a batch to its longest row; padding carries the label IGNORE. Padded rows mask it out with an
    attention mask; packed rows make it a segment of its own, so that no real token attends to it."""
    import torch

    length = max(len(ids) for ids in rows["input_ids"])

    def padded(seqs: list[list[int]], value: int) -> torch.Tensor:
        return torch.tensor([seq + [value] * (length - len(seq)) for seq in seqs])

    inputs = {"input_ids": padded(rows["input_ids"], pad_token_id)}
    if "position_ids" in rows:
        inputs["position_ids"] = torch.tensor([positions + list(range(length - len(positions)))
                                               for positions in rows["position_ids"]])
    else:
        inputs["attention_mask"] = padded([[1] * len(ids) for ids in rows["input_ids"]], 0)
    return MicroBatch(inputs, padded(rows["labels"], IGNORE), sum(rows["tokens"]), sum(rows["label_tokens"]))


def train_batches(
    dataset: datasets.Dataset,
    *,
    micro_batch_size: int,
    grad_accum_steps: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    pad_token_id: int,
    start_step: int = 0,
) -> Iterator[GlobalBatch]:
    """For each optimizer step after start_step, this rank's micro batches.

    Every epoch draws one seeded permutation of the rows and cuts it into global batches of
    micro_batch_size x dp_size x grad_accum_steps rows; rank r takes the r-th contiguous slice of each.
    The global batch of a step is therefore the same whatever the strategy and process count.
    """
    import torch

    per_rank = micro_batch_size * grad_accum_steps
    global_batch = per_rank * dp_size
    steps_per_epoch = len(dataset) // global_batch
    epoch, first = divmod(start_step, steps_per_epoch)
    counts = dataset.select_columns(["tokens", "label_tokens"])
    while True:
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        for start in range(first * global_batch, steps_per_epoch * global_batch, global_batch):
            everyone = counts[order[start : start + global_batch]]
            mine = order[start + dp_rank * per_rank : start + (dp_rank + 1) * per_rank]
            yield GlobalBatch(
                [collate(dataset[mine[i : i + micro_batch_size]], pad_token_id)
                 for i in range(0, per_rank, micro_batch_size)],
                tokens=sum(everyone["tokens"]), label_tokens=sum(everyone["label_tokens"]),
            )
        epoch, first = epoch + 1, 0


def eval_batches(
    dataset: datasets.Dataset, *, micro_batch_size: int, max_batches: int, dp_rank: int, dp_size: int, pad_token_id: int
) -> Iterator[MicroBatch]:
    """This rank's share of the first max_batches x micro_batch_size eval rows, in batches of micro_batch_size.

    The rows are the same whatever the number of ranks (rounded down to a multiple of it, so that every rank runs
    the same number of forward passes).
    """
    rows = min(len(dataset), max_batches * micro_batch_size) // dp_size * dp_size
    share = rows // dp_size
    first = dp_rank * share
    for start in range(first, first + share, micro_batch_size):
        yield collate(dataset[start : min(start + micro_batch_size, first + share)], pad_token_id)
