"""Tenants: named bearer tokens with quotas, each seeing only its own sandboxes.

``corral token create NAME`` (on the Unix socket: the admin) makes a token of 256
random bits; the registry keeps only its SHA-256 (table ``tenants``, made on open, so
an older registry gains it), looked up on every request: a revoked token is refused
at once, no cache outlives :meth:`TokenStore.revoke`.

Who a request is (:class:`~corral.server.caller.Caller`) is decided by the daemon's
door (:mod:`corral.server.door`), which asks :meth:`Tenants.identify` whether a token
is the daemon's own (``--token``/``CORRAL_TOKEN``: the admin, ``tenant`` None, sees
everything) or a tenant's; nothing else calls it. The request then runs acting for
its caller, so every lookup by id, on every front-end, hides other tenants' things
exactly as ids that do not exist.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import sqlite3
import time
from typing import Any, Protocol

from corral.errors import InvalidArgument, NotFound, Unauthorized
from corral.schema import TENANT_NAME
from corral.server.caller import (
    ADMIN,
    CALLER_KEY,
    UNIDENTIFIED,
    Caller,
    caller_name,
    caller_of,
    require_admin,
    require_image_rights,
    tenant_of,
)
from corral.server.tenant_model import ADMIN_NAME, Tenant

__all__ = [
    "ADMIN",
    "ADMIN_NAME",
    "CALLER_KEY",
    "Caller",
    "UNIDENTIFIED",
    "caller_name",
    "Tenant",
    "Tenants",
    "TokenStore",
    "caller_of",
    "require_admin",
    "require_image_rights",
    "tenant_of",
]

TOKEN_PREFIX = "crl_"  # tells a corral tenant token apart in a config file or a leak scan

TABLE = """
CREATE TABLE IF NOT EXISTS tenants (
    name TEXT PRIMARY KEY,
    token_sha256 BLOB NOT NULL UNIQUE,
    max_sandboxes INTEGER,
    max_memory_mb INTEGER,
    max_cpus REAL,
    allow_images INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    max_lifetime REAL,
    max_snapshot_mb INTEGER,
    max_builds INTEGER,
    allow_host_network INTEGER NOT NULL DEFAULT 0,
    max_gpus INTEGER
);
CREATE TABLE IF NOT EXISTS revoked_tenants (
    name TEXT PRIMARY KEY,
    revoked_at REAL NOT NULL
);
"""
_COLUMNS = ("name, max_sandboxes, max_memory_mb, max_cpus, allow_images, created_at, "
            "max_lifetime, max_snapshot_mb, max_builds, allow_host_network, max_gpus")
# The quotas `corral token update` may change (None: no quota of the tenant's own)
QUOTAS = ("max_sandboxes", "max_memory_mb", "max_cpus", "max_lifetime", "max_snapshot_mb",
          "max_builds", "max_gpus")
RIGHTS = ("allow_host_network",)  # rights an update may grant or take back
DEFAULT_MAX_BUILDS = 1  # image builds a tenant runs at once, unless its token says


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def check_new_tenant(name: str, **quotas: float | None) -> None:
    """:class:`InvalidArgument` unless ``name`` and ``quotas`` may make a tenant."""
    if not isinstance(name, str) or not re.fullmatch(TENANT_NAME, name) or name == ADMIN_NAME:
        raise InvalidArgument(
            f"invalid tenant name {name!r}: use 1-63 lower-case letters, digits, '-' "
            f"or '_', starting with a letter or digit, not {ADMIN_NAME!r}",
            details={"name": name},
        )
    _check_quotas(quotas)


def check_updates(changes: dict[str, Any]) -> None:
    """:class:`InvalidArgument` unless ``changes`` are new values of :data:`QUOTAS` or
    of :data:`RIGHTS`."""
    unknown = set(changes) - set(QUOTAS) - set(RIGHTS)
    if unknown:
        raise InvalidArgument(
            f"cannot update {sorted(unknown)}: only {', '.join(QUOTAS + RIGHTS)}")
    for right in RIGHTS:
        if right in changes and not isinstance(changes[right], bool):
            raise InvalidArgument(f"{right} must be true or false, got {changes[right]!r}",
                                  details={"field": right})
    _check_quotas({k: v for k, v in changes.items() if k not in RIGHTS})


def new_token() -> str:
    """A fresh tenant token: 256 random bits."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def token_digest(token: str) -> bytes:
    """What a registry keeps of a token: its SHA-256."""
    return _digest(token)


