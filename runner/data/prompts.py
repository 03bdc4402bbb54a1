"""Prompt data (data.format=prompt), which task=grpo samples completions for: each record's prompt (a text, or a
conversation rendered with the chat template up to the assistant's turn) as token ids, and its other fields, which
the rewards read; or each line of text files, a prompt without fields. Prompt sets are small (GSM8K's 7,473
questions are 4 MB): every process reads and tokenizes them itself, without a token store.

Each step draws its prompts from one seeded permutation per epoch, cut into steps of prompts_per_step; data-parallel
rank r takes the r-th contiguous share. The prompts of a step are therefore the same whatever the process count."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional

from runner.data.chat import ChatRenderer, Conversation, template_or_none
from runner.data.read import HUB_ROWS, error_source, read_records, read_text, work_items
from runner.errors import require

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from runner.config.data import DataConfig


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    shown: Any  # as the rewards receive it: the prompt's text, or its messages (a conversation)
    fields: dict[str, Any]  # the record's other fields
    where: str  # its file and line (or record, or row)

    @property
    def conversational(self) -> bool:
        return isinstance(self.shown, list)


@dataclass
class PromptSet:
    prompts: list[Prompt]
    stop_token: int  # where a completion ends: the end-of-sequence token, or a chat template's end of turn

    def __len__(self) -> int:
        return len(self.prompts)


@dataclass
class PromptBatch:
    """This rank's prompts of one step (or one eval batch), each once; `first`: the index of its first prompt among
    the whole step's (every rank's), from which each completion's seed follows."""

    prompts: list[Prompt]
    first: int
    stop_token: int  # where their completions end


def read_prompts(data: DataConfig, tokenizer: PreTrainedTokenizerBase) -> PromptSet:
    """Every record's prompt, in the data's order; a record without the prompt field, or a conversation with no chat
    template to render it, is refused in one line with its file and line."""
    from runner.data.splits import read_hub
    from runner.data.tokenize import Encoder, token_dtype

    if data.hub_dataset and data.hub_dataset not in HUB_ROWS:
        HUB_ROWS[data.hub_dataset] = read_hub(data)
    source = error_source(data)
    template = template_or_none(data, tokenizer)
    renderer: Optional[ChatRenderer] = None
    encoder = Encoder(data, tokenizer, token_dtype(tokenizer))

    def rendered(shown: Any, where: str) -> str:
        nonlocal renderer
        if not (isinstance(shown, list) or data.prompt_as_chat):
            return str(shown)
        if renderer is None:
            require(
                bool(template),
                f"{source}: {where} is a conversation (or data.prompt_as_chat=true), which needs a "
                "chat template, and the tokenizer has none; give one with "
                "data.chat_template=<a Jinja file>",
            )
            renderer = ChatRenderer(tokenizer, template, "all")
        if isinstance(shown, list):
            return renderer.render(Conversation(shown), source, where, add_generation_prompt=True)
        return renderer.prompt(str(shown), where)

    prompts = []
    for item in work_items(data):
        if item.kind == "text":  # a prompt per line
            for path in item.paths:
                lines = [
                    (f"{path} line {number}", line)
                    for number, line in enumerate(read_text(path, source).splitlines(), 1)
                    if line.strip()
                ]
                texts = [rendered(line, where) for where, line in lines]
                prompts += [Prompt(ids, line, {}, where) for (where, line), ids in zip(lines, encoder.ids(texts))]
            continue
        for record, where in read_records(item, source):
            require(
                isinstance(record, dict) and data.prompt_field in record,
                f"{source}: {where} has no field {data.prompt_field!r} (data.prompt_field), which holds the prompt",
            )
            shown = record[data.prompt_field]
            [ids] = encoder.ids([rendered(shown, where)])
            require(bool(ids), f"{source}: {where} has an empty prompt")
            fields = {key: value for key, value in record.items() if key != data.prompt_field}
            prompts.append(Prompt(ids, shown, fields, where))
    require(bool(prompts), f"{source} holds no records")
    stop = renderer.end_of_turn if renderer is not None else tokenizer.eos_token_id
    return PromptSet(prompts, stop)


def prompt_splits(prompts: PromptSet, eval_fraction: float, seed: int) -> tuple[PromptSet, PromptSet]:
    """The train and eval prompts: the eval ones the first round(eval_fraction x prompts) (at least one) of a seeded
    permutation, the train ones the rest, each in the data's order."""
    import torch

    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed)).tolist()
    held = max(1, round(eval_fraction * len(prompts)))
    evals, train = sorted(order[:held]), sorted(order[held:])
    return (
        PromptSet([prompts.prompts[i] for i in train], prompts.stop_token),
        PromptSet([prompts.prompts[i] for i in evals], prompts.stop_token),
    )


def prompt_steps(
    prompts: PromptSet,
    *,
    per_step: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    start_step: int = 0,
    steps_per_draw: int = 1,
) -> Iterator[PromptBatch]:
    """For each step after start_step, this rank's share of the step's `per_step` prompts; each draw of prompts
    serves `steps_per_draw` steps in a row (the later ones train again on the first's completions)."""
    import torch

    share = per_step // dp_size
    draws_per_epoch = len(prompts) // per_step
    draw, repeats = divmod(start_step, steps_per_draw)
    epoch, first = divmod(draw, draws_per_epoch)
    while True:
        order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        for start in range(first * per_step, draws_per_epoch * per_step, per_step):
            mine = order[start + dp_rank * share : start + (dp_rank + 1) * share]
            drawn = PromptBatch([prompts.prompts[i] for i in mine], dp_rank * share, prompts.stop_token)
            for _ in range(steps_per_draw - repeats):
                yield drawn
            repeats = 0
        epoch, first = epoch + 1, 0


def eval_prompt_batches(
    prompts: PromptSet, *, batch_size: int, max_batches: int, dp_rank: int, dp_size: int
) -> Iterator[PromptBatch]:
    """This rank's share of the first max_batches x batch_size eval prompts (rounded down to a multiple of the
    ranks, at least one each), in batches of batch_size."""
    count = max(dp_size, min(len(prompts), max_batches * batch_size) // dp_size * dp_size)
    share = count // dp_size
    first = dp_rank * share
    for start in range(first, first + share, batch_size):
        yield PromptBatch(prompts.prompts[start : min(start + batch_size, first + share)], start, prompts.stop_token)
