"""A schema key's default and its help, together in its dataclass field: the one place both live. `run --help
<group>` prints the help whole (runner/cli/help.py), and a test holds conf/ to repeating no default."""

from __future__ import annotations

import copy
from dataclasses import MISSING, Field, field
from typing import Any, Callable, Optional

HELP = "help"


def setting(default: Any = MISSING, help: str = "", *, factory: Optional[Callable[[], Any]] = None) -> Any:
    """A dataclass field with its help. A mutable default (a list, a dict, a dataclass) is copied for each
    instance."""
    metadata = {HELP: help}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    if default is not MISSING and type(default).__hash__ is None:
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def help_of(key: Field) -> str:
    return key.metadata.get(HELP, "")
