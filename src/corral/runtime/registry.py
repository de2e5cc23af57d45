"""The SQLite registry of sandboxes and snapshots: the engine's memory across restarts.

Snapshot layers are reference-counted here: a layer's ``refcount`` is the number of
snapshots (not deleted) whose chain holds it, plus the number of live sandboxes that
were started from such a chain. Both change in the same transaction as the rows they
count; :meth:`Registry.recount_snapshots` recomputes them from the rows after a restart.

WAL mode with ``synchronous=NORMAL``: a committed transaction survives a crash of the
process (the case that matters: ``kill -9`` of the daemon), at ~50 µs a write.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from corral.runtime import storage
from corral.schema import SandboxInfo, SandboxSpec, SandboxState, SnapshotInfo

SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    state TEXT NOT NULL,
    spec TEXT NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL,
    ended_at REAL,
    reason TEXT,
    pid INTEGER,
    pid_start INTEGER,
    cgroup TEXT
);
CREATE TABLE IF NOT EXISTS tags (
    sandbox_id TEXT NOT NULL REFERENCES sandboxes(id) ON DELETE CASCADE,
    tag TEXT NOT NULL,
    PRIMARY KEY (tag, sandbox_id)
);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS layers (
    id TEXT PRIMARY KEY,
    digest TEXT NOT NULL,
    size INTEGER NOT NULL,
    refcount INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS layers_digest ON layers(digest);
CREATE TABLE IF NOT EXISTS snapshots (
    id TEXT PRIMARY KEY,
    name TEXT,
    image TEXT NOT NULL,
    image_digest TEXT NOT NULL,
    layers TEXT NOT NULL,
    created_at REAL NOT NULL,
    size INTEGER NOT NULL,
    source_sandbox TEXT,
    spec TEXT NOT NULL,
    deleted INTEGER NOT NULL DEFAULT 0,
    users INTEGER NOT NULL DEFAULT 0,
    tenant TEXT NOT NULL DEFAULT ''
);
"""
_SNAPSHOT_COLUMNS = (
    "id, name, image, image_digest, layers, created_at, size, source_sandbox, spec, users"
)
_CHAIN = "id IN (SELECT value FROM json_each(?))"


@dataclass(frozen=True)
class SnapshotRow:
    """A snapshot as stored: its info plus what restoring it needs."""

    id: str
    name: str | None
    image: str
    image_digest: str
    layers: list[str]  # top first
    created_at: float
    size_bytes: int
    source_sandbox: str | None
    spec: SandboxSpec  # of the sandbox it was taken from: defaults for restores
    users: int = 0  # live sandboxes started from it

    def info(self) -> SnapshotInfo:
        return SnapshotInfo(
            id=self.id, name=self.name, image=self.image, layers=self.layers,
            size_bytes=self.size_bytes, created_at=self.created_at,
            source_sandbox=self.source_sandbox,
        )


