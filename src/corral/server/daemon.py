"""Running the daemon: one engine, one app, a Unix socket and optionally TCP.

:func:`serve` blocks until SIGTERM / SIGINT (or ``idle_exit``), then shuts down in
order: stop accepting, give in-flight requests ``shutdown_grace`` seconds, close
the engine, remove the socket file.

SIGINT (Ctrl-C, ``corral daemon stop``) stops every sandbox. SIGTERM (systemd,
``corral daemon restart``, an upgrade) hands them over when ``restore_grace`` > 0:
they keep running, their agents detached, and the next daemon on the same state
directory adopts them (live restore: :mod:`corral.runtime.restore`, docs/restart.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import uvicorn

from corral._socket_dir import unsafe_socket_dir
from corral._version import __version__
from corral.cluster.ids import id_prefix
from corral.errors import InvalidArgument, InvalidState
from corral.runtime.cache_seed import seed_cache
from corral.runtime.engine import ID_PREFIX, Engine
from corral.runtime.images import DEFAULT_IMAGE
from corral.runtime.paths import default_cache_dir
from corral.runtime.statefiles import secure_state_dir
from corral.server import accesslog
from corral.server.admission import LIVE_STATES
from corral.server.app import Activity, create_app
from corral.server.auth_throttle import weak_token_warning
from corral.server.conn_limits import (
    ConnectionBook,
    accept_backlog,
    default_max_connections,
    protocol_for,
    raise_open_file_limit,
)
from corral.server.log_limits import RepeatFilter
from corral.server.settings import ServerSettings
from corral.server.ws_flow import ws_protocol_for

logger = logging.getLogger("corral.server")

SOCKET_MODE = 0o600
SOCKET_DIR_MODE = 0o700
BACKLOG = 4096
IDLE_CHECK_S = 1.0
# Idle client connections stay open this long. uvicorn's 5 s default makes a client
# that reuses a connection just as it is closed fail with 'Server disconnected'.
KEEP_ALIVE_S = 300
DRAIN_BACKSTOP_S = 5.0


class _Server(uvicorn.Server):
    """uvicorn, with signals handled on the loop and never re-raised after shutdown
    (uvicorn re-raises them, which would kill the process before the engine closes)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self.handover = False  # SIGTERM: leave the sandboxes to the next daemon

    def request_exit(self, *, handover: bool = False) -> None:
        """Begin a graceful shutdown (a second request forces it)."""
        if self.should_exit:
            self.force_exit = True
        else:
            self.handover = handover
        self.should_exit = True
        self._on_exit()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._signalled, sig)
        # A parent may have blocked them, and a mask survives exec: a Ray worker blocks
        # SIGINT, so a cluster node's daemon never saw `cluster down`'s SIGINT (stopped
        # by SIGKILL a minute later, its sandboxes left to the warden's grace).
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
        try:
            yield
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    def _signalled(self, sig: int) -> None:
        logger.info("received %s: shutting down", signal.Signals(sig).name)
        self.request_exit(handover=sig == signal.SIGTERM)


