"""E2B's API on a corral daemon: scripts written for the ``e2b`` Python SDK run
unchanged with ``E2B_API_URL=http://HOST:PORT``, ``E2B_SANDBOX_URL=http://HOST:PORT``
and ``E2B_API_KEY=<the daemon's --token>``.

The SDK sends two kinds of request to the same daemon port, told apart by header
(their paths overlap Tensorlake's, so a header, not a path, routes them):

- the **control API** (create, list, get, kill, set_timeout, connect, pause, metrics)
  carries ``X-API-KEY``: this module;
- **envd**, the in-sandbox API (processes: :mod:`.e2b_envd`; files: :mod:`.e2b_files`),
  carries ``E2b-Sandbox-Id`` and ``X-Access-Token``, the per-sandbox token the create
  reply gave: an HMAC of the sandbox id under the daemon's token, so it opens that
  sandbox only and is never stored.

The daemon's door reads them first (:mod:`.e2b_door`): the key or access token is
checked from the headers alone (nothing is read before), and a wrong one is a 401,
which the SDK raises as ``AuthenticationException``.

What maps to what: a template is a corral image (:class:`E2BSettings`); ``timeout``
is the sandbox's lifetime from now (``set_timeout`` moves it); ``metadata`` is kept as
tags (and listed by them); ``envs`` are the sandbox's environment. ``pause`` freezes
the sandbox, or hibernates one created with metadata ``{"corral.checkpointable":
"true"}`` (its processes to disk, its memory freed, as E2B's own pause: docs/live.md);
``connect`` thaws or restores it. ``allow_internet_access`` gives the public internet
through corral's egress filter, ``network={allow_out, deny_out}`` an egress policy
(docs/network.md). ``lifecycle={"on_timeout": "pause"}`` makes the sandbox
checkpointable and its timeout hibernates it (``connect`` or its next command resumes
it); ``connect`` of a paused sandbox starts its timeout again (E2B's rule). Refused
(400, never ignored): other network options, MCP, volume mounts, IAM, auto-pause with
a network, filesystem-only auto-pause, ``auto_resume=False``. ``fork`` and
snapshots: :mod:`.e2b_fork`. Answered 501: logs, templates, volumes, secrets.
"""

from __future__ import annotations

import base64
import binascii
import os
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router
from starlette.types import ASGIApp, Receive, Scope, Send

from corral.errors import (
    CorralError,
    ImageNotFound,
    InvalidArgument,
    SandboxNotFound,
    SnapshotNotFound,
)
from corral.network_schema import NetworkPolicy
from corral.runtime.distribution import is_reference
from corral.runtime.events import SandboxEnded
from corral.runtime.prepare import INTERPRETER_IMAGE  # built there (scripts/install.sh runs it)
from corral.schema import (
    MAX_TIMEOUT_S,
    NetworkMode,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    validate_model,
)
from corral.server import context as ctx
from corral.server.caller import caller_of
from corral.server.compat import (
    e2b_envd,
    e2b_files,
    e2b_interpreter,
    e2b_lifecycle,
    e2b_watch,
)
from corral.server.compat._wire import compat_network, name_pairs
from corral.server.compat.e2b_connect import ConnectError, Handler, caught, iso
from corral.server.compat.e2b_door import MARK
from corral.server.compat.e2b_network import egress_policy
from corral.server.context import unless_gone
from corral.server.door import TRAFFIC
from corral.server.lifetime import set_lifetime
from corral.server.wire import read_json

TAG = "e2b"
TEMPLATE_TAG = "e2b.template="
META_TAG = "e2b.m:"
DEFAULT_TEMPLATE = "base"
INTERPRETER_TEMPLATE = "code-interpreter-v1"  # e2b-code-interpreter's default template
DEFAULT_IMAGE = "rl"
DEFAULT_TIMEOUT_S = 300  # the SDK's own default lifetime
# envd features served: default user, stdin close, octet-stream upload, watch events'
# entries (0.6.3; file metadata, 0.6.2, is refused by the upload)
ENVD_VERSION = "0.6.3"
MAX_LIST = 1000
LIVE = (SandboxState.PENDING, SandboxState.RUNNING, SandboxState.PAUSED)
STATE = {SandboxState.PAUSED: "paused"}  # everything else alive is "running"
ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


