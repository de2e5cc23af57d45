"""Volumes travel between the nodes of a cluster (:mod:`corral.runtime.volume_travel`),
over the peer path of layers and images (:mod:`corral.server.peer_layers`):

- ``GET /v1/peer/volumes/{name}?owner=TENANT`` (the cluster's peer credential, or the
  admin): the volume as that tenant names it, described for another node to copy: its
  fields and the digest of its content, which makes its tree readable by that digest
  at ``/v1/peer/layers/{digest}``;
- ``POST /v1/cluster/volumes/fetch`` ``{"volume", "node"}`` (the caller, tenant or
  admin): make the caller's volume held by ``node`` usable here. This daemon asks the
  holder with the peer credential *as the caller* (``?owner=``, from the caller's
  token, never from the body), so another tenant's volume answers as one that does
  not exist; the holder's address comes from the cluster's directory, never from the
  request. The cluster client calls it before placing a sandbox that mounts the
  volume on a node other than its home.
"""

from __future__ import annotations

import asyncio
import re
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral.api.daemon_models import VolumeFetchRequest
from corral.errors import InvalidArgument
from corral.runtime.volumes import check_name
from corral.schema import TENANT_NAME
from corral.server import context as ctx
from corral.server.caller import require_peer
from corral.server.peer_layers import Peer, _peer_at, _peer_credential, fetcher


async def peer_volume(request: Request) -> Response:
    require_peer(request)
    name = check_name(request.path_params["name"])
    owner = request.query_params.get("owner") or None  # its own only, as it names them
    if owner is not None and not re.fullmatch(TENANT_NAME, owner):
        raise InvalidArgument(f"invalid owner {owner[:80]!r}: a tenant's name")
    desc = await ctx.engine(request).describe_volume(name, owner=owner)  # may hash it
    return JSONResponse(desc)


async def fetch_own_volume(request: Request, body: VolumeFetchRequest) -> Response:
    name = check_name(body.volume)
    owner = ctx.owner(request)
    engine = ctx.engine(request)
    url, pins = await asyncio.to_thread(_peer_at, body.node)
    peer = Peer(url, _peer_credential(request), pins)
    query = "" if owner is None else f"?owner={quote(owner, safe='')}"
    desc = await asyncio.to_thread(peer.describe,
                                   f"/v1/peer/volumes/{quote(name, safe='')}{query}")
    info = await engine.pull_volume(name, desc, peer.open_layer, fetcher(request),
                                    node=body.node, owner=owner)
    return JSONResponse(info.model_dump(mode="json"))
