"""The connection to a corral daemon: one HTTP connection pool, shared by sandboxes."""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import httpx

from corral.api.operations import operation
from corral.client._async._lean import AsyncLeanPool
from corral.client._backends import AsyncBackend
from corral.client._body import bounded
from corral.client._config import CONNECT_TIMEOUT, DEFAULT_TIMEOUT, UNSET, Endpoint, env_now
from corral.client._embed import ensure_daemon
from corral.client._transport import daemon_errors, is_connect_error, raise_for_status
from corral.client._unix import AsyncDaemonTransport
from corral.client._wire import Encoder, LeanRequest
from corral.errors import DaemonUnavailable, InvalidArgument

if TYPE_CHECKING:
    from corral.client._async._router import AsyncRouter

Request = httpx.Request | LeanRequest

# Commands run for minutes and fan-out runs hundreds at once: a connection per call in
# flight (a Unix socket is cheap), and no wait for a free one.
_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=64)


def _timeout(seconds: float | None) -> httpx.Timeout:
    connect = CONNECT_TIMEOUT if seconds is None else min(CONNECT_TIMEOUT, seconds)
    return httpx.Timeout(seconds, connect=connect, pool=None)


RECONNECT_WAIT_S = 30.0
"""How long a request waits for a daemon that answered this client before and now does
not (it is restarting: its sandboxes live on, docs/restart.md), retrying the connect."""
_RECONNECT_POLL_S = 0.2