# ---------------------------------------------------------------- settings


@dataclass(frozen=True)
class E2BSettings:
    """Which corral image an E2B template means (daemon environment, read at start):

    - ``CORRAL_E2B_DEFAULT_IMAGE`` (else ``CORRAL_COMPAT_DEFAULT_IMAGE``, else ``rl``):
      the image of E2B's default template ``base``; the Code Interpreter's
      ``code-interpreter-v1`` is the built-in ``code-interpreter`` image (numpy, pandas,
      matplotlib; its kernel itself needs only ``python3``, so any image may serve);
    - ``CORRAL_E2B_TEMPLATES``: more, ``template=image`` pairs separated by commas,
      e.g. ``code-interpreter-v1=code-interpreter,my-agent=python``. A template neither
      mapped nor a corral image's name is refused.
    - ``CORRAL_COMPAT_NETWORK`` (``none``, default, or ``host``): what a sandbox
      created with ``allow_internet_access=True`` gets; with ``none`` it is refused.
    """

    default_image: str = DEFAULT_IMAGE
    templates: Mapping[str, str] = field(default_factory=dict)
    network: NetworkMode = NetworkMode.NONE

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "E2BSettings":
        default = (environ.get("CORRAL_E2B_DEFAULT_IMAGE", "").strip()
                   or environ.get("CORRAL_COMPAT_DEFAULT_IMAGE", "").strip() or DEFAULT_IMAGE)
        templates = {DEFAULT_TEMPLATE: default, INTERPRETER_TEMPLATE: INTERPRETER_IMAGE}
        templates.update(name_pairs(environ, "CORRAL_E2B_TEMPLATES",
                                    "code-interpreter-v1=code-interpreter,my-agent=python"))
        network = compat_network(environ)
        return cls(default_image=default, templates=templates, network=network)

    def image(self, template: str) -> str:
        return self.templates.get(template, template)


def settings(request: Request) -> E2BSettings:
    return request.app.state.e2b_settings


# --------------------------------------------------------------- the wire


def error(status: int, message: str) -> JSONResponse:
    """An error as E2B's API words it: ``{"code": status, "message"}``."""
    return JSONResponse({"code": status, "message": message}, status_code=status)


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def _unb64(text: str) -> str:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()


def meta_tag(key: str, value: str) -> str:
    return f"{META_TAG}{_b64(key)}={_b64(value)}"


def metadata(info: SandboxInfo) -> dict[str, str]:
    out = {}
    for tag in info.spec.tags:
        if tag.startswith(META_TAG):
            key, _, value = tag[len(META_TAG):].partition("=")
            try:
                out[_unb64(key)] = _unb64(value)
            except (binascii.Error, UnicodeDecodeError, ValueError):
                continue
    return out


def template(info: SandboxInfo) -> str:
    for tag in info.spec.tags:
        if tag.startswith(TEMPLATE_TAG):
            return tag[len(TEMPLATE_TAG):]
    return info.spec.image


def _started(info: SandboxInfo) -> float:
    return info.started_at or info.created_at


def listed_json(info: SandboxInfo) -> dict[str, Any]:
    spec = info.spec
    return {
        "templateID": template(info),
        "sandboxID": info.id,
        "clientID": "corral",
        "startedAt": iso(_started(info)),
        "endAt": iso(_started(info) + spec.timeout),
        "cpuCount": max(1, round(spec.cpus)),
        "memoryMB": spec.memory_mb,
        "diskSizeMB": spec.disk_mb,
        "state": STATE.get(info.state, "running"),
        "envdVersion": ENVD_VERSION,
        "metadata": metadata(info),
    }


