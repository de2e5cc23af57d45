"""Daemon to daemon: the layers of snapshots travel between the nodes of a cluster.

Served on the daemon's TCP port, behind the same bearer token as everything else; the
admin's only (a tenant token gets 403: layers are named by digest, whoever's snapshot
they hold). Daemons call each other's GET routes with the cluster's peer credential,
which opens those and nothing else (:mod:`corral.server.peer_auth`):

- ``GET /v1/peer/snapshots/{id_or_name}``: what another node needs to restore a
  snapshot (:func:`corral.runtime.layer_fetch.describe`);
- ``GET /v1/peer/layers/{digest}``: one layer's tree as a stream
  (:mod:`corral.runtime.layer_wire`). Only the layers of snapshots this daemon holds
  can be read, named by digest; a digest is never a path;
- ``POST /v1/peer/snapshots/fetch`` ``{"snapshot", "node"}``: make the snapshot
  restorable here, fetching its missing layers from the daemon of ``node``. The peer's
  address comes from the cluster's directory (Ray's KV, at ``CORRAL_RAY_GCS``, which
  ``corral cluster up`` sets; or a static map in ``CORRAL_PEERS``), never from the
  request: the token is sent only to the cluster's own daemons. The cluster client
  calls it before restoring a snapshot on a node that lacks it. The snapshot's image
  comes along if this node lacks it or has another build of it
  (:func:`corral.runtime.image_travel.image_for_snapshot`);
- ``GET /v1/peer/images/{name}`` and ``POST /v1/peer/images/fetch`` ``{"image",
  "node"}``: the same for an image (:mod:`corral.runtime.image_travel`); its layers
  are served by ``/v1/peer/layers`` too, and so is a root image's tree, by its content
  digest (:mod:`corral.runtime.root_travel`; only a root a peer was described), and so
  is a volume's (:mod:`corral.server.peer_volumes`; only a volume a peer was described);
- ``GET /v1/peer/checkpoints/{snapshot_id}`` (``?owner=TENANT``): a live snapshot's
  process images as one tree (:mod:`corral.runtime.live_travel`), fetched after its
  description (``"live"``: digest, kernel, CRIU build) matched this node's;
- ``GET /v1/peer/stats``: the layers and bytes this daemon fetched.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
from collections.abc import Iterable, Iterator
from typing import Any
from urllib.parse import quote

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from corral.api.daemon_models import FetchRequest, ImageFetchRequest
from corral.cluster.proof import Pins, proven_client
from corral.errors import (
    CorralError,
    InvalidArgument,
    InvalidState,
    LayerTransferError,
    NotFound,
    SnapshotNotFound,
    error_from_dict,
)
from corral.runtime import layer_wire, live_travel
from corral.runtime.image_travel import describe_image, image_for_snapshot, pull_image
from corral.runtime.layer_fetch import SNAPSHOT_ID, LayerFetcher, layer_path_for
from corral.runtime.root_travel import root_path_for
from corral.runtime.volume_travel import volume_path_for
from corral.server import context as ctx
from corral.server.caller import require_peer

GCS_ENV = "CORRAL_RAY_GCS"
PEERS_ENV = "CORRAL_PEERS"  # {"node": "http://host:port"}: peers without Ray (set by its operator)
PEER_TIMEOUT = httpx.Timeout(30.0, read=120.0)
MAX_DESCRIPTION = 1 << 20


def fetcher(request: Request) -> LayerFetcher:
    state = request.app.state
    found: LayerFetcher | None = getattr(state, "layer_fetcher", None)
    if found is None:
        found = state.layer_fetcher = LayerFetcher(ctx.engine(request).snapshots)
    return found


async def peer_snapshot(request: Request) -> Response:
    require_peer(request)
    ref = request.path_params["id_or_name"]
    engine = ctx.engine(request)
    # ?owner=TENANT: as that tenant finds it (its own only; names in its namespace)
    owner = request.query_params.get("owner") or None
    desc = await engine.describe_snapshot(ref, owner)
    if desc.get("kind") == "live":  # its process images: digest, kernel and CRIU build
        images = engine.checkpoint_images(desc["id"], owner=owner)
        if images is not None:
            desc["live"] = await asyncio.to_thread(live_travel.describe, images,
                                                   engine.layout.cache_dir)
    return JSONResponse(desc)


async def peer_checkpoint(request: Request) -> Response:
    """A live snapshot's process images as one tree (``root_form``), for its tenant
    (``?owner=``) only: another tenant's snapshot answers as not found."""
    require_peer(request)
    sid = request.path_params["snapshot_id"]
    if not SNAPSHOT_ID.fullmatch(sid):
        raise InvalidArgument(f"not a snapshot id: {sid[:80]!r}", details={"snapshot": sid[:80]})
    owner = request.query_params.get("owner") or None
    images = ctx.engine(request).checkpoint_images(sid, owner=owner)
    if images is None:
        raise SnapshotNotFound(f"snapshot {sid} holds no process images on this node",
                               details={"snapshot": sid})
    return StreamingResponse(layer_wire.stream(images, root_form=True),
                             media_type="application/x-tar")


