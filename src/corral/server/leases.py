"""Client leases: sandboxes that end soon after the client that made them dies.

A client (``Session(lease=30)`` in the SDK) takes a lease with a ``ttl`` and renews it
while its process runs (every ``ttl / 3``); its sandboxes carry the tag
``lease=<id>``. When a lease is not renewed for ``ttl`` seconds (the client was
killed, its host lost its network) the daemon stops every sandbox carrying its tag,
with the reason ``lease expired: ...``, and forgets the lease. Releasing it
(``DELETE /v1/leases/{id}``, when a session closes) ends its sandboxes at once.

Leases are rows of the registry (they survive a daemon restart; after one, every lease
gets a full ``ttl`` again, the time its client needed to reach the new daemon) and are
a tenant's own: another tenant's lease is as if it did not exist, and a sandbox may
carry only a lease tag of its own tenant's (:meth:`Leases.check_tags`).

``--default-lease SECONDS`` makes the SDK take one by default for its sessions over TCP
(``GET /v1/info`` says ``default_lease``): a remote trainer's sandboxes do not outlive
it by their whole lifetime.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import sqlite3
import time
from collections.abc import Sequence

from corral.api.daemon_models import LeaseInfo
from corral.errors import CorralError, InvalidArgument, LeaseNotFound, QuotaExceeded
from corral.runtime.engine import Engine

logger = logging.getLogger("corral.server")

LEASE_TAG_KEY = "lease"
MIN_TTL_S = 1.0
MAX_TTL_S = 86400.0
SWEEP_S = 0.5  # how often expired leases are looked for
MAX_LEASES_PER_TENANT = 1024  # a client takes one per session or reserving pool
SCHEMA = """
CREATE TABLE IF NOT EXISTS leases (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL DEFAULT '',
    ttl REAL NOT NULL,
    expires_at REAL NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS lease_holds (
    lease_id TEXT NOT NULL,
    sandbox_id TEXT NOT NULL,
    PRIMARY KEY (lease_id, sandbox_id)
);
"""




def lease_tag(lease_id: str) -> str:
    """The tag of a lease's sandboxes: ``lease=<id>``."""
    return f"{LEASE_TAG_KEY}={lease_id}"


class Leases:
    """The daemon's leases (a table of its registry) and the sweep that ends theirs."""

    def __init__(self, db: sqlite3.Connection, engine: Engine) -> None:
        self.db = db
        self.engine = engine
        db.executescript(SCHEMA)
        # After a restart every lease gets a full ttl: its client may have been
        # retrying while no daemon answered.
        db.execute("UPDATE leases SET expires_at = ? + ttl", (time.time(),))

    def create(self, tenant: str | None, ttl: float, lease_id: str | None = None) -> LeaseInfo:
        """A new lease; with ``lease_id`` (a cluster's client takes one lease on every
        node under one id) that lease, renewed if this tenant has it already."""
        if not isinstance(ttl, (int, float)) or not math.isfinite(ttl) or \
                not MIN_TTL_S <= ttl <= MAX_TTL_S:
            raise InvalidArgument(
                f"a lease's ttl must be between {MIN_TTL_S:g} and {MAX_TTL_S:g} seconds, "
                f"got {ttl!r}", details={"field": "ttl"})
        if lease_id is not None:
            owner = self.db.execute("SELECT tenant FROM leases WHERE id=?", (lease_id,)).fetchone()
            if owner is not None and owner[0] == (tenant or ""):
                self.db.execute("UPDATE leases SET ttl=? WHERE id=?", (ttl, lease_id))
                return self.renew(tenant, lease_id)
            if owner is not None:
                raise InvalidArgument(f"lease id {lease_id!r} is taken: leave out id for a "
                                      "new one", details={"field": "id"})
        self._check_count(tenant)
        lease_id = lease_id or "lease-" + secrets.token_hex(8)
        now = time.time()
        self.db.execute("INSERT INTO leases (id, tenant, ttl, expires_at, created_at) "
                        "VALUES (?, ?, ?, ?, ?)", (lease_id, tenant or "", ttl, now + ttl, now))
        return LeaseInfo(id=lease_id, tag=lease_tag(lease_id), ttl=ttl, expires_at=now + ttl)

    def _check_count(self, tenant: str | None) -> None:
        """A tenant's leases are rows of the registry, each living up to a day, that the
        sweep scans: a loop of creates must not grow them without bound."""
        if not tenant:
            return  # the admin's
        used = self.db.execute("SELECT COUNT(*) FROM leases WHERE tenant=?",
                               (tenant,)).fetchone()[0]
        if used >= MAX_LEASES_PER_TENANT:
            raise QuotaExceeded(
                f"tenant {tenant!r} holds {used} leases, the most a tenant may: release "
                "those of closed sessions (DELETE /v1/leases/{id}) or let them expire",
                details={"quota": "max_leases", "limit": MAX_LEASES_PER_TENANT,
                         "used": used, "requested": 1, "tenant": tenant})

    def renew(self, tenant: str | None, lease_id: str) -> LeaseInfo:
        ttl = self._ttl(tenant, lease_id)
        expires = time.time() + ttl
        self.db.execute("UPDATE leases SET expires_at=? WHERE id=?", (expires, lease_id))
        return LeaseInfo(id=lease_id, tag=lease_tag(lease_id), ttl=ttl, expires_at=expires)

    async def release(self, tenant: str | None, lease_id: str) -> None:
        """End the lease's sandboxes now and forget it (idempotent)."""
        if self._row(tenant, lease_id) is None:
            return
        await self._end(lease_id, "its lease was released by its client")

    async def end_tenant(self, tenant: str, reason: str) -> int:
        """End every lease of ``tenant`` now (its token was revoked: nothing may renew
        them, and a token issued again under its name must not find them); how many."""
        ids = [r[0] for r in self.db.execute("SELECT id FROM leases WHERE tenant=?", (tenant,))]
        for lease_id in ids:
            await self._end(lease_id, reason)
        return len(ids)

    def hold(self, tenant: str | None, lease_id: str, sandbox_ids: Sequence[str]) -> None:
        """Tie sandboxes handed out to a client's reserve (``pool_reserve``) to its lease:
        they are deleted when it ends. :class:`~corral.errors.LeaseNotFound` if the lease
        is not ``tenant``'s live one (the caller then deletes them itself). Rows of
        sandboxes that are gone are dropped here, so a long lease's rows stay bounded."""
        self._ttl(tenant, lease_id)
        held = [r[0] for r in self.db.execute(
            "SELECT sandbox_id FROM lease_holds WHERE lease_id=?", (lease_id,))]
        gone = [(lease_id, sid) for sid in held if not self._exists(sid)]
        self.db.executemany("DELETE FROM lease_holds WHERE lease_id=? AND sandbox_id=?", gone)
        self.db.executemany("INSERT OR IGNORE INTO lease_holds (lease_id, sandbox_id) "
                            "VALUES (?, ?)", [(lease_id, sid) for sid in sandbox_ids])

    def _exists(self, sandbox_id: str) -> bool:
        try:
            return not self.engine.get(sandbox_id, owner=None).state.terminal
        except CorralError:
            return False

    def check_tags(self, tags: Sequence[str], tenant: str | None) -> None:
        """A sandbox may carry only a live lease's tag, of its own tenant's."""
        for tag in tags:
            key, sep, value = tag.partition("=")
            if sep and key == LEASE_TAG_KEY:
                self._ttl(tenant, value)

    async def run(self) -> None:
        """End the sandboxes of leases not renewed in time (the daemon's task)."""
        while True:
            await asyncio.sleep(SWEEP_S)
            expired = [r[0] for r in self.db.execute(
                "SELECT id FROM leases WHERE expires_at < ?", (time.time(),))]
            for lease_id in expired:
                try:
                    await self._end(lease_id, "lease expired: its client stopped renewing "
                                    "it (the client process died or lost the daemon)")
                except Exception:  # noqa: BLE001 - one lease must not stop the sweep
                    logger.exception("could not end the sandboxes of lease %s", lease_id)

    async def _end(self, lease_id: str, reason: str) -> None:
        row = self.db.execute("SELECT tenant FROM leases WHERE id=?", (lease_id,)).fetchone()
        self.db.execute("DELETE FROM leases WHERE id=?", (lease_id,))
        if row is None:
            return
        tenant = row[0] or None
        doomed = [i for i in self.engine.list(tags=[lease_tag(lease_id)], owner=tenant)
                  if not i.state.terminal and i.spec.tenant == tenant]
        if doomed:
            logger.info("lease %s ended (%s): stopping %d sandboxes", lease_id, reason,
                        len(doomed))
        held = [r[0] for r in self.db.execute(
            "SELECT sandbox_id FROM lease_holds WHERE lease_id=?", (lease_id,))]
        self.db.execute("DELETE FROM lease_holds WHERE lease_id=?", (lease_id,))
        await asyncio.gather(*(self.engine.stop(i.id, grace=0, reason=reason, owner=tenant)
                               for i in doomed), return_exceptions=True)
        # a reserve's pool sandboxes (used or not) are deleted, as after any use; owner=tenant:
        # only the lease's own tenant's, whatever a row says
        await asyncio.gather(*(self.engine.delete(sid, owner=tenant, wait=False) for sid in held),
                             return_exceptions=True)

    def _row(self, tenant: str | None, lease_id: str) -> tuple[float] | None:
        row = self.db.execute("SELECT ttl FROM leases WHERE id=? AND tenant=?",
                              (lease_id, tenant or "")).fetchone()
        return None if row is None else (float(row[0]),)

    def _ttl(self, tenant: str | None, lease_id: str) -> float:
        row = self._row(tenant, lease_id)
        if row is None:
            raise LeaseNotFound(
                f"no lease {lease_id!r}: it expired (its client stopped renewing it) or "
                "never existed; take a new one", details={"lease_id": lease_id})
        return row[0]

