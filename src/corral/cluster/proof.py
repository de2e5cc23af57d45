"""A node's daemon proves who it is before anyone sends it a credential.

On a cluster a daemon's address is not its identity: when a daemon dies, Ray restarts
it on another port, and until every client has read the directory again, whoever binds
the old port (any local user) would be sent the bearer tokens meant for it. So every
connection a client, a peer daemon or the supervisor opens to a node's daemon is proven
first, before the first byte of a request that carries a credential:

- Each node actor makes an **Ed25519 key pair** when it starts a daemon: the private
  key goes to the daemon in its environment (``CORRAL_NODE_KEY``, never on a command
  line), the public key into the node's directory entry, next to its URL (Ray's KV,
  which Ray's token authentication guards; ``GET /v1/cluster/nodes`` for clients
  outside Ray). A restarted daemon gets a new pair, and its new entry.
- On each new TCP connection the client sends ``GET /v1/cluster/proof?nonce=N`` (no
  credential, a fresh random ``N``) and the daemon answers with its signature over
  (:data:`CONTEXT`, its node id, the address and port *the connection arrived at*,
  ``N``). The client checks it with the key the directory pins for the address it
  dialled; the connection is then used for the real request (HTTP keep-alive).
- A connection to an address the directory does not list, or whose answer does not
  verify (a squatter, a relay to the daemon's new port: it signs its own port), fails
  as a connection error (:class:`httpcore.ConnectError`, so nothing was sent): the
  cluster client then reads the directory again and goes where it says now.

Why a signature and not TLS: the daemons serve plain HTTP to the compatibility clients
(E2B, Tensorlake, ...) on the same port, and a cluster+http tenant must be able to
check a node without holding anything that would let it impersonate one (an HMAC key
would). One signature per new connection costs ~0.1 ms; requests on a kept-alive
connection cost nothing more.
"""

from __future__ import annotations

import base64
import json
import secrets
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpcore
import httpx

from corral.api import operation

CONTEXT = b"corral-node-proof/1"
PROOF_PATH = operation("node_proof").path  # declared in corral.api like every endpoint
KEY_ENV = "CORRAL_NODE_KEY"
NONCE_BYTES = 32
MAX_REPLY = 4096
PROOF_TIMEOUT_S = 30.0  # the proof's exchange; never less than the connect timeout


# ------------------------------------------------------------------ keys


def make_key() -> tuple[str, str]:
    """A new key pair, ``(private, public)``, each as base64 of its raw 32 bytes."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    private = Ed25519PrivateKey.generate()
    raw_public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return _b64(private.private_bytes_raw()), _b64(raw_public)


def statement(node_id: str, host: str, port: int, nonce: str) -> bytes:
    """What a daemon signs: who it is, where the connection reached it, the nonce."""
    return b"\n".join([CONTEXT, node_id.encode(), host.encode(), str(port).encode(),
                       nonce.encode()])


def sign(private: str, node_id: str, host: str, port: int, nonce: str) -> str:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.from_private_bytes(base64.b64decode(private))
    return _b64(key.sign(statement(node_id, host, port, nonce)))


def verify(public: str, signature: str, node_id: str, host: str, port: int, nonce: str) -> bool:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        key = Ed25519PublicKey.from_public_bytes(base64.b64decode(public, validate=True))
        key.verify(base64.b64decode(signature, validate=True),
                   statement(node_id, host, port, nonce))
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def url_key(public: str) -> str:
    """A node's public key as it is written in a ``cluster+http://HOST:PORT?key=KEY``
    address (base64url, no padding: 43 characters; the key is its own fingerprint)."""
    return base64.urlsafe_b64encode(base64.b64decode(public)).decode().rstrip("=")


def parse_key(text: str) -> str | None:
    """The public key an address's ``key=`` names (either base64 alphabet, padded or
    not), in the directory's form; None if it is not 32 bytes of base64."""
    # (a standard-alphabet "+" reads as a space once a query string is decoded, the
    # first or last character's too: spaces are "+" before anything is stripped; then,
    # failing that, spaces around it as pasted)
    for form in (text.strip("\t\r\n\v\f"), text.strip()):
        form = form.replace(" ", "+").replace("-", "+").replace("_", "/")
        try:
            raw = base64.b64decode(form + "=" * (-len(form) % 4), validate=True)
        except ValueError:
            continue
        if len(raw) == 32:
            return _b64(raw)
    return None