def name_of_revoked(name: str) -> InvalidArgument:
    # ownership is by name: a new tenant of that name would own what is left of
    # the revoked one (sandboxes, snapshots, logs, eval runs)
    return InvalidArgument(
        f"the name {name!r} belonged to a revoked tenant, whose sandboxes, "
        "snapshots and logs may remain: choose another name", details={"name": name})


def name_taken(name: str) -> InvalidArgument:
    return InvalidArgument(
        f"a tenant named {name!r} already exists: revoke it first or choose another "
        "name", details={"name": name},
    )


def no_tenant(name: str) -> NotFound:
    return NotFound(f"no tenant {name!r}: see `corral token ls`", details={"name": name})


class TokenStore:
    """The ``tenants`` table of the registry's database."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db
        self._db.executescript(TABLE)  # the migration: older registries gain the table
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(tenants)")}
        for column, kind in (("max_lifetime", "REAL"), ("max_snapshot_mb", "INTEGER"),
                             ("max_builds", "INTEGER"),
                             ("allow_host_network", "INTEGER NOT NULL DEFAULT 0"),
                             ("max_gpus", "INTEGER")):
            if column not in columns:  # and a table from before it, the column
                self._db.execute(f"ALTER TABLE tenants ADD COLUMN {column} {kind}")

    def create(
        self,
        name: str,
        *,
        max_sandboxes: int | None = None,
        max_memory_mb: int | None = None,
        max_cpus: float | None = None,
        allow_images: bool = False,
        allow_host_network: bool = False,
        max_lifetime: float | None = None,
        max_snapshot_mb: int | None = None,
        max_builds: int | None = None,
        max_gpus: int | None = None,
    ) -> tuple[Tenant, str]:
        """A new tenant and its token (shown once: only its hash is kept)."""
        quotas = {"max_sandboxes": max_sandboxes, "max_memory_mb": max_memory_mb,
                  "max_cpus": max_cpus, "max_lifetime": max_lifetime,
                  "max_snapshot_mb": max_snapshot_mb, "max_builds": max_builds,
                  "max_gpus": max_gpus}
        check_new_tenant(name, **quotas)
        if self._db.execute("SELECT 1 FROM revoked_tenants WHERE name = ?", (name,)).fetchone():
            raise name_of_revoked(name)
        token = new_token()
        tenant = Tenant(name, allow_images=allow_images, created_at=time.time(),
                        allow_host_network=allow_host_network, **quotas)
        try:
            self._db.execute(
                f"INSERT INTO tenants ({_COLUMNS}, token_sha256) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (name, max_sandboxes, max_memory_mb, max_cpus, int(allow_images),
                 tenant.created_at, max_lifetime, max_snapshot_mb, max_builds,
                 int(allow_host_network), max_gpus, _digest(token)),
            )
        except sqlite3.IntegrityError:
            raise name_taken(name) from None
        return tenant, token

    def update(self, name: str, changes: dict[str, Any]) -> Tenant:
        """Set quotas of a tenant (``changes``: names of :data:`QUOTAS`, a value or None
        to drop it); takes effect at its next request. What it holds stays (a lower quota
        refuses only what comes next)."""
        check_updates(changes)
        if self.get(name) is None:
            raise NotFound(f"no tenant {name!r}: see `corral token ls`", details={"name": name})
        if changes:
            sets = ", ".join(f"{k} = ?" for k in changes)  # names checked against QUOTAS
            self._db.execute(f"UPDATE tenants SET {sets} WHERE name = ?",
                             (*changes.values(), name))
        found = self.get(name)
        assert found is not None
        return found

    def list(self) -> list[Tenant]:
        rows = self._db.execute(f"SELECT {_COLUMNS} FROM tenants ORDER BY name").fetchall()
        return [_tenant(r) for r in rows]

    def get(self, name: str) -> Tenant | None:
        row = self._db.execute(f"SELECT {_COLUMNS} FROM tenants WHERE name = ?", (name,)).fetchone()
        return None if row is None else _tenant(row)

    def revoke(self, name: str) -> None:
        """Forget a tenant's token: its next request is 401. Its sandboxes stay (the
        admin sees and deletes them). Its name is never given to another tenant."""
        self._db.execute("SAVEPOINT revoke")  # both statements or neither
        try:
            if self._db.execute("DELETE FROM tenants WHERE name = ?", (name,)).rowcount == 0:
                raise no_tenant(name)
            self._db.execute("INSERT OR REPLACE INTO revoked_tenants VALUES (?, ?)",
                             (name, time.time()))
        except BaseException:
            self._db.execute("ROLLBACK TO revoke")
            self._db.execute("RELEASE revoke")
            raise
        self._db.execute("RELEASE revoke")

    def lookup(self, token: str) -> Tenant | None:
        """The tenant whose token this is, or None. Only the token's hash is looked up."""
        row = self._db.execute(
            f"SELECT {_COLUMNS} FROM tenants WHERE token_sha256 = ?", (_digest(token),)
        ).fetchone()
        return None if row is None else _tenant(row)


