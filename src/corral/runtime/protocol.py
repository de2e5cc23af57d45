"""The wire protocol between the engine and the in-sandbox agent (``agent/agent.c``).

Frame: ``u32 payload_len | u8 type | u32 request_id | payload``, little endian.
Payload: fields ``u8 tag | u32 len | bytes``; integers are 8-byte little endian.
The numbers below must match the enums at the top of ``agent.c``.

What the engine accepts from an agent is defined here too, since the agent runs among
code that may forge its frames: caps on frame sizes by type (:func:`check_header`,
from the header alone), fields that must tile a payload exactly (:func:`iter_fields`),
and each reply's field rules (:func:`validate`). A breach raises
:class:`ProtocolViolation`; :mod:`corral.runtime.channel` ends the sandbox for it.
"""

from __future__ import annotations

import struct
from enum import IntEnum, unique
from typing import Iterable, Iterator

HEADER = struct.Struct("<IBI")
FIELD = struct.Struct("<BI")
U64 = struct.Struct("<Q")
I64 = struct.Struct("<q")
ENTRY = struct.Struct("<IQqII")


@unique
class Msg(IntEnum):
    EXEC = 1
    STDIN = 2
    STDIN_CLOSE = 3
    SIGNAL = 4
    RESIZE = 5  # a terminal's new size (ROWS, COLS); no reply
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
    TAIL = 108  # a stream went over its cap: DROPPED bytes, then its tail (channel.py)


@unique
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
    OUTPUT_TAIL = 31  # EXEC: bytes of MAX_OUTPUT kept from the end of each stream
    STREAM = 32  # TAIL: 1 stdout, 2 stderr
    DROPPED = 33  # TAIL: bytes dropped between the head and the tail
    ROWS = 34  # EXEC with ROWS and COLS: on a pseudo-terminal of that size
    COLS = 35
    UID = 36  # EXEC: run as this uid of the sandbox (0 or 1000; default the agent's, 1000)
    QUIET_START = 37  # EXEC (present: set): no STARTED frame; the first frame says it started


Field = tuple[int, "bytes | bytearray | memoryview | str | int"]
"""(tag, value): an int goes as a u64, a str as UTF-8, anything else as its bytes."""


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