async def peer_layer(request: Request) -> Response:
    require_peer(request)
    digest = layer_wire.check_digest(request.path_params["digest"])
    engine = ctx.engine(request)
    path = layer_path_for(engine.snapshots, digest)
    root = None if path is not None else root_path_for(engine.images, digest)
    if root is None and path is None:  # a volume's tree (corral.runtime.volume_travel)
        root = await asyncio.to_thread(volume_path_for, engine.volumes, digest)
    if path is None and root is None:
        raise NotFound(f"no snapshot, image or volume on this node holds layer {digest}",
                       details={"digest": digest})
    if root is not None:  # a root image's or a volume's tree, in the form roots travel in
        return StreamingResponse(layer_wire.stream(root, root_form=True),
                                 media_type="application/x-tar")
    return StreamingResponse(layer_wire.stream(path), media_type="application/x-tar")


async def peer_stats(request: Request) -> Response:
    require_peer(request)
    return JSONResponse(fetcher(request).stats.json())


async def peer_image(request: Request) -> Response:
    require_peer(request)
    images, name = ctx.engine(request).images, request.path_params["name"]
    return JSONResponse(await asyncio.to_thread(describe_image, images, name))  # hashes a root


async def fetch_image(request: Request, body: ImageFetchRequest) -> Response:
    require_peer(request)
    return await pull_image_here(request, body)


async def pull_image_here(request: Request, body: ImageFetchRequest) -> Response:
    """Make the built image ``body.image`` usable here, pulled from ``body.node``."""
    images = ctx.engine(request).images
    if images.exists(body.image):  # here already (built here, pulled, or everywhere)
        return JSONResponse(images.get(body.image, check_base=False).info().model_dump(mode="json"))
    url, pins = await asyncio.to_thread(_peer_at, body.node)
    peer = Peer(url, _peer_credential(request), pins)
    desc = await asyncio.to_thread(peer.describe, f"/v1/peer/images/{quote(body.image, safe='')}")
    if desc.get("name") != body.image:
        raise LayerTransferError(f"the daemon at {url} described another image than "
                                 f"{body.image!r}", details={"peer": url})
    image = await pull_image(fetcher(request), desc, peer.open_layer)
    return JSONResponse(image.info().model_dump(mode="json"))


async def fetch_snapshot(request: Request, body: FetchRequest) -> Response:
    require_peer(request)
    return await import_snapshot_here(request, body, None)


async def import_snapshot_here(request: Request, body: FetchRequest, owner: str | None
                               ) -> Response:
    """Make ``body.snapshot`` restorable here, fetched from ``body.node``; ``owner`` (a
    tenant): only a snapshot of its own, found as it names it (the peer is asked with
    the cluster's peer credential, never the tenant's)."""
    engine = ctx.engine(request)
    here = engine.snapshots.lookup(body.snapshot, owner=owner)
    if here is not None:
        return JSONResponse(here.info().model_dump(mode="json"))
    url, pins = await asyncio.to_thread(_peer_at, body.node)
    peer = Peer(url, _peer_credential(request), pins)
    query = "" if owner is None else f"?owner={quote(owner, safe='')}"
    desc = await asyncio.to_thread(
        peer.describe, f"/v1/peer/snapshots/{quote(body.snapshot, safe='')}{query}")
    if owner is not None and (desc.get("spec") or {}).get("tenant") != owner:
        raise SnapshotNotFound(f"no snapshot {body.snapshot!r}: `corral snapshot ls` lists "
                               "yours", details={"snapshot": body.snapshot})
    open_images = None
    if desc.get("kind") == "live":  # same kernel and CRIU, checked before its image comes
        live_travel.checked(desc.get("live"), str(desc.get("id")), body.node,
                            engine.layout.cache_dir)
        open_images = functools.partial(peer.open_images, str(desc.get("id")), owner)
    desc = await image_for_snapshot(  # its image here too (a root by its content)
        fetcher(request), desc, lambda name: peer.describe(f"/v1/peer/images/{quote(name)}"),
        peer.open_layer)
    info = await fetcher(request).import_snapshot(desc, peer.open_layer, holder=body.node,
                                                  open_images=open_images)
    return JSONResponse(info.model_dump(mode="json"))


def _peer_credential(request: Request) -> str | None:
    """What this daemon shows its peers: the peer credential, else (peers configured
    by hand with ``CORRAL_PEERS`` and one shared token) its own token."""
    settings = ctx.settings(request)
    return settings.peer_token or settings.token


