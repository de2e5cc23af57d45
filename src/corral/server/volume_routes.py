"""Routes for volumes (:mod:`corral.runtime.volumes`): the caller's own.

``POST /v1/volumes?name=NAME[&max_mb=N]`` with a tar archive as the body (streamed to
disk as it comes, of any size within the tenant's quota and the disk's reserve:
:mod:`corral.server.volume_stream`; ``corral volume create NAME --from DIR`` makes it), ``GET
/v1/volumes``, ``GET /v1/volumes/{name}``, ``DELETE /v1/volumes/{name}``, ``POST
/v1/volumes/{name}/snapshot`` ``{"name": NEW}`` (a new volume of its files as they are).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral.api.models import VolumeSnapshotRequest
from corral.errors import InvalidArgument
from corral.runtime.volumes import check_name
from corral.server import context as ctx
from corral.server.volume_stream import stage_body


async def create_volume(request: Request) -> Response:
    name = request.query_params.get("name")
    if name is None:
        raise InvalidArgument("missing query parameter 'name', e.g. ?name=dataset")
    check_name(name)  # before the body is read
    raw_max = request.query_params.get("max_mb")
    if raw_max is not None and not raw_max.isdecimal():
        raise InvalidArgument(f"invalid max_mb {raw_max!r}: a whole number of MiB, e.g. 512")
    max_mb = int(raw_max) if raw_max is not None else None
    engine = ctx.engine(request)
    owner = ctx.owner(request)
    engine.check_volume_name_free(name, owner=owner)  # before the body is read
    staged = await stage_body(request, engine.layout.state_dir,
                              lambda size: engine.check_volume_quota(size, owner=owner))
    try:
        info = await engine.create_volume(name, staged, max_mb=max_mb, owner=owner)
    finally:
        staged.unlink(missing_ok=True)
    return JSONResponse(info.model_dump(mode="json"), status_code=201)


async def snapshot_volume(request: Request, body: VolumeSnapshotRequest) -> Response:
    info = await ctx.engine(request).snapshot_volume(
        check_name(request.path_params["name"]), check_name(body.name),
        owner=ctx.owner(request))
    return JSONResponse(info.model_dump(mode="json"), status_code=201)


async def list_volumes(request: Request) -> Response:
    vols = ctx.engine(request).list_volumes(owner=ctx.owner(request))
    return JSONResponse({"volumes": [v.model_dump(mode="json") for v in vols]})


async def get_volume(request: Request) -> Response:
    info = ctx.engine(request).get_volume(request.path_params["name"], owner=ctx.owner(request))
    return JSONResponse(info.model_dump(mode="json"))


async def delete_volume(request: Request) -> Response:
    await ctx.engine(request).remove_volume(request.path_params["name"], owner=ctx.owner(request))
    return Response(status_code=204)