def detail_json(request: Request, info: SandboxInfo) -> dict[str, Any]:
    return {
        **listed_json(info),
        "envdAccessToken": ctx.door(request).mint(caller_of(request), info.id),
        "allowInternetAccess": info.spec.network != NetworkMode.NONE,
        "domain": None,
        "lifecycle": e2b_lifecycle.lifecycle_json(info.spec),
    }


def created_json(request: Request, info: SandboxInfo) -> dict[str, Any]:
    door, caller = ctx.door(request), caller_of(request)
    return {
        "templateID": template(info),
        "sandboxID": info.id,
        "clientID": "corral",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": door.mint(caller, info.id),
        "trafficAccessToken": door.mint(caller, info.id, TRAFFIC),
        "domain": None,
    }


# ----------------------------------------------------------------- bodies


class _Body(BaseModel):
    # Strict: "600" or true is refused, never coerced; fields a newer SDK adds are ignored.
    model_config = ConfigDict(extra="allow", strict=True)


class NewSandbox(_Body):
    templateID: str = Field(DEFAULT_TEMPLATE, min_length=1, max_length=200)
    timeout: int | None = Field(None, ge=0, le=int(MAX_TIMEOUT_S))
    metadata: dict[str, str] | None = Field(None, max_length=48)
    envVars: dict[str, str] | None = Field(None, max_length=1000)
    allow_internet_access: bool | None = None
    autoPause: bool | None = None
    autoPauseMemory: bool | None = None
    autoResume: Any = None
    network: Any = None
    mcp: Any = None
    iam: Any = None
    volumeMounts: Any = None
    secure: bool | None = None


class TimeoutBody(_Body):
    timeout: int = Field(..., ge=0, le=int(MAX_TIMEOUT_S))


class ConnectBody(_Body):
    timeout: int | None = Field(None, ge=0, le=int(MAX_TIMEOUT_S))


async def _body(request: Request, model: type[BaseModel], what: str) -> Any:
    return validate_model(model, await read_json(request, what, required=False), what)


def _refuse(what: str, hint: str) -> InvalidArgument:
    return InvalidArgument(f"{what} is not supported by corral's E2B front-end: {hint}")


E2B_HOME = "/home/user"
"""E2B's working directory (its user ``user``'s home), made owned by the sandbox's user."""


CHECKPOINTABLE_KEY = "corral.checkpointable"  # metadata {KEY: "true"}: pause() hibernates


def _spec(req: NewSandbox, cfg: E2BSettings, snapshot: str | None = None) -> SandboxSpec:
    if req.mcp:
        raise _refuse("mcp", "start the server with sandbox.commands.run() instead")
    if req.volumeMounts:
        raise _refuse("volume_mounts", "copy files in with sandbox.files.write()")
    if req.iam:
        raise _refuse("iam", "corral sandboxes have no workload identity")
    auto_pause = e2b_lifecycle.auto_pause(
        pause=req.autoPause, memory=req.autoPauseMemory, resume=req.autoResume,
        networked=bool(req.network or req.allow_internet_access))
    network: NetworkMode | dict[str, list[str]] = NetworkMode.NONE
    if req.network:
        network = egress_policy(req.network)
    elif req.allow_internet_access:
        # the public internet through corral's filter (docs/network.md); the host's own
        # network only where the front-end was told so (and the daemon allows it)
        network = NetworkMode.HOST if cfg.network == NetworkMode.HOST else {}
    tags = [TAG, TEMPLATE_TAG + req.templateID]
    for key, value in (req.metadata or {}).items():
        tag = meta_tag(key, value)
        if len(tag) > 128:
            raise InvalidArgument(f"metadata {key[:64]!r}: a key and its value of up to about "
                                  "90 bytes together are kept", details={"key": key[:64]})
        tags.append(tag)
    fields = {
        "image": cfg.image(req.templateID),
        "timeout": float(req.timeout or DEFAULT_TIMEOUT_S),
        # where E2B's own sandboxes start their commands and put relative paths ($HOME
        # stays the image's: its user's ~/.local packages are found there)
        "workdir": E2B_HOME,
        "env": req.envVars or {},
        "network": network,
        "tags": tags,
        # pause() then hibernates it (memory to disk, as E2B's pause does): docs/live.md
        "checkpointable": auto_pause or (req.metadata or {}).get(CHECKPOINTABLE_KEY) == "true",
        # lifecycle on_timeout="pause": its timeout hibernates it (docs/live.md)
        "on_timeout": "hibernate" if auto_pause else "stop",
    }
    if snapshot is not None:  # from create_snapshot's (e2b_fork): its own unless asked
        fields = {k: v for k, v in fields.items() if k not in ("image", "workdir") and (
            (k, v) not in (("checkpointable", False), ("on_timeout", "stop"), ("env", {})))}
        fields["snapshot"] = snapshot
    return SandboxSpec.parse(fields)