# Over TCP a request goes out in two writes (headers, body); without TCP_NODELAY the
# second waits for the daemon's delayed ACK (tens of ms per call).
_TCP_OPTIONS = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
# On a cluster, a node that dies mid-call (its host gone, no RST) is noticed in about
# 5 + 2 x 3 s by keepalive probes rather than when a long exec's timeout ends.
_CLUSTER_OPTIONS = _TCP_OPTIONS + [
    (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
    (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 5),
    (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 2),
    (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3),
    (socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 11_000),  # unacknowledged data, too
]


class AsyncClient:
    """A connection pool to one corral daemon, used by the sandboxes made with it.

    ``url`` is ``unix:///path/to/corral.sock`` or ``http://host:port`` (with
    ``token``), or ``ray://HOST:PORT`` / ``ray://auto`` for the daemons of a Ray cluster
    (``corral cluster up``; each call goes straight to the right node's daemon); left
    out, it comes from ``CORRAL_URL``, else ``CORRAL_SOCKET`` (see
    :mod:`corral.client._config`), and then the SDK may start a daemon itself.
    ``timeout`` bounds every request except commands, whose requests last as long as
    the command's own timeout allows. Building a client does no I/O.

    Example::

        async with corral.AsyncClient("unix:///run/corral/corral.sock") as client:
            sb = await corral.AsyncSandbox.create(image="python", client=client)

    Calls that get no ``client=`` share :meth:`default`.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._endpoint = Endpoint.resolve(url, token)
        self.timeout = timeout
        cluster = self._endpoint.cluster
        # whole replies on the daemon's Unix socket skip httpx's client (client/_wire.py)
        self._lean: AsyncLeanPool | None = None
        if transport is None and self._endpoint.uds and cluster is None:
            self._lean = AsyncLeanPool(self._endpoint.uds)
        if transport is None:
            options = _CLUSTER_OPTIONS if cluster else None if self._endpoint.uds else _TCP_OPTIONS
            transport = AsyncDaemonTransport(
                uds=self._endpoint.uds, limits=_LIMITS, socket_options=options
            )
        self._http = httpx.AsyncClient(
            base_url=self._endpoint.base_url,
            headers=self._endpoint.headers(),
            timeout=_timeout(timeout),
            transport=transport,
        )
        self._encoder = Encoder(self._endpoint.base_url, self._http.headers, self._http.timeout)
        self._router: AsyncRouter | None = None
        self._answered = False  # a daemon answered: a later refusal is a restart
        self.reconnect_wait = RECONNECT_WAIT_S
        if cluster is not None:
            from corral.client._async._router import AsyncRouter

            self._router = AsyncRouter(cluster, self._http, self.send, self._endpoint.token)

    @classmethod
    def default(cls) -> AsyncClient:
        """The client shared by calls given none, configured from the environment.

        One per process (and, for asyncio, per event loop) and per value of
        ``CORRAL_URL``/``CORRAL_TOKEN``/``CORRAL_SOCKET``/``CORRAL_NO_EMBED``: built on
        first use, and again when one of them changed (sandboxes made before keep
        the client they were made with).
        """
        return AsyncBackend.shared(cls, env=env_now())

    @classmethod
    def reopen(cls, url: str | None, token: str | None) -> AsyncClient:
        """A client to the daemon ``connect_args`` name, shared in this process like
        :meth:`default` (what an unpickled sandbox uses; outside an event loop, a new one)."""
        try:
            return AsyncBackend.shared(cls, env=env_now(), url=url, token=token)
        except RuntimeError:  # no running loop: connections must wait for the one used
            return cls(url, token=token)

    @property
    def url(self) -> str:
        """The daemon's address, ``unix://...``, ``http://...`` or ``ray://...``."""
        return self._endpoint.url

    @property
    def router(self) -> AsyncRouter | None:
        """Where calls go on a Ray cluster (``ray://``); None for one daemon."""
        return self._router

    @property
    def connect_args(self) -> dict[str, str | None]:
        """What builds another client to the same daemon: ``Client(**c.connect_args)``.

        ``url`` is None for the embedded daemon, so the copy resolves (and starts) it
        the same way; ``token`` is the one this client sends.
        """
        return {"url": None if self._endpoint.embed else self._endpoint.url,
                "token": self._endpoint.token}

    @property
    def over_tcp(self) -> bool:
        """Whether this client reaches its daemons over TCP (one, or a Ray cluster's;
        not on a Unix socket): a session then takes the daemons' ``default_lease``
        (on a cluster, one lease on every node: ``_leases``)."""
        return self._endpoint.uds is None

    @property
    def is_closed(self) -> bool:
        return self._http.is_closed

    async def health(self) -> dict[str, Any]:
        """``{"status": "ok"}`` if the daemon answers; :class:`DaemonUnavailable` if not."""
        health: dict[str, Any] = (await self.call("health")).json()
        return health

    async def info(self) -> dict[str, Any]:
        """The daemon's version, capacity and sandbox counts (``GET /v1/info``)."""
        info: dict[str, Any] = (await self.call("info")).json()
        return info

    async def request(
        self, method: str, path: str, *, timeout: float | None = UNSET, node: str | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """Send one request of the HTTP API (``docs/api.md``) and return its reply.

        Error replies raise their typed :class:`~corral.errors.CorralError`; an
        unreachable daemon raises :class:`~corral.errors.DaemonUnavailable`. ``node``
        pins a create to a node of a cluster.
        """
        return await self._dispatch(method, path, timeout, node, kwargs, stream=False)

    async def call(
        self, name: str, ids: Mapping[str, object] | None = None, *,
        timeout: float | None = UNSET, node: str | None = None, stream: bool = False,
        **kwargs: Any,
    ) -> httpx.Response:
        """Send operation ``name`` of :mod:`corral.api.operations` (its method and path
        from the shared declaration, the path's parameters from ``ids``), as
        :meth:`request` (``stream=True``: as :meth:`stream`)."""
        op = operation(name)
        path = op.url(**(ids or {}))
        return await self._dispatch(op.method, path, timeout, node, kwargs, stream=stream)

    async def stream(
        self, method: str, path: str, *, timeout: float | None = UNSET, **kwargs: Any
    ) -> httpx.Response:
        """Like :meth:`request`, but the body is left unread: read it with
        ``aiter_lines()``/``aiter_bytes()`` and close the reply with ``aclose()``."""
        return await self._dispatch(method, path, timeout, None, kwargs, stream=True)

    async def _dispatch(
        self, method: str, path: str, timeout: float | None, node: str | None,
        kwargs: dict[str, Any], *, stream: bool,
    ) -> httpx.Response:
        if timeout is not UNSET:
            kwargs["timeout"] = _timeout(timeout)
        if self._router is not None:
            return await self._router.request(method, path, kwargs, node=node, stream=stream)
        if node is not None:
            raise InvalidArgument(
                f"node= places a sandbox on a node of a Ray cluster, and {self.url} is one "
                "daemon: set CORRAL_URL=ray://HOST:PORT (see `corral cluster up`)"
            )
        if self._lean is not None and not stream:
            lean = self._encoder.encode(method, path, kwargs)
            if lean is not None:
                return await self.send(lean)
        return await self.send(self._http.build_request(method, path, **kwargs), stream=stream)

    async def send(self, request: Request, *, stream: bool = False) -> httpx.Response:
        """Send a built request; start the embedded daemon first if it is needed, and
        wait up to :attr:`reconnect_wait` seconds for one that answered before (it is
        restarting) when the request could not be sent.

        A body held in memory goes out in bounded pieces (:mod:`corral.client._body`)."""
        if isinstance(request, httpx.Request):
            request = bounded(request)
        try:
            response = await self._send_once(request, stream)
        except DaemonUnavailable as exc:
            if not is_connect_error(exc):
                raise
            if self._endpoint.embed and self._endpoint.uds:
                # Nothing listens on the default socket (never started, it exited when
                # idle, or it restarts): start the shared daemon, then retry; the
                # request never left.
                await AsyncBackend.run_blocking(ensure_daemon, self._endpoint.uds)
                response = await self._send_once(request, stream)
            elif self._answered and self.reconnect_wait > 0:
                response = await self._reconnect(request, stream, exc)
            else:
                raise
        self._answered = True
        if response.is_error and stream:
            with daemon_errors(self._endpoint):
                await response.aread()
            await response.aclose()
        raise_for_status(response)
        return response

    async def _reconnect(
        self, request: Request, stream: bool, first: DaemonUnavailable
    ) -> httpx.Response:
        """Retry a request that never left until the daemon answers again (bounded)."""
        deadline = time.monotonic() + self.reconnect_wait
        while time.monotonic() < deadline:
            await AsyncBackend.sleep(_RECONNECT_POLL_S)
            try:
                return await self._send_once(request, stream)
            except DaemonUnavailable as exc:
                if not is_connect_error(exc):
                    raise
        raise first

    async def _send_once(self, request: Request, stream: bool) -> httpx.Response:
        with daemon_errors(self._endpoint):
            if isinstance(request, LeanRequest):
                assert self._lean is not None
                return await self._lean.send(request)
            return await self._http.send(request, stream=stream)

    def _errors(self) -> Any:
        """A context manager turning transport errors into ``DaemonUnavailable``."""
        return daemon_errors(self._endpoint)

    async def aclose(self) -> None:
        """Close the connections (sandboxes stay; only this process's pool closes)."""
        if self._lean is not None:
            await self._lean.aclose()
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"
