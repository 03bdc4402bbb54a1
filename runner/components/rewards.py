"""task=grpo's rewards: functions named `module:function` (or `path/to/file.py:function`) in the config, with
TRL's signature: each takes the prompts, the completions, their token ids and every other field of the prompts'
records (as lists, by field name) and returns a float per completion, or None where it does not score it. The
built-in ones are below: a final answer that equals the record's, a regex match, and a length penalty.

A completion is a string, or for chat prompts a list of one assistant message (TRL's conversational layout); the
built-in rewards read its text either way."""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

from runner.config.fields import setting
from runner.errors import RewardFailed, SpecError, require

Reward = Callable[..., list[Optional[float]]]


@dataclass
class RewardSpec:
    function: str = setting(
        "runner.components.rewards:answer_matches",
        "`module:function` (importable) or `path/to/file.py:function`.",
    )
    weight: float = setting(1.0, "This reward's weight in the completion's reward.")
    args: dict[str, Any] = setting(
        {},
        "Keyword arguments bound to the function (the built-in regex_matches' `pattern`).",
    )
    name: Optional[str] = setting(None, "What the metrics call it (rewards/<name>/mean); unset: the function's name.")


def load_reward(spec: RewardSpec) -> Reward:
    """The function a reward names, with its arguments bound; a one-line SpecError if it cannot be had."""
    where, _, name = spec.function.rpartition(":")
    require(
        bool(where) and bool(name),
        f"task.rewards: {spec.function} names no function; write module:function or path/to/file.py:function",
    )
    try:
        if where.endswith(".py"):
            require(Path(where).is_file(), f"task.rewards: {where} is not a file")
            loader = importlib.util.spec_from_file_location(f"runner_reward_{Path(where).stem}", where)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except SpecError:
        raise
    except Exception as error:  # the user's file may raise anything as it imports
        raise SpecError(f"task.rewards: {where} does not import ({type(error).__name__}: {error})") from None
    function = getattr(module, name, None)
    require(callable(function), f"task.rewards: {where} has no function {name}")
    return partial(function, **spec.args) if spec.args else function


def rewards_of(
    functions: list[tuple[str, Reward]],
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]],
    fields: dict[str, list[Any]],
) -> list[list[float]]:
    """Each function's reward of each completion ([functions][completions], NaN where it gave None); RewardFailed
    names a function that raised or answered with the wrong count or kind."""
    scores = []
    for name, function in functions:
        try:
            given = function(prompts=prompts, completions=completions, completion_ids=completion_ids, **fields)
        except Exception as error:  # the user's function may raise anything
            raise RewardFailed(f"reward {name} raised {type(error).__name__}: {error}") from error
        if not isinstance(given, (list, tuple)) or len(given) != len(completions):
            count = len(given) if isinstance(given, (list, tuple)) else type(given).__name__
            raise RewardFailed(
                f"reward {name} returned {count} values for {len(completions)} completions; it "
                "returns one float (or None) per completion"
            )
        try:
            scores.append([math.nan if value is None else float(value) for value in given])
        except (TypeError, ValueError) as error:
            raise RewardFailed(f"reward {name} returned a value that is not a number or None ({error})") from None
    return scores


def text_of(completion: Any) -> str:
    """A completion's text: the string, or the content of its last message (TRL's conversational layout)."""
    if isinstance(completion, list):
        return str(completion[-1].get("content", "")) if completion else ""
    return str(completion)


NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def final_answer(text: str) -> Optional[str]:
    """The answer a text ends with: what follows GSM8K's `####`, else its last number; None without either."""
    if "####" in text:
        return text.rsplit("####", 1)[1].strip() or None
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def same_answer(found: Optional[str], expected: str) -> bool:
    """Numbers compare as numbers (1,000 = 1000.0, $5 = 5); other answers as their stripped text."""
    if found is None:
        return False

    def number(text: str) -> Optional[float]:
        cleaned = text.strip().replace(",", "").lstrip("$").rstrip(".")
        try:
            return float(cleaned)
        except ValueError:
            return None

    if number(found) is not None and number(expected) is not None:
        return number(found) == number(expected)
    return found.strip() == expected.strip()


def answer_matches(completions: list[Any], answer: list[str], **_: Any) -> list[Optional[float]]:
    """1.0 where the completion's final answer equals the record's `answer` field's (GSM8K's `#### 42`), else 0.0;
    None for a record without one."""
    return [
        None
        if expected is None
        else float(same_answer(final_answer(text_of(completion)), final_answer(str(expected)) or str(expected)))
        for completion, expected in zip(completions, answer)
    ]


def regex_matches(completions: list[Any], pattern: str, **_: Any) -> list[Optional[float]]:
    """1.0 where the completion matches `pattern` from its start (Python's re.match, DOTALL), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)
    return [float(compiled.match(text_of(completion)) is not None) for completion in completions]


def length_penalty(completion_ids: list[list[int]], limit: int, **_: Any) -> list[Optional[float]]:
    """0 for a completion of at most `limit` tokens; past it, minus the share it runs over."""
    return [-max(0, len(ids) - limit) / limit for ids in completion_ids]