class Registry:
    """Rows of sandboxes and their tags. One connection, used from one thread."""

    def __init__(self, path: Path) -> None:
        # Root only: rows hold every sandbox's env (secrets included). SQLite gives the
        # -wal and -shm files the database file's mode.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.close(fd)
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.chmod(f"{path}{suffix}", 0o600)
        self._db = sqlite3.connect(  # its "disk is full" is a typed StorageFull
            str(path), isolation_level=None, check_same_thread=False, factory=storage.Connection
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(SCHEMA)
        _names_per_tenant(self._db)
        _hibernation_column(self._db)
        self._seq = int(self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM sandboxes").fetchone()[0])
        self._spec = SpecCache()  # rows' specs, parsed once

    def close(self) -> None:
        self._db.close()

    @property
    def db(self) -> sqlite3.Connection:
        """The connection, for tables another module keeps (the server's tenants)."""
        return self._db

    def insert(self, sandbox_id: str, spec: SandboxSpec, cgroup: str) -> SandboxInfo:
        # Creation order, for listings. Counted here rather than with MAX(seq) per
        # create (a table scan on the create path): one engine owns the state dir.
        self._seq += 1
        seq = self._seq
        now = time.time()
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT INTO sandboxes (id, seq, state, spec, created_at, cgroup) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (sandbox_id, seq, SandboxState.PENDING.value, spec.model_dump_json(), now, cgroup),
            )
            self._db.executemany(
                "INSERT INTO tags (sandbox_id, tag) VALUES (?, ?)",
                [(sandbox_id, t) for t in spec.tags],
            )
        return SandboxInfo(id=sandbox_id, state=SandboxState.PENDING, spec=spec, created_at=now)

    def set_running(self, sandbox_id: str, pid: int, pid_start: int | None) -> float:
        now = time.time()
        self._db.execute(
            "UPDATE sandboxes SET state=?, started_at=?, pid=?, pid_start=? WHERE id=?",
            (SandboxState.RUNNING.value, now, pid, pid_start, sandbox_id),
        )
        return now

    def set_state(self, sandbox_id: str, state: SandboxState, reason: str | None = None) -> None:
        if state.terminal:
            self._db.execute(
                "UPDATE sandboxes SET state=?, reason=COALESCE(?, reason), ended_at=? "
                "WHERE id=?",
                (state.value, reason, time.time(), sandbox_id),
            )
        else:
            self._db.execute(
                "UPDATE sandboxes SET state=?, reason=COALESCE(?, reason) WHERE id=?",
                (state.value, reason, sandbox_id),
            )

    def set_spec(self, sandbox_id: str, spec: SandboxSpec) -> None:
        """Replace a sandbox's stored spec (its tags stay as they were)."""
        self._db.execute(
            "UPDATE sandboxes SET spec=? WHERE id=?", (spec.model_dump_json(), sandbox_id)
        )

    def delete(self, sandbox_id: str) -> None:
        self._db.execute("DELETE FROM sandboxes WHERE id=?", (sandbox_id,))

    def set_hibernated(self, sandbox_id: str, checkpoint: str | None) -> None:
        """The live checkpoint a hibernated sandbox's processes are in (None: awake): what
        the next engine on this state directory resumes it from."""
        self._db.execute("UPDATE sandboxes SET hibernated=? WHERE id=?", (checkpoint, sandbox_id))

    def hibernated_rows(self) -> builtins.list[tuple[str, str]]:
        """(id, checkpoint) of the sandboxes hibernated (paused, their processes in a
        checkpoint): they have no process to adopt or lose."""
        return list(self._db.execute(
            "SELECT id, hibernated FROM sandboxes WHERE hibernated IS NOT NULL AND state=?",
            (SandboxState.PAUSED.value,)))

    def set_created(self, sandbox_id: str, created_at: float) -> None:
        """Keep a resumed sandbox's creation time (its maximum lifetime counts from it)."""
        self._db.execute("UPDATE sandboxes SET created_at=? WHERE id=?", (created_at, sandbox_id))

    def get(self, sandbox_id: str, *, owner: str | None = None) -> SandboxInfo | None:
        """The sandbox of that id; with ``owner`` (a tenant), only if it is that tenant's:
        another's row is then filtered out by SQLite itself, never read or parsed, so it
        costs the same as an id that never existed (no timing tells them apart)."""
        sql = ("SELECT id, state, spec, created_at, started_at, ended_at, reason "
               "FROM sandboxes WHERE id=?")
        if owner is not None:
            sql += " AND json_extract(spec, '$.tenant') IS ?"
        args = (sandbox_id,) if owner is None else (sandbox_id, owner)
        row = self._db.execute(sql, args).fetchone()
        return _info(row, self._spec) if row else None

    def list(
        self, *, tags: Iterable[str] = (), states: Iterable[SandboxState] = ()
    ) -> list[SandboxInfo]:
        sql = (
            "SELECT id, state, spec, created_at, started_at, ended_at, reason FROM sandboxes"
        )
        where, args = [], []
        for t in tags:  # every tag must be present
            where.append("id IN (SELECT sandbox_id FROM tags WHERE tag=?)")
            args.append(t)
        values = [s.value for s in states]
        if values:
            where.append(f"state IN ({','.join('?' * len(values))})")
            args.extend(values)
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY seq"
        return [_info(r, self._spec) for r in self._db.execute(sql, args)]

    def live_rows(self) -> builtins.list[tuple[str, str, int | None, int | None, str]]:
        """(id, state, pid, pid_start, cgroup) of sandboxes not in a terminal state, but
        those hibernated (no process to adopt or lose: :meth:`hibernated_rows`)."""
        return list(
            self._db.execute(
                "SELECT id, state, pid, pid_start, cgroup FROM sandboxes "
                "WHERE state NOT IN ('stopped', 'failed') "
                "AND (hibernated IS NULL OR state != 'paused')"
            )
        )

    def ended_before(self, cutoff: float, limit: int) -> builtins.list[str]:
        """Ids of sandboxes that ended (stopped or failed) before ``cutoff``, oldest first."""
        return [r[0] for r in self._db.execute(
            "SELECT id FROM sandboxes WHERE state IN (?, ?) AND ended_at < ? "
            "ORDER BY ended_at LIMIT ?",
            (SandboxState.STOPPED.value, SandboxState.FAILED.value, cutoff, limit))]

    def counts(self) -> dict[str, int]:
        return dict(self._db.execute("SELECT state, COUNT(*) FROM sandboxes GROUP BY state"))

    # -------------------------------------------------------------- snapshots

    def add_snapshot(self, row: SnapshotRow, layer: tuple[str, str, int], *,
                     below: Sequence[tuple[str, str, int]] = ()) -> None:
        """Insert a snapshot, its new top layer ``(id, digest, size)`` (and ``below``,
        for a snapshot fetched from another node) unless known, and a reference on every
        layer of its chain. ``sqlite3.IntegrityError`` if its owner (``spec.tenant``)
        has a snapshot of that name."""
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany(
                "INSERT OR IGNORE INTO layers (id, digest, size, created_at) VALUES (?, ?, ?, ?)",
                [(*x, row.created_at) for x in (layer, *below)],
            )
            self._db.execute(
                f"INSERT INTO snapshots ({_SNAPSHOT_COLUMNS}, tenant) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?)",
                (row.id, row.name, row.image, row.image_digest, json.dumps(row.layers),
                 row.created_at, row.size_bytes, row.source_sandbox, row.spec.model_dump_json(),
                 row.spec.tenant or ""),
            )
            self._db.execute(
                f"UPDATE layers SET refcount = refcount + 1 WHERE {_CHAIN}",
                (json.dumps(row.layers),),
            )

    def snapshot(self, ref: str, *, include_deleted: bool = False) -> SnapshotRow | None:
        """The snapshot with this id (names: :meth:`named`)."""
        sql = f"SELECT {_SNAPSHOT_COLUMNS} FROM snapshots WHERE id=?"
        if not include_deleted:
            sql += " AND deleted=0"
        row = self._db.execute(sql, (ref,)).fetchone()
        return _snapshot(row) if row else None

    def named(self, name: str) -> builtins.list[SnapshotRow]:
        """The snapshots (not deleted) named ``name``: at most one per owner."""
        return [_snapshot(r) for r in self._db.execute(
            f"SELECT {_SNAPSHOT_COLUMNS} FROM snapshots WHERE name=? AND deleted=0 "
            "ORDER BY created_at", (name,))]

    def snapshots(self) -> builtins.list[SnapshotRow]:
        return [
            _snapshot(r) for r in self._db.execute(
                f"SELECT {_SNAPSHOT_COLUMNS} FROM snapshots WHERE deleted=0 ORDER BY created_at"
            )
        ]

    def layer_rows(self, layer_ids: builtins.list[str]) -> dict[str, tuple[str, int]]:
        """``{id: (digest, size)}`` of the given layers."""
        rows = self._db.execute(
            f"SELECT id, digest, size FROM layers WHERE {_CHAIN}", (json.dumps(layer_ids),)
        )
        return {lid: (digest, size) for lid, digest, size in rows}

    def owner_layers(self, owner: str | None) -> dict[str, int]:
        """``{layer id: size}`` of the layers ``owner``'s snapshots hold (also those
        deleted but still used by a sandbox: their layers are still on disk), each once."""
        return dict(self._db.execute(
            "SELECT DISTINCT layers.id, layers.size FROM snapshots, json_each(snapshots.layers) "
            "JOIN layers ON layers.id = json_each.value WHERE snapshots.tenant = ?",
            (owner or "",)))

    def use_snapshot(self, snapshot_id: str, delta: int) -> bool:
        """A sandbox starts (+1) or stops (-1) using a snapshot: count it on the snapshot
        and its layers; the last user of a deleted snapshot removes its row. Returns
        whether some layer is left unreferenced."""
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "UPDATE snapshots SET users = users + ? WHERE id=?", (delta, snapshot_id)
            )
            self._db.execute(
                f"UPDATE layers SET refcount = refcount + ? WHERE {_CHAIN}",
                (delta, self._chain(snapshot_id)),
            )
            self._db.execute(
                "DELETE FROM snapshots WHERE id=? AND deleted=1 AND users<=0", (snapshot_id,)
            )
        return delta < 0 and self._has_unreferenced()

    def drop_snapshot(self, snapshot_id: str) -> bool:
        """Delete a snapshot: its row goes now, or when its last user ends. Its own
        references go now. Returns whether some layer is left unreferenced."""
        with self._db:
            self._db.execute("BEGIN")
            row = self._db.execute(
                "SELECT layers FROM snapshots WHERE id=? AND deleted=0", (snapshot_id,)
            ).fetchone()
            if row is None:
                return False
            self._db.execute(f"UPDATE layers SET refcount = refcount - 1 WHERE {_CHAIN}", row)
            self._db.execute("UPDATE snapshots SET deleted=1 WHERE id=?", (snapshot_id,))
            self._db.execute("DELETE FROM snapshots WHERE id=? AND users<=0", (snapshot_id,))
        return self._has_unreferenced()

    def unreferenced_layers(self) -> builtins.list[str]:
        return [r[0] for r in self._db.execute("SELECT id FROM layers WHERE refcount<=0")]

    def forget_layer(self, layer_id: str) -> bool:
        """Delete a layer's row if nothing references it (then its files may go)."""
        cur = self._db.execute("DELETE FROM layers WHERE id=? AND refcount<=0", (layer_id,))
        return cur.rowcount == 1

    def pending_layers(self) -> dict[str, str]:
        """``{id: digest}`` of the layers committed but not yet settled (their digest
        :data:`~corral.runtime.layers.PENDING` + a boot id)."""
        return dict(self._db.execute("SELECT id, digest FROM layers WHERE digest LIKE 'pending:%'"))

    def settle_layer(self, layer_id: str, digest: str) -> bool:
        """Record the digest of a pending layer, now hashed and durable; False if its
        row is gone (removed meanwhile) or was settled already."""
        with self._db:
            cur = self._db.execute(
                "UPDATE layers SET digest=? WHERE id=? AND digest LIKE 'pending:%'",
                (digest, layer_id))
        return cur.rowcount == 1

    def drop_layer(self, layer_id: str) -> builtins.list[str]:
        """Forget a layer and every snapshot whose chain holds it (a layer torn by a
        crash of the machine); returns those snapshots' ids. Recount afterwards."""
        with self._db:
            self._db.execute("BEGIN")
            ids = [r[0] for r in self._db.execute(
                "SELECT id FROM snapshots WHERE EXISTS (SELECT 1 FROM json_each(snapshots.layers) "
                "WHERE json_each.value = ?)", (layer_id,))]
            self._db.executemany("DELETE FROM snapshots WHERE id=?", [(i,) for i in ids])
            self._db.execute("DELETE FROM layers WHERE id=?", (layer_id,))
        return ids

    def layer_by_digest(self, digest: str) -> str | None:
        """The id of a settled layer with this digest (a snapshot's layer is named at
        random when committed: :meth:`LayerStore.install_unsealed`), or None."""
        row = self._db.execute("SELECT id FROM layers WHERE digest=? LIMIT 1", (digest,)).fetchone()
        return row[0] if row else None

    def layer_ids(self) -> set[str]:
        return {r[0] for r in self._db.execute("SELECT id FROM layers")}

    def recount_snapshots(self, users: dict[str, int] | None = None) -> None:
        """After a restart only the sandboxes adopted from before are alive (``users``:
        how many use each snapshot): drop the other uses (and deleted snapshots kept
        only for them) and recount every layer's references."""
        users = users or {}
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "DELETE FROM snapshots WHERE deleted=1 AND id NOT IN "
                "(SELECT value FROM json_each(?))", (json.dumps(list(users)),))
            self._db.execute("UPDATE snapshots SET users=0")
            self._db.executemany("UPDATE snapshots SET users=? WHERE id=?",
                                 [(n, sid) for sid, n in users.items()])
            self._db.execute(
                "UPDATE layers SET refcount = (SELECT COUNT(*) FROM snapshots, "
                "json_each(snapshots.layers) WHERE json_each.value = layers.id "
                "AND snapshots.deleted=0) + (SELECT COALESCE(SUM(snapshots.users), 0) "
                "FROM snapshots, json_each(snapshots.layers) "
                "WHERE json_each.value = layers.id)"
            )

    def _chain(self, snapshot_id: str) -> str:
        row = self._db.execute("SELECT layers FROM snapshots WHERE id=?", (snapshot_id,)).fetchone()
        return row[0] if row else "[]"

    def _has_unreferenced(self) -> bool:
        row = self._db.execute("SELECT 1 FROM layers WHERE refcount<=0 LIMIT 1").fetchone()
        return row is not None


