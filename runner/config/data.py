"""The `data` group: where the documents are, how they become rows (runner/data/), and the checks that need no
tokenizer: one source, existing files of one kind, lengths and fractions in range."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Optional

from runner.config.fields import setting
from runner.errors import require
from runner.files.paths import absolute_path


class DataFormat(str, Enum):
    text = "text"
    instruction = "instruction"
    chat = "chat"
    # Preference pairs (runner/data/preference.py): a prompt, a chosen and a rejected response, for task=dpo.
    preference = "preference"
    # Prompts (runner/data/prompts.py) for task=grpo: records with a prompt (a text or a conversation) and the
    # fields the rewards read, or text files, a prompt per line.
    prompt = "prompt"


class ChatFormat(str, Enum):
    auto = "auto"  # from each record's keys
    messages = "messages"
    sharegpt = "sharegpt"
    alpaca = "alpaca"


class TrainOn(str, Enum):
    assistant = "assistant"
    last_assistant = "last_assistant"
    all = "all"


@dataclass
class DataConfig:
    files: Optional[str] = setting(
        None,
        "A local file, directory or glob (plain text, .json/.jsonl or .parquet); set it or hub_dataset.",
    )
    hub_dataset: Optional[str] = setting(
        None,
        "A dataset name on the hub, read with datasets.load_dataset; set it or files.",
    )
    hub_split: str = setting("train", "data.hub_dataset: the split read.")
    format: DataFormat = setting(
        DataFormat.text,
        "What a record holds: text (plain documents), instruction (a prompt and a response), chat (a conversation), "
        "preference (task=dpo's pairs) or prompt (task=grpo's prompts).",
    )
    text_field: str = setting(
        "text",
        "data.format=text, .json/.jsonl/.parquet or hub records: the field holding a document.",
    )
    prompt_field: str = setting(
        "prompt",
        "data.format=instruction, preference or prompt: the field holding the prompt.",
    )
    response_field: str = setting(
        "response",
        "data.format=instruction: the field holding the response, the only tokens that train.",
    )
    chosen_field: str = setting(
        "chosen",
        "Preference pairs: the chosen response's field (torchtune's stack_exchange_paired: response_j).",
    )
    rejected_field: str = setting(
        "rejected",
        "Preference pairs: the rejected response's field (stack_exchange_paired: response_k).",
    )
    drop_long_prompts: bool = setting(
        False,
        "A pair whose prompt fills seq_len, leaving no room for a response, is refused by its file and line; true: "
        "left out, and counted (as TRL's DPOTrainer drops them).",
    )
    chat_format: ChatFormat = setting(
        ChatFormat.auto,
        "Chat (runner/data/chat.py): how records hold their conversations: messages (role and content), sharegpt (from "
        "and value), alpaca (instruction, input, output), or auto: from each record's keys.",
    )
    chat_template: Optional[str] = setting(None, "Chat: a Jinja chat template file; unset: the tokenizer's own.")
    train_on: TrainOn = setting(
        TrainOn.assistant,
        "Chat: the tokens that train: every assistant turn (with its end-of-turn token), the last assistant turn, or "
        "all of them.",
    )
    prompt_as_chat: bool = setting(
        False,
        "data.format=prompt: a text prompt goes through the chat template as a user's turn, ended by the generation "
        "prompt (the template's own for an instruct model; conversations always do).",
    )
    seq_len: int = setting(
        256,
        "Tokens per row: documents are cut (or packed) to it, examples longer are refused or cut.",
    )
    eval_fraction: float = setting(0.05, "Share of the documents held out for evaluation.")
    packing: bool = setting(
        False,
        "Several documents or examples per row, each attending only to itself (runner/data/pack.py); no padding to "
        "train on.",
    )
    num_proc: Optional[int] = setting(
        None,
        "Processes that tokenize the corpus (once: later runs read the token store); unset: this machine's cores.",
    )
    streaming: bool = setting(
        False,
        "Read through datasets' IterableDataset and tokenized as training goes, each rank its own shard "
        "(runner/data/stream.py): for a corpus past the disk, or a hub dataset not downloaded whole.",
    )
    cache_dir: Optional[str] = setting(
        None,
        "Where the token store lives (shared storage serves every node); unset: $RUNNER_TOKEN_CACHE, else "
        "~/.cache/runner/tokens.",
    )


BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def check(data: DataConfig) -> None:
    require(
        bool(data.files) != bool(data.hub_dataset),
        "set exactly one of data.files (a local file, directory or glob) and data.hub_dataset (a hub name)",
    )
    require(data.seq_len >= 2, f"data.seq_len={data.seq_len} must be at least 2")
    require(0 < data.eval_fraction < 1, f"data.eval_fraction={data.eval_fraction} must be between 0 and 1")
    require(data.num_proc is None or data.num_proc >= 1, f"data.num_proc={data.num_proc} must be at least 1")
    if data.chat_template:
        require(
            data.format in (DataFormat.chat, DataFormat.preference, DataFormat.prompt),
            f"data.chat_template is for data.format=chat, preference and prompt, not {data.format.value}",
        )
        require(os.path.isfile(data.chat_template), f"data.chat_template={data.chat_template} is not a file")
    if data.format is DataFormat.preference:
        require(
            not data.packing,
            "data.packing=true packs examples into rows; preference pairs keep a row for each "
            "response, side by side: set data.packing=false",
        )
        require(
            not data.streaming,
            "data.streaming=true streams documents; preference pairs are read from the token "
            "store: set data.streaming=false",
        )
    require(
        not data.prompt_as_chat or data.format is DataFormat.prompt,
        f"data.prompt_as_chat is for data.format=prompt, not {data.format.value}",
    )
    if data.format is DataFormat.prompt:
        require(
            not data.packing and not data.streaming,
            "data.format=prompt holds prompts, whose completions task=grpo samples as it trains: set "
            "data.packing=false and data.streaming=false",
        )
    if data.files:
        files = resolve_files(data.files)
        require(bool(files), f"data.files={data.files} matches no file; give an existing file, directory or glob")
        kinds = {file_kind(f) for f in files}
        require(len(kinds) == 1, f"data.files={data.files} mixes file kinds ({', '.join(sorted(kinds))}); pick one")
        require(
            data.format is not DataFormat.preference or kinds != {"text"},
            f"data.files={data.files} are text files; preference pairs are records of .json, .jsonl or .parquet files",
        )


def with_absolute_paths(data: DataConfig, base: Path) -> DataConfig:
    """`data.files`, `data.cache_dir` and `data.chat_template` as absolute paths from `base`: the spec then means the
    same from any directory."""
    return replace(
        data,
        files=absolute_path(data.files, base),
        cache_dir=absolute_path(data.cache_dir, base),
        chat_template=absolute_path(data.chat_template, base),
    )


def resolve_files(pattern: str) -> list[str]:
    """The files a `data.files` value names, sorted so that every rank and every run sees the same order."""
    pattern = os.path.expanduser(pattern)
    if os.path.isdir(pattern):
        pattern = os.path.join(pattern, "**", "*")
    return sorted(path for path in glob.glob(pattern, recursive=True) if os.path.isfile(path))


def file_kind(path: str) -> str:
    """How a file is read: "text" (a document per file), "json" (JSON Lines, or one array) or "parquet"."""
    return BUILDERS.get(os.path.splitext(path)[1].lower(), "text")
