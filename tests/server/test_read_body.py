"""``wire.read_body``: a small declared body is read in one await, a larger one piece by
piece; both are refused with 413 past the limit before a byte is read, and cut with
408 when the client stops sending (the small one: all of it within the idle timeout).
ASGI messages from a fake client; no daemon, no root."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

from corral.errors import FileTooLarge, RequestTimeout
from corral.server import wire


def _request(pieces: list[bytes], declared: int | None, *, stall: bool = False) -> Request:
    messages = [{"type": "http.request", "body": p, "more_body": i < len(pieces) - 1}
                for i, p in enumerate(pieces)]
    received = []

    async def receive():
        if stall and len(received) == len(messages) - 1:
            await asyncio.sleep(30)  # the client stops before its last piece
        received.append(messages[len(received)])
        return received[-1]

    headers = [] if declared is None else [(b"content-length", str(declared).encode())]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers,
                    "query_string": b""}, receive)


@pytest.mark.parametrize("pieces, declared", [
    ([b'{"timeout":30.0}'], 16),  # small: one await
    ([b"a" * 40000, b"b" * 30000], 70000),  # over WHOLE_BODY_BYTES: piece by piece
    ([b"abc", b"def"], None),  # no length declared: piece by piece
    ([b""], 0),
])
def test_bodies_are_read_whole(pieces, declared):
    got = asyncio.run(wire.read_body(_request(pieces, declared), 1 << 20, "body"))
    assert bytes(got) == b"".join(pieces)


@pytest.mark.parametrize("declared", [16, 70000])
def test_a_declared_length_over_the_limit_is_refused_before_any_byte(declared):
    request = _request([b"x" * declared], declared)
    with pytest.raises(FileTooLarge):
        asyncio.run(wire.read_body(request, 10, "body"))


@pytest.mark.parametrize("pieces, declared", [
    ([b'{"a":', b"1}"], 7),  # small: all of it within the timeout
    ([b"a" * 40000, b"b" * 30000], 70000),  # large: each piece within it
])
def test_a_body_that_stops_arriving_is_cut(monkeypatch, pieces, declared):
    monkeypatch.setattr(wire, "BODY_IDLE_TIMEOUT_S", 0.05)
    with pytest.raises(RequestTimeout):
        asyncio.run(wire.read_body(_request(pieces, declared, stall=True), 1 << 20, "body"))
