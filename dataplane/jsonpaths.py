"""Find the first string in a parsed JSON value that a check refuses, and name where it sits.

Both services refuse strings their back ends cannot hold before any work starts: the data plane a lone
surrogate (the tokenizer fails on it), the control plane a NUL character (PostgreSQL text cannot hold it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def first_bad_string(value: Any, bad: Callable[[str], bool], path: str = "") -> str | None:
    """The path (`messages[0].content`) of the first string in `value` for which `bad` is true, or None."""
    if isinstance(value, str):
        return path if bad(value) else None
    if isinstance(value, dict):
        items: Any = ((f"{path}.{key}" if path else str(key), item) for key, item in value.items())
    elif isinstance(value, list):
        if set(map(type, value)) <= {int}:  # token ids: nothing to check, and passed over in C
            return None
        items = ((f"{path}[{index}]", item) for index, item in enumerate(value))
    else:
        return None
    for where, item in items:
        found = first_bad_string(item, bad, where)
        if found:
            return found
    return None


def not_utf8(text: str) -> bool:
    """A lone surrogate (from a JSON escape such as \\ud800) cannot be encoded as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