# ------------------------------------------------------------------ pins


@dataclass(frozen=True)
class Pin:
    """Who must answer at an address: a node id and its daemon's public key (a node
    id of None: whichever node that key signs for, as at a client's first contact,
    where only the key is configured)."""

    node_id: str | None
    key: str


def address_of(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


class Pins:
    """The addresses a directory lists now, each with its node's key (thread-safe:
    the table is replaced whole)."""

    def __init__(self, nodes: Iterable[tuple[str, str | None, str]] = ()) -> None:
        self._lock = threading.Lock()
        self._by_address: dict[tuple[str, int], Pin] = {}
        self.replace(nodes)

    def replace(self, nodes: Iterable[tuple[str, str | None, str]]) -> None:
        """Pin exactly these ``(url, node_id, key)``; a node without a key is not pinned
        (so never contacted with a credential)."""
        table = {address_of(url): Pin(node_id, key) for url, node_id, key in nodes if key}
        with self._lock:
            self._by_address = table

    def get(self, host: str, port: int) -> Pin | None:
        with self._lock:
            return self._by_address.get((host, port))

    def lists(self, url: str) -> bool:
        return self.get(*address_of(url)) is not None


# ------------------------------------------------------------------ the exchange


def _request(host: str, port: int, nonce: str) -> bytes:
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return (f"GET {PROOF_PATH}?nonce={nonce} HTTP/1.1\r\nHost: {authority}\r\n"
            "Accept: application/json\r\n\r\n").encode()


def _body(reply: bytes) -> bytes | None:
    """The body of a complete reply in ``reply``, None while more must be read; a
    ValueError if it is no 200 with a Content-Length."""
    head, sep, body = reply.partition(b"\r\n\r\n")
    if not sep:
        if len(reply) > MAX_REPLY:
            raise ValueError("an over-long reply")
        return None
    lines = head.split(b"\r\n")
    if len(lines[0].split()) < 2 or lines[0].split()[1] != b"200":
        raise ValueError(f"it answered {lines[0][:80]!r}")
    length = next((int(v) for k, _, v in (line.partition(b":") for line in lines[1:])
                   if k.strip().lower() == b"content-length"), None)
    if length is None or length > MAX_REPLY:
        raise ValueError("a reply without a small Content-Length")
    return body[:length] if len(body) >= length else None


def _check(pin: Pin, host: str, port: int, nonce: str, body: bytes) -> None:
    try:
        answer = json.loads(body)
        node_id, signature = str(answer["node_id"]), str(answer["signature"])
    except (ValueError, KeyError, TypeError):
        raise ValueError("no proof in its answer") from None
    if (pin.node_id is not None and node_id != pin.node_id) or not verify(
            pin.key, signature, node_id, host, port, nonce):
        raise ValueError("its proof does not verify against the directory's key")


class Unproven(httpcore.ConnectError):
    """A daemon did not prove the key pinned for its address (nothing was sent to it)."""


def _refused(host: str, port: int, why: str) -> httpcore.ConnectError:
    return Unproven(
        f"the daemon at {host}:{port} did not prove it is the node the cluster's directory "
        f"lists there ({why}): no credential was sent; the directory is read again")


def _unlisted(host: str, port: int) -> httpcore.ConnectError:
    return httpcore.ConnectError(
        f"{host}:{port} is not a daemon the cluster's directory lists now: no credential "
        "is sent there; the directory is read again")


class AsyncProvingBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, proving each new connection (see the module)."""

    def __init__(self, pins: Pins, inner: httpcore.AsyncNetworkBackend | None = None) -> None:
        self.pins = pins
        self.inner = inner or httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        pin = self.pins.get(host, port)
        if pin is None:
            raise _unlisted(host, port)
        stream = await self.inner.connect_tcp(host, port, timeout, local_address, socket_options)
        nonce = secrets.token_hex(NONCE_BYTES)
        wait = max(timeout or 0.0, PROOF_TIMEOUT_S)  # a busy daemon answers late
        try:
            await stream.write(_request(host, port, nonce), wait)
            reply = b""
            while (body := _body(reply)) is None:
                chunk = await stream.read(MAX_REPLY, wait)
                if not chunk:
                    raise ValueError("it closed the connection")
                reply += chunk
            _check(pin, host, port, nonce, body)
        except (ValueError, httpcore.NetworkError, httpcore.TimeoutException) as exc:
            await stream.aclose()
            raise _refused(host, port, str(exc) or type(exc).__name__) from None
        return stream

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("a cluster's daemons are reached over TCP only")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


class ProvingBackend(httpcore.NetworkBackend):
    """The blocking twin of :class:`AsyncProvingBackend`."""

    def __init__(self, pins: Pins, inner: httpcore.NetworkBackend | None = None) -> None:
        self.pins = pins
        self.inner = inner or httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None,
                    socket_options: Any = None) -> httpcore.NetworkStream:
        pin = self.pins.get(host, port)
        if pin is None:
            raise _unlisted(host, port)
        stream = self.inner.connect_tcp(host, port, timeout, local_address, socket_options)
        nonce = secrets.token_hex(NONCE_BYTES)
        wait = max(timeout or 0.0, PROOF_TIMEOUT_S)  # a busy daemon answers late
        try:
            stream.write(_request(host, port, nonce), wait)
            reply = b""
            while (body := _body(reply)) is None:
                chunk = stream.read(MAX_REPLY, wait)
                if not chunk:
                    raise ValueError("it closed the connection")
                reply += chunk
            _check(pin, host, port, nonce, body)
        except (ValueError, httpcore.NetworkError, httpcore.TimeoutException) as exc:
            stream.close()
            raise _refused(host, port, str(exc) or type(exc).__name__) from None
        return stream

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Any = None) -> httpcore.NetworkStream:
        raise httpcore.ConnectError("a cluster's daemons are reached over TCP only")

    def sleep(self, seconds: float) -> None:
        self.inner.sleep(seconds)


# ------------------------------------------------------------------ httpx clients


def guard_client(http: httpx.Client | httpx.AsyncClient, pins: Pins) -> None:
    """Make every new connection of ``http`` (built with httpx's own transport) prove
    itself against ``pins``. A client with another transport is a TypeError: it could
    not be proven, so it must not talk to a cluster."""
    transport = http._transport  # noqa: SLF001 - httpx exposes no setter for the backend
    pool = getattr(transport, "_pool", None)
    if not isinstance(pool, (httpcore.ConnectionPool, httpcore.AsyncConnectionPool)):
        raise TypeError("a cluster client needs httpx's own HTTP transport: its daemons "
                        "are proven on every connection (corral.cluster.proof)")
    if isinstance(pool, httpcore.AsyncConnectionPool):
        pool._network_backend = AsyncProvingBackend(pins, pool._network_backend)  # noqa: SLF001
    else:
        pool._network_backend = ProvingBackend(pins, pool._network_backend)  # noqa: SLF001


def proven_client(pins: Pins, **options: Any) -> httpx.Client:
    """A blocking httpx client that talks only to daemons ``pins`` lists, proven.

    Never through a proxy named in the environment (``HTTP_PROXY``, ``ALL_PROXY``...,
    which httpx would otherwise mount in front of the guarded transport): the request,
    its credential with it, would go to the proxy, and no daemon would prove anything."""
    options.setdefault("trust_env", False)
    http = httpx.Client(**options)
    guard_client(http, pins)
    return http


def async_proven_client(pins: Pins, **options: Any) -> httpx.AsyncClient:
    """An asyncio httpx client that talks only to daemons ``pins`` lists, proven (never
    through the environment's proxy: :func:`proven_client`)."""
    options.setdefault("trust_env", False)
    http = httpx.AsyncClient(**options)
    guard_client(http, pins)
    return http


def pins_of(entries: Iterable[dict[str, Any]]) -> Pins:
    """Pins from directory entries (``{"node_id", "url", "key"}``)."""
    return Pins((str(e.get("url", "")), str(e.get("node_id", "")), str(e.get("key") or ""))
                for e in entries)
