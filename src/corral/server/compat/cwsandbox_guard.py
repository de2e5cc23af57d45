"""What a cwsandbox gRPC call may cost before and after it is authenticated.

:class:`Guard` is a server interceptor: it checks the ``authorization`` metadata of
every call *before* the server reads or deserialises a request message. A call
without the right token is answered ``UNAUTHENTICATED`` by a handler that never asks
for a message (a request-streaming handler that aborts at once), so an unauthenticated
client cannot make the daemon buffer its payload: the HTTP/2 stream is reset with
whatever flow control let through (a few hundred KiB at most).

It also keeps the HTTP API's edge (issue 23, part 5), sharing its books: the client's
address is its real one (the relayed connection's, :mod:`.cwsandbox_edge`); wrong tokens
count in the daemon's :class:`~corral.server.auth_throttle.AuthThrottle` (per address,
/64 for IPv6, and per token name: a guesser blocked on one port is blocked on both), and
a blocked caller is answered ``RESOURCE_EXHAUSTED`` before its token is checked; a
connection whose call passed the door is no stranger any more (it is promoted in the
connection book); a response-streaming call (``StreamExec``) is a live stream of its
tenant, counted with its HTTP ones against ``--max-tenant-streams``; and the calls one
client address may have in flight are capped (the HTTP API's ``--max-client-requests``,
counted apart). Past a cap: ``RESOURCE_EXHAUSTED``.

Message sizes: requests are capped at :data:`MAX_RECEIVE_BYTES` (the largest unary
``WriteFile`` the client sends, 32 MiB, plus framing); the client's 100 MiB channel
limit is never needed, since larger files go through ``StreamExec`` in 64 KiB-1 MiB
pieces.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio

from corral.errors import TooManyRequests
from corral.server.auth_throttle import AuthThrottle
from corral.server.caller import Caller
from corral.server.compat import cwsandbox_wire as wire
from corral.server.compat.cwsandbox_edge import GrpcEdge
from corral.server.compat.cwsandbox_log import log_call, logged, rpc_name
from corral.server.conn_limits import Connection
from corral.server.door import Door
from corral.server.limits import ClientLimiter, too_many
from corral.server.stream_limits import StreamBook

UNARY_FILE_CAP = 32 << 20  # ReadFile / WriteFile: larger files take the client's stream path
MAX_RECEIVE_BYTES = UNARY_FILE_CAP + (1 << 20)
MAX_SEND_BYTES = UNARY_FILE_CAP + (1 << 20)


def check_token(
    metadata: Any, identify: Callable[[str | None], Caller | None]
) -> wire.RpcFailure | Caller:
    """Who ``metadata``'s ``authorization: Bearer <token>`` is (the daemon's token: the
    admin; a tenant token: that tenant), else the failure."""
    for key, value in metadata or ():
        if key.lower() != "authorization":
            continue
        value = value.decode("latin-1") if isinstance(value, bytes) else value
        scheme, _, credentials = value.partition(" ")
        caller = identify(credentials.strip()) if scheme.lower() == "bearer" else None
        if caller is not None:
            return caller
        return wire.RpcFailure(
            grpc.StatusCode.UNAUTHENTICATED,
            "wrong API key: set CWSANDBOX_API_KEY to the corral daemon's token "
            "(its --token or CORRAL_TOKEN) or a tenant token (corral token create)",
        )
    return wire.RpcFailure(
        grpc.StatusCode.UNAUTHENTICATED,
        "missing API key: set CWSANDBOX_API_KEY to the corral daemon's token "
        "(its --token or CORRAL_TOKEN)",
    )


def bearer_of(metadata: Any) -> str | None:
    """The token ``metadata``'s ``authorization: Bearer`` carries (what the throttle
    counts a failure against), or None."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            value = value.decode("latin-1") if isinstance(value, bytes) else value
            scheme, _, credentials = value.partition(" ")
            return credentials.strip() or None if scheme.lower() == "bearer" else None
    return None


