"""SandboxFusion's ``/run_code``, ``/run_jupyter`` (and ``/submit`` for stdin/stdout
tests, judged by corral's judge: :mod:`.sandboxfusion_submit`) on a corral daemon: verl's code
rewards (``sandbox_fusion_url``) and the ``sandbox-fusion`` client run unchanged
against ``http://HOST:PORT/sandboxfusion/<token>`` (verl: ``.../run_code``).

These clients send no credentials, so the daemon's token travels in the path. The
daemon's guard lets exactly ``/sandboxfusion/<token>/run_code``, ``.../run_jupyter`` and ``.../submit``
through without a bearer token (:func:`lift_token`), after moving the token out of
the path, so that no log line (the access log included) ever shows it; the handler
compares it in constant time before it reads a byte of the body. A wrong or missing
token is 401 and never a run.

Each request gets a fresh sandbox, taken from a warm pool (one per image and memory
size, made on first use, refilled through admission control; at most eight, each
deleted after ``CORRAL_FUSION_POOL_IDLE`` seconds unused: :mod:`.sandboxfusion_pools`),
and deleted after the
reply is ready, on a client that hangs up, and on every error. The language's
toolchain runs as SandboxFusion's own runners run it (:data:`.sandboxfusion_model.LANGUAGES`):
the code is written to a fresh file in the working directory next to ``files``, compiled
with ``compile_timeout`` if the language compiles, run with ``stdin`` and
``run_timeout``, and ``fetch_files`` are read back. ``memory_limit_MB`` (verl sends it)
is the sandbox's memory limit (-1: corral's default); exceeding it is an OOM kill
(``return_code`` -9). ``/run_jupyter`` runs its cells in one Python process
(:mod:`corral.guest.fusion_kernel`).

Bad input gets SandboxFusion's own answers: 422 ``{"detail": [...]}`` for a body that
does not fit its models, 200 ``SandboxError`` for what its runners would fail on (bad
base64, a language no image here provides, a sandbox that could not be had), and no
sandbox is made or left for any of them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import re
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router
from starlette.types import Scope

from corral.errors import (
    CorralError,
    FileError,
    FileTooLarge,
    ImageNotFound,
    InvalidArgument,
    NotFound,
    OutputBudgetExceeded,
    Unsupported,
)
from corral.guest import program
from corral.pool_schema import MAX_POOL_SIZE
from corral.schema import DEFAULT_MEMORY_MB, SandboxInfo, SandboxSpec
from corral.server import context as ctx
from corral.server.compat.sandboxfusion_model import (
    FAILED,
    FINISHED,
    LANGUAGES,
    MAX_FETCH_BYTES,
    MAX_OUTPUT,
    MAX_TIMEOUT_S,
    SANDBOX_ERROR,
    SUCCESS,
    DriverOutput,
    FusionSettings,
    RunCodeRequest,
    RunJupyterRequest,
    code_response,
    command_result,
    decode_files,
    jupyter_response,
    run_status,
    validation_detail,
)
from corral.server.compat.sandboxfusion_pools import FusionPools
from corral.server.compat.sandboxfusion_submit import (
    JUDGE_IMAGE,
    JUDGE_MEMORY_MB,
    SubmitRequest,
    eval_result,
    judge_argv,
    judge_request,
)
from corral.server.door import Credential, Kind
from corral.server.limits import parse_json
from corral.server.tenants import UNIDENTIFIED, caller_of
from corral.server.wire import HeldJSONResponse, read_body

logger = logging.getLogger("corral.server")

PREFIX = "/sandboxfusion/"
PATH_SAFE = re.compile(r"[A-Za-z0-9._~-]+")  # a token that needs no escaping in a path
ENDPOINTS = ("run_code", "run_jupyter", "submit")
REDACTED = "TOKEN"  # what the path shows in place of the token, from the guard on
TOKEN_KEY = "corral.sandboxfusion.token"  # where the guard puts it (the ASGI scope)
TAG = "sandboxfusion"
MAX_POOLED_MEMORY_MB = 4 * DEFAULT_MEMORY_MB  # bigger sandboxes are not kept idle
MIN_MEMORY_MB = 16  # a sandbox's least memory_mb: a smaller memory_limit_MB gets it
POOL_LIFETIME_S = 4 * MAX_TIMEOUT_S  # a pool hands out sandboxes with half left at least
MAX_FETCH_TOTAL = 256 << 20
HOLD_KEY = "corral.sandboxfusion.hold"  # a request's room in the output budget (its scope)
STDIN_INLINE = 1 << 20  # larger stdin goes through a file

T = TypeVar("T", bound=BaseModel)


def lift_token(scope: Scope) -> bool:
    """Called by the daemon's guard first: take the token out of a ``/sandboxfusion/``
    path (every log shows ``/sandboxfusion/TOKEN/...`` from then on) and say whether
    the request is one of the two endpoints, which check it themselves; any other
    path under the prefix still needs the bearer token."""
    path = scope.get("path", "")
    if not path.startswith(PREFIX):
        return False
    token, sep, rest = path[len(PREFIX):].partition("/")
    scope["path"] = f"{PREFIX}{REDACTED}{sep}{rest}"
    scope["raw_path"] = scope["path"].encode()
    if not (sep and token and rest in ENDPOINTS):
        return False
    scope[TOKEN_KEY] = token
    return True


def credentials(scope: Scope) -> tuple[Credential, ...] | None:
    """For the door: the token in the path of the two endpoints (lifted out of it, see
    :func:`lift_token`); a wrong one is let in unidentified, and they refuse it in
    SandboxFusion's words. None for any other request."""
    if not lift_token(scope):
        return None
    return (Credential(scope.get(TOKEN_KEY), Kind.LENIENT),)


