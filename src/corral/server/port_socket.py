"""A byte stream to a port of one's own sandbox, over a WebSocket (``/v1/sandboxes/{id}/
ports/{port}/socket``).

The quickest way between a client and a server inside a sandbox: after the WebSocket's
handshake, each binary message is written to a TCP connection the daemon made to the
sandbox's loopback port (:meth:`~corral.server.sandbox_verbs.SandboxVerbs.connect_port`,
as an exposed port's is: the sandbox reaches nothing new), and what that connection
sends comes back as binary messages. No HTTP request per message, so a request and its
reply cost a few wake-ups instead of a request's parsing, routing and JSON (what
:class:`corral.rl.SandboxEnv` steps over, ``benchmarks/bench_gym.py``).

Unlike an exposed port's URL, this is an API call: the door authenticates the
handshake like any request (the Unix socket, or a bearer token; the failed-auth
throttle counts wrong ones), the service layer checks the caller may reach the sandbox
(another tenant's answers as a missing one: close code 1008), and the stream is held
under the caller's credential, so revoking it closes the socket. Each one counts as a
live stream of the tenant (``--max-tenant-streams``; over it, close code 1013).
Nothing the sandbox sends is parsed here: bytes pass as they come, at most
:data:`CHUNK` a message; a client message is bounded by uvicorn's ``ws_max_size``.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import Any

from starlette.types import Receive, Scope, Send

from corral.errors import CorralError
from corral.server.sandbox_verbs import SandboxVerbs

__all__ = ["CHUNK", "match", "serve"]

CHUNK = 1 << 16  # the most one message from the sandbox carries
_PATH = re.compile(r"/v1/sandboxes/(?P<sid>[A-Za-z0-9_.-]{1,100})/ports/(?P<port>[0-9]{1,5})/socket")
POLICY = 1008  # refused: no such sandbox for this caller, or not authenticated
UNAVAILABLE = 1011  # nothing answers on the port
TRY_LATER = 1013  # over the tenant's live streams


def match(scope: Scope) -> tuple[str, int] | None:
    """``(sandbox id, port)`` of a port-socket WebSocket, None for any other path."""
    m = _PATH.fullmatch(scope.get("path", ""))
    return (m["sid"], int(m["port"])) if m else None


async def _close(send: Send, code: int, reason: str = "") -> None:
    await send({"type": "websocket.close", "code": code, "reason": reason[:120]})


async def serve(scope: Scope, receive: Receive, send: Send, verbs: SandboxVerbs,
                streams: Any) -> None:
    """Relay one WebSocket to the port :func:`match` found in its path (see the module
    docstring); returns when either side ends."""
    target = match(scope)
    assert target is not None
    sandbox_id, port = target
    keys: list[tuple[str, object]] = [("tenant", verbs.caller.name)] if verbs.caller.name else []
    if streams is not None and keys and streams.take(keys) is not None:
        await _close(send, TRY_LATER, "too many live streams for this tenant")
        return
    try:
        if (await receive())["type"] != "websocket.connect":
            return
        try:
            sock = await verbs.connect_port(sandbox_id, port)
        except CorralError as exc:
            # another tenant's sandbox is a missing one (404): refused like a bad credential
            await _close(send, POLICY if exc.status in (401, 403, 404) else UNAVAILABLE, str(exc))
            return
        reader, writer = await asyncio.open_connection(sock=sock, limit=CHUNK)
        await send({"type": "websocket.accept"})
        try:
            await _relay(reader, writer, receive, send)
        finally:
            writer.close()
    finally:
        if streams is not None and keys:
            streams.give(keys)


async def _relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 receive: Receive, send: Send) -> None:
    async def to_sandbox() -> None:
        while True:
            message = await receive()
            if message["type"] != "websocket.receive":
                return  # the client left
            data = message.get("bytes")
            if data is None:
                data = (message.get("text") or "").encode()
            writer.write(data)
            await writer.drain()

    async def to_client() -> None:
        while data := await reader.read(CHUNK):
            await send({"type": "websocket.send", "bytes": data})
        with contextlib.suppress(Exception):  # the client may be gone already
            await _close(send, 1000)

    tasks = [asyncio.create_task(to_sandbox()), asyncio.create_task(to_client())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
