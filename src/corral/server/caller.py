"""Who a request acts for: the :class:`Caller`, resolved once at the door and passed on.

A caller is never guessed: :class:`~corral.server.door.Door` makes one from the
request's credentials (or refuses the request), and every layer below takes it from
the request (:func:`caller_of`) or as an argument. A request that reached a handler
without one answers as :data:`UNIDENTIFIED` (it sees nothing), never as the admin.

Scopes:

- ``admin``: the Unix socket or the daemon's own token; sees everything;
- ``tenant``: a tenant token; sees only the tenant's things;
- ``sandbox``: a per-sandbox token (E2B's envd and Code Interpreter access tokens),
  minted for one caller and one sandbox: it acts as its minter's tenant, on that
  sandbox only, and dies when the token that minted it is revoked;
- ``peer``: another daemon of the cluster, on the read-only peer routes only.

``token_id`` names the credential (``admin``, ``peer`` or the tenant's name, never
given twice): revoking it closes every call it opened
(:class:`~corral.server.open_calls.OpenCalls`), and so does logging out of the
dashboard ``session`` a call came through.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import Scope as AsgiScope

from corral.errors import Forbidden
from corral.server.tenant_model import ADMIN_NAME, Tenant

__all__ = [
    "ADMIN",
    "CALLER_KEY",
    "DAEMON",
    "Caller",
    "PEER",
    "Scope",
    "UNIDENTIFIED",
    "caller_name",
    "caller_of",
    "require_admin",
    "require_image_rights",
    "require_peer",
    "tenant_of",
]

CALLER_KEY = "corral.caller"  # where the door puts the request's Caller (ASGI scope)
PEER_ID = "peer"
DAEMON_ID = "\0daemon"  # never a token's name: nothing revokes the daemon's own work


class Scope(enum.Enum):
    """What a credential opens."""

    ADMIN = "admin"
    TENANT = "tenant"
    SANDBOX = "sandbox"
    PEER = "peer"


@dataclass(frozen=True)
class Caller:
    """Who sent a request: ``tenant`` None acts for the admin (see the module docstring)."""

    tenant: Tenant | None = None
    token_id: str = ADMIN_NAME
    scope: Scope = Scope.ADMIN
    sandbox_id: str | None = None  # scope SANDBOX: the one sandbox it opens
    session: str | None = None  # the dashboard session the request came through

    @classmethod
    def of_tenant(cls, tenant: Tenant) -> Caller:
        return cls(tenant, tenant.name, Scope.TENANT)

    @classmethod
    def on_behalf_of(cls, owner: str | None) -> Caller:
        """The daemon acting for ``owner`` (None: for itself) in its own work, e.g. a
        tenant's pool refilling: what that tenant would see, nothing it may change."""
        return DAEMON if owner is None else cls(Tenant(owner), DAEMON_ID, Scope.TENANT)

    @property
    def name(self) -> str | None:
        """The owner it acts for: its tenant's name, None for the admin."""
        return None if self.tenant is None else self.tenant.name

    def sees(self, owner: str | None) -> bool:
        """Whether this caller may see a thing of ``owner`` (None: the admin's): the
        admin sees everything, a tenant its own only."""
        return self.name is None or self.name == owner

    @property
    def may_manage_images(self) -> bool:
        return self.scope is Scope.ADMIN or (
            self.scope is Scope.TENANT and self.tenant is not None and self.tenant.allow_images)

    @property
    def may_use_host_network(self) -> bool:
        """A right of the admin, or of a tenant whose token grants it."""
        return self.scope is Scope.ADMIN or (
            self.tenant is not None and self.tenant.allow_host_network)

    def keys(self) -> tuple[str, ...]:
        """What revoking ends this caller's calls by: its token (the admin's cannot be
        revoked) and its dashboard session."""
        keys: tuple[str, ...] = ()
        if self.tenant is not None:
            keys += (token_key(self.token_id),)
        if self.session is not None:
            keys += (session_key(self.session),)
        return keys

    def in_session(self, session: str) -> Caller:
        return Caller(self.tenant, self.token_id, self.scope, self.sandbox_id, session)


def token_key(token_id: str) -> str:
    return f"token:{token_id}"


def session_key(session: str) -> str:
    return f"session:{session}"


ADMIN = Caller()
PEER = Caller(None, PEER_ID, Scope.PEER)
DAEMON = Caller(None, DAEMON_ID, Scope.ADMIN)  # the daemon's own work (sweeps, revocation)
# a wrong credential an endpoint refuses itself, or a request no door saw: sees nothing
UNIDENTIFIED = Caller(Tenant(""), "", Scope.TENANT)


def caller_of(request: Request) -> Caller:
    """Who sent ``request`` (set by the door); :data:`UNIDENTIFIED` if nobody checked."""
    caller = request.scope.get(CALLER_KEY)
    return caller if isinstance(caller, Caller) else UNIDENTIFIED


def caller_name(scope: AsgiScope) -> str | None:
    """The owner a request acts for: its caller's tenant, None for the admin, and
    nothing at all ("", fail closed) if no credential was checked."""
    caller = scope.get(CALLER_KEY)
    return caller.name if isinstance(caller, Caller) else ""


def tenant_of(request: Request) -> str | None:
    """The tenant name of ``request``'s caller; None for the admin."""
    return caller_of(request).name


def require_admin(request: Request, what: str) -> None:
    """:class:`Forbidden` unless the admin sent ``request``."""
    if caller_of(request).scope is not Scope.ADMIN:
        raise Forbidden(f"{what} needs the admin (the Unix socket or the daemon's token)")


def require_peer(request: Request) -> None:
    """:class:`Forbidden` unless another daemon of the cluster (or the admin) sent it."""
    if caller_of(request).scope not in (Scope.ADMIN, Scope.PEER):
        raise Forbidden("a peer (daemon to daemon) call needs the admin or the peer credential")


def require_image_rights(request: Request, what: str) -> None:
    """Images are shared read-only: changing them is the admin's, or a tenant's whose
    token was made with ``--allow-images``."""
    if not caller_of(request).may_manage_images:
        raise Forbidden(
            f"{what} needs the admin or a tenant token made with --allow-images "
            "(images are shared by every tenant)"
        )
