"""Plain data and framing between the judge and the solution process.

Runs inside the sandbox: :mod:`corral.rl._grading` sends this file's text followed by
:mod:`corral.guest.judge`'s as one ``python3 -I -c`` program, so it imports nothing of
corral. The decoder is the trust boundary: whatever the solution's process sends, the
judge gets back only exact built-in types (docs/grading.md).
"""

import json
import math
import os
import select
import struct
import sys
import time

MAX_MESSAGE = 64 << 20          # bytes of one message between judge and solution
MAX_DEPTH = 100                 # nesting of plain data, the same count on both sides
HEADER = struct.Struct("<I")
PLAIN_SCALARS = (type(None), bool, int, float, str)

# Big integers are plain data too (json parses them with int(), which Python otherwise
# caps at 4300 digits); the message size bounds the work.
sys.set_int_max_str_digits(0)


class SolutionGone(BaseException):
    """The solution process died or broke the protocol: no more calls."""


class JudgeTimeout(BaseException):
    """The test's time ran out."""


class Handle:
    """Base of the judge's handles to objects in the solution's process."""

    __slots__ = ("_id",)


def _exact(value):
    """A subclass of a plain type (``Counter``, ``namedtuple``, ``IntEnum``, a ``str``
    subclass, ``bytearray``...) as its exact base value, read through the base type's
    own methods: a subclass that overrides ``__eq__`` or ``__iter__`` has no say.
    ``None`` if ``value`` is nothing of the kind."""
    for base, convert in _BASES:
        if isinstance(value, base):
            try:
                return convert(value)
            except Exception:  # noqa: BLE001 - a fake __class__, a broken subclass
                return None
    return None


_BASES = (
    (int, int.__index__),
    (float, float.__float__),
    (complex, complex.__complex__),
    (str, str.__str__),
    ((bytes, bytearray), lambda v: bytes(memoryview(v))),
    (list, lambda v: list(list.__iter__(v))),
    (tuple, lambda v: tuple(tuple.__iter__(v))),
    (dict, lambda v: dict((k, dict.__getitem__(v, k)) for k in dict.__iter__(v))),
    (frozenset, lambda v: frozenset(frozenset.__iter__(v))),
    (set, lambda v: set(set.__iter__(v))),
)


def encode(value, ref=None, depth=0):
    """``value`` as JSON-able data. On the solution's side (``ref`` given), a subclass
    of a plain type is sent as its base value and anything else as a handle
    (``ref(value)``); on the judge's side, anything not plain raises ``TypeError``."""
    if depth > MAX_DEPTH:
        raise ValueError("plain data nested deeper than %d levels" % MAX_DEPTH)
    t = type(value)
    if t is float and (value != value or value in (math.inf, -math.inf)):
        return {"$t": "float", "v": repr(value)}
    if t in PLAIN_SCALARS:
        return value
    if t is list:
        return [encode(v, ref, depth + 1) for v in value]
    if t in (tuple, set, frozenset):
        return {"$t": t.__name__, "v": [encode(v, ref, depth + 1) for v in value]}
    if t is dict:
        return {"$t": "dict", "v": [[encode(k, ref, depth + 1), encode(v, ref, depth + 1)]
                                    for k, v in value.items()]}
    if t is bytes:
        return {"$t": "bytes", "v": value.hex()}
    if t is complex:
        return {"$t": "complex", "v": [repr(value.real), repr(value.imag)]}
    if isinstance(value, Handle):
        return {"$t": "ref", "v": value._id}
    if ref is None:
        raise TypeError("%s is not plain data" % t.__name__)
    exact = _exact(value)
    if exact is not None:
        return encode(exact, ref, depth)
    if isinstance(value, type(sys)):  # a module: the judge imports its own if stdlib
        return {"$t": "module", "v": [str(getattr(value, "__name__", "")), ref(value)]}
    return {"$t": "ref", "v": ref(value)}


def decode(data, ref, depth=0, module=None):
    """The inverse of :func:`encode`, accepting nothing else: any other shape raises
    ``ValueError`` (the judge treats it as the solution breaking the protocol).
    ``module(name, id)`` turns a module of the solution into the judge's own (else it is
    a handle like any object)."""
    if depth > MAX_DEPTH:
        raise ValueError("nested too deep")
    t = type(data)
    if t in PLAIN_SCALARS:
        return data
    if t is list:
        return [decode(v, ref, depth + 1, module) for v in data]
    if t is not dict or set(data) != {"$t", "v"}:
        raise ValueError("not a plain-data encoding")
    kind, v = data["$t"], data["v"]
    if kind == "ref" and type(v) is int:
        return ref(v)
    if kind == "module" and type(v) is list and len(v) == 2 and type(v[0]) is str \
            and type(v[1]) is int:
        return module(v[0], v[1]) if module is not None else ref(v[1])
    if kind == "float" and v in ("nan", "inf", "-inf"):
        return math.nan if v == "nan" else float(v)  # one NaN: [nan] == [nan] holds
    if kind == "bytes" and type(v) is str:
        return bytes.fromhex(v)
    if kind == "complex" and type(v) is list and len(v) == 2 and all(type(x) is str for x in v):
        return complex(float(v[0]), float(v[1]))
    if type(v) is not list:
        raise ValueError("not a plain-data encoding")
    if kind == "dict":
        if not all(type(p) is list and len(p) == 2 for p in v):
            raise ValueError("not a plain-data encoding")
        return {decode(k, ref, depth + 1, module): decode(x, ref, depth + 1, module) for k, x in v}
    items = [decode(x, ref, depth + 1, module) for x in v]
    if kind == "tuple":
        return tuple(items)
    if kind == "set":
        return set(items)
    if kind == "frozenset":
        return frozenset(items)
    raise ValueError("not a plain-data encoding")


def send(fd, obj):
    data = json.dumps(obj, allow_nan=False).encode()
    if len(data) > MAX_MESSAGE:
        raise ValueError("message of %d bytes is over the %d byte limit" % (len(data), MAX_MESSAGE))
    view = memoryview(HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def recv(fd, deadline=None):
    """One message, or ``SolutionGone`` (EOF, oversize, garbage) / ``JudgeTimeout``."""
    head = _read_exact(fd, HEADER.size, deadline)
    (size,) = HEADER.unpack(head)
    if size > MAX_MESSAGE:
        raise SolutionGone("the solution sent a message of %d bytes (limit %d)" % (size, MAX_MESSAGE))
    try:
        return json.loads(_read_exact(fd, size, deadline))
    except (ValueError, RecursionError):
        raise SolutionGone("the solution sent a malformed message") from None


def _read_exact(fd, n, deadline):
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise JudgeTimeout()
        chunk = os.read(fd, min(n - len(buf), 1 << 20))
        if not chunk:
            raise SolutionGone("the solution's process ended")
        buf += chunk
    return bytes(buf)
