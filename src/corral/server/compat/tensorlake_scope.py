"""Tensorlake namespaces: which sandboxes, snapshots and pools a request may see.

A namespace is a boundary. Every object the front-end makes carries its namespace as
the tag ``tensorlake.ns=<namespace>``: a sandbox and its copies on the sandbox, a pool
on its spec (and so on every sandbox it hands out), a snapshot on the spec of the
sandbox it was taken from. A request sees the objects of its own namespace only:

- ``/v1/namespaces/{ns}/...`` is namespace ``ns``; the flat paths (``/sandboxes``,
  ``/api/v1/...``) are namespace ``default``;
- an object of another namespace, or one made outside the front-end (a native corral
  sandbox has no namespace tag), answers exactly like an id that never existed: the
  same 404, the same body, naming only what the request asked for;
- lists show the namespace's objects only; sandbox names are unique per namespace.

In-sandbox calls carry their namespace too: a sandbox's ``sandbox_url`` is the
daemon's URL plus ``/v1/namespaces/{ns}`` when it was reached through a namespaced
path, and Tensorlake's client keeps that path in front of ``/api/v1/...``.
"""

from __future__ import annotations

from starlette.requests import Request

from corral.errors import InvalidArgument, NotFound, SandboxNotFound, SnapshotNotFound
from corral.pool_schema import PoolDetail
from corral.runtime.engine import Engine
from corral.runtime.pools import PoolManager
from corral.schema import SandboxInfo, SnapshotInfo
from corral.server.caller import Caller
from corral.server.compat.tensorlake_model import NAME_RE, NAME_TAG, NS_TAG, STATUS
from corral.server.service import SandboxService

DEFAULT_NAMESPACE = "default"
NS_PREFIX = "/v1/namespaces/{namespace}"


def namespace(request: Request) -> str:
    """The namespace of a namespaced path (``/v1/namespaces/{ns}/...``), else default."""
    ns = request.path_params.get("namespace", DEFAULT_NAMESPACE)
    if not NAME_RE.fullmatch(ns):
        raise InvalidArgument(
            f"invalid namespace {ns[:100]!r}: use 1-100 ASCII letters, digits and _.-, "
            "starting with a letter or digit"
        )
    return ns


def ns_tag(ns: str) -> str:
    return NS_TAG + ns


def sandbox_url(request: Request) -> str:
    """Where the client sends a sandbox's in-sandbox calls: this daemon, as the client
    reached it, under the request's namespace (none for the flat paths).

    Tensorlake's client sends them there; to ``localhost`` / ``127.0.0.1`` with
    ``Host: <id>.local``, elsewhere with ``X-Tensorlake-Sandbox-Id``."""
    url = str(request.base_url).rstrip("/")
    if "namespace" in request.path_params:
        url += NS_PREFIX.format(namespace=namespace(request))
    return url


def resolve(engine: Engine, ref: str, ns: str, caller: Caller) -> SandboxInfo:
    """A sandbox of namespace ``ns`` by id, or by the Tensorlake name given at create
    (live ones first, and only ``caller``'s own: a name never resolves to another
    tenant's sandbox); :func:`no_sandbox` for anything else."""
    tag = ns_tag(ns)
    try:
        info = engine.get(ref, owner=caller.name)
    except SandboxNotFound:
        info = None
    if info is not None and tag in info.spec.tags:
        return info
    if NAME_RE.fullmatch(ref):
        named = SandboxService.own(caller, engine.list(tags=[NAME_TAG + ref, tag],
                                                        owner=caller.name))
        if named:
            return min(named, key=lambda i: (STATUS[i.state] != "running", -i.created_at))
    raise no_sandbox(ref, ns)


def no_sandbox(ref: str, ns: str) -> SandboxNotFound:
    """The one answer for a sandbox that does not exist in ``ns``, wherever it is."""
    return SandboxNotFound(
        f"no sandbox {ref!r} in namespace {ns!r}: it never existed or was deleted "
        "(list sandboxes to see what exists)",
        details={"sandbox_id": ref},
    )


def snapshot(engine: Engine, ref: str, ns: str, owner: str | None) -> SnapshotInfo:
    """``owner``'s snapshot taken from a sandbox of namespace ``ns``;
    :class:`SnapshotNotFound`, the same for every other one, if not."""
    try:
        if ns_tag(ns) in engine.snapshots.source_tags(ref, owner=owner):
            return engine.get_snapshot(ref, owner=owner)
    except SnapshotNotFound:
        pass
    raise SnapshotNotFound(
        f"no snapshot {ref!r} in namespace {ns!r}: it never existed or was deleted "
        "(list snapshots to see what exists)",
        details={"snapshot_id": ref},
    )


def snapshots(engine: Engine, ns: str, owner: str | None) -> list[SnapshotInfo]:
    return engine.snapshots.list(tag=ns_tag(ns), owner=owner)


def pool(pools: PoolManager, name: str, ns: str, owner: str | None) -> PoolDetail:
    """``owner``'s sandbox pool of namespace ``ns``; :class:`NotFound`, the same for
    every other one, if not."""
    try:
        got = pools.get_pool(name, owner=owner)
    except NotFound:
        got = None
    if got is None or ns_tag(ns) not in got.spec.tags:
        raise NotFound(
            f"no sandbox pool {name!r} in namespace {ns!r}: it was never made or was "
            "deleted (list sandbox pools to see what exists)",
            details={"pool": name},
        )
    return got


def pools(manager: PoolManager, ns: str, owner: str | None) -> list[PoolDetail]:
    return [p for p in manager.details(owner=owner) if ns_tag(ns) in p.spec.tags]