def _names_per_tenant(db: sqlite3.Connection) -> None:
    """Snapshot names are unique per owner: a registry made when they were one
    namespace gets the ``tenant`` column (from each row's spec) and the new index."""
    columns = {r[1] for r in db.execute("PRAGMA table_info(snapshots)")}
    with db:
        db.execute("BEGIN")
        if "tenant" not in columns:
            db.execute("ALTER TABLE snapshots ADD COLUMN tenant TEXT NOT NULL DEFAULT ''")
            db.execute("UPDATE snapshots SET tenant = COALESCE(json_extract(spec, '$.tenant'), '')")
        db.execute("DROP INDEX IF EXISTS snapshots_name")
        db.execute("CREATE UNIQUE INDEX IF NOT EXISTS snapshots_tenant_name "
                   "ON snapshots(tenant, name) WHERE deleted = 0")


def _hibernation_column(db: sqlite3.Connection) -> None:
    """A registry made before hibernated sandboxes survived a restart gets the column
    naming each one's checkpoint (engine_hibernate.py)."""
    if "hibernated" not in {r[1] for r in db.execute("PRAGMA table_info(sandboxes)")}:
        db.execute("ALTER TABLE sandboxes ADD COLUMN hibernated TEXT")


MAX_SPECS = 4096  # parsed specs a registry keeps (SpecCache)
MAX_CACHED_SPEC_CHARS = 16 << 10
"""A spec's text longer than this is parsed at each read, never kept: a tenant's
sandboxes with megabytes of environment each would otherwise stay in the daemon's memory
after they ended (tests/security/test_spec_cache_bounds.py). A usual spec is < 1 KB."""
MAX_SPECS_CHARS = 8 << 20  # all kept texts together (each is held twice: text and parse)