class ProtocolViolation(Exception):
    """Bytes from an agent that the protocol does not allow. ``code`` names the rule."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# What the engine accepts from an agent. Every length is checked from the frame's header,
# before the payload is read: a sandbox cannot make the daemon allocate past these.
MAX_FRAME = 16 << 20
"""The largest frame of any kind (a directory listing, a file chunk)."""
MAX_DATA_FRAME = (1 << 20) + 64
"""STDOUT / STDERR frames: the agent forwards what one read of a pipe returned (64 KiB)."""
MAX_CONTROL_FRAME = 4096
"""READY, STARTED, TAIL, EXIT and ERR frames: a few integers and a short message."""
MAX_MESSAGE = 2048
MAX_ERRNO = 4095
MAX_PID = 1 << 22  # the kernel's PID_MAX_LIMIT
MAX_ENTRY_NAME = 4096
MAX_DROPPED = 1 << 53  # bytes one stream may claim to have dropped (exact in JSON)
AGENT_MSGS = frozenset(
    {Msg.STARTED, Msg.STDOUT, Msg.STDERR, Msg.TAIL, Msg.EXIT, Msg.OK, Msg.ERR, Msg.READY}
)


_CAPS: dict[int, int] = {  # keyed by Msg, looked up by a header's raw int
    m: MAX_DATA_FRAME if m in (Msg.STDOUT, Msg.STDERR) else MAX_FRAME if m == Msg.OK
    else MAX_CONTROL_FRAME
    for m in AGENT_MSGS
}


def check_header(length: int, msg: int) -> None:
    """Refuse a frame from its header alone: an unknown type or a size over its cap."""
    cap = _CAPS.get(msg)
    if cap is None:
        raise ProtocolViolation("unknown_message", f"a frame of unknown type {msg}")
    if length > cap:
        raise ProtocolViolation(
            "frame_too_large",
            f"a {Msg(msg).name} frame announcing {length} bytes (at most {cap} allowed)",
        )


def iter_fields(payload: bytes) -> Iterator[tuple[int, bytes]]:
    """The fields of a payload; :class:`ProtocolViolation` unless they tile it exactly."""
    off, n = 0, len(payload)
    while off < n:
        if off + FIELD.size > n:
            raise ProtocolViolation("bad_field", "a payload ends inside a field header")
        tag, length = FIELD.unpack_from(payload, off)
        off += FIELD.size
        if length > n - off:
            raise ProtocolViolation(
                "bad_field", f"field {tag} announces {length} bytes, {n - off} remain"
            )
        yield tag, payload[off : off + length]
        off += length


class Fields:
    """Decoded fields of one frame, looked up by tag."""

    __slots__ = ("_items",)

    def __init__(self, payload: bytes = b"") -> None:
        self._items = list(iter_fields(payload))

    def tags(self) -> list[int]:
        return [t for t, _ in self._items]

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


# Field rules per reply: tag -> (kind, low, high). Kinds: "u64"/"i64" (exactly 8
# bytes, value within [low, high]), "bytes" (length within [low, high]), "entry"
# (a stat record and a name). Tags a reply does not list are ignored (never read);
# a listed tag may appear once, except ENTRY in a listing.
_Rule = tuple[str, int, int]
_FLAG: _Rule = ("u64", 0, 1)
_ERR_RULES: dict[int, _Rule] = {
    Tag.ERRNO: ("u64", 0, MAX_ERRNO), Tag.MESSAGE: ("bytes", 0, MAX_MESSAGE),
}
RULES: dict[int, dict[int, _Rule]] = {
    Msg.READY: {},
    Msg.STARTED: {Tag.PID: ("u64", 1, MAX_PID)},
    Msg.STDOUT: {Tag.DATA: ("bytes", 0, MAX_DATA_FRAME)},
    Msg.STDERR: {Tag.DATA: ("bytes", 0, MAX_DATA_FRAME)},
    Msg.TAIL: {Tag.STREAM: ("u64", 1, 2), Tag.DROPPED: ("u64", 1, MAX_DROPPED)},
    Msg.EXIT: {
        Tag.CODE: ("i64", -64, 255), Tag.KILLED_BY_SIGNAL: ("u64", 0, 64),
        Tag.TIMED_OUT: _FLAG, Tag.TRUNC_OUT: _FLAG, Tag.TRUNC_ERR: _FLAG,
        Tag.DURATION_US: ("u64", 0, 1 << 53),
    },
    Msg.ERR: _ERR_RULES,
}
REQUIRED: dict[int, tuple[int, ...]] = {
    Msg.STARTED: (Tag.PID,), Msg.STDOUT: (Tag.DATA,), Msg.STDERR: (Tag.DATA,),
    Msg.TAIL: (Tag.STREAM, Tag.DROPPED), Msg.EXIT: (Tag.CODE,), Msg.ERR: (Tag.ERRNO,),
}
_ENTRY_RULE: _Rule = ("entry", 0, MAX_ENTRY_NAME)
# An OK's fields depend on the request it answers.
OK_RULES: dict[int, dict[int, _Rule]] = {
    Msg.FREAD: {Tag.SIZE: ("u64", 0, (1 << 63) - 1), Tag.DATA: ("bytes", 0, MAX_FRAME)},
    Msg.FLIST: {Tag.ENTRY: _ENTRY_RULE},
    Msg.FSTAT: {Tag.ENTRY: _ENTRY_RULE},
}
OK_REQUIRED: dict[int, tuple[int, ...]] = {
    Msg.FREAD: (Tag.SIZE, Tag.DATA), Msg.FSTAT: (Tag.ENTRY,),
}


def validate(msg: int, fields: Fields, request: int | None = None, max_data: int | None = None) -> None:
    """Check a reply's fields against :data:`RULES` (an OK: :data:`OK_RULES` of the
    ``request`` it answers; ``max_data`` bounds an FREAD's DATA, the length asked)."""
    if msg == Msg.OK:
        rules, required = OK_RULES.get(request or 0, {}), OK_REQUIRED.get(request or 0, ())
    else:
        rules, required = RULES[msg], REQUIRED.get(msg, ())
    seen: set[int] = set()
    for tag, value in fields._items:
        rule = rules.get(tag)
        if rule is None:
            continue
        if tag in seen and not (tag == Tag.ENTRY and request == Msg.FLIST):
            raise ProtocolViolation("bad_field", f"field {tag} twice in a {Msg(msg).name} frame")
        seen.add(tag)
        _check_value(msg, tag, value, rule)
    if max_data is not None and len(fields.raw(Tag.DATA)) > max_data:
        raise ProtocolViolation(
            "bad_field", f"{len(fields.raw(Tag.DATA))} bytes of data where {max_data} were asked"
        )
    missing = [t for t in required if t not in seen]
    if missing:
        raise ProtocolViolation("bad_field", f"a {Msg(msg).name} frame without field {missing[0]}")


def _check_value(msg: int, tag: int, value: bytes, rule: _Rule) -> None:
    kind, low, high = rule
    if kind in ("u64", "i64"):
        if len(value) != 8:
            raise ProtocolViolation(
                "bad_field", f"field {tag} of a {Msg(msg).name} frame is {len(value)} bytes, not 8"
            )
        number = (U64 if kind == "u64" else I64).unpack(value)[0]
    elif kind == "entry":
        number = len(value) - ENTRY.size
        if number < 0:
            raise ProtocolViolation("bad_field", f"a file entry of {len(value)} bytes")
    else:
        number = len(value)
    if not low <= number <= high:
        raise ProtocolViolation(
            "bad_field", f"field {tag} of a {Msg(msg).name} frame is out of range ({number})"
        )


def decode_entry(raw: bytes) -> tuple[int, int, int, int, int, str]:
    """(mode, size, mtime_ns, uid, gid, name) of an ENTRY field."""
    mode, size, mtime, uid, gid = ENTRY.unpack_from(raw)
    return mode, size, mtime, uid, gid, raw[ENTRY.size :].decode(errors="surrogateescape")


class Reply:
    """One frame from the agent. ``data``: an output frame's bytes."""

    __slots__ = ("msg", "fields", "data")

    def __init__(self, msg: int, fields: Fields, data: bytes = b"") -> None:
        self.msg = msg
        self.fields = fields
        self.data = data
