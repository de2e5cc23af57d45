"""What a cwsandbox gRPC call may cost before and after it is authenticated.

:class:`Guard` is a server interceptor: it checks the ``authorization`` metadata of
every call *before* the server reads or deserialises a request message. A call
without the right token is answered ``UNAUTHENTICATED`` by a handler that never asks
for a message (a request-streaming handler that aborts at once), so an unauthenticated
client cannot make the daemon buffer its payload: the HTTP/2 stream is reset with
whatever flow control let through (a few hundred KiB at most).

It also caps the calls one client address may have in flight (the HTTP API's
``--max-client-requests``, counted apart): more are answered ``RESOURCE_EXHAUSTED``.

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

from corral.server.caller import Caller
from corral.server.compat import cwsandbox_wire as wire
from corral.server.compat.cwsandbox_log import log_call, logged, rpc_name
from corral.server.door import Door
from corral.server.limits import ClientLimiter, too_many

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


def _peer_address(context: grpc.aio.ServicerContext) -> str:
    """``ipv4:127.0.0.1:5000`` → ``ipv4:127.0.0.1`` (the port changes per connection)."""
    peer = context.peer() or "?"
    return peer.rpartition(":")[0] or peer


async def abort(context: grpc.aio.ServicerContext, failure: wire.RpcFailure) -> None:
    """End the call with ``failure`` (its status, message and details)."""
    await context.abort(failure.code, failure.message, trailing_metadata=failure.trailing_metadata())


def _refusal(handler: grpc.RpcMethodHandler, failure: wire.RpcFailure) -> grpc.RpcMethodHandler:
    """A handler that answers ``failure`` without reading a single request message."""

    async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> None:
        await abort(context, failure)

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(
            refuse, response_serializer=handler.response_serializer
        )
    return grpc.stream_unary_rpc_method_handler(
        refuse, response_serializer=handler.response_serializer
    )


def _counted(
    behavior: Callable[..., Any], clients: ClientLimiter, caller: Caller, door: Door,
    callers: dict[int, Caller],
) -> Callable[..., Any]:
    """``behavior`` refused past the per-client cap, and counted while it runs; its
    ``caller`` (from the door) handed to the servicer (:meth:`Guard.caller_of`), and the
    call held open under it, so that revoking its token cancels it."""

    async def admit(context: grpc.aio.ServicerContext) -> str:
        client = _peer_address(context)
        if not clients.enter(client):
            said = too_many(client, clients.limit)
            await abort(context, wire.RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                  said["message"]))
        return client

    if inspect.isasyncgenfunction(behavior):  # else a coroutine (streams with context.write)
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            client = await admit(context)
            callers[id(context)] = caller
            ended = _Revoked()
            try:
                with door.calls.holding(caller, ended.cancel):
                    async for reply in behavior(request, context):
                        yield reply
            except asyncio.CancelledError:
                await ended.abort(context)
                raise
            finally:
                callers.pop(id(context), None)
                clients.leave(client)

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        client = await admit(context)
        callers[id(context)] = caller
        ended = _Revoked()
        try:
            with door.calls.holding(caller, ended.cancel):
                return await behavior(request, context)
        except asyncio.CancelledError:
            await ended.abort(context)
            raise
        finally:
            callers.pop(id(context), None)
            clients.leave(client)

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
    """Authentication before any message is read, then the per-client cap; with
    ``log_calls`` (``--log-format json``) one access-log line per call (cwsandbox_log)."""

    def __init__(self, door: Door, max_client_calls: int, log_calls: bool = False) -> None:
        self.door = door  # the daemon's one door: the same check as for HTTP
        self.clients = ClientLimiter(max_client_calls)
        self.log_calls = log_calls
        self._callers: dict[int, Caller] = {}  # by id(context), while the call runs

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
        failure = check_token(handler_call_details.invocation_metadata, self.door.bearer)
        method = rpc_name(handler_call_details.method)
        if isinstance(failure, wire.RpcFailure):
            if self.log_calls:
                log_call(method, None, failure.code.name, time.perf_counter())
            return _refusal(handler, failure)
        kind = (handler.request_streaming, handler.response_streaming)
        attribute, factory = _KINDS[kind]
        behavior = _counted(getattr(handler, attribute), self.clients, failure, self.door,
                            self._callers)
        if self.log_calls:
            behavior = logged(behavior, method, failure.name)
        return factory(
            behavior,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
