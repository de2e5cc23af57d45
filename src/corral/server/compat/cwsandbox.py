"""CoreWeave Sandbox front-end: scripts written for the ``cwsandbox`` client run unmodified.

``corral serve --grpc HOST:PORT`` serves ``coreweave.sandbox.v1.SandboxService`` over
gRPC on the daemon's own event loop, against the same engine and admission control as
corral's HTTP API. The client is pointed at it with environment variables only::

    CWSANDBOX_BASE_URL=http://HOST:PORT   # http:// = no TLS
    CWSANDBOX_API_KEY=<the daemon's --token>

What maps to what (the details live in :mod:`corral.server.compat.cwsandbox_wire`):

- CreateSandbox admits and starts a sandbox and answers once it runs (corral starts
  one in well under a second), so the client's first poll sees ``RUNNING``. A main
  command other than the client's keep-alive default runs in the background; when it
  exits the sandbox stops and reports ``COMPLETED`` with its exit code.
- DeleteSandbox removes the sandbox; its final state stays visible to GetSandbox (the
  client polls for it after a stop) in a bounded in-memory record.
- StreamExec streams a command's output and exit, and its stdin as the client sends
  it; a cancelled call (the client's exec timeout is the call's deadline) kills the
  command. See :mod:`corral.server.compat.cwsandbox_exec`.
- ConnectSandbox (direct data plane) is ``UNIMPLEMENTED``, so the client uses this
  service for everything; so are TTY sessions, logs, snapshots and templates.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import grpc.aio
from cwsandbox._proto import sandbox_pb2, sandbox_pb2_grpc

from corral.errors import CorralError, FileError, FileNotFound, InvalidArgument, SandboxNotFound
from corral.runtime.engine import SANDBOX_HOME, Engine
from corral.runtime.events import SandboxDeleted
from corral.schema import SandboxInfo, SandboxState
from corral.server.admission import LIVE_STATES
from corral.server.auth_throttle import AuthThrottle
from corral.server.caller import Caller
from corral.server.compat import cwsandbox_exec as cwexec
from corral.server.compat import cwsandbox_wire as wire
from corral.server.compat.cwsandbox_edge import GrpcEdge, cut_if_unread
from corral.server.compat.cwsandbox_guard import (
    MAX_RECEIVE_BYTES,
    MAX_SEND_BYTES,
    UNARY_FILE_CAP,
    Guard,
)
from corral.server.compat.cwsandbox_guard import abort as _abort
from corral.server.door import Door
from corral.server.sandbox_verbs import SandboxVerbs
from corral.server.service import SandboxService as Lifecycle
from corral.server.settings import ServerSettings
from corral.server.stream_limits import StreamBook

__all__ = ["CwSandboxFrontend", "SandboxService"]

logger = logging.getLogger("corral.server.cwsandbox")

MAX_DELETE_GRACE_S = 30.0
ENDED_RECORDS = 10_000  # deleted sandboxes whose final state GetSandbox still reports
ENDED_BYTES = 64 << 20  # ... and the bytes their messages may take together
PYTHON_PATHS = ("/usr/local/bin/python", "/usr/bin/python")
PYTHON_ALIAS = f"{SANDBOX_HOME}/.local/bin/python"  # first on the PATH the engine sets
PYTHON_ALIAS_SCRIPT = b'#!/bin/sh\nexec python3 "$@"\n'


class SandboxService(sandbox_pb2_grpc.SandboxServiceServicer):
    """``coreweave.sandbox.v1.SandboxService`` on a corral engine."""

    def __init__(
        self,
        settings: ServerSettings,
        engine: Engine,
        lifecycle: Lifecycle,
        guard: Guard,
        activity: Any = None,
    ) -> None:
        self._settings = settings
        self._guard = guard  # the door's caller of each call
        self._engine = engine  # exec and files; create, delete and stop go to lifecycle
        self._lifecycle = lifecycle
        self._activity = activity
        self._commands: dict[str, tuple[str, tuple[str, ...]]] = {}
        self._mains: dict[str, asyncio.Task[None]] = {}
        self._exit_codes: dict[str, int] = {}
        # deleted sandboxes' last messages, with their tenant (others' are unknown ids)
        self._ended: OrderedDict[str, tuple[str | None, Any]] = OrderedDict()
        self._ended_bytes = 0
        # a sandbox deleted another way (native API, E2B, lifetime, retention) is
        # forgotten here too (a tenant's creates with large commands, deleted over
        # HTTP, grew the daemon's memory without bound)
        engine.events.subscribe(SandboxDeleted, self._deleted)

    # ------------------------------------------------------------- plumbing

    @contextlib.asynccontextmanager
    async def _rpc(
        self, context: grpc.aio.ServicerContext, operation: str, **where: Any
    ) -> AsyncIterator[None]:
        """Authenticate, count the call as activity, and turn errors into statuses."""
        if self._activity is not None:
            self._activity.in_flight += 1
        try:
            self._guard.caller_of(context)  # resolved once, by the door (fails closed)
            yield  # each verb passes its caller on explicitly (a tenant sees only its own)
        except wire.RpcFailure as failure:
            await _abort(context, failure)
        except CorralError as exc:
            await _abort(context, wire.from_corral(exc, operation=operation, **where))
        except grpc.aio.AbortError:
            raise
        except Exception:
            logger.exception("unexpected error serving cwsandbox %s", operation)
            await _abort(
                context,
                wire.RpcFailure(
                    grpc.StatusCode.INTERNAL, "internal error in the corral daemon; see its log"
                ),
            )
        finally:
            if self._activity is not None:
                self._activity.in_flight -= 1
                self._activity.last = time.monotonic()

    def _verbs(self, context: grpc.aio.ServicerContext) -> SandboxVerbs:
        """The service's sandbox verbs, for this call's caller (from the door)."""
        return SandboxVerbs(self._engine, self._guard.caller_of(context))

    def _message(self, info: SandboxInfo) -> Any:
        return wire.sandbox_message(
            info, exit_code=self._exit_codes.get(info.id), command=self._commands.get(info.id)
        )

    # ------------------------------------------------------------ lifecycle

    async def CreateSandbox(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with self._rpc(context, "create"):
            images = {image.name for image in self._engine.images.list()}
            plan = wire.plan_create(request, images)
            caller = self._guard.caller_of(context)  # from the door
            host_network = (self._settings.allow_host_network  # the daemon's and the caller's
                            and caller.may_use_host_network)
            spec = self._lifecycle.plan(  # ImageNotFound and the like before waiting for room
                await self._lifecycle.with_image(plan.spec, caller), caller, host_network=host_network,
                frontend="cwsandbox")
            info = await self._lifecycle.create(spec, caller)
            try:
                verbs = SandboxVerbs(self._engine, caller)
                await self._python_alias(verbs, info.id)
                for path, data in plan.files:
                    await verbs.write_file(info.id, path, data)
                if plan.command is not None:
                    self._commands[info.id] = plan.command
                    self._start_main(info.id, plan.command, caller)
            except BaseException:
                await asyncio.shield(self._discard(info.id, caller))
                raise
            # The reply may never reach a client that gave up just now: then nobody
            # knows the sandbox, so it goes.
            context.add_done_callback(
                lambda ctx: self._discard_if_cancelled(ctx, info.id, caller))
            logger.debug("cwsandbox client created sandbox %s (image %s)", info.id, spec.image)
            return self._message(info)

    @staticmethod
    async def _python_alias(verbs: SandboxVerbs, sandbox_id: str) -> None:
        """cwsandbox scripts (and ``@session.function``) run ``python``, which the hosted
        ``python:3.11`` image has; Debian's python3 does not: add it on the PATH."""
        for path in PYTHON_PATHS:
            with contextlib.suppress(FileNotFound):
                await verbs.stat(sandbox_id, path)
                return
        await verbs.write_file(sandbox_id, PYTHON_ALIAS, PYTHON_ALIAS_SCRIPT, mode=0o755)

    def _discard_if_cancelled(self, context: grpc.aio.ServicerContext, sandbox_id: str,
                              caller: Caller) -> None:
        if context.cancelled():
            logger.info(
                "cwsandbox client left before sandbox %s was handed over: deleting it", sandbox_id
            )
            asyncio.ensure_future(self._discard(sandbox_id, caller))

    async def _discard(self, sandbox_id: str, caller: Caller) -> None:
        """Delete a sandbox nobody will use; never raises."""
        await self._stop_main(sandbox_id)
        try:
            await self._lifecycle.delete(sandbox_id, caller)
        except CorralError as exc:
            logger.warning("could not delete sandbox %s: %s", sandbox_id, exc.message)
            self._lifecycle.pools.release(sandbox_id)
        self._commands.pop(sandbox_id, None)
        self._exit_codes.pop(sandbox_id, None)

    def _start_main(self, sandbox_id: str, command: tuple[str, tuple[str, ...]],
                    caller: Caller) -> None:
        argv = [command[0], *command[1]]
        task = asyncio.create_task(self._run_main(sandbox_id, argv, caller))
        self._mains[sandbox_id] = task
        task.add_done_callback(lambda t: self._forget_main(sandbox_id, t))

    def _forget_main(self, sandbox_id: str, task: asyncio.Task[None]) -> None:
        if self._mains.get(sandbox_id) is task:
            del self._mains[sandbox_id]

    async def _run_main(self, sandbox_id: str, argv: list[str], caller: Caller) -> None:
        """The sandbox's main command: when it exits, so does the sandbox (COMPLETED)."""
        try:
            result = await self._engine.exec(sandbox_id, argv, timeout=None, max_output=0,
                                             owner=caller.name)
            code = wire.exit_status(result.returncode)
        except FileError as exc:  # the command could not start
            code = cwexec.cannot_run_status(exc)
        except CorralError:
            return  # the sandbox ended first: its state says why
        try:
            if self._engine.get(sandbox_id, owner=caller.name).state != SandboxState.RUNNING:
                return  # killed because its sandbox is ending (lifetime, stop): not its exit
        except CorralError:
            return
        self._exit_codes[sandbox_id] = code
        try:
            await self._lifecycle.stop(  # for the caller that made it
                sandbox_id, caller, grace=0, reason=f"its main command exited with status {code}"
            )
        except CorralError:
            return

    async def _stop_main(self, sandbox_id: str) -> None:
        task = self._mains.pop(sandbox_id, None)
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task})

    async def GetSandbox(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        sid = request.sandbox_id
        async with self._rpc(context, "get", sandbox_id=sid):
            try:
                info = wire.reachable(self._verbs(context).get(sid))
            except SandboxNotFound:
                if (ended := self._ended_message(sid, context)) is not None:
                    return ended
                raise
            message = self._message(info)
            if info.state in (SandboxState.RUNNING, SandboxState.PAUSED):
                with contextlib.suppress(CorralError, OSError):  # it may end meanwhile
                    usage = self._verbs(context).usage(sid)
                    message.status.resource_usage.memory_mb = int(usage["memory_mb"])
            return message

    async def ListSandboxes(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with self._rpc(context, "list"):
            tags = list(request.tags)
            wanted = request.state
            states = wire.corral_states(wanted) if wanted else None
            infos = self._engine.list(tags=tags, state=states,
                                      owner=self._guard.caller_of(context).name)
            found = [self._message(i) for i in infos if not wire.tensorlake_owned(i.spec.tags)]
            terminal = wanted in wire.TERMINAL_STATES or (not wanted and request.show_terminated)
            if terminal:
                found += [m for owner, m in self._ended.values()
                          if set(tags) <= set(m.spec.tags)
                          and self._guard.caller_of(context).sees(owner)]
            if wanted:
                found = [m for m in found if m.status.state == wanted]
            elif not request.show_terminated:
                found = [m for m in found if m.status.state not in wire.TERMINAL_STATES]
            if len(request.volume_ids):
                found = []  # corral has no registered volumes
            oldest_first = request.sort_direction == sandbox_pb2.SORT_DIRECTION_ASCENDING
            found.sort(key=lambda m: m.status.create_time.ToNanoseconds(), reverse=not oldest_first)
            return _page(found, request.page_size, request.page_token)

    async def DeleteSandbox(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        sid = request.sandbox_id
        async with self._rpc(context, "delete", sandbox_id=sid):
            if len(request.snapshot_volumes):
                raise wire.unsupported("snapshot_volumes (file-system snapshots)")
            try:
                info = wire.reachable(self._verbs(context).get(sid))
            except SandboxNotFound:
                if (ended := self._ended_message(sid, context)) is not None:
                    return sandbox_pb2.DeleteSandboxResponse(sandbox=ended)
                if request.allow_missing:
                    return sandbox_pb2.DeleteSandboxResponse()
                raise
            # Shielded: a client that gives up half-way must not leave half a sandbox.
            final = await asyncio.shield(self._delete(
                info, float(request.grace_period_seconds), self._guard.caller_of(context)))
            return sandbox_pb2.DeleteSandboxResponse(sandbox=final)

    def _ended_message(self, sid: str, context: grpc.aio.ServicerContext) -> Any:
        """The last message of a deleted sandbox the caller may see, else None."""
        owner, message = self._ended.get(sid, (None, None))
        return message if self._guard.caller_of(context).sees(owner) else None

    def _deleted(self, event: SandboxDeleted) -> None:
        self._commands.pop(event.sandbox_id, None)
        self._exit_codes.pop(event.sandbox_id, None)

    async def _delete(self, info: SandboxInfo, grace: float, caller: Caller) -> Any:
        sid = info.id
        await self._stop_main(sid)
        if info.state in LIVE_STATES and grace > 0:
            # reason "deleted": a sandbox on its way out keeps no copy of its files
            info = await self._lifecycle.stop(  # the service's: its places given back
                sid, caller, grace=min(grace, MAX_DELETE_GRACE_S), reason="deleted")
        exit_code, command = self._exit_codes.get(sid), self._commands.get(sid)
        await self._lifecycle.delete(sid, caller)  # (forgets them: _deleted)
        state = wire.cw_state(info, exit_code)
        final = wire.sandbox_message(
            info,
            exit_code=exit_code,
            command=command,
            state=state if state in wire.TERMINAL_STATES else sandbox_pb2.STATE_TERMINATED,
            ended_at=info.ended_at or time.time(),
        )
        self._ended[sid] = (info.spec.tenant, final)
        self._ended_bytes += final.ByteSize()
        while len(self._ended) > ENDED_RECORDS or self._ended_bytes > ENDED_BYTES:
            _, (_, gone) = self._ended.popitem(last=False)
            self._ended_bytes -= gone.ByteSize()
        return final

    # ----------------------------------------------------------------- exec

    async def StreamExec(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        async with self._rpc(context, "exec"):
            await cwexec.stream_exec(self._verbs(context), self._settings, context)

    async def Exec(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with self._rpc(context, "exec", sandbox_id=request.sandbox_id):
            reply = await cwexec.unary_exec(self._verbs(context), request, context)
            self._bound_unread(context, len(reply.stdout) + len(reply.stderr))
            return reply

    # ---------------------------------------------------------------- files

    async def WriteFile(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        sid, path = request.sandbox_id, request.path
        async with self._rpc(context, "write_file", sandbox_id=sid, path=path):
            cwexec.check_container(request.container)
            wire.reachable(self._verbs(context).get(sid))
            limit = min(self._settings.max_upload_bytes, UNARY_FILE_CAP)
            if len(request.content) > limit:
                raise wire.RpcFailure(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{len(request.content)} bytes is over the {limit}-byte limit of one WriteFile",
                    reason="CWSANDBOX_FILE_TOO_LARGE",
                    metadata={"filepath": path, "operation": "write_file",
                              "size_bytes": len(request.content), "max_size_bytes": limit},
                )
            try:
                await self._verbs(context).write_file(sid, path, bytes(request.content))
            except FileError:
                await self._remove_partial(self._verbs(context), sid, path)
                raise
            return sandbox_pb2.WriteFileResponse()

    @staticmethod
    async def _remove_partial(verbs: SandboxVerbs, sid: str, path: str) -> None:
        """After a failed write, leave no half-written file behind."""
        with contextlib.suppress(CorralError):
            if not (await verbs.stat(sid, path)).is_dir:
                await verbs.remove(sid, path)

    async def ReadFile(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        sid, path = request.sandbox_id, request.path
        async with self._rpc(context, "read_file", sandbox_id=sid, path=path):
            cwexec.check_container(request.container)
            wire.reachable(self._verbs(context).get(sid))
            limit = min(self._settings.max_upload_bytes, UNARY_FILE_CAP)
            # held in the output budget until the call has ended: the reply waits in
            # gRPC for a client that may not read it (as unary Exec's output)
            data, hold = await self._verbs(context).read_file_held(sid, path, limit)
            context.add_done_callback(lambda _: hold.release())
            self._bound_unread(context, len(data))
            return sandbox_pb2.ReadFileResponse(content=data)

    def _bound_unread(self, context: grpc.aio.ServicerContext, nbytes: int) -> None:
        """A reply holding its room until its call ends is cut if not taken in time."""
        cut_if_unread(self._guard.connection(context), context, nbytes,
                      self._settings.write_stall_timeout, self._settings.write_min_rate)


# What corral lacks answers UNIMPLEMENTED (ConnectSandbox too: the client then falls
# back to this service for exec and files), with no traceback in the daemon's log.


def _not_supported(what: str) -> Callable[..., Any]:
    async def method(self: SandboxService, request: Any, context: grpc.aio.ServicerContext) -> None:
        async with self._rpc(context, what):
            raise wire.unsupported(what)

    return method


for _name, _what in (
    ("ConnectSandbox", "the direct data plane (the client falls back to this service)"),
    ("CreateSandboxFromTemplate", "creating from a template"),
    ("CreateSandboxFromFile", "creating from a Compose file"),
    ("GetSandboxBuildLogs", "build logs"),
    ("PurgeSandboxes", "PurgeSandboxes"),
    ("StreamLogs", "streaming logs"),
    ("CreateFileSystemSnapshot", "file-system snapshots"),
    ("GetFileSystemSnapshot", "file-system snapshots"),
    ("ListFileSystemSnapshots", "file-system snapshots"),
    ("DeleteFileSystemSnapshot", "file-system snapshots"),
):
    setattr(SandboxService, _name, _not_supported(_what))


# ----------------------------------------------------------------- helpers


def _page(found: list[Any], size: int, token: str) -> Any:
    """One page of a list; the token is the offset of the next page."""
    start = wire.page_start(token)
    if size <= 0:
        return sandbox_pb2.ListSandboxesResponse(sandboxes=found[start:])
    end = start + size
    return sandbox_pb2.ListSandboxesResponse(
        sandboxes=found[start:end], next_page_token=str(end) if end < len(found) else ""
    )


# ----------------------------------------------------------------- server


class CwSandboxFrontend:
    """The gRPC server of :class:`SandboxService` on the daemon's loop."""

    def __init__(
        self, settings: ServerSettings, engine: Engine, lifecycle: Lifecycle, door: Door,
        activity: Any = None, *, edge: GrpcEdge, throttle: AuthThrottle, streams: StreamBook,
    ) -> None:
        assert settings.grpc is not None
        self.settings = settings
        self.edge = edge  # the public port, bounded like HTTP's (cwsandbox_edge.py)
        self.guard = Guard(door, settings.max_client_requests, edge=edge, throttle=throttle,
                           streams=streams, log_calls=settings.log_format == "json")
        self.service = SandboxService(settings, engine, lifecycle, self.guard, activity)
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._stopping: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Listen on ``settings.grpc``; the port (useful when it was 0)."""
        host, port = self.settings.grpc  # type: ignore[misc]
        server = grpc.aio.server(
            interceptors=[self.guard],
            options=[
                ("grpc.max_send_message_length", MAX_SEND_BYTES),
                ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
                # A fixed 1 MiB window per call instead of one that grows (BDP probing):
                # what an unauthenticated client can push before its reset stays small.
                ("grpc.http2.bdp_probe", 0),
                ("grpc.http2.lookahead_bytes", 1 << 20),
            ]
        )
        sandbox_pb2_grpc.add_SandboxServiceServicer_to_server(self.service, server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:  # the server listens on a private Unix socket; the edge on the network
            server.add_insecure_port(self.edge.backend_address)
            await server.start()
            bound = await self.edge.listen(host, port)
        except (RuntimeError, OSError):
            await server.stop(0)
            raise InvalidArgument(
                f"cannot listen for gRPC on {address}: is the port in use?") from None
        self._server, self.port = server, bound
        logger.info(
            "CoreWeave Sandbox (cwsandbox) API on grpc://%s:%d: CWSANDBOX_BASE_URL=http://%s:%d, "
            "CWSANDBOX_API_KEY=<the daemon's token>", host, bound, host, bound,
        )
        return bound

    def begin_shutdown(self, grace: float) -> None:
        """Refuse new calls; calls in flight get ``grace`` seconds to end."""
        if self._server is not None and self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(grace))

    async def _stop(self, grace: float) -> None:
        self.edge.stop_accepting()  # relayed connections end with the server's calls
        assert self._server is not None
        await self._server.stop(grace)
        await self.edge.close()

    async def close(self) -> None:
        """Stop the server (at once if :meth:`begin_shutdown` was not called)."""
        if self._server is None:
            return
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(0))
        await self._stopping
        mains = list(self.service._mains.values())
        for task in mains:
            task.cancel()
        await asyncio.gather(*mains, return_exceptions=True)
        self._server = None