def _peer_at(node: str) -> tuple[str, Pins | None]:
    """The URL of ``node``'s daemon, and the directory's pins its connections are
    proven against (None for a static ``CORRAL_PEERS`` map: its operator vouches)."""
    static = os.environ.get(PEERS_ENV)
    if static:
        try:
            return str(json.loads(static)[node]), None
        except (ValueError, KeyError, TypeError):
            raise InvalidArgument(f"no peer {node[:80]!r} among this daemon's {PEERS_ENV}",
                                  details={"node": node[:80]}) from None
    gcs = os.environ.get(GCS_ENV)
    if not gcs:
        raise InvalidState(
            "this daemon is not part of a corral cluster, so it fetches no snapshot from "
            "other nodes: start it with `corral cluster up` (which tells it the cluster)"
        )
    directory = _directory(gcs)
    return directory.pinned(node).url, directory.pins


@functools.lru_cache(maxsize=1)
def _directory(gcs: str) -> Any:
    from corral.cluster.directory import Directory  # imports Ray: only on a cluster

    return Directory(gcs, tokens=False)  # peers' URLs only: no node's admin token here


class Peer:
    """Another node's daemon, as this daemon reads snapshots and layers from it."""

    def __init__(self, url: str, token: str | None, pins: Pins | None = None) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.pins = pins  # the peer proves who it is on each connection (cluster/proof.py)

    def describe(self, path: str) -> dict[str, Any]:
        """The JSON object the peer answers ``GET path`` with (bounded)."""
        with self._get(path) as reply:
            body = b""
            for chunk in reply.iter_bytes():
                body += chunk
                if len(body) > MAX_DESCRIPTION:
                    raise LayerTransferError(f"the peer at {self.url} answered {path} "
                                             f"with more than {MAX_DESCRIPTION} bytes")
        try:
            desc = json.loads(body)
        except ValueError:
            raise LayerTransferError(f"the peer at {self.url} sent no JSON for {path}",
                                     details={"peer": self.url}) from None
        if not isinstance(desc, dict):
            raise LayerTransferError(f"the peer at {self.url} sent no object for {path}")
        return desc

    @contextlib.contextmanager
    def open_layer(self, digest: str, size: int) -> Iterator[Iterable[bytes]]:
        with self._get(f"/v1/peer/layers/{layer_wire.check_digest(digest)}") as reply:
            yield self._chunks(reply, digest)

    @contextlib.contextmanager
    def open_images(self, sid: str, owner: str | None, digest: str, size: int
                    ) -> Iterator[Iterable[bytes]]:
        """A live snapshot's process images, as ``owner`` (its tenant) is served them."""
        query = "" if owner is None else f"?owner={quote(owner, safe='')}"
        with self._get(f"/v1/peer/checkpoints/{quote(sid, safe='')}{query}") as reply:
            yield self._chunks(reply, digest)

    def _chunks(self, reply: httpx.Response, digest: str) -> Iterator[bytes]:
        try:
            yield from reply.iter_raw()
        except httpx.HTTPError as exc:
            raise LayerTransferError(
                f"layer {digest}: the stream from {self.url} broke off "
                f"({type(exc).__name__}: {exc}): nothing of it was kept; retry",
                details={"digest": digest, "peer": self.url},
            ) from None

    @contextlib.contextmanager
    def _get(self, path: str) -> Iterator[httpx.Response]:
        try:
            # a peer daemon, never through the environment's proxy (cluster/proof.py)
            http = (httpx.Client(timeout=PEER_TIMEOUT, trust_env=False) if self.pins is None
                    else proven_client(self.pins, timeout=PEER_TIMEOUT))
            with http, http.stream(
                "GET", self.url + path, headers=self.headers
            ) as reply:
                if reply.status_code != 200:
                    raise _peer_error(self.url, path, reply)
                yield reply
        except httpx.HTTPError as exc:
            raise LayerTransferError(
                f"the daemon at {self.url} did not answer {path} ({type(exc).__name__}: "
                f"{exc}): is its node alive? (`corral cluster status`)",
                details={"peer": self.url},
            ) from None


_PASSED_ON = {"snapshot_not_found", "image_not_found", "volume_not_found", "invalid_state"}


def _peer_error(url: str, path: str, reply: httpx.Response) -> CorralError:
    """The peer's refusal: what it says of the snapshot or image itself is passed on
    (typed), anything else is a failed transfer."""
    text = reply.read()[:4000].decode(errors="replace")
    try:
        err = json.loads(text)["error"]
        message = str(err.get("message"))
        code = str(err.get("code"))
    except (ValueError, KeyError, TypeError, AttributeError):
        message, code = text[:300], ""
    if code in _PASSED_ON:
        return error_from_dict({"code": code, "message": f"{message} (on the node at {url})"})
    return LayerTransferError(f"the daemon at {url} refused {path}: HTTP {reply.status_code}: "
                              f"{message[:300]}", details={"peer": url})

