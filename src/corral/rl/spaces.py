"""Exact transfer of gymnasium spaces and values between this process and a sandbox.

A :class:`~corral.rl.SandboxEnv` talks to its environment over a pipe, one JSON line per
message. JSON alone would lose what RL code relies on: a ``float32`` observation would
come back as ``float64`` lists, a tuple as a list, ``np.int64(3)`` as ``3``. Here every
value keeps its type: arrays travel as ``dtype``, ``shape`` and their raw bytes
(base64), so an observation is bit-for-bit the one the environment produced, and a
trajectory digest computed on either side of the pipe is the same.

Nothing is ever unpickled: what comes out of a sandbox is untrusted, and JSON with a
few tagged shapes can only rebuild plain data.

This module runs on both sides. It imports only the standard library, numpy and
gymnasium, and is uploaded into the sandbox next to the environment server
(``corral.guest.env_server``), so both ends share one codec.

>>> from gymnasium.spaces import Box, Dict, Discrete
>>> space = Dict({"pos": Box(-1.0, 1.0, (2,)), "door": Discrete(3, start=1)})
>>> space_from_dict(space_to_dict(space)) == space
True
>>> decode(encode(np.arange(3, dtype=np.uint8))).dtype
dtype('uint8')
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
from gymnasium import spaces

# Tags of encoded values: a dict with exactly one of these keys.
ND, ND_OBJECT, NP_SCALAR, TUPLE, BYTES, DICT, OPAQUE = (
    "__nd__", "__ndo__", "__np__", "__tuple__", "__bytes__", "__dict__", "__opaque__",
)
TAGS = frozenset({ND, ND_OBJECT, NP_SCALAR, TUPLE, BYTES, DICT, OPAQUE})


class UnsupportedSpace(TypeError):
    """A space type this codec cannot describe (see :func:`space_to_dict`)."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytearray:
    # A bytearray, so arrays built on it are writable (np.frombuffer of bytes is not).
    return bytearray(base64.b64decode(text))


def _dtype_descr(dtype: np.dtype) -> Any:
    return np.lib.format.dtype_to_descr(dtype)


def _dtype(descr: Any) -> np.dtype:
    if isinstance(descr, list):  # a structured dtype: [[name, type, (shape)], ...]
        descr = [tuple(field) for field in descr]
    return np.lib.format.descr_to_dtype(descr)


# --------------------------------------------------------------------- values


def encode(value: Any) -> Any:
    """``value`` as JSON-ready data that :func:`decode` turns back into an equal value
    of the same type (arrays: same dtype, shape and bytes)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            return {ND_OBJECT: [list(value.shape), [encode(v) for v in value.reshape(-1)]]}
        data = np.ascontiguousarray(value)
        return {ND: [_dtype_descr(value.dtype), list(value.shape), _b64(data.tobytes())]}
    if isinstance(value, np.generic):
        return {NP_SCALAR: [_dtype_descr(value.dtype), _b64(value.tobytes())]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, tuple):
        return {TUPLE: [encode(v) for v in value]}
    if isinstance(value, (bytes, bytearray)):
        return {BYTES: _b64(bytes(value))}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not (len(value) == 1 and TAGS & value.keys()):
            return {k: encode(v) for k, v in value.items()}
        return {DICT: [[encode(k), encode(v)] for k, v in value.items()]}
    # Anything else (an object in an info dict): its repr, so a step never fails on it.
    return {OPAQUE: repr(value)}


def decode(data: Any) -> Any:
    """The value :func:`encode` described. An opaque object comes back as its repr."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        ((tag, body),) = data.items()
        if tag == ND:
            descr, shape, raw = body
            return np.frombuffer(_unb64(raw), dtype=_dtype(descr)).reshape(shape)
        if tag == NP_SCALAR:
            descr, raw = body
            return np.frombuffer(_unb64(raw), dtype=_dtype(descr))[0]
        if tag == TUPLE:
            return tuple(decode(v) for v in body)
        if tag == ND_OBJECT:
            shape, items = body
            out = np.empty(len(items), dtype=object)
            for i, item in enumerate(items):
                out[i] = decode(item)
            return out.reshape(shape)
        if tag == BYTES:
            return bytes(_unb64(body))
        if tag == DICT:
            return {_hashable(decode(k)): decode(v) for k, v in body}
        if tag == OPAQUE:
            return body
    return {k: decode(v) for k, v in data.items()}


def _hashable(key: Any) -> Any:
    return key.item() if isinstance(key, np.generic) else key