class SpecCache:
    """Rows' spec texts and their parses: every ``get`` of a live sandbox (each exec, pool
    acquire, log entry) reads the same row, and parsing it is most of a read's CPU. Keyed
    on the whole text (the tenant is in it), so a parse answers only for the same text; a
    :class:`SandboxSpec` is frozen, so the parsed one is shared. Bounded in entries and
    in characters; large texts are not kept at all."""

    def __init__(self) -> None:
        self._specs: dict[str, SandboxSpec] = {}
        self._chars = 0

    def __call__(self, text: str) -> SandboxSpec:
        spec = self._specs.get(text)
        if spec is not None:
            return spec
        spec = SandboxSpec.model_validate(json.loads(text))
        if len(text) <= MAX_CACHED_SPEC_CHARS:
            if len(self._specs) >= MAX_SPECS or self._chars + len(text) > MAX_SPECS_CHARS:
                self._specs.clear()
                self._chars = 0
            self._specs[text] = spec
            self._chars += len(text)
        return spec


def _info(row: tuple[Any, ...], spec: Callable[[str], SandboxSpec]) -> SandboxInfo:
    sid, state, text, created, started, ended, reason = row
    return SandboxInfo(
        id=sid,
        state=SandboxState(state),
        spec=spec(text),
        created_at=created,
        started_at=started,
        ended_at=ended,
        reason=reason,
    )


def _snapshot(row: tuple[Any, ...]) -> SnapshotRow:
    sid, name, image, image_digest, layers, created, size, source, spec, users = row
    return SnapshotRow(
        id=sid, name=name, image=image, image_digest=image_digest, layers=json.loads(layers),
        created_at=created, size_bytes=size, source_sandbox=source,
        spec=SandboxSpec.model_validate(json.loads(spec)), users=users,
    )