def _snapshot(request: Request, template: str) -> str | None:
    """The id of the caller's snapshot a template names (``Sandbox.create(snapshot_id)``),
    unless it is a template of the front-end's settings."""
    if template in settings(request).templates:
        return None
    try:
        return ctx.engine(request).get_snapshot(template, owner=ctx.owner(request)).id
    except SnapshotNotFound:
        return None


# --------------------------------------------------------------- handlers


def _target(request: Request) -> SandboxInfo:
    """A live sandbox made through this front-end, else the one 404."""
    sid = request.path_params["sandbox_id"]
    try:
        info = ctx.sandboxes(request).get(sid)
    except SandboxNotFound:
        info = None
    if info is None or TAG not in info.spec.tags or info.state not in LIVE:
        raise SandboxNotFound(f"sandbox {sid} not found: it never existed, was killed or "
                              "timed out", details={"sandbox_id": sid})
    return info


async def create_sandbox(request: Request) -> Response:
    req: NewSandbox = await _body(request, NewSandbox, "E2B sandbox request")
    cfg = settings(request)
    snapshot = _snapshot(request, req.templateID)
    spec = _spec(req, cfg, snapshot)
    if snapshot is None and not is_reference(spec.image) and not ctx.engine(request).images.exists(spec.image):
        raise ImageNotFound(
            f"no corral image for E2B template {req.templateID!r}: build one, or map the "
            f"template when starting the daemon: CORRAL_E2B_TEMPLATES='{req.templateID}="
            f"IMAGE'", details={"template": req.templateID})
    service = ctx.service(request)
    # The daemon's own flag (--allow-host-network) still decides, whatever the front-end's
    # CORRAL_COMPAT_NETWORK says: E2B may not be the way around it.
    caller = caller_of(request)
    spec = service.plan(await service.with_image(spec, caller), caller,
                        host_network=ctx.host_network_allowed(request), frontend="e2b")
    created = await unless_gone(request, service.create(spec, caller))
    return JSONResponse(created_json(request, created), status_code=201)


def _query_states(raw: str | None) -> list[SandboxState]:
    if not raw:
        return [SandboxState.RUNNING, SandboxState.PAUSED, SandboxState.PENDING]
    states: list[SandboxState] = []
    for name in raw.split(","):
        if name == "running":
            states += [SandboxState.RUNNING, SandboxState.PENDING]
        elif name == "paused":
            states.append(SandboxState.PAUSED)
        else:
            raise InvalidArgument(f"unknown state {name!r}: use running or paused")
    return states


def _query_metadata(raw: str | None) -> list[str]:
    if not raw:
        return []
    try:
        pairs = urllib.parse.parse_qsl(raw, keep_blank_values=True, max_num_fields=64)
    except ValueError:
        raise InvalidArgument("metadata: at most 64 key=value pairs") from None
    return [meta_tag(urllib.parse.unquote(k), urllib.parse.unquote(v)) for k, v in pairs]