def _throttled(refusal: TooManyRequests) -> wire.RpcFailure:
    return wire.RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal.message)


_Held = tuple[Connection, list[tuple[str, object]]]  # what a running call counts under
_NOT_RELAYED = wire.RpcFailure(
    grpc.StatusCode.UNAVAILABLE,
    "this connection did not come through the daemon's --grpc address: connect there")


async def abort(context: grpc.aio.ServicerContext, failure: wire.RpcFailure) -> None:
    """End the call with ``failure`` (its status, message and details)."""
    await context.abort(failure.code, failure.message, trailing_metadata=failure.trailing_metadata())


def _refusal(handler: grpc.RpcMethodHandler, failure: wire.RpcFailure,
             guard: Guard, credential: str | None) -> grpc.RpcMethodHandler:
    """A handler that answers ``failure`` without reading a single request message; a
    wrong token counts as a failed authentication of the connection's address (a
    blocked one is told to wait instead)."""

    async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> None:
        conn = guard.connection(context)
        if conn is None:
            await abort(context, _NOT_RELAYED)
        assert conn is not None
        slow = guard.throttle.refusal(conn.client, credential)
        if slow is not None:
            await abort(context, _throttled(slow))
        guard.throttle.failed(conn.client, credential)
        await abort(context, failure)

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(
            refuse, response_serializer=handler.response_serializer
        )
    return grpc.stream_unary_rpc_method_handler(
        refuse, response_serializer=handler.response_serializer
    )


async def _one(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
    """The one request message of a unary-request call, read as a stream."""
    async for message in requests:
        return message
    await abort(context, wire.RpcFailure(grpc.StatusCode.INVALID_ARGUMENT,
                                         "the call ended before its request message"))


def _counted(
    behavior: Callable[..., Any], guard: Guard, caller: Caller, credential: str | None,
    handler: grpc.RpcMethodHandler,
) -> Callable[..., Any]:
    """``behavior`` refused past the edge's caps, and counted while it runs; its
    ``caller`` (from the door) handed to the servicer (:meth:`Guard.caller_of`), and the
    call held open under it, so that revoking its token cancels it. It is served as a
    request-streaming handler: a unary request is read only once the call was admitted
    (so a connection is no stranger from its first call's headers on, however long
    its first message takes to arrive, and a refused call's message is never read)."""
    clients, door, callers = guard.clients, guard.door, guard._callers
    streaming, single = handler.response_streaming, not handler.request_streaming

    async def admit(context: grpc.aio.ServicerContext) -> _Held:
        conn = guard.connection(context)
        if conn is None:
            await abort(context, _NOT_RELAYED)
        assert conn is not None
        slow = guard.throttle.refusal(conn.client, credential)
        if slow is not None:
            await abort(context, _throttled(slow))
        guard.throttle.succeeded(conn.client, credential)
        guard.promote(conn)
        if not clients.enter(conn.client):
            said = too_many(conn.client, clients.limit)
            await abort(context, wire.RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                  said["message"]))
        keys: list[tuple[str, object]] = [("tenant", caller.name)] if streaming and caller.name \
            else []
        full = guard.streams.take(keys) if keys else None
        if full is not None:
            clients.leave(conn.client)
            await abort(context, wire.RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                  full.message))
        conn.busy += 1
        return conn, keys

    def leave(held: _Held) -> None:
        conn, keys = held
        clients.leave(conn.client)
        conn.busy = max(0, conn.busy - 1)
        guard.streams.give(keys)

    if inspect.isasyncgenfunction(behavior):  # else a coroutine (streams with context.write)
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            held = await admit(context)
            callers[id(context)] = caller
            ended = _Revoked()
            try:
                if single:
                    request = await _one(request, context)
                with door.calls.holding(caller, ended.cancel):
                    async for reply in behavior(request, context):
                        yield reply
            except asyncio.CancelledError:
                await ended.abort(context)
                raise
            finally:
                callers.pop(id(context), None)
                leave(held)

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        held = await admit(context)
        callers[id(context)] = caller
        ended = _Revoked()
        try:
            if single:
                request = await _one(request, context)
            with door.calls.holding(caller, ended.cancel):
                return await behavior(request, context)
        except asyncio.CancelledError:
            await ended.abort(context)
            raise
        finally:
            callers.pop(id(context), None)
            leave(held)

    return unary


