"""Generation as every inference path shares it: the decoding settings, prompts cut into left-padded batches,
the choice of each next token, and the completion's end (an end-of-sequence token or a stop string).

Batches are fixed by the prompts' order alone, whatever the number of processes: a batch is then computed
identically by one process or by any rank that takes it, so greedy output does not depend on how it was split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch
    from transformers import LogitsProcessorList, PreTrainedTokenizerBase


@dataclass(frozen=True)
class Decoding:
    max_new_tokens: int
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    eos_token_id: Optional[int] = None
    pad_token_id: int = 0

    def warpers(self) -> LogitsProcessorList:
        """transformers' own sampling warpers, in generate()'s order (temperature, top-k, top-p)."""
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        warpers = LogitsProcessorList()
        if self.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k:
            warpers.append(TopKLogitsWarper(self.top_k))
        if self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(self.top_p))
        return warpers


def next_tokens(
    logits: torch.Tensor, input_ids: torch.Tensor, decoding: Decoding, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """The next token of each row from its last position's logits [rows, vocab]: the argmax, or a draw from the
    warped distribution."""
    import torch

    logits = logits.float()
    if not decoding.do_sample:
        return logits.argmax(dim=-1)
    scores = decoding.warpers()(input_ids, logits)
    return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator).squeeze(1)


Batch = dict[str, "torch.Tensor"]


def prompt_batches(prompts: list[list[int]], batch_size: int, pad_token_id: int) -> list[Batch]:
    """The tokenized prompts in batches of `batch_size`, in order, left-padded (the new tokens then follow every
    row's last real token): input_ids and attention_mask."""
    import torch

    batches = []
    for start in range(0, len(prompts), batch_size):
        rows = prompts[start : start + batch_size]
        length = max(len(row) for row in rows)
        batches.append(
            {
                "input_ids": torch.tensor([[pad_token_id] * (length - len(row)) + row for row in rows]),
                "attention_mask": torch.tensor([[0] * (length - len(row)) + [1] * len(row) for row in rows]),
            }
        )
    return batches


def up_to_eos(row: list[int], eos_token_id: Optional[int]) -> list[int]:
    """A row's new tokens up to and including its end-of-sequence token (generate pads the rows that end first)."""
    if eos_token_id is not None and eos_token_id in row:
        return row[: row.index(eos_token_id) + 1]
    return row


def completion(
    new_tokens: list[int], tokenizer: PreTrainedTokenizerBase, eos_token_id: Optional[int], stop: Optional[str]
) -> tuple[str, int]:
    """A row's completion text and its token count: up to (not including) the first end-of-sequence token, and cut
    before the stop string where it appears."""
    new_tokens = up_to_eos(new_tokens, eos_token_id)
    if new_tokens and new_tokens[-1] == eos_token_id:
        new_tokens = new_tokens[:-1]
    text = tokenizer.decode(new_tokens, skip_special_tokens=True)
    if stop and stop in text:
        text = text[: text.index(stop)]
    return text, len(new_tokens)