def _token_ok(request: Request) -> bool:
    """The path's token is the daemon's or a tenant's (the guard identified it; a
    tenant's runs are its own sandboxes, under its quota)."""
    return caller_of(request) is not UNIDENTIFIED


async def _read_held(request: Request, sid: str, path: str, cap: int,
                     held: Callable[[int], int]) -> bytes:
    """A file of the sandbox read with its room in the output budget
    (:meth:`SandboxVerbs.read_file_held`), kept until the reply is written."""
    data, hold = await ctx.sandboxes(request).read_file_held(sid, path, cap, held)
    request.scope.setdefault(HOLD_KEY, []).append(hold)
    return data


def _detail(status: int, detail: Any, *, close: bool = False) -> JSONResponse:
    """An error as FastAPI (SandboxFusion's server) words it."""
    return JSONResponse(
        {"detail": detail}, status_code=status, headers={"Connection": "close"} if close else None
    )


async def _body(request: Request, model: type[T]) -> T | JSONResponse:
    """The request body as ``model``, or the reply SandboxFusion's server gives."""
    try:
        raw = await read_body(request, ctx.settings(request).max_upload_bytes, "request body")
        data = parse_json(raw, "request body")
    except FileTooLarge as exc:
        return _detail(413, exc.message, close=True)
    except InvalidArgument as exc:
        return _detail(422, [{"type": "json_invalid", "loc": ["body"], "msg": exc.message}])
    except CorralError as exc:  # a body that stalls (408)
        return _detail(exc.status, exc.message, close=True)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        return _detail(422, validation_detail(exc))