def paged(request: Request, items: list[Any]) -> tuple[list[Any], dict[str, str]]:
    """The page of ``items`` that ``limit`` and ``nextToken`` ask for, and its headers."""
    q = request.query_params
    raw_limit, raw_next = q.get("limit", "100"), q.get("nextToken", "0")
    if not (raw_limit.isdecimal() and len(raw_limit) < 6 and 1 <= int(raw_limit) <= MAX_LIST):
        raise InvalidArgument(f"limit must be a whole number from 1 to {MAX_LIST}")
    if not (raw_next.isdecimal() and len(raw_next) < 12):
        raise InvalidArgument("invalid nextToken: pass the one the last page gave")
    limit, offset = int(raw_limit), int(raw_next)
    more = {"X-Next-Token": str(offset + limit)} if offset + limit < len(items) else {}
    return items[offset:offset + limit], more


async def list_sandboxes(request: Request) -> Response:
    q = request.query_params
    tags = [TAG, *_query_metadata(q.get("metadata"))]
    if q.get("template"):
        tags.append(TEMPLATE_TAG + q["template"])
    # the caller's own only (the admin's too): a team lists its own sandboxes, and a
    # search by metadata never finds another tenant's (server/reserved_tags.py)
    infos = ctx.service(request).own(caller_of(request),
        ctx.engine(request).list(tags=tags, state=_query_states(q.get("state")),
                                 owner=ctx.owner(request)))
    infos.sort(key=_started, reverse=q.get("order") == "desc")
    page, headers = paged(request, infos)
    return JSONResponse([listed_json(i) for i in page], headers=headers)


async def get_sandbox(request: Request) -> Response:
    return JSONResponse(detail_json(request, _target(request)))


async def kill_sandbox(request: Request) -> Response:
    sid = _target(request).id
    await ctx.service(request).delete(sid, caller_of(request))
    return Response(status_code=204)


async def set_timeout(request: Request) -> Response:
    body: TimeoutBody = await _body(request, TimeoutBody, "timeout request")
    await set_lifetime(request, _target(request).id, float(body.timeout))
    return Response(status_code=204)


async def update_network(request: Request) -> Response:
    """``update_network``: a new egress policy (only for a sandbox made with one:
    ``network=`` or ``allow_internet_access=True``); connections it refuses are cut."""
    policy = egress_policy(await read_json(request, "network update", required=True))
    await ctx.service(request).update_network(_target(request).id, NetworkPolicy(**policy),
                                              caller_of(request))
    return Response(status_code=204)


async def refresh(request: Request) -> Response:
    _target(request)
    return Response(status_code=204)


async def connect_sandbox(request: Request) -> Response:
    body: ConnectBody = await _body(request, ConnectBody, "connect request")
    info = _target(request)
    status = 200
    if info.state == SandboxState.PAUSED:
        info = await ctx.sandboxes(request).resume(info.id)
        status = 201
        # E2B: a resumed sandbox's timeout starts again at connect, the one given (or
        # the default), whatever was left of it: as far as its maximum lifetime allows
        want = min(float(body.timeout or DEFAULT_TIMEOUT_S),
                   ctx.service(request).lifetime_left(info))
        info = await set_lifetime(request, info.id, want)
    elif body.timeout:
        left = _started(info) + info.spec.timeout - datetime.now(timezone.utc).timestamp()
        # a running sandbox's timeout only grows, as far as its maximum lifetime allows
        want = min(float(body.timeout), ctx.service(request).lifetime_left(info))
        if want > left:
            info = await set_lifetime(request, info.id, want)
    return JSONResponse(created_json(request, info), status_code=status)


async def pause_sandbox(request: Request) -> Response:
    info = _target(request)
    if info.state == SandboxState.PAUSED:
        return error(409, f"sandbox {info.id} is already paused")
    if info.spec.checkpointable:  # E2B's pause keeps memory on disk: corral's hibernate
        await ctx.sandboxes(request).hibernate(info.id)
    else:
        await ctx.sandboxes(request).pause(info.id)
    return Response(status_code=204)


