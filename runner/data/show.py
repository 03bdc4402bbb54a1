"""What trains, shown: rows as the model reads them, the tokens whose labels train marked, and the counts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runner.data.rows import IGNORE

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from runner.data.prompts import PromptSet
    from runner.data.rows import RowSet

# Trained text: green on a terminal, else between brackets.
MARKS = {True: ("\x1b[32m", "\x1b[0m"), False: ("[[", "]]")}
SEGMENT = " ┃ "  # between the examples of a packed row


def shown_row(row: dict[str, Any], tokenizer: PreTrainedTokenizerBase, colour: bool) -> str:
    """The row's text, a token's text marked where its label trains (the model predicts it)."""
    opening, closing = MARKS[colour]
    starts = {i for i, position in enumerate(row.get("position_ids", [])) if position == 0 and i}
    pieces, run, trained = [], [], None
    for i, (token, label) in enumerate(zip(row["input_ids"], row["labels"])):
        if run and (i in starts or (label != IGNORE) != trained):
            pieces.append(marked(tokenizer.decode(run), trained, opening, closing))
            run = []
        if i in starts:
            pieces.append(SEGMENT)
        run.append(token)
        trained = label != IGNORE
    if run:
        pieces.append(marked(tokenizer.decode(run), trained, opening, closing))
    return "".join(pieces)


def marked(text: str, trained: bool, opening: str, closing: str) -> str:
    return f"{opening}{text}{closing}" if trained else text


def counts(train: RowSet, evaluation: RowSet, seq_len: int, unit: str = "rows") -> str:
    """The splits' sizes in `unit` (rows, or preference pairs), their tokens and the trained share."""
    tokens, trained = int(train.tokens.sum()), int(train.label_tokens.sum())
    meta = train.store.meta
    line = (
        f"{len(train):,} train and {len(evaluation):,} eval {unit} of up to {seq_len} tokens; {tokens:,} train "
        f"tokens, {trained:,} of them trained ({trained / max(tokens, 1):.0%})"
    )
    if "cut" in meta:
        line += f"; {meta['cut']:,} of {meta['documents']:,} examples longer than data.seq_len={seq_len}, cut"
    if meta.get("dropped_pairs"):
        line += f"; {meta['dropped_pairs']:,} pairs whose prompt fills data.seq_len left out"
    return line


def shown_prompts(train: PromptSet, evaluation: PromptSet, count: int, tokenizer: PreTrainedTokenizerBase) -> str:
    """The first `count` train prompts as the model reads them (their tokens decoded: a chat template's rendering
    included), with the fields the rewards receive; the counts, and the token that ends their completions."""
    import json

    lines = []
    for index, prompt in enumerate(train.prompts[:count]):
        lines += [f"--- train prompt {index} ({prompt.where}), {len(prompt.ids)} tokens", tokenizer.decode(prompt.ids)]
        if prompt.fields:
            lines.append(f"    fields: {json.dumps(prompt.fields, ensure_ascii=False)[:500]}")
    longest = max(len(prompt.ids) for prompt in train.prompts)
    lines.append(
        f"--- {len(train):,} train and {len(evaluation):,} eval prompts, the longest {longest} tokens; "
        f"completions end at {tokenizer.decode([train.stop_token])!r}"
    )
    return "\n".join(lines)
