"""Checks of the SDK's public arguments, made before anything is sent.

A wrong argument raises :class:`~corral.errors.InvalidArgument` naming it (``details``:
``{"errors": [{"field", "message"}]}``, as the daemon's validation errors), never a
``TypeError``/``OverflowError`` from deeper down, and is never silently reinterpreted
(a string is not a list of tags, an integer is not file content).

Timeouts mean one thing everywhere: a number of seconds ``> 0`` and at most
:data:`~corral.schema.MAX_TIMEOUT_S` (30 days), or ``None`` for "no limit" where a
limit is optional. ``0`` is refused, never read as "no limit".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, overload

from corral.errors import InvalidArgument
from corral.schema import MAX_TIMEOUT_S

MAX_STOP_GRACE_S = 300.0
"""The longest ``grace`` of a stop (the daemon's ``StopRequest``)."""


def invalid(name: str, message: str, **details: Any) -> InvalidArgument:
    """The error for argument ``name``: ``"<name>: <message>"``."""
    return InvalidArgument(
        f"{name}: {message}",
        details={"errors": [{"field": name, "message": message}], **details},
    )


def _kind(value: object) -> str:
    return type(value).__name__


@overload
def timeout(
    name: str, value: object, *, optional: Literal[False], maximum: float = ...,
    zero: bool = ...,
) -> float: ...


@overload
def timeout(
    name: str, value: object, *, optional: bool = ..., maximum: float = ..., zero: bool = ...,
) -> float | None: ...


def timeout(
    name: str, value: object, *, optional: bool = True, maximum: float = MAX_TIMEOUT_S,
    zero: bool = False,
) -> float | None:
    """Seconds in ``(0, maximum]`` (``[0, maximum]`` with ``zero``); ``None`` (no
    limit) only if ``optional``."""
    if value is None and optional:
        return None
    none = " (or None for no limit)" if optional else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(name, f"expected a number of seconds{none}, got {_kind(value)}")
    seconds = float(value)
    if math.isnan(seconds) or not (0 <= seconds if zero else 0 < seconds) or seconds > maximum:
        low = ">= 0" if zero else "> 0"
        raise invalid(
            name, f"expected seconds {low} and <= {maximum:.0f}{none}, got {value!r}",
            maximum=maximum,
        )
    return seconds


def check_lease(value: object) -> float | None:
    """A session's ``lease``: None (the daemon's default over TCP), 0 (none), or
    seconds in ``[1, 86400]``."""
    seconds = timeout("lease", value, zero=True, maximum=86400.0)
    if seconds is not None and 0 < seconds < 1:
        raise invalid("lease", f"expected 0 (no lease) or at least 1 second, got {value!r}")
    return seconds


def integer(name: str, value: object, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"expected an integer, got {_kind(value)}")
    if minimum is not None and value < minimum:
        raise invalid(name, f"expected an integer >= {minimum}, got {value}")
    return value


def text(name: str, value: object, *, empty: bool = False) -> str:
    """A string (non-empty unless ``empty``), without NUL bytes."""
    if not isinstance(value, str):
        raise invalid(name, f"expected a string, got {_kind(value)}")
    if not value and not empty:
        raise invalid(name, "must not be empty")
    if "\0" in value:
        raise invalid(name, "must not contain NUL bytes")
    return value


def strings(name: str, value: object) -> list[str]:
    """A list of strings; a single string is refused (it is not a list of its letters)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence | set | frozenset):
        raise invalid(name, f"expected a list of strings, got {_kind(value)}")
    for item in value:
        if not isinstance(item, str):
            raise invalid(name, f"expected a list of strings, got an item of type {_kind(item)}")
    return list(value)


def str_map(name: str, value: object) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise invalid(name, f"expected a dict of strings, got {_kind(value)}")
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise invalid(name, f"expected a dict of strings, got {k!r}: {_kind(v)}")
    return dict(value)


def content(name: str, value: object) -> bytes:
    """Bytes to write: ``bytes``-like, or ``str`` (UTF-8). An ``int`` is refused
    (``bytes(123)`` would be 123 NUL bytes)."""
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise invalid(name, f"expected bytes or str, got {_kind(value)}")


def flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise invalid(name, f"expected True or False, got {_kind(value)}")
    return value


def file_mode(name: str, value: object) -> int:
    mode = integer(name, value, minimum=0)
    if mode > 0o7777:
        raise invalid(name, f"expected permission bits <= 0o7777, got {oct(mode)}")
    return mode


def command(value: object) -> str | list[str]:
    """An argv list of strings (not empty) or one shell string (not empty)."""
    if isinstance(value, str):
        return text("cmd", value)
    if isinstance(value, (bytes, bytearray)) or not isinstance(value, Sequence):
        raise invalid(
            "cmd", f"expected a list of strings (argv) or one shell string, got {_kind(value)}"
        )
    argv = strings("cmd", value)
    if not argv:
        raise invalid("cmd", "must not be empty")
    return argv
