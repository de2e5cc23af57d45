"""``POST /v1/images/dockerfile``: build a Dockerfile, streaming its log.

The body is a tar holding ``dockerfile.json`` (a :class:`DockerfileRequest`: the
Dockerfile's text, the image's name, ``build_args``, ``target``) and ``context/`` (the
build context, ``.dockerignore`` already applied by the client). The reply is NDJSON
:class:`~corral.image_schema.BuildEvent` lines, as for ``/v1/images/build``; errors
before any work (a refused instruction, with its line) are plain error replies.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response

from corral.errors import InvalidArgument
from corral.image_schema import DockerfileRequest
from corral.runtime.dockerfile import parse_dockerfile
from corral.runtime.dockerfile_build import build_dockerfile
from corral.runtime.fsutil import _remove_tree
from corral.runtime.image_build import BuildResult, OnEvent, host_cpus
from corral.schema import validate_model
from corral.server import context as ctx
from corral.server.builds import builds_gate
from corral.server.image_routes import CONTEXT_DIR, TAR, _lines, _run, save_context
from corral.server.streaming import NDJSONResponse
from corral.server.tenants import require_image_rights, tenant_of

REQUEST_MEMBER = "dockerfile.json"
MEMORY_MB = 2048  # what a Dockerfile build is admitted with (its steps' sandboxes)


async def build_dockerfile_route(request: Request) -> Response:
    require_image_rights(request, "building an image")
    engine = ctx.engine(request)
    if request.headers.get("content-type", "").split(";")[0].strip() != TAR:
        raise InvalidArgument(f"send the Dockerfile build as a tar ({TAR}) holding "
                              f"{REQUEST_MEMBER} and {CONTEXT_DIR}/")
    work: Path = await asyncio.to_thread(engine.images.work_dir, "dockerfile")
    try:
        with builds_gate(request).receiving(tenant_of(request)):
            data = await save_context(request, work, REQUEST_MEMBER)
        req = validate_model(DockerfileRequest, data, "Dockerfile build request")
        context = work / "root" / CONTEXT_DIR
        context.mkdir(exist_ok=True)
        parse_dockerfile(req.dockerfile, req.build_args)  # refused lines: a plain error
        gate, owner = builds_gate(request), tenant_of(request)
        cpus = gate.cpus_for(owner, host_cpus())
        host_network = owner is None or ctx.host_network_allowed(request)
        ticket = await gate.admit(owner, MEMORY_MB, cpus)
    except BaseException:
        await asyncio.to_thread(_remove_tree, work)
        raise

    async def run(on_event: OnEvent) -> BuildResult:
        return await build_dockerfile(
            engine, context, name=req.name, text=req.dockerfile, build_args=req.build_args,
            target=req.target, on_event=on_event, cpus=cpus, host_network=host_network,
            owner=owner)

    queue: asyncio.Queue[bytes | None] = asyncio.Queue()
    task = asyncio.create_task(_run(run, queue, engine.images))

    async def cleanup() -> None:
        try:
            if not task.done():
                task.cancel()  # the client left: the build stops, its sandbox goes
            await asyncio.gather(task, return_exceptions=True)
        finally:
            gate.release(ticket)
            await asyncio.to_thread(_remove_tree, work)

    return NDJSONResponse(_lines(queue), cleanup=cleanup)
