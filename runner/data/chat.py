"""Chat data (data.format=chat): conversations as users have them, rendered with the model's chat template, and
the mask of the tokens that train.

A record holds its conversation in one of three layouts, named by data.chat_format or found from its keys:
  - messages: OpenAI's `messages` (role and content; system, user, assistant and tool roles; an assistant's
    `tool_calls`), with an optional `tools` column;
  - sharegpt: `conversations` of `from` and `value` (human, gpt, system; LLaMA-Factory's function_call and
    observation turns become tool calls and tool results), with an optional `tools` column (JSON or a list);
  - alpaca: `instruction`, optional `input`, `output`, optional `system` and `history` ([prompt, response] pairs).

The mask comes from the rendered conversation itself, not from `{% generation %}` markers (which most published
templates lack): an assistant turn trains from where the template's generation prompt ends (the model is never
asked to write the prompt's own tokens) to where the next message begins, its end-of-turn token included; the
last turn, to the end of the conversation. A template that renders an earlier turn differently once later turns
follow (Qwen3's, which drops earlier reasoning) cannot be masked this way and is refused in one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from runner.errors import SpecError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from runner.config.data import DataConfig

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}


@dataclass
class Conversation:
    messages: list[dict[str, Any]]
    tools: Optional[list[Any]] = None


def layout(record: dict[str, Any]) -> str:
    """The layout a record's keys say it has."""
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record and "output" in record:
        return "alpaca"
    return ""


def conversation(record: Any, chat_format: str, source: str, where: str) -> Conversation:
    """The record's conversation, checked: known roles, no empty message, at least one assistant turn."""
    if not isinstance(record, dict):
        raise SpecError(f"{source}: {where} is a JSON {type(record).__name__}, not an object of fields")
    kind = layout(record) if chat_format == "auto" else chat_format
    if kind == "messages":
        found = Conversation(
            [dict(message) for message in field(record, "messages", list, source, where)],
            tools_of(record, source, where),
        )
    elif kind == "sharegpt":
        found = Conversation(
            [
                sharegpt_message(turn, i, source, where)
                for i, turn in enumerate(field(record, "conversations", list, source, where))
            ],
            tools_of(record, source, where),
        )
    elif kind == "alpaca":
        found = Conversation(alpaca_messages(record, source, where))
    else:
        raise SpecError(
            f"{source}: {where} has none of the chat layouts' keys (messages, conversations, or "
            f"instruction and output; it has: {', '.join(record)}); set data.chat_format"
        )
    check(found, source, where)
    return found


def field(record: dict[str, Any], key: str, kind: type, source: str, where: str) -> Any:
    value = record.get(key)
    if not isinstance(value, kind):
        raise SpecError(
            f"{source}: {where} has {key} = {json.dumps(value, default=str)[:40]}, not a "
            f"{'list' if kind is list else 'string'}"
        )
    return value


def tools_of(record: dict[str, Any], source: str, where: str) -> Optional[list[Any]]:
    tools = record.get("tools")
    if isinstance(tools, str):  # LLaMA-Factory keeps them as a JSON string
        try:
            tools = json.loads(tools) if tools.strip() else None
        except ValueError as error:
            raise SpecError(f"{source}: {where} has tools that are not valid JSON ({error})") from None
    return tools or None


def sharegpt_message(turn: Any, index: int, source: str, where: str) -> dict[str, Any]:
    if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
        raise SpecError(f"{source}: {where} turn {index} is not an object with 'from' and 'value'")
    role = SHAREGPT_ROLES.get(turn["from"])
    if role is None:
        raise SpecError(
            f"{source}: {where} turn {index} is from '{turn['from']}'; ShareGPT turns are from "
            f"{', '.join(SHAREGPT_ROLES)}"
        )
    if turn["from"] != "function_call":
        return {"role": role, "content": turn["value"]}
    try:
        call = json.loads(turn["value"])
    except ValueError as error:
        raise SpecError(f"{source}: {where} turn {index} is a function_call that is not valid JSON ({error})") from None
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}


def alpaca_messages(record: dict[str, Any], source: str, where: str) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": record["system"]}] if record.get("system") else []
    for pair in record.get("history") or []:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise SpecError(f"{source}: {where} has a history entry that is not a [prompt, response] pair")
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    prompt = field(record, "instruction", str, source, where)
    if record.get("input"):
        prompt += "\n" + record["input"]
    return messages + [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": field(record, "output", str, source, where)},
    ]


def check(found: Conversation, source: str, where: str) -> None:
    for i, message in enumerate(found.messages):
        role = message.get("role")
        if role not in ROLES:
            raise SpecError(f"{source}: {where} message {i} has role '{role}'; the roles are {', '.join(ROLES)}")
        content = message.get("content")
        if not (isinstance(content, str) and content.strip()) and not message.get("tool_calls"):
            raise SpecError(f"{source}: {where} message {i} ({role}) is empty")
    if not any(message["role"] == "assistant" for message in found.messages):
        raise SpecError(f"{source}: {where} has no assistant turn: nothing to train on")


