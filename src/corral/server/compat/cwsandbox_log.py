"""``--log-format json`` for the cwsandbox gRPC front-end: one ``corral.access`` line
per call, like the HTTP API's (:mod:`corral.server.accesslog`)::

    {"time": "...", "level": "info", "logger": "corral.access",
     "message": "gRPC CreateSandbox OK", "tenant": "team-a", "method": "CreateSandbox",
     "route": "grpc:CreateSandbox", "status": "OK", "duration_ms": 12.3}

``method`` is the RPC's name (never a request's content); ``status`` the gRPC code's
name. A call refused for its token has ``"tenant": null``.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import grpc.aio

from corral.server.accesslog import access_log
from corral.server.tenants import ADMIN_NAME


def rpc_name(full_method: str) -> str:
    """``/coreweave.sandbox.v1.SandboxService/CreateSandbox`` → ``CreateSandbox``."""
    return full_method.rpartition("/")[2] or "-"


def log_call(method: str, tenant: str | None, status: str, began: float) -> None:
    access_log.info(
        "gRPC %s %s", method, status,
        extra={
            "tenant": tenant,
            "method": method,
            "route": f"grpc:{method}",
            "status": status,
            "duration_ms": round((time.perf_counter() - began) * 1000, 3),
        },
    )


def _status(context: grpc.aio.ServicerContext, failed: bool) -> str:
    """The call's gRPC status: the code it was given (an abort), else OK or UNKNOWN."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):
        return next((c.name for c in grpc.StatusCode if c.value[0] == code), str(code))
    return "UNKNOWN" if failed else "OK"


def logged(behavior: Callable[..., Any], method: str, tenant: str | None) -> Callable[..., Any]:
    """``behavior`` with one access-log line when it ends, however it ends."""
    name = ADMIN_NAME if tenant is None else tenant

    if inspect.isasyncgenfunction(behavior):
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            began, failed = time.perf_counter(), True
            try:
                async for reply in behavior(request, context):
                    yield reply
                failed = False
            finally:
                log_call(method, name, _status(context, failed), began)

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        began, failed = time.perf_counter(), True
        try:
            reply = await behavior(request, context)
            failed = False
            return reply
        finally:
            log_call(method, name, _status(context, failed), began)

    return unary
