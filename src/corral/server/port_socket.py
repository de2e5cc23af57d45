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
What the daemon holds in between is held in the tenant's output budget, as an exposed
port's WebSocket holds it (``server/ws_flow.py``): the client's message until the
sandbox's server has taken it (one in flight), and the sandbox's bytes (the room of
the largest message yet, at most :data:`CHUNK`, kept while the socket lasts); when
the budget has no room, the socket is closed with 1013 and a reason that says so (a
sandbox server that reads nothing no longer makes the daemon hold 16 MiB a socket
outside it).

On the daemon's own Unix socket (its owner, the admin) there is a quicker way still:
``POST .../ports/{port}/handoff`` (:func:`handoff`) makes the same connection and hands
the client its descriptor (``SCM_RIGHTS``, one ``\\0`` byte before the reply's head), so
each message then costs two wake-ups (client, sandbox) instead of four: the daemon is
out of the path. Nothing the sandbox can reach changes (it is the connection the relay
would have used). The daemon keeps its own reference while the request lasts (the
client holds the request open; its end is the connection's): a checkpoint resets the
connection through it as it resets a relayed one, the stream counts as a live stream
of the tenant, and revoking the credential ends it (reset).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
from typing import Any

from starlette.types import Receive, Scope, Send

from corral.errors import CapacityExceeded, CorralError, InvalidArgument, TooManyRequests
from corral.runtime import syscalls
from corral.runtime.output_budget import OutputHold
from corral.server.coalesce import CoalescedWrites
from corral.server.limits import UNIX_TRANSPORT_KEY
from corral.server.sandbox_verbs import SandboxVerbs
from corral.server.wire import error_response
from corral.server.ws_flow import SPENT, UP_REFUSAL, Relayed

__all__ = ["CHUNK", "handoff", "match", "match_handoff", "serve"]

CHUNK = 1 << 16  # the most one message from the sandbox carries
_PATH = re.compile(r"/v1/sandboxes/(?P<sid>[A-Za-z0-9_.-]{1,100})/ports/(?P<port>[0-9]{1,5})/socket")
_HANDOFF = re.compile(
    r"/v1/sandboxes/(?P<sid>[A-Za-z0-9_.-]{1,100})/ports/(?P<port>[0-9]{1,5})/handoff")
POLICY = 1008  # refused: no such sandbox for this caller, or not authenticated
UNAVAILABLE = 1011  # nothing answers on the port
TRY_LATER = 1013  # over the tenant's live streams


def match(scope: Scope) -> tuple[str, int] | None:
    """``(sandbox id, port)`` of a port-socket WebSocket, None for any other path."""
    m = _PATH.fullmatch(scope.get("path", ""))
    return (m["sid"], int(m["port"])) if m else None


def match_handoff(scope: Scope) -> tuple[str, int] | None:
    """``(sandbox id, port)`` of a handoff request (``POST``), None for anything else."""
    m = _HANDOFF.fullmatch(scope.get("path", "")) if scope.get("method") == "POST" else None
    return (m["sid"], int(m["port"])) if m else None


async def handoff(scope: Scope, receive: Receive, send: Send, verbs: SandboxVerbs,
                  streams: Any) -> None:
    """Hand the client a connection to the port :func:`match_handoff` found (see the
    module docstring); returns when the client ends the request (or is revoked)."""
    target = match_handoff(scope)
    assert target is not None
    sandbox_id, port = target
    transport = scope.get(UNIX_TRANSPORT_KEY)
    if transport is None:  # only a Unix socket carries descriptors
        await error_response(InvalidArgument(
            "a port's connection is handed over on the daemon's Unix socket only: "
            "use the port socket (a WebSocket) on TCP"))(scope, receive, send)
        return
    keys: list[tuple[str, object]] = [("tenant", verbs.caller.name)] if verbs.caller.name else []
    if streams is not None and keys and streams.take(keys) is not None:
        await error_response(TooManyRequests("too many live streams for this tenant"))(
            scope, receive, send)
        return
    try:
        try:
            sock = await verbs.connect_port(sandbox_id, port)
        except CorralError as exc:
            await error_response(exc)(scope, receive, send)
            return
        try:
            await _hand(transport, sock, scope, receive, send)
        finally:
            sock.close()  # the client's descriptor keeps the connection
    finally:
        if streams is not None and keys:
            streams.give(keys)


async def _hand(transport: Any, sock: socket.socket, scope: Scope, receive: Receive,
                send: Send) -> None:
    if isinstance(transport, CoalescedWrites):
        transport.flush()
    sent = False
    if not transport.get_write_buffer_size():  # the descriptor's byte comes first
        with socket.socket(fileno=os.dup(transport.get_extra_info("socket").fileno())) as conn:
            with contextlib.suppress(OSError):
                sent = socket.send_fds(conn, [b"\0"], [sock.fileno()]) == 1
    if not sent:
        busy = CapacityExceeded("the daemon could not hand the connection over now: try "
                                "again, or use the port socket")
        await error_response(busy)(scope, receive, send)
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/octet-stream")]})
    await send({"type": "http.response.body", "body": b"", "more_body": True})
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except BaseException:  # revoked (cancelled), or the daemon stops: the connection ends
        syscalls.reset_tcp(sock.fileno())
        raise


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
            await _relay(reader, writer, receive, send,
                         Relayed(scope, verbs.output_hold()), verbs.output_hold())
        finally:
            writer.close()
    finally:
        if streams is not None and keys:
            streams.give(keys)


async def _relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 receive: Receive, send: Send, held: Relayed, out: OutputHold) -> None:
    """Both ways until either side ends: ``held`` holds the client's message until the
    sandbox's server took it, ``out`` the sandbox's bytes until the client's took them."""
    async def to_sandbox() -> None:
        while True:
            message = await receive()
            if message["type"] != "websocket.receive":
                return  # the client left
            data = message.get("bytes")
            if data is None:
                data = (message.get("text") or "").encode()
            del message
            if not held.took(len(data)):
                await _close(send, TRY_LATER, UP_REFUSAL)
                return
            writer.write(data)
            del data
            await writer.drain()
            held.sent()

    async def to_client() -> None:
        while data := await reader.read(CHUNK):
            if len(data) > out.nbytes:  # the largest piece's room is kept (at most
                out.grow(len(data) - out.nbytes)  # CHUNK: what the socket's buffers
                if out.nbytes < len(data):  # hold anyway): no budget call a message
                    await _close(send, TRY_LATER, SPENT)
                    return
            await send({"type": "websocket.send", "bytes": data})
        with contextlib.suppress(Exception):  # the client may be gone already
            await _close(send, 1000)

    tasks: list[asyncio.Future[Any]] = [asyncio.create_task(to_sandbox()),
                                        asyncio.create_task(to_client())]
    if (gone := held.gone()) is not None:  # (a client that left while the sandbox's
        tasks.append(asyncio.ensure_future(gone))  # server does not take its message)
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        held.release()
        out.release()
