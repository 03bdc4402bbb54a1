"""Preference pairs (data.format=preference): a prompt and two responses to it, the chosen and the rejected, which
task=dpo trains on.

A record holds its pair in one of the layouts users have, found from its keys:
  - TRL's: `prompt`, `chosen` and `rejected`, each text (standard) or messages (conversational); without a prompt
    (TRL's implicit prompt), chosen and rejected are whole conversations that differ in their last turn only;
  - LLaMA-Factory's ShareGPT ranking data: `conversations` (the prompt's turns), `chosen` and `rejected` (a turn
    each);
  - other field names, given by data.prompt_field, data.chosen_field and data.rejected_field (torchtune's
    stack_exchange_paired: question, response_j and response_k).

Text is tokenized as TRL tokenizes its standard format: the prompt, then the response and the end-of-sequence token
(each text tokenized on its own), the response and the end trained. Conversations are rendered with the chat
template (runner/data/chat.py), their last assistant turn trained. Each pair is two documents of the token store,
the chosen then the rejected, and two rows, side by side: a batch of pairs holds its chosen rows, then its rejected
rows, as TRL's concatenated forward takes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from runner.data.chat import ChatRenderer, Conversation, check, sharegpt_message, tools_of
from runner.data.rows import RowSet, columns
from runner.errors import SpecError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Messages = list[dict[str, Any]]


@dataclass
class Pair:
    prompt: Union[str, Messages]  # text, or the prompt's turns
    chosen: Union[str, Messages]  # text, or the chosen assistant turn
    rejected: Union[str, Messages]
    tools: Optional[list[Any]] = None

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


def pair(record: Any, names: tuple[str, str, str], source: str, where: str) -> Pair:
    """The record's pair, checked: both responses there, of the prompt's kind, and different."""
    prompt_key, chosen_key, rejected_key = names
    if not isinstance(record, dict):
        raise SpecError(f"{source}: {where} is a JSON {type(record).__name__}, not an object of fields")
    for key in (chosen_key, rejected_key):
        if not record.get(key):
            raise SpecError(
                f"{source}: {where} has no {key} response (its fields: {', '.join(record)}); a preference "
                "pair needs a prompt, a chosen and a rejected response"
            )
    chosen, rejected = record[chosen_key], record[rejected_key]
    if isinstance(record.get("conversations"), list) and isinstance(chosen, dict):  # LLaMA-Factory's ranking data
        found = Pair(
            [sharegpt_message(turn, i, source, where) for i, turn in enumerate(record["conversations"])],
            [sharegpt_message(chosen, 0, source, f"{where} {chosen_key}")],
            [sharegpt_message(rejected, 0, source, f"{where} {rejected_key}")],
            tools_of(record, source, where),
        )
    elif prompt_key in record:
        found = Pair(record[prompt_key], chosen, rejected, tools_of(record, source, where))
    elif isinstance(chosen, list) and isinstance(rejected, list):  # TRL's implicit prompt
        if chosen[:-1] != rejected[:-1]:
            raise SpecError(
                f"{source}: {where} has no {prompt_key}, and its {chosen_key} and {rejected_key} "
                "conversations differ before their last turn, so the prompt they share cannot be told"
            )
        found = Pair(chosen[:-1], chosen[-1:], rejected[-1:], tools_of(record, source, where))
    else:
        raise SpecError(
            f"{source}: {where} has no {prompt_key} (its fields: {', '.join(record)}); name the prompt's "
            "field with data.prompt_field"
        )
    kinds = {type(part) for part in (found.prompt, found.chosen, found.rejected)}
    if kinds not in ({str}, {list}):
        raise SpecError(
            f"{source}: {where} mixes text and conversations in its prompt and responses; give all "
            "three as text or all as messages"
        )
    if found.chosen == found.rejected:
        raise SpecError(f"{source}: {where} has the same chosen and rejected response: there is nothing to prefer")
    if found.conversational:
        for response in (found.chosen, found.rejected):
            check(Conversation(found.prompt + response, found.tools), source, where)
            if response[-1].get("role") != "assistant":
                raise SpecError(
                    f"{source}: {where}: a response ends with a {response[-1].get('role')} turn, not the assistant's"
                )
    elif not found.prompt.strip():
        raise SpecError(f"{source}: {where} has an empty {prompt_key}")
    return found


class PairEncoder:
    """A pair's two sequences, the chosen and the rejected, each with the mask of its response's tokens."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, template: Optional[str], ids: Callable[[list[str]], list[list[int]]]
    ):
        self.tokenizer, self.template, self.ids = tokenizer, template, ids
        self.renderer: Optional[ChatRenderer] = None

    def __call__(self, found: Pair, source: str, where: str) -> list[tuple[list[int], list[int]]]:
        if not found.conversational:
            eos = self.tokenizer.eos_token_id
            prompt, chosen, rejected = self.ids([found.prompt, found.chosen, found.rejected])
            return [
                (prompt + response + [eos], [0] * len(prompt) + [1] * (len(response) + 1))
                for response in (chosen, rejected)
            ]
        if self.renderer is None:
            if not self.template:
                raise SpecError(
                    f"{source}: {where} is a conversation, which needs a chat template, and the tokenizer "
                    "has none; give one with data.chat_template=<a Jinja file>"
                )
            self.renderer = ChatRenderer(self.tokenizer, self.template, "last_assistant")
        return [
            self.renderer(Conversation(found.prompt + response, found.tools), source, where)
            for response in (found.chosen, found.rejected)
        ]


def prompts_fit(masks: list[Any], seq_len: int) -> list[bool]:
    """For each pair (`masks`: the chosen and rejected masks of each pair in turn), whether both its responses start
    within seq_len: a pair whose prompt fills the row would train nothing."""
    return [bool(masks[i][1:seq_len].any() and masks[i + 1][1:seq_len].any()) for i in range(0, len(masks), 2)]


class PairSet:
    """Rows of preference pairs read as pairs: pair i is rows 2i (chosen) and 2i+1 (rejected). A batch of pairs is
    their chosen rows, then their rejected rows; a pair's counts are its two rows'."""

    def __init__(self, rows: RowSet):
        self.rows, self.store = rows, rows.store
        self.tokens = rows.tokens[0::2] + rows.tokens[1::2]
        self.label_tokens = rows.label_tokens[0::2] + rows.label_tokens[1::2]

    def __len__(self) -> int:
        return len(self.rows) // 2

    def batch(self, indices: Any) -> dict[str, list]:
        """The pairs' rows, each with its index in the store (`store_row`)."""
        first = [2 * int(i) for i in indices]
        return columns(
            [{**self.rows[i], "store_row": self.rows.start + i} for i in first]
            + [{**self.rows[i + 1], "store_row": self.rows.start + i + 1} for i in first]
        )