def chat_template(data: DataConfig, tokenizer: PreTrainedTokenizerBase) -> str:
    """data.chat_template's file, else the tokenizer's own template; neither is refused in one line."""
    template = template_or_none(data, tokenizer)
    if not template:
        raise SpecError(
            "data.format=chat needs a chat template, and the tokenizer has none; give one with "
            "data.chat_template=<a Jinja file>"
        )
    return template


def template_or_none(data: DataConfig, tokenizer: PreTrainedTokenizerBase) -> Optional[str]:
    """data.chat_template's file, else the tokenizer's own template, else None."""
    if data.chat_template:
        return Path(data.chat_template).read_text(encoding="utf-8")
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    return template or None


class ChatRenderer:
    """A conversation's tokens, rendered with the chat template, and the mask of those that train
    (data.train_on: every assistant turn, the last one, or all)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: str, train_on: str):
        if not getattr(tokenizer, "is_fast", False):
            raise SpecError(
                "data.format=chat maps the template's text to tokens by their offsets, which only "
                "fast tokenizers give; use a fast tokenizer (tokenizer.json)"
            )
        self.tokenizer, self.template, self.train_on = tokenizer, template, train_on
        self.end_of_turn = self.turns_end()

    def turns_end(self) -> int:
        """The token that ends an assistant turn, where generation stops. A template whose assistant turn ends on
        no token of its own (GLM-4's leaves it to the next message's header) is refused: the model would never
        learn to stop. Found on a short conversation, as TRL's is_chat_template_stop_token_trained does."""
        probe = Conversation(
            [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Bye"},
            ]
        )
        try:
            text = self.render(probe, "", "")
            ids, mask = self.masked(text, self.assistant_spans(probe, text, "", ""))
        except SpecError:  # a template that wants other conversations: their own checks apply
            return self.tokenizer.eos_token_id
        trained = [token for token, bit in zip(ids, mask) if bit and self.tokenizer.decode([token]).strip()]
        ends = set(self.tokenizer.get_added_vocab().values()) | set(self.tokenizer.all_special_ids)
        if trained and trained[-1] not in ends:
            raise SpecError(
                "the chat template ends an assistant turn on no token of its own, so the model would "
                "never learn to stop; give one that does with data.chat_template=<file> (TRL's "
                "`_training` templates do)"
            )
        return trained[-1] if trained else self.tokenizer.eos_token_id

    def prompt(self, text: str, where: str) -> str:
        """A user's prompt as the template asks the model to answer it: the user turn and the generation prompt."""
        return self.render(
            Conversation([{"role": "user", "content": text}]), "task.prompts", where, add_generation_prompt=True
        )

    def render(self, found: Conversation, source: str, where: str, **options: Any) -> str:
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(
                found.messages, tools=found.tools, chat_template=self.template, tokenize=False, **options
            )
        except TemplateError as error:
            raise SpecError(f"{source}: {where}: the chat template refuses it: {error}") from None

    def __call__(self, found: Conversation, source: str, where: str) -> tuple[list[int], list[int]]:
        text = self.render(found, source, where)
        if self.train_on == "all":
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            return ids, [1] * len(ids)
        spans = self.assistant_spans(found, text, source, where)
        return self.masked(text, spans[-1:] if self.train_on == "last_assistant" else spans)

    def masked(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        # A token trains when it lies within a turn: the end found from the text may fall inside the next
        # message's first token (a special token that shares its first character with the one `through` ends with).
        mask = [
            int(any(span_start <= start and end <= span_end for span_start, span_end in spans))
            for start, end in encoded["offset_mapping"]
        ]
        return encoded["input_ids"], mask

    def assistant_spans(self, found: Conversation, text: str, source: str, where: str) -> list[tuple[int, int]]:
        """Each assistant turn's characters in `text`: from the end of the generation prompt that precedes it to
        the start of what the next message adds (the last turn: to the end, with what closes the conversation)."""
        spans = []
        for i, message in enumerate(found.messages):
            if message["role"] != "assistant":
                continue
            before = self.render(
                Conversation(found.messages[:i], found.tools), source, where, add_generation_prompt=True
            )
            through = self.render(Conversation(found.messages[: i + 1], found.tools), source, where)
            end = common_prefix(through, text)
            # What `through` has past the common part must be what the template closes every conversation with
            # (an end-of-sequence token): otherwise the template rendered a turn differently once others followed.
            if not text.startswith(before) or not text.endswith(through[end:]):
                raise SpecError(
                    f"{source}: {where}: the chat template renders an earlier turn differently once later "
                    "turns follow (as Qwen3's drops earlier reasoning), so the tokens of each turn "
                    "cannot be told; give a template that keeps earlier turns as they were with "
                    "data.chat_template=<file> (TRL publishes such `_training` templates)"
                )
            spans.append((len(before), end))
        return spans


def common_prefix(a: str, b: str) -> int:
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length
