"""The image endpoints: list, get, delete, build (its log streamed), import.

Handlers only; :mod:`corral.api.operations` declares them (and so documents them in
``/openapi.json``). A build may take minutes, so ``POST /v1/images/build``
replies with NDJSON :class:`~corral.image_schema.BuildEvent` lines as the build goes:
its errors before any work (a bad spec, an unknown base image, a missing ``copy``
source) are ordinary error replies; a step that fails is the stream's last line,
``{"type": "error", "error": {"code": "image_build_failed", ...}}``. A client that hangs
up cancels the build, which leaves nothing behind but the steps already cached.

The build request is a JSON :class:`~corral.image_schema.BuildRequest`, or, when its
``copy`` steps need files, a tar (``Content-Type: application/x-tar``) holding
``build.json`` (the same request) and ``context/`` (what ``copy`` sources name,
relative to it); the daemon never reads its own host's files for a client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral.errors import (
    CorralError,
    FileTooLarge,
    ImageImportError,
    ImageInUse,
    ImageNotFound,
    InternalError,
    InvalidArgument,
)
from corral.image_schema import (
    UPLOADED_ARCHIVE,
    BuildEvent,
    BuildRequest,
    ImageInfo,
    PruneResult,
    PullEvent,
    PullRequest,
    validate_image_name,
)
from corral.runtime.distribution import parse_reference
from corral.runtime.fsutil import _remove_tree
from corral.runtime.image_build import BuildResult, ImageBuild, OnEvent, host_cpus
from corral.runtime.image_pull import prune, pull_image, unique_sizes
from corral.runtime.images import Image, ImageStore
from corral.runtime.oci import import_image
from corral.runtime.oci_layers import apply_layer
from corral.schema import SandboxState, validate_model
from corral.server import context as ctx
from corral.server.builds import builds_gate
from corral.server.limits import parse_json
from corral.server.streaming import NDJSONResponse
from corral.server.tenants import require_image_rights, tenant_of
from corral.server.wire import check_room, paced, read_json, save_body

logger = logging.getLogger("corral.server")

TAR = "application/x-tar"
SPEC_MEMBER = "build.json"
CONTEXT_DIR = "context"
# An image archive is streamed to disk, not held in memory: its own, larger cap.
MAX_IMPORT_BYTES = 64 << 30
_LIVE = [SandboxState.PENDING, SandboxState.RUNNING, SandboxState.PAUSED, SandboxState.STOPPING]


def _name(request: Request) -> str:
    return validate_image_name(request.path_params["name"])


async def list_images(request: Request) -> Response:
    store = ctx.engine(request).images
    images, unique = await asyncio.gather(asyncio.to_thread(store.list),
                                          asyncio.to_thread(unique_sizes, store.images_dir))
    return JSONResponse({"images": [_info(store, i, unique).model_dump(mode="json")
                                    for i in images]})


async def get_image(request: Request) -> Response:
    store = ctx.engine(request).images
    image = store.get(_name(request), check_base=False)
    info = await asyncio.to_thread(_info, store, image)
    return JSONResponse(info.model_dump(mode="json"))


def _info(store: ImageStore, image: Image, unique: dict[str, int] | None = None) -> ImageInfo:
    """An image's info, with the reference it was pulled from and the bytes only it
    uses (``unique``: :func:`unique_sizes` of the store, computed if not given).
    Blocking."""
    if unique is None:
        unique = unique_sizes(store.images_dir)
    info = image.info().model_copy(update={"unique_bytes": unique.get(image.name)})
    if image.kind == "built":
        with contextlib.suppress(OSError, ValueError, ImageNotFound):
            source = store.manifest(image.name).get("source") or {}
            if source.get("kind") == "pull":
                info = info.model_copy(update={"ref": source.get("ref")})
    return info


async def pull_image_route(request: Request) -> Response:
    """Pull a registry image into the store, streaming :class:`PullEvent` lines; the
    registry's credentials are the daemon's (its ``REGISTRY_AUTH_FILE`` or
    ``~/.docker/config.json``), never sent by a client."""
    require_image_rights(request, "pulling an image")
    req = validate_model(PullRequest, await read_json(request, "pull request"), "pull request")
    store = ctx.engine(request).images
    parse_reference(req.ref)  # a malformed reference: a plain error reply
    if req.name is not None:
        validate_image_name(req.name)
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def progress(event: dict) -> None:
        line = PullEvent(**event).model_dump_json(exclude_none=True).encode() + b"\n"
        loop.call_soon_threadsafe(queue.put_nowait, line)

    async def run() -> None:
        try:
            image = await asyncio.to_thread(pull_image, store, req.ref, name=req.name,
                                            insecure=req.insecure, on_progress=progress)
            event = PullEvent(type="image", image=await asyncio.to_thread(_info, store, image))
        except CorralError as exc:
            event = PullEvent(type="error", error=exc.to_dict())
        except Exception as exc:  # the reply has started: report in-band
            logger.exception("image pull failed")
            error = InternalError(f"the image pull failed: {type(exc).__name__}")
            event = PullEvent(type="error", error=error.to_dict())
        queue.put_nowait(event.model_dump_json(exclude_none=True).encode() + b"\n")
        queue.put_nowait(None)

    task = asyncio.create_task(run())

    async def cleanup() -> None:
        # A client that leaves does not stop the pull (a thread): it finishes, and the
        # next pull of the reference finds it, or resumes its blobs.
        await asyncio.gather(asyncio.shield(task), return_exceptions=True)

    return NDJSONResponse(_lines(queue), cleanup=cleanup)


async def prune_images(request: Request) -> Response:
    """Delete the layers no image, build cache entry or sandbox holds."""
    require_image_rights(request, "pruning images")
    store = ctx.engine(request).images
    removed, freed = await asyncio.to_thread(prune, store.images_dir)
    return JSONResponse(PruneResult(layers=removed, freed_bytes=freed).model_dump(mode="json"))


async def delete_image(request: Request) -> Response:
    """Refused (409 ``image_in_use``) while this daemon's sandboxes, snapshots or pools
    use the image, or other images are built on it; idempotent otherwise."""
    require_image_rights(request, "deleting an image")
    engine, name = ctx.engine(request), _name(request)
    if not engine.images.exists(name):
        return Response(status_code=204)
    # in use by any tenant's: all must be counted (owner None: every owner's)
    sandboxes = [i.id for i in engine.list(state=_LIVE, owner=None) if i.spec.image == name]
    snapshots = [s.id for s in engine.list_snapshots(owner=None) if s.image == name]
    pools = [p.name for p in ctx.pools(request).list_pools(owner=None) if p.spec.image == name]
    if sandboxes or snapshots or pools:
        users = [f"{len(v)} {k}" for k, v in (("sandbox(es)", sandboxes),
                 ("snapshot(s)", snapshots), ("pool(s)", pools)) if v]
        raise ImageInUse(
            f"image {name!r} is in use by {', '.join(users)}: delete them first",
            details={"image": name, "sandboxes": sandboxes, "snapshots": snapshots,
                     "pools": pools},
        )
    with contextlib.suppress(ImageNotFound):  # removed meanwhile: just as good
        await asyncio.to_thread(engine.images.remove, name)
    return Response(status_code=204)


async def build_image(request: Request) -> Response:
    require_image_rights(request, "building an image")
    engine = ctx.engine(request)
    store = engine.images
    work: Path | None = None
    try:
        if request.headers.get("content-type", "").split(";")[0].strip() == TAR:
            work = await asyncio.to_thread(store.work_dir, "build")
            with builds_gate(request).receiving(tenant_of(request)):
                data = await save_context(request, work)
            context: Path | None = work / "root" / CONTEXT_DIR
        else:
            data, context = await read_json(request, "build request"), None
        req = validate_model(BuildRequest, data, "build request")
        gate, owner = builds_gate(request), tenant_of(request)
        build = ImageBuild(engine, req.spec, name=req.name, context=context, context_only=True,
                           sources=req.sources, cpus=gate.cpus_for(owner, host_cpus()),
                           host_network=owner is None or ctx.host_network_allowed(request),
                           owner=owner)
        # admitted like a sandbox, before the reply starts: a refusal is a plain error
        ticket = await gate.admit(owner, build.spec.memory_mb, build.cpus)
    except BaseException:
        if work is not None:
            await asyncio.to_thread(_remove_tree, work)
        raise
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()
    task = asyncio.create_task(_run(build, queue, store))

    async def cleanup() -> None:
        try:
            if not task.done():
                task.cancel()  # the client left: the build stops, its sandbox goes
            await asyncio.gather(task, return_exceptions=True)
        finally:
            gate.release(ticket)  # its places, however it ended
            if work is not None:
                await asyncio.to_thread(_remove_tree, work)

    return NDJSONResponse(_lines(queue), cleanup=cleanup)


async def _run(build: ImageBuild | Callable[[OnEvent], Awaitable[BuildResult]],
               queue: asyncio.Queue[bytes | None], store: ImageStore) -> None:
    run = build.run if isinstance(build, ImageBuild) else build
    try:
        result = await run(lambda event: queue.put_nowait(_line(event)))
        info = await asyncio.to_thread(_info, store, result.image)
        queue.put_nowait(_line(BuildEvent(type="image", image=info,
                                          stats=result.stats)))
    except CorralError as exc:
        queue.put_nowait(_line(BuildEvent(type="error", error=exc.to_dict())))
    except Exception as exc:  # the reply has started: report in-band
        logger.exception("image build failed")
        error = InternalError(f"the image build failed: {type(exc).__name__}: {exc}")
        queue.put_nowait(_line(BuildEvent(type="error", error=error.to_dict())))
    finally:
        queue.put_nowait(None)


async def _lines(queue: asyncio.Queue[bytes | None]) -> AsyncIterator[bytes]:
    while (line := await queue.get()) is not None:
        yield line


def _line(event: BuildEvent) -> bytes:
    return event.model_dump_json(exclude_none=True).encode() + b"\n"


async def save_context(request: Request, work: Path, member: str = SPEC_MEMBER) -> dict:
    """The body, a build tar, streamed to ``work`` (never held whole: bounded by
    --max-upload-bytes on disk, not in memory) and unpacked there; the JSON request it
    holds as ``member``. The caller removes ``work`` whatever happens."""
    archive = work / "context.tar"
    await save_body(request, archive, request.app.state.settings.max_upload_bytes,
                    "build context")
    return await asyncio.to_thread(_unpack_context, archive, work, member)


def _unpack_context(archive: Path, work: Path, member: str) -> dict:
    """Unpack the build tar ``archive`` safely (no path or link may leave
    ``work/root``), then remove it; the JSON request it holds as ``member``."""
    root = work / "root"
    root.mkdir()
    apply_layer(root, archive)
    archive.unlink()
    spec = root / member
    if not spec.is_file() or spec.is_symlink():
        raise InvalidArgument(f"the build tar has no {member} (the build request)")
    data = parse_json(spec.read_bytes(), member)  # bounded depth and size, like a body
    if not isinstance(data, dict):
        raise InvalidArgument(f"{member} must hold a JSON object")
    return data


async def import_image_route(request: Request) -> Response:
    """The body is the archive (``docker save`` or an OCI layout as a tar), streamed
    to disk; ``?name=`` names the image (an image of that name is replaced)."""
    require_image_rights(request, "importing an image")
    engine = ctx.engine(request)
    name = request.query_params.get("name")
    if not name:
        raise InvalidArgument("missing query parameter 'name', e.g. ?name=alpine")
    validate_image_name(name)
    work = await asyncio.to_thread(engine.images.work_dir, "import")
    try:
        archive = work / "archive"
        await _save_body(request, archive)
        image = await asyncio.to_thread(import_image, engine.images, archive, name)
    except ImageImportError as exc:  # name what the client sent, not our temp files
        message = exc.message
        for temp in (str(work / "archive.tar"), str(archive), str(work)):
            message = message.replace(temp, UPLOADED_ARCHIVE)
        raise ImageImportError(message, details={**exc.details, "path": UPLOADED_ARCHIVE}) from None
    finally:
        await asyncio.to_thread(_remove_tree, work)
    return JSONResponse(image.info().model_dump(mode="json"), status_code=201)


async def _save_body(request: Request, path: Path) -> None:
    size = 0
    with open(path, "wb") as f:
        async for chunk in paced(request):  # a stalled upload is cut (408)
            size += len(chunk)
            if size > MAX_IMPORT_BYTES:
                raise FileTooLarge(f"the image archive is over {MAX_IMPORT_BYTES} bytes",
                                   details={"limit": MAX_IMPORT_BYTES})
            check_room(path.parent, size, size - len(chunk), "image archive")
            await asyncio.to_thread(f.write, chunk)
    if size == 0:
        raise InvalidArgument("missing request body: send the image archive (a tar)")