class FusionFrontend:
    """The front-end's state: its settings and the warm pools it made."""

    def __init__(self, settings: FusionSettings) -> None:
        self.settings = settings
        self.pools = FusionPools(settings.pool_idle)  # bounded: sandboxfusion_pools
        self.kernel = program("fusion_kernel").encode()

    # ---------------------------------------------------------------- sandboxes

    async def _acquire(self, request: Request, image: str, memory_mb: int) -> SandboxInfo:
        service = ctx.service(request)
        spec = service.plan(SandboxSpec.parse(
            {"image": image, "memory_mb": memory_mb, "tags": [TAG], "timeout": POOL_LIFETIME_S}
        ), caller_of(request), frontend="sandboxfusion")
        tenant = caller_of(request).name
        key = (tenant, image, spec.memory_mb)
        name = self.pools.get(key)
        if name is None and spec.memory_mb <= MAX_POOLED_MEMORY_MB:
            await self.pools.sweep(service.pools)  # idle pools make room
        if name is None and spec.memory_mb <= MAX_POOLED_MEMORY_MB and self.pools.has_room(tenant):
            # a tenant's pool is its own (its quota, its sandboxes)
            name = f"{TAG}-{image}-{spec.memory_mb}" + (f"-{tenant}" if tenant else "")
            if not service.pools.owns(tenant, name):  # its own: names are per tenant
                service.pools.create_pool(
                    name, spec, min_ready=self.settings.warm,
                    max_size=min(MAX_POOL_SIZE, ctx.settings(request).max_sandboxes),
                    owner=tenant)
            self.pools.add(key, name, service.pools)
        if name is not None:
            try:
                return await service.pools.acquire(
                    name, ctx.settings(request).queue_timeout, exact=True, owner=tenant)
            except NotFound:  # deleted (idle, or by someone): made again next time
                self.pools.forget(key)
        return await service.create(spec, caller_of(request))

    @contextlib.asynccontextmanager
    async def sandbox(self, request: Request, image: str, memory_mb: int) -> AsyncIterator[str]:
        """A fresh sandbox for one request, deleted after it whatever happens."""
        info = await self._acquire(request, image, memory_mb)
        try:
            yield info.id
        finally:  # shielded: a client that left (cancelled) still gets it deleted
            await asyncio.shield(ctx.service(request).delete(info.id, caller_of(request)))

    @staticmethod
    def memory_mb(limit: int) -> int:
        """The sandbox's memory for ``memory_limit_MB`` (-1: corral's default)."""
        return max(limit, MIN_MEMORY_MB) if limit > 0 else DEFAULT_MEMORY_MB

    # ------------------------------------------------------------------- steps

    @staticmethod
    async def write_files(request: Request, sid: str, files: dict[str, bytes]) -> None:
        engine = ctx.sandboxes(request)
        for name, data in files.items():
            await engine.write_file(sid, name, data)

    @staticmethod
    async def fetch(request: Request, sid: str, names: list[str]) -> dict[str, str]:
        """``names`` that are regular files, base64; missing ones are left out. Their
        room in the output budget is reserved first (as a command's output; the reply
        keeps it until written), so a lowered grant fetches less, refused typed."""
        engine, out, left = ctx.sandboxes(request), {}, MAX_FETCH_TOTAL
        if names:
            await engine.kill_processes(sid)  # nothing changes them while they are read
        for name in names:
            try:  # held as base64 (4 bytes for 3) until the reply is written
                data = await _read_held(request, sid, name, min(MAX_FETCH_BYTES, left),
                                        lambda n: (n + 2) // 3 * 4)
            except FileTooLarge:
                raise  # a SandboxError naming it, never a silently missing file
            except FileError:  # missing, a directory, not a regular file
                continue
            left -= len(data)
            out[name] = base64.b64encode(data).decode()
        return out

    @staticmethod
    async def command(
        request: Request, sid: str, argv: list[str], timeout: float, stdin: str | None = None
    ) -> dict[str, Any]:
        engine = ctx.sandboxes(request)
        if stdin is not None and len(stdin) > STDIN_INLINE:
            path = f"/tmp/stdin-{secrets.token_hex(4)}"
            await engine.write_file(sid, path, stdin)
            argv, stdin = ["/bin/sh", "-c", 'exec "$@" < "$0"', path, *argv], None
        r = await engine.exec(
            sid, argv, timeout=timeout, stdin=stdin, max_output=MAX_OUTPUT, output_tail=0
        )
        return command_result(r)

    # --------------------------------------------------------------- endpoints

    def _image(self, request: Request, language: str) -> str:
        """The image ``language`` runs in; :class:`Unsupported` or
        :class:`ImageNotFound` naming what to build (a ``SandboxError`` reply)."""
        image = self.settings.images.get(language)
        if image is None or language not in LANGUAGES:
            raise Unsupported(self.settings.missing(language), details={"language": language})
        if not ctx.engine(request).images.exists(image):
            raise ImageNotFound(self.settings.not_built(language, image),
                                details={"language": language, "image": image})
        return image

    async def run_code(self, request: Request, req: RunCodeRequest) -> dict[str, Any]:
        chain = LANGUAGES.get(req.language)
        image = self._image(request, req.language)
        assert chain is not None
        files = decode_files(req.files)
        src = f"tmp{secrets.token_hex(4)}{chain.ext}"
        compiled = ran = None
        async with self.sandbox(request, image, self.memory_mb(req.memory_limit_MB)) as sid:
            await self.write_files(request, sid, {**files, src: req.code.encode()})
            if chain.compile is not None:
                compiled = await self.command(
                    request, sid, chain.argv(chain.compile, src), req.compile_timeout
                )
            if compiled is None or (compiled["status"] == FINISHED and compiled["return_code"] == 0):
                argv = chain.argv(chain.run, src) + (req.args if req.language == "pytest" else [])
                ran = await self.command(request, sid, argv, req.run_timeout, req.stdin)
            fetched = await self.fetch(request, sid, req.fetch_files)
        return code_response(
            run_status(compiled, ran), compile_result=compiled, run_result=ran, files=fetched
        )

    async def run_jupyter(self, request: Request, req: RunJupyterRequest) -> dict[str, Any]:
        image = self._image(request, "python")
        files = decode_files(req.files)
        nonce = secrets.token_hex(4)
        driver, config, result = (f"/tmp/kernel-{nonce}{x}" for x in (".py", ".json", ".out"))
        job = {"cells": req.cells, "cell_timeout": req.cell_timeout, "result": result}
        async with self.sandbox(request, image, self.memory_mb(req.memory_limit_MB)) as sid:
            await self.write_files(request, sid, {
                **files, driver: self.kernel, config: json.dumps(job).encode()
            })
            ran = await self.command(
                request, sid, ["python3", driver, config], req.total_timeout
            )
            if ran["status"] != FINISHED or ran["return_code"] != 0:
                return jupyter_response(FAILED, driver=ran)
            try:  # the cells' results (their code may write them): in the budget too
                raw = await _read_held(request, sid, result, MAX_FETCH_TOTAL, lambda n: 2 * n)
                cells = DriverOutput.model_validate_json(raw).cells
            except OutputBudgetExceeded:
                raise  # a SandboxError that says so
            except (CorralError, ValidationError):
                cells = None
            if cells is None or len(cells) != len(req.cells):  # one result per cell sent
                why = "the cells' process ended without its results (did a cell replace them?)"
                return jupyter_response(FAILED, why, driver=ran)
            fetched = await self.fetch(request, sid, req.fetch_files)
        return jupyter_response(
            SUCCESS, driver=ran, cells=[c.model_dump() for c in cells], files=fetched
        )


async def _submit(frontend: FusionFrontend, request: Request, req: SubmitRequest) -> dict[str, Any]:
    """``/submit``: a completion against stdin/stdout cases, by corral's judge
    (:mod:`.sandboxfusion_submit`)."""
    _, cases, line, nonce = judge_request(req)
    if not ctx.engine(request).images.exists(JUDGE_IMAGE):
        raise ImageNotFound(f"/submit runs on the {JUDGE_IMAGE!r} built-in image, which is not "
                            "built here: run `make install` (corral.runtime.prepare)",
                            details={"image": JUDGE_IMAGE})
    per_case = 6 * (req.config.run_timeout or 10.0) + 10  # the judge's wall guard, and some
    timeout = min(MAX_TIMEOUT_S, (req.config.compile_timeout or 60.0) + per_case * len(cases))
    async with frontend.sandbox(request, JUDGE_IMAGE, JUDGE_MEMORY_MB) as sid:
        r = await ctx.sandboxes(request).exec(
            sid, judge_argv(), timeout=timeout, stdin=line, max_output=MAX_OUTPUT, output_tail=0,
            env={"PATH": "/usr/local/bin:/usr/bin:/bin"},
        )
    return eval_result(req, cases, r.stdout.decode("utf-8", "replace"), nonce, r.timed_out)


def _submit_failed(status: str, message: str = "") -> dict[str, Any]:
    return {"id": "", "accepted": False, "extracted_code": "", "tests": [],
            "extra": {"status": status, "message": message}}


def _endpoint(
    model: type[T], run: Callable[[FusionFrontend, Request, T], Awaitable[dict[str, Any]]],
    failed: Callable[..., dict[str, Any]],
) -> Callable[[Request], Awaitable[Response]]:
    async def handler(request: Request) -> Response:
        if not _token_ok(request):  # before a byte of the body is read
            return _detail(401, "wrong token: use http://HOST:PORT/sandboxfusion/<the daemon's "
                           "--token>/ as the SandboxFusion endpoint", close=True)
        req = await _body(request, model)
        if isinstance(req, JSONResponse):
            return req
        frontend: FusionFrontend = request.app.state.sandboxfusion
        try:
            reply = await ctx.unless_disconnected(request, run(frontend, request, req))
        except CorralError as exc:  # what SandboxFusion's runners would fail on
            reply = failed(SANDBOX_ERROR, exc.message)
        except BaseException:
            for held in request.scope.pop(HOLD_KEY, ()):
                held.release()
            raise
        # the reply holds its room in the output budget until written (one hold, sized
        # to it: the others' room goes back)
        hold, *others = request.scope.pop(HOLD_KEY, None) or [
            ctx.engine(request).output_budget.hold(ctx.owner(request))]
        for held in others:
            held.release()
        try:
            return HeldJSONResponse(reply, hold)
        except BaseException:
            hold.release()
            raise

    return handler


def routes() -> list[Route]:
    return [
        Route(PREFIX + "{token}/run_code", _endpoint(
            RunCodeRequest, FusionFrontend.run_code, code_response), methods=["POST"]),
        Route(PREFIX + "{token}/run_jupyter", _endpoint(
            RunJupyterRequest, FusionFrontend.run_jupyter, jupyter_response), methods=["POST"]),
        Route(PREFIX + "{token}/submit", _endpoint(SubmitRequest, _submit, _submit_failed),
              methods=["POST"]),
    ]


def mount(app: Starlette) -> None:
    """Serve SandboxFusion's endpoints on ``app`` too (settings read from the
    environment now: a malformed one stops the daemon from starting), behind the
    native routes like the Tensorlake front-end's."""
    app.state.sandboxfusion = FusionFrontend(FusionSettings.from_env())
    app.router.default = Router(routes=routes(), default=app.router.default)
    token = app.state.settings.token
    if token and not PATH_SAFE.fullmatch(token):
        logger.warning(
            "the daemon's token has characters other than letters, digits and -._~: "
            "SandboxFusion clients, which send it in the URL path, cannot use it as is"
        )

