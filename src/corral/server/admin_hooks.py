"""Who is asking, and whose is a sandbox: the three questions metrics and logs ask.

Whoever holds the daemon's token (or reaches the Unix socket) is its administrator,
:data:`ADMIN`; a tenant token (:mod:`corral.server.tenants`) is that tenant, and a
sandbox belongs to the tenant in its ``spec.tenant`` (None: the admin's).
:mod:`corral.server.metrics` and :mod:`corral.server.accesslog` call nothing else:

- :func:`require_admin`: ``GET /metrics`` is an administrator's view of the whole host;
- :func:`request_tenant`: the ``tenant`` of a JSON request log line;
- :func:`sandbox_tenant`: the ``tenant`` label of ``corral_tenant_sandboxes``.
"""

from __future__ import annotations

from starlette.types import Scope

from corral.errors import Forbidden
from corral.schema import SandboxInfo
from corral.server.tenants import ADMIN_NAME as ADMIN
from corral.server.tenants import caller_name


def request_tenant(scope: Scope) -> str:
    """The principal a request was authenticated as (the guard already let it in)."""
    name = caller_name(scope)
    return ADMIN if name is None else name


def sandbox_tenant(info: SandboxInfo) -> str:
    """The principal a sandbox belongs to."""
    return info.spec.tenant or ADMIN


def require_admin(scope: Scope, what: str) -> None:
    """:class:`~corral.errors.Forbidden` unless the request is the administrator's (the
    Unix socket always is; on TCP the guard has checked the token)."""
    if request_tenant(scope) != ADMIN:
        raise Forbidden(f"{what} needs the daemon's admin token (or its Unix socket)")