async def metrics(request: Request) -> Response:
    info = _target(request)
    if info.state != SandboxState.RUNNING:
        return JSONResponse([])
    usage = ctx.sandboxes(request).usage(info.id)
    now = datetime.now(timezone.utc)
    spec = info.spec
    return JSONResponse([{
        "timestamp": now.isoformat().replace("+00:00", "Z"),
        "timestampUnix": int(now.timestamp()),
        "cpuCount": max(1, round(spec.cpus)),
        "cpuUsedPct": round(min(100.0, 100 * usage.get("cpu_seconds", 0.0) / max(
            now.timestamp() - _started(info), 1e-3) / spec.cpus), 2),
        "memUsed": int(usage.get("memory_mb", 0) * (1 << 20)),
        "memTotal": spec.memory_mb << 20,
        "memCache": 0,
        "diskUsed": 0,
        "diskTotal": spec.disk_mb << 20,
    }])


async def unsupported(request: Request) -> Response:
    return error(501, f"{request.method} {request.url.path} is part of the E2B API that "
                 "corral's E2B front-end does not implement; see docs/e2b.md for what "
                 "is supported")


def _api_error(exc: CorralError | ConnectError) -> Response:
    if isinstance(exc, ConnectError):
        return error(400, exc.message)
    return error(exc.status, exc.message)


_SB = "/sandboxes/{sandbox_id}"
CONTROL = (
    ("POST", "/v2/sandboxes", create_sandbox),
    ("POST", "/sandboxes", create_sandbox),
    ("GET", "/v2/sandboxes", list_sandboxes),
    ("GET", "/sandboxes", list_sandboxes),
    ("GET", _SB, get_sandbox),
    ("DELETE", _SB, kill_sandbox),
    ("POST", _SB + "/timeout", set_timeout),
    ("POST", _SB + "/refreshes", refresh),
    ("PUT", _SB + "/network", update_network),
    ("POST", "/v2" + _SB + "/connect", connect_sandbox),
    ("POST", _SB + "/connect", connect_sandbox),
    ("POST", _SB + "/resume", connect_sandbox),
    ("POST", _SB + "/pause", pause_sandbox),
    ("GET", _SB + "/metrics", metrics),
)


class Dispatch:
    """Middleware just inside the daemon's guard: the requests the door (:mod:`.e2b_door`)
    marked go to E2B's control API or envd, whatever their path; the rest go on."""

    def __init__(self, app: ASGIApp, extra: Sequence[tuple[str, str, Handler]] = ()) -> None:
        self.app = app  # extra: more control routes (e2b_fork's, which imports this module)
        control = [Route(path, caught(handler, _api_error), methods=[method])
                   for method, path, handler in (*CONTROL, *extra)]
        control.append(Route("/{rest:path}", unsupported, methods=ALL_METHODS))
        self.routers = {
            "api": Router(routes=control),
            "envd": Router(routes=e2b_envd.routes() + e2b_files.routes(),
                           default=e2b_files.no_route),
            "jupyter": Router(routes=e2b_interpreter.routes(),
                              default=e2b_interpreter.no_route),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.routers.get(scope.get(MARK, ""), self.app)(scope, receive, send)


def mount(app: Starlette) -> None:
    """The E2B front-end's state on ``app`` (its settings read from the environment
    now: a malformed one stops the daemon from starting); its routes are
    :class:`Dispatch`'s."""
    app.state.e2b_settings = E2BSettings.from_env()
    processes = app.state.e2b_processes = e2b_envd.ProcessTable()
    contexts = app.state.e2b_contexts = e2b_interpreter.Contexts()
    watchers = app.state.e2b_watchers = e2b_watch.Watchers()

    def ended(event: SandboxEnded) -> None:
        processes.forget(event.sandbox_id)
        contexts.forget(event.sandbox_id)
        watchers.forget(event.sandbox_id)

    app.state.engine.events.subscribe(SandboxEnded, ended)