def _tenant(row: tuple[Any, ...]) -> Tenant:
    (name, max_sandboxes, max_memory_mb, max_cpus, allow_images, created_at, max_lifetime,
     max_snapshot_mb, max_builds, allow_host_network, max_gpus) = row
    return Tenant(name, max_sandboxes, max_memory_mb, max_cpus, bool(allow_images), created_at,
                  max_lifetime, max_snapshot_mb, max_builds, bool(allow_host_network), max_gpus)


def _check_quotas(quotas: dict[str, Any]) -> None:
    for field, value in quotas.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or value < 0):
            raise InvalidArgument(f"{field} must be a number >= 0, got {value!r}",
                                  details={"field": field})


class TenantStore(Protocol):
    """Where tenants are kept: a daemon's registry (:class:`TokenStore`), or on a Ray
    cluster the cluster's (:class:`corral.server.cluster_tenants.ClusterTokenStore`)."""

    def list(self) -> list[Tenant]: ...

    def get(self, name: str) -> Tenant | None: ...

    def lookup(self, token: str) -> Tenant | None: ...


class Tenants:
    """Who a credential is: the one place the daemon's token and tenant tokens are checked."""

    def __init__(self, store: TenantStore, admin_token: str | None) -> None:
        self.store = store
        self._admin = _digest(admin_token) if admin_token else None

    def identify(self, given: str | None) -> Caller | None:
        """The caller ``given`` authenticates, or None if it is no valid token."""
        if not given:
            return None
        if self._admin is not None and hmac.compare_digest(_digest(given), self._admin):
            return ADMIN
        tenant = self.store.lookup(given)
        return None if tenant is None else Caller.of_tenant(tenant)

    def quota_of(self, name: str | None) -> Tenant | None:
        """A tenant's current quotas (None: the admin's, or a revoked tenant's)."""
        return None if name is None else self.store.get(name)

    def refusal(self) -> Unauthorized:
        """What a credential that is no valid token is told (the store may say why)."""
        why = getattr(self.store, "unavailable", lambda: None)()
        return Unauthorized(why) if why else unauthorized_tenant()


def unauthorized_tenant() -> Unauthorized:
    return Unauthorized(
        "wrong bearer token: send 'Authorization: Bearer TOKEN' with the daemon's token "
        "(--token or CORRAL_TOKEN) or a tenant token from `corral token create` "
        "(revoked tokens are refused)"
    )
