"""The wire protocol between the engine and the in-sandbox agent (``agent/agent.c``).

Frame: ``u32 payload_len | u8 type | u32 request_id | payload``, little endian.
Payload: fields ``u8 tag | u32 len | bytes``; integers are 8-byte little endian.
The numbers below must match the enums at the top of ``agent.c``.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import Iterable, Iterator

HEADER = struct.Struct("<IBI")
FIELD = struct.Struct("<BI")
U64 = struct.Struct("<Q")
I64 = struct.Struct("<q")
ENTRY = struct.Struct("<IQqII")


class Msg(IntEnum):
    EXEC = 1
    STDIN = 2
    STDIN_CLOSE = 3
    SIGNAL = 4
    FWRITE = 10
    FREAD = 11
    FLIST = 12
    FSTAT = 13
    FREMOVE = 14
    FMKDIR = 15
    PING = 16
    # agent -> engine
    STARTED = 101
    STDOUT = 102
    STDERR = 103
    EXIT = 104
    OK = 105
    ERR = 106
    READY = 107


class Tag(IntEnum):
    ARGV = 1
    ENV = 2
    CWD = 3
    TIMEOUT_MS = 4
    MAX_OUTPUT = 5
    STDIN = 6
    STDIN_OPEN = 7
    PATH = 8
    DATA = 9
    MODE = 10
    PARENTS = 11
    OFFSET = 12
    LENGTH = 13
    TRUNCATE = 14
    RECURSIVE = 15
    SIGNAL = 16
    PID = 20
    CODE = 21
    TIMED_OUT = 22
    TRUNC_OUT = 23
    TRUNC_ERR = 24
    DURATION_US = 25
    ERRNO = 26
    MESSAGE = 27
    ENTRY = 28
    SIZE = 29
    KILLED_BY_SIGNAL = 30


Field = tuple[int, "bytes | str | int"]


def encode(msg: int, request_id: int, fields: Iterable[Field] = ()) -> bytes:
    parts: list[bytes] = []
    for tag, value in fields:
        if isinstance(value, bool) or isinstance(value, int):
            raw = U64.pack(int(value) & 0xFFFFFFFFFFFFFFFF)
        elif isinstance(value, str):
            raw = value.encode()
        else:
            raw = bytes(value)
        parts.append(FIELD.pack(tag, len(raw)))
        parts.append(raw)
    payload = b"".join(parts)
    return HEADER.pack(len(payload), msg, request_id) + payload


def iter_fields(payload: bytes) -> Iterator[tuple[int, bytes]]:
    off, n = 0, len(payload)
    while off + FIELD.size <= n:
        tag, length = FIELD.unpack_from(payload, off)
        off += FIELD.size
        yield tag, payload[off : off + length]
        off += length


class Fields:
    """Decoded fields of one frame, looked up by tag."""

    __slots__ = ("_items",)

    def __init__(self, payload: bytes) -> None:
        self._items = list(iter_fields(payload))

    def raw(self, tag: int, default: bytes = b"") -> bytes:
        for t, v in self._items:
            if t == tag:
                return v
        return default

    def all(self, tag: int) -> list[bytes]:
        return [v for t, v in self._items if t == tag]

    def u64(self, tag: int, default: int = 0) -> int:
        v = self.raw(tag)
        return U64.unpack(v)[0] if len(v) == 8 else default

    def i64(self, tag: int, default: int = 0) -> int:
        v = self.raw(tag)
        return I64.unpack(v)[0] if len(v) == 8 else default

    def text(self, tag: int) -> str:
        return self.raw(tag).decode(errors="replace")


def decode_entry(raw: bytes) -> tuple[int, int, int, int, int, str]:
    """(mode, size, mtime_ns, uid, gid, name) of an ENTRY field."""
    mode, size, mtime, uid, gid = ENTRY.unpack_from(raw)
    return mode, size, mtime, uid, gid, raw[ENTRY.size :].decode(errors="surrogateescape")