def bind_unix(path: Path) -> socket.socket:
    """A listening Unix socket at ``path`` that only its owner may connect to.

    The parent directory is created (mode 0700) if missing. A stale socket file is
    replaced; one a live daemon listens on is not.
    """
    path = Path(path).absolute()
    if len(os.fsencode(path)) >= 108:
        raise InvalidArgument(f"the socket path {path} is too long for a Unix socket (max 107)")
    if not path.parent.is_dir():
        path.parent.mkdir(mode=SOCKET_DIR_MODE, parents=True)
    if (why := unsafe_socket_dir(path)) is not None:  # they could swap the socket
        raise InvalidArgument(
            f"will not listen on {path}: {why}, so other users could replace the socket "
            "with their own; choose a --socket in a directory only root or you can write "
            "(the default /run/corral)", details={"socket": str(path)})
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise InvalidArgument(f"{path} exists and is not a socket: choose another --socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # nobody listens: left over from a daemon that died
        else:
            raise InvalidState(f"another daemon is already listening on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # never world-connectable, not even for an instant
    try:
        sock.bind(str(path))
    finally:
        os.umask(old_umask)
    os.chmod(path, SOCKET_MODE)
    sock.listen(BACKLOG)
    sock.setblocking(False)
    return sock


def bind_tcp(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0 picks a free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=BACKLOG)
    # Accepted connections inherit this: without it a response written in two parts
    # waits for the client's delayed ACK (~40 ms per request over TCP).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    return sock


def _remove_socket(path: Path, inode: int) -> None:
    """Remove our socket file, but not one a newer daemon made at the same path."""
    with contextlib.suppress(OSError):
        if path.lstat().st_ino == inode:
            path.unlink()


async def _exit_when_idle(
    server: _Server, activity: Activity, engine: Engine, idle_exit: float
) -> None:
    live = {s.value for s in LIVE_STATES}
    while not server.should_exit:
        await asyncio.sleep(min(IDLE_CHECK_S, idle_exit / 4))
        if activity.idle_for() < idle_exit:
            continue
        if any(n for state, n in engine.counts(owner=None).items() if state in live):
            continue
        logger.info("no requests for %g s and no sandboxes: exiting (--idle-exit)", idle_exit)
        server.request_exit()


async def _drain(engine: Engine, grace: float, handover: Any = None) -> None:
    """After ``grace`` seconds of shutdown, stop every sandbox (or, with ``handover``,
    detach from them all): commands still streaming end (their clients get an error,
    not a cut connection) and requests can finish. ``handover``: the warm pools, closed
    first (their ready sandboxes are deleted, not handed over)."""
    await asyncio.sleep(grace)
    if handover is not None:
        await handover.close()
        logger.info("handing %d live sandboxes over to the next daemon (for %g s)",
                    len(engine.list(state=LIVE_STATES, owner=None)), engine.restore_grace)
        await engine.close(handover=True)
        return
    live = engine.list(state=LIVE_STATES, owner=None)  # the daemon's own work: all owners'
    if live:
        logger.info("stopping %d sandboxes still alive after %g s", len(live), grace)
    await asyncio.gather(
        *(engine.stop(i.id, grace=0, reason="the daemon shut down", owner=None) for i in live),
        return_exceptions=True,
    )


async def _shut_down(engine: Engine, app: Any, frontend: Any,
                     tasks: list[asyncio.Task[None]], sockets: list[socket.socket], *,
                     handover: bool) -> None:
    if frontend is not None:  # before the drain is cancelled: it ends their commands
        await frontend.close()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for sock in sockets:
        sock.close()
    if app is not None:
        await app.state.pools.close()  # deletes the pools' ready sandboxes
    await engine.close(handover=handover)  # handover: its sandboxes wait for the next daemon
    if app is not None:
        await app.state.logs.close()  # after the engine: its last stops are logged


async def _seed_default(engine: Engine) -> None:
    try:
        await asyncio.to_thread(engine.images.seed, DEFAULT_IMAGE)
    except Exception as exc:  # noqa: BLE001 - the first create links it, or says why not
        logger.warning("could not link the host's default image: %s", exc)


async def run(settings: ServerSettings) -> None:
    """Serve until told to stop; the coroutine behind :func:`serve`."""
    prefix = ID_PREFIX if settings.node is None else id_prefix(settings.node)
    seeding = settings.seed_cache and settings.cache_dir is not None
    if seeding:  # the tools now (the agent); the prepared images when first asked for
        linked = await asyncio.to_thread(seed_cache, default_cache_dir(), settings.cache_dir, [])
        if linked:
            logger.info("linked the host's %s into %s", ", ".join(linked), settings.cache_dir)
    engine = await Engine.open(settings.state_dir, settings.cache_dir, id_prefix=prefix,
                               network_hosts=settings.network_hosts,
                               restore_grace=settings.restore_grace)
    engine.retention = settings.retention
    if seeding:
        engine.images.seed_from = default_cache_dir() / "images"
    for path in secure_state_dir(engine.layout.state_dir):  # root's alone, however it was left
        logger.info("made %s root-only", path)
    socket_path = Path(settings.socket).absolute()
    if settings.tcp is not None and (weak := weak_token_warning(settings.token)):
        logger.warning("%s", weak)
    sockets: list[socket.socket] = []
    inode = None
    tasks: list[asyncio.Task[None]] = []
    if seeding:  # the default image linked in the background: the daemon answers meanwhile
        tasks.append(asyncio.create_task(_seed_default(engine)))
    app = None
    server: _Server | None = None
    frontend = None  # the cwsandbox gRPC API (--grpc)
    try:
        sockets.append(bind_unix(socket_path))
        inode = socket_path.lstat().st_ino
        if settings.tcp is not None:
            sockets.append(bind_tcp(*settings.tcp))
        app = create_app(settings, engine)
        app.state.service.count_adopted()  # sandboxes the engine took over (live restore)
        open_files = raise_open_file_limit()
        book = ConnectionBook(  # every TCP connection, counted from accept (conn_limits.py)
            settings.max_connections or default_max_connections(open_files),
            settings.max_client_connections)
        if settings.grpc is not None:
            frontend = await _start_grpc(settings, engine, app, book)

        def on_exit() -> None:
            app.state.admission.close()
            if frontend is not None:  # its calls get as long as HTTP requests
                frontend.begin_shutdown(settings.shutdown_grace + DRAIN_BACKSTOP_S)
            if not tasks:  # the daemon's own work: it passes owner=None where it acts
                handover = server is not None and server.handover and settings.restore_grace > 0
                tasks.append(asyncio.create_task(_drain(
                    engine, settings.shutdown_grace, app.state.pools if handover else None)))

        config = uvicorn.Config(
            app,
            lifespan="off",
            # httptools, bounded before auth; replies no client reads end (write stall)
            http=protocol_for(book, KEEP_ALIVE_S, settings.write_stall_timeout,
                              settings.write_min_rate),
            # WebSocket only to an exposed port (server/expose.py): the guard closes others
            # "websockets" warns of its deprecation; sans-I/O, not read while its
            # replies wait (pongs to a client that reads nothing: ws_flow.py), reset as
            # HTTP ones are when their client reads too little of what they send
            ws=ws_protocol_for(settings.write_stall_timeout, settings.write_min_rate),
            loop="asyncio",
            # behind no proxy it knows of: a loopback client's X-Forwarded-For would
            # rename it for the auth throttle and the per-client caps (uvicorn trusts it)
            proxy_headers=False,
            log_config=None,
            # (--log-format json logs each request itself, with no path: accesslog.py)
            access_log=logger.isEnabledFor(logging.DEBUG) and settings.log_format == "text",
            # A backstop only: _drain ends what the engine runs after shutdown_grace.
            timeout_graceful_shutdown=settings.shutdown_grace + DRAIN_BACKSTOP_S,  # type: ignore[arg-type]
            backlog=accept_backlog(open_files, BACKLOG),
            timeout_keep_alive=KEEP_ALIVE_S,
        )
        server = _Server(config, on_exit=on_exit)
        _log_start(settings, engine, sockets)
        tasks.append(asyncio.create_task(app.state.leases.run()))  # ends expired leases
        if app.state.cluster_tenancy is not None:  # the cluster's tenants, kept fresh
            tasks.append(asyncio.create_task(app.state.cluster_tenancy.run()))
        if settings.idle_exit is not None:
            tasks.append(asyncio.create_task(
                _exit_when_idle(server, app.state.activity, engine, settings.idle_exit)))
        await server.serve(sockets=sockets)
    finally:
        await _shut_down(engine, app, frontend, tasks, sockets,
                         handover=server is not None and server.handover)
        if inode is not None:  # only now: a new daemon could not open the engine before
            _remove_socket(socket_path, inode)
        logger.info("corral daemon stopped")


async def _start_grpc(settings: ServerSettings, engine: Engine, app: Any,
                      book: ConnectionBook) -> Any:
    """The CoreWeave Sandbox gRPC front-end, listening (imported only when asked for);
    its connections count in ``book`` with the HTTP API's."""
    try:
        from corral.server.compat.cwsandbox import CwSandboxFrontend
        from corral.server.compat.cwsandbox_edge import GrpcEdge
    except ImportError as exc:
        raise InvalidArgument(
            f"--grpc needs the cwsandbox client's packages ({exc.name} is missing): "
            "pip install 'corral[compat]'"
        ) from None
    frontend = CwSandboxFrontend(settings, engine, app.state.service, app.state.door,
                                 app.state.activity, edge=GrpcEdge(book),
                                 throttle=app.state.throttle, streams=app.state.streams)
    await frontend.start()
    return frontend


def _log_start(settings: ServerSettings, engine: Engine, sockets: list[socket.socket]) -> None:
    where = [f"unix:{sockets[0].getsockname()} (mode 0600, no token)"]
    if len(sockets) > 1:
        host, port = sockets[1].getsockname()[:2]
        where.append(f"http://{host}:{port} (bearer token required)")
    logger.info(
        "corral %s listening on %s; state %s; pid %d",
        __version__,
        " and ".join(where),
        engine.layout.state_dir,
        os.getpid(),
    )


def configure_logging(level: str, log_format: str = "text") -> None:
    """Log to stderr at ``level`` unless the caller set logging up already; as JSON
    lines with ``log_format="json"`` (:mod:`corral.server.accesslog`)."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise InvalidArgument(f"unknown log level {level!r}: use debug, info, warning or error")
    handler = logging.StreamHandler()
    handler.setFormatter(accesslog.formatter(log_format))
    handler.addFilter(RepeatFilter())  # a flood of one line becomes a count (log_limits.py)
    logging.basicConfig(handlers=[handler])
    logging.getLogger("corral").setLevel(numeric)
    # uvicorn's own start/stop chatter only when debugging; its errors always.
    logging.getLogger("uvicorn").setLevel(
        numeric if numeric <= logging.DEBUG else max(numeric, logging.WARNING)
    )


def serve(settings: ServerSettings) -> None:
    """Run a daemon in this process until SIGTERM / SIGINT (blocking)."""
    configure_logging(settings.log_level, settings.log_format)
    _event_loop_run()(run(settings))


def _event_loop_run() -> Callable[[Coroutine[Any, Any, None]], None]:
    """asyncio's ``run``, or uvloop's with ``CORRAL_DAEMON_LOOP=uvloop`` (where uvloop is
    installed): the daemon then spends ~25% less CPU per request
    (``benchmarks/bench_cpu.py``). Not the default until the whole suite has run on it
    (docs/performance.md)."""
    if os.environ.get("CORRAL_DAEMON_LOOP") == "uvloop":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run  # type: ignore[no-any-return]
    return asyncio.run
