"""The checked spec as YAML, as runner.config.spec.to_yaml writes it, for `run --cfg job`, without the structured
config that to_yaml builds of the spec first (OmegaConf validates and wraps each of its hundreds of values: four
times the work of the YAML itself).

The spec's dataclasses are converted as OmegaConf converts them where that is plain: a value of exactly its field's
primitive type, an enum member (its name), a list, a dict of str keys, a nested spec dataclass (its own type's
fields). Anything else (an int in a float field, which OmegaConf would make a float; a string OmegaConf would read
as an interpolation or as missing; a tuple; a field OmegaConf ignores) sends the whole spec through to_yaml."""

from __future__ import annotations

import dataclasses
import enum
import functools
import typing
from typing import Any

import yaml
from omegaconf._utils import get_omega_conf_dumper

from runner.config.spec import RunSpec, to_yaml
from runner.config.tracker import redacted


class _NotPlain(Exception):
    """A value whose conversion is OmegaConf's to make."""


def spec_yaml(spec: RunSpec) -> str:
    """to_yaml(spec), the same text."""
    try:
        plain = redacted(_dataclass(spec))
    except _NotPlain:
        return to_yaml(spec)
    return yaml.dump(plain, default_flow_style=False, allow_unicode=True, sort_keys=False,
                     Dumper=get_omega_conf_dumper())


def plain_spec(spec: RunSpec) -> bool:
    """Whether spec_yaml converts the spec itself (for the tests: a spec it leaves to to_yaml costs the time)."""
    try:
        _dataclass(spec)
    except _NotPlain:
        return False
    return True


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, Any], ...]:
    """A dataclass's fields and their resolved types, as OmegaConf reads them."""
    fields = dataclasses.fields(cls)
    if issubclass(cls, dict) or any(field.metadata.get("omegaconf_ignore") is True for field in fields):
        raise _NotPlain(cls)
    hints = typing.get_type_hints(cls)
    return tuple((field.name, hints[field.name]) for field in fields)


def _dataclass(value: Any) -> dict[str, Any]:
    return {name: _value(getattr(value, name), hint) for name, hint in _fields(type(value))}


def _value(value: Any, hint: Any) -> Any:
    if typing.get_origin(hint) is typing.Union:
        args = typing.get_args(hint)
        if len(args) != 2 or type(None) not in args:
            raise _NotPlain(hint)
        if value is None:
            return None
        hint = args[0] if args[1] is type(None) else args[1]
    if hint is Any:
        return _any(value)
    if hint in (bool, int, float, str):
        if type(value) is not hint or (hint is str and _read_by_omegaconf(value)):
            raise _NotPlain(value)
        return value
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        if not isinstance(value, hint):
            raise _NotPlain(value)
        return value.name
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list and type(value) is list:
        item = args[0] if args else Any
        return [_value(element, item) for element in value]
    if origin is dict and type(value) is dict and (not args or args[0] is str):
        item = args[1] if args else Any
        return {_str_key(key): _value(element, item) for key, element in value.items()}
    if isinstance(hint, type) and dataclasses.is_dataclass(hint) and isinstance(value, hint):
        return _dataclass(value)
    raise _NotPlain(value)


def _any(value: Any) -> Any:
    """A value of a field typed Any: plain data only."""
    if value is None or type(value) in (bool, int, float):
        return value
    if type(value) is str and not _read_by_omegaconf(value):
        return value
    if type(value) is list:
        return [_any(element) for element in value]
    if type(value) is dict:
        return {_str_key(key): _any(element) for key, element in value.items()}
    raise _NotPlain(value)


def _str_key(key: Any) -> str:
    if type(key) is not str:
        raise _NotPlain(key)
    return key


def _read_by_omegaconf(text: str) -> bool:
    """A string OmegaConf reads as more than text: an interpolation (resolved by to_yaml) or MISSING."""
    return "${" in text or text == "???"
