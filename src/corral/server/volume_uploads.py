"""Resumable uploads into a volume: the uploads of :mod:`corral.server.upload_routes`
(an upload id and an offset; staged on the host; surviving a restart of the daemon),
aimed at a volume instead of a sandbox::

    POST   /v1/volumes/{name}/uploads         {"path", "size", "mode"} -> {"upload_id", "offset": 0}
    PATCH  /v1/volumes/{name}/uploads/{uid}   Upload-Offset: N, the bytes from N -> {"offset", "done"}
    GET    /v1/volumes/{name}/uploads/{uid}   -> {"offset", "size", "done"}
    DELETE /v1/volumes/{name}/uploads/{uid}   abandon it

``path`` is inside the volume (``models/ckpt.bin``; no ``..``, never through a symlink).
The volume must be the caller's own, made on this node (a copy of another node's:
write into it there), and mounted by no running sandbox ``ro`` or ``cow`` (their files
would change under them; ``rw`` writers see the file appear). Its size counts against
the tenant's quota, or must fit a capped volume's free space. When the last byte
arrives the file is put in place whole (:meth:`corral.runtime.volumes.Volumes.write_file`);
a volume that is mounted meanwhile keeps the upload at its last byte: an empty PATCH at
that offset tries again.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral.api.models import UploadCreate
from corral.runtime.volumes import check_name, check_rel
from corral.server import context as ctx
from corral.server.upload_routes import (
    VOLUME_KEY,
    Upload,
    finished,
    receive_patch,
    uploads,
)

_NO_CAP = 1 << 62  # an uncapped volume: its tenant's quota bounds the upload instead


def _key(request: Request) -> str:
    return VOLUME_KEY + check_name(request.path_params["name"])


def _find(request: Request) -> Upload:
    name = check_name(request.path_params["name"])
    ctx.engine(request).get_volume(name, owner=ctx.owner(request))  # VolumeNotFound
    return uploads(request).get(ctx.owner(request), _key(request),
                                request.path_params["upload_id"])


async def create_volume_upload(request: Request, body: UploadCreate) -> Response:
    name = check_name(request.path_params["name"])
    owner = ctx.owner(request)
    info = ctx.engine(request).check_volume_upload(name, body.size, owner=owner)
    path = "/".join(check_rel(body.path))
    cap = info.max_mb << 20 if info.max_mb is not None else _NO_CAP
    up = uploads(request).add(owner, _key(request), path, body.size, int(body.mode, 8), cap)
    return JSONResponse(up.state(), status_code=201)


async def volume_upload_state(request: Request) -> Response:
    return JSONResponse(_find(request).state())


async def abandon_volume_upload(request: Request) -> Response:
    uploads(request).drop(_find(request))
    return Response(status_code=204)


async def patch_volume_upload(request: Request) -> Response:
    return await receive_patch(request, _find(request), _finish)


async def _finish(request: Request, up: Upload) -> None:
    assert up.volume is not None
    await ctx.engine(request).write_volume_file(up.volume, up.path, up.part, up.mode,
                                                owner=up.owner)
    await finished(up)