def dumps(message: dict[str, Any]) -> bytes:
    """One protocol line: the encoded message as JSON, ending in ``\\n``."""
    return json.dumps(encode(message), separators=(",", ":")).encode() + b"\n"


def loads(line: bytes | str) -> dict[str, Any]:
    """The message of one protocol line."""
    return decode(json.loads(line))


# --------------------------------------------------------------------- spaces


def space_to_dict(space: spaces.Space) -> dict[str, Any]:
    """A JSON-ready description of ``space`` (Box, Discrete, MultiDiscrete,
    MultiBinary, Tuple, Dict, Text, Sequence, OneOf, Graph; subclasses as their base).
    Seeds are not part of it: seed the rebuilt space yourself."""
    if isinstance(space, spaces.Box):
        return {"type": "Box", "low": encode(space.low), "high": encode(space.high),
                "dtype": _dtype_descr(space.dtype)}
    if isinstance(space, spaces.Discrete):
        return {"type": "Discrete", "n": int(space.n), "start": int(space.start),
                "dtype": _dtype_descr(space.dtype)}
    if isinstance(space, spaces.MultiDiscrete):
        return {"type": "MultiDiscrete", "nvec": encode(space.nvec),
                "start": encode(space.start), "dtype": _dtype_descr(space.dtype)}
    if isinstance(space, spaces.MultiBinary):
        n = space.n
        return {"type": "MultiBinary", "n": [int(x) for x in n] if np.ndim(n) else int(n)}
    if isinstance(space, spaces.Tuple):
        return {"type": "Tuple", "spaces": [space_to_dict(s) for s in space.spaces]}
    if isinstance(space, spaces.Dict):
        return {"type": "Dict",
                "spaces": [[k, space_to_dict(s)] for k, s in space.spaces.items()]}
    if isinstance(space, spaces.Text):
        return {"type": "Text", "min_length": int(space.min_length),
                "max_length": int(space.max_length), "charset": space.characters}
    if isinstance(space, spaces.Sequence):
        return {"type": "Sequence", "feature_space": space_to_dict(space.feature_space),
                "stack": bool(space.stack)}
    if isinstance(space, spaces.OneOf):
        return {"type": "OneOf", "spaces": [space_to_dict(s) for s in space.spaces]}
    if isinstance(space, spaces.Graph):
        return {"type": "Graph", "node_space": space_to_dict(space.node_space),
                "edge_space": None if space.edge_space is None else space_to_dict(space.edge_space)}
    raise UnsupportedSpace(
        f"cannot transfer a {type(space).__name__} space out of the sandbox: use one of "
        "Box, Discrete, MultiDiscrete, MultiBinary, Tuple, Dict, Text, Sequence, OneOf, "
        "Graph (or a subclass of one)"
    )


def space_from_dict(data: dict[str, Any]) -> spaces.Space:
    """The space :func:`space_to_dict` described (a fresh, unseeded one)."""
    kind = data.get("type")
    if kind == "Box":
        low, high = decode(data["low"]), decode(data["high"])
        return spaces.Box(low=low, high=high, shape=low.shape, dtype=_dtype(data["dtype"]))
    if kind == "Discrete":
        dtype = _dtype(data["dtype"]) if "dtype" in data else np.int64
        return spaces.Discrete(data["n"], start=data["start"], dtype=dtype)
    if kind == "MultiDiscrete":
        return spaces.MultiDiscrete(
            decode(data["nvec"]), dtype=_dtype(data["dtype"]), start=decode(data["start"])
        )
    if kind == "MultiBinary":
        return spaces.MultiBinary(data["n"])
    if kind == "Tuple":
        return spaces.Tuple([space_from_dict(s) for s in data["spaces"]])
    if kind == "Dict":
        # Pairs, not a dict: gymnasium keeps their order (it sorts a dict's keys).
        return spaces.Dict([(k, space_from_dict(s)) for k, s in data["spaces"]])
    if kind == "Text":
        return spaces.Text(
            data["max_length"], min_length=data["min_length"], charset=data["charset"]
        )
    if kind == "Sequence":
        return spaces.Sequence(space_from_dict(data["feature_space"]), stack=data["stack"])
    if kind == "OneOf":
        return spaces.OneOf([space_from_dict(s) for s in data["spaces"]])
    if kind == "Graph":
        edge = data["edge_space"]
        return spaces.Graph(
            space_from_dict(data["node_space"]), None if edge is None else space_from_dict(edge)
        )
    raise UnsupportedSpace(f"unknown space description {kind!r}: is the sandbox's corral newer?")
