"""The wire models of interactive processes (:mod:`corral.server.processes`): a spawn,
a process's info, stdin/exchange requests and their replies, a signal and a resize.
Shared by the daemon and the SDK, like :mod:`corral.api.models`; the limits they
check are defined here once, and the engine takes them from here."""

from __future__ import annotations

import base64
import binascii
from typing import Literal

from pydantic import (
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    model_validator,
)

from corral._model import Model
from corral.api.models import MAX_OUTPUT_LIMIT, ErrorDetail, ExecResponse
from corral.errors import InvalidArgument

__all__ = [
    "DEFAULT_MAX_BUFFER", "MAX_EXCHANGE_ITEMS", "MAX_TERMINAL_SIDE",
    "ExchangeItem", "ExchangeRequest", "ExchangeResponse", "ExchangeResult",
    "ProcessInfo", "ProcessList", "ResizeRequest", "SignalRequest", "SpawnRequest",
]

DEFAULT_MAX_BUFFER = 16 << 20
"""Bytes of unread output the engine keeps per process and stream (stdout, stderr)."""
MAX_TERMINAL_SIDE = 4096
"""The most rows, and the most columns, a terminal may have."""
MAX_EXCHANGE_ITEMS = 4096
"""The most processes one ``POST /v1/processes/exchange`` may name."""
_MAX_WAIT_S = 30 * 86400


class SpawnRequest(Model):
    """``POST /v1/sandboxes/{id}/processes``: a shell string runs under ``/bin/sh -c``."""

    model_config = ConfigDict(extra="forbid")

    cmd: list[str] | str
    timeout: StrictFloat | None = Field(None, gt=0, le=_MAX_WAIT_S)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    user: str | None = Field(None, max_length=64)  # "root" or the sandbox user: docs/users.md
    max_buffer: StrictInt = Field(DEFAULT_MAX_BUFFER, ge=0, le=MAX_OUTPUT_LIMIT)
    pty: StrictBool = False
    rows: StrictInt | None = Field(None, ge=1, le=MAX_TERMINAL_SIDE)
    cols: StrictInt | None = Field(None, ge=1, le=MAX_TERMINAL_SIDE)

    @model_validator(mode="after")
    def _size_needs_pty(self) -> SpawnRequest:
        if not self.pty and (self.rows is not None or self.cols is not None):
            raise ValueError("rows and cols size a terminal: they need pty=true")
        return self


class ResizeRequest(Model):
    """``POST .../processes/{process_id}/resize``: the terminal's new size in cells."""

    model_config = ConfigDict(extra="forbid")

    rows: StrictInt = Field(ge=1, le=MAX_TERMINAL_SIDE)
    cols: StrictInt = Field(ge=1, le=MAX_TERMINAL_SIDE)


class SignalRequest(Model):
    """``POST .../processes/{process_id}/signal``: a number or a name (``SIGTERM``, ``TERM``)."""

    model_config = ConfigDict(extra="forbid")

    signal: StrictInt | str  # strict: true is not signal 1


class ProcessInfo(Model):
    """A process: ``result`` once it has exited, ``error`` if its sandbox ended first."""

    id: str
    sandbox_id: str
    pid: int
    cmd: list[str]
    state: Literal["running", "exited", "lost"]
    stdin_open: bool
    pty: bool = False
    rows: int | None = None
    cols: int | None = None
    started_at: float
    ended_at: float | None = None
    unread_bytes: int = 0
    result: ExecResponse | None = None
    error: ErrorDetail | None = None


class ProcessList(Model):
    processes: list[ProcessInfo]


class ExchangeItem(Model):
    """One process of ``POST /v1/processes/exchange`` and what to write to it first
    (``data`` as text, or ``data_b64``; neither: write nothing, just read a line)."""

    model_config = ConfigDict(extra="forbid")

    sandbox_id: str
    process_id: str
    data: str | None = None
    data_b64: str | None = None

    def payload(self) -> bytes:
        if self.data is not None and self.data_b64 is not None:
            raise InvalidArgument("an exchange item takes data or data_b64, not both")
        if self.data_b64 is None:
            return (self.data or "").encode()
        try:
            return base64.b64decode(self.data_b64, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidArgument("an exchange item's data_b64 is not valid base64") from None


class ExchangeRequest(Model):
    """``POST /v1/processes/exchange``: ``timeout`` seconds to wait for each line."""

    model_config = ConfigDict(extra="forbid")

    items: list[ExchangeItem] = Field(min_length=1, max_length=MAX_EXCHANGE_ITEMS)
    timeout: StrictFloat | None = Field(None, gt=0, le=_MAX_WAIT_S)


class ExchangeResult(Model):
    """One item's line (``data``, or ``data_b64`` if not UTF-8; ``""`` once the process
    has exited and its stdout was all read), or its ``error``."""

    data: str | None = None
    data_b64: str | None = None
    error: ErrorDetail | None = None


class ExchangeResponse(Model):
    results: list[ExchangeResult]


class ConsumeResponse(Model):
    """``POST .../consume``: the process's next line (``data``, or ``data_b64`` if not
    UTF-8; ``""``: it exited first; ``null``: none within the timeout, and it was
    killed), how it ended (``result``: its exit, the output left unread), and whether its
    sandbox was deleted before the reply (``deleted``: the sandbox is deleted whatever
    happened, before the reply, or with ``?delete=after`` right after it: then false)."""

    data: str | None = None
    data_b64: str | None = None
    result: ExecResponse
    deleted: bool = True
