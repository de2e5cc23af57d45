"""The agent's socket protocol (runtime/agent_wire.py) cuts frames where they arrive:
however the bytes are split across reads, every frame is handed on once, whole and in
order; a header over its type's cap is refused before any of its payload is waited for,
and nothing after a fault is handed on."""

from __future__ import annotations

import random

import pytest

from corral.runtime.agent_wire import AgentWire
from corral.runtime.protocol import HEADER, MAX_CONTROL_FRAME, Msg, ProtocolViolation, Tag, encode

FRAMES = [
    (Msg.READY, 0, []),
    (Msg.STARTED, 1, [(Tag.PID, 42)]),
    (Msg.STDOUT, 1, [(Tag.DATA, b"x" * 5000)]),
    (Msg.STDERR, 1, [(Tag.DATA, b"")]),
    (Msg.EXIT, 1, [(Tag.CODE, 0)]),
    (Msg.OK, 2, []),
]


def _wire() -> tuple[AgentWire, list[tuple[int, int, list[int]]], list[BaseException]]:
    got: list[tuple[int, int, list[int]]] = []
    faults: list[BaseException] = []
    wire = AgentWire(lambda m, r, f: got.append((m, r, f.tags())), faults.append, lambda: None)
    return wire, got, faults


def _expected() -> list[tuple[int, int, list[int]]]:
    return [(m, r, [t for t, _ in fields]) for m, r, fields in FRAMES]


@pytest.mark.parametrize("seed", range(20))
def test_frames_split_anywhere_are_handed_on_whole_in_order(seed):
    stream = b"".join(encode(m, r, f) for m, r, f in FRAMES)
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(stream)), rng.randint(0, 12)))
    wire, got, faults = _wire()
    for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        wire.data_received(stream[a:b])
    assert got == _expected() and not faults
    assert wire.buffered() == 0 and wire.received == len(stream)


def test_every_byte_in_its_own_read():
    stream = b"".join(encode(m, r, f) for m, r, f in FRAMES)
    wire, got, faults = _wire()
    for i in range(len(stream)):
        wire.data_received(stream[i:i + 1])
    assert got == _expected() and not faults


def test_an_oversized_header_is_refused_at_once_and_nothing_after_is_handed_on():
    wire, got, faults = _wire()
    ok = encode(Msg.OK, 2, [])
    wire.data_received(ok + HEADER.pack(MAX_CONTROL_FRAME + 1, Msg.EXIT, 1))  # no payload yet
    assert got == [(Msg.OK, 2, [])]
    assert len(faults) == 1 and isinstance(faults[0], ProtocolViolation)
    assert faults[0].code == "frame_too_large"
    wire.data_received(ok)  # read after the fault: dropped unread
    assert len(got) == 1 and wire.buffered() == 0