class _Revoked:
    """Ends the running call when its token is revoked: its task is cancelled (a
    running command is killed, as when the client cancels), and the client is told
    UNAUTHENTICATED (a handler that just stops would leave it waiting for a status)."""

    def __init__(self) -> None:
        self.task = asyncio.current_task()
        self.revoked = False

    def cancel(self) -> None:
        self.revoked = True
        if self.task is not None:
            self.task.cancel()

    async def abort(self, context: grpc.aio.ServicerContext) -> None:
        """After the cancel: the status, if it was the revoke's (raises AbortError)."""
        if self.revoked and not context.done():
            await abort(context, wire.RpcFailure(
                grpc.StatusCode.UNAUTHENTICATED,
                "the token of this call was revoked while it ran"))


_KINDS = {  # (request_streaming, response_streaming) → (attribute, factory)
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


class Guard(grpc.aio.ServerInterceptor):
    """Authentication before any message is read, then the edge's caps; with
    ``log_calls`` (``--log-format json``) one access-log line per call (cwsandbox_log)."""

    def __init__(
        self, door: Door, max_client_calls: int, *, edge: GrpcEdge, throttle: AuthThrottle,
        streams: StreamBook, log_calls: bool = False,
    ) -> None:
        self.door = door  # the daemon's one door: the same check as for HTTP
        self.edge = edge  # who the connection really is (cwsandbox_edge)
        self.throttle = throttle  # the daemon's, shared with HTTP (auth_throttle.py)
        self.streams = streams  # the daemon's live streams per tenant (stream_limits.py)
        self.clients = ClientLimiter(max_client_calls)
        self.log_calls = log_calls
        self._callers: dict[int, Caller] = {}  # by id(context), while the call runs

    def connection(self, context: grpc.aio.ServicerContext) -> Connection | None:
        """The relayed connection of a call; None if it did not come through the edge."""
        return self.edge.connection_of(context.peer() or "")

    def promote(self, conn: Connection) -> None:
        """One of ``conn``'s calls passed the door: it is no stranger now."""
        if not conn.authenticated:
            conn.authenticated = True
            self.edge.book.promote(conn)

    def caller_of(self, context: grpc.aio.ServicerContext) -> Caller:
        """The caller the door found for the call ``context`` is; fail closed: a call
        that did not pass this interceptor is UNAUTHENTICATED."""
        caller = self._callers.get(id(context))
        if caller is None:
            raise wire.RpcFailure(grpc.StatusCode.UNAUTHENTICATED,
                                  "this call was not authenticated by the daemon's door")
        return caller

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler  # an unknown method: UNIMPLEMENTED, nothing read
        metadata = handler_call_details.invocation_metadata
        failure = check_token(metadata, self.door.bearer)
        method = rpc_name(handler_call_details.method)
        if isinstance(failure, wire.RpcFailure):
            if self.log_calls:
                log_call(method, None, failure.code.name, time.perf_counter())
            return _refusal(handler, failure, self, bearer_of(metadata))
        attribute, _ = _KINDS[(handler.request_streaming, handler.response_streaming)]
        _, factory = _KINDS[(True, handler.response_streaming)]  # read after admission
        behavior = _counted(getattr(handler, attribute), self, failure, bearer_of(metadata),
                            handler)
        if self.log_calls:
            behavior = logged(behavior, method, failure.name)
        return factory(
            behavior,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
