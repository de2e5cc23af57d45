"""Sandbox logs that outlive the sandbox: its commands and its lifecycle, in SQLite.

A :class:`SandboxLogs` listens to the engine's events (:mod:`corral.runtime.events`)
and keeps, per sandbox, the last :data:`MAX_COMMANDS` commands (argv, start and end,
how each ended, the tails of its output: :mod:`corral.runtime.cmdtap`) and the last
:data:`MAX_EVENTS` lifecycle events (ready, restored or forked, paused, stopping, stopped with
its reason, timeout, OOM, deleted). They can be read until the sandbox is deleted, and
for ``retention`` seconds after.

Bounded against a hostile sandbox, which may run a million tiny commands:

- an entry is a few KiB at most (:data:`~corral.runtime.cmdtap.TAIL_BYTES` a stream);
- entries wait in memory (at most :data:`MAX_PENDING`; past that the oldest are dropped
  and counted) and are written in one transaction every :data:`FLUSH_INTERVAL_S`, in a
  thread: a command never waits for the disk;
- each write trims its sandboxes to their rings, each owner (a tenant, or the admin) to
  :data:`MAX_OWNER_BYTES` (its own oldest entries first), and the whole store to
  :data:`MAX_TOTAL_BYTES` (the oldest entries of the owner holding the most first): a
  tenant's flood never pushes out another's logs while it holds more than they do;
- the retention sweep removes at most :data:`SWEEP_BATCH` rows a pass.

Its own database (``logs.db`` next to the registry, mode 0600): the registry's
transactions never wait for a log write.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from corral.runtime.events import (
    CommandEnded,
    Events,
    Forking,
    SandboxDeleted,
    SandboxEnded,
    SandboxStarted,
    StateChanged,
)
from corral.schema import SandboxState

log = logging.getLogger("corral.runtime")

MAX_COMMANDS = 1000  # per sandbox: its last commands
MAX_EVENTS = 200  # per sandbox: its last lifecycle events
MAX_PENDING = 20_000  # entries not yet written, all sandboxes together
MAX_TOTAL_BYTES = 256 << 20  # the whole store; past it the biggest owner's oldest go
MAX_OWNER_BYTES = 64 << 20  # one owner's (tenant's) entries; past it its own oldest go
_TRIM_GUESS = 16 << 10  # bytes an entry is taken for when trimming (entries are smaller)
FLUSH_INTERVAL_S = 0.2
SWEEP_INTERVAL_S = 30.0
SWEEP_BATCH = 5000  # rows removed a sweep at most
DEFAULT_RETENTION_S = 86400.0
MAX_READ = 5000  # entries one read returns at most

SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    seq INTEGER PRIMARY KEY,
    sandbox_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    at REAL NOT NULL,
    size INTEGER NOT NULL,
    data TEXT NOT NULL,
    owner TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS entries_sandbox ON entries(sandbox_id, kind, seq);
CREATE TABLE IF NOT EXISTS deleted (sandbox_id TEXT PRIMARY KEY, at REAL NOT NULL,
                                    owner TEXT);
"""

Entry = tuple[int, str, str, float, str, str]  # seq, sandbox id, kind, time, JSON, owner


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _command(ev: CommandEnded) -> dict[str, Any]:
    return {
        "argv": list(ev.argv), "started_at": ev.started_at, "ended_at": ev.ended_at,
        "outcome": ev.outcome, "exit_code": ev.exit_code,
        "stdout_tail": _text(ev.stdout_tail), "stderr_tail": _text(ev.stderr_tail),
    }


def _ended_event(reason: str) -> str:
    """What kind of end a reason describes (the engine's reasons start with these)."""
    for prefix, name in (("timeout", "timeout"), ("idle timeout", "idle_timeout")):
        if reason.startswith(prefix):
            return name
    if "memory" in reason or "OOM" in reason:
        return "oom"
    return "stopped"


class SandboxLogs:
    """The log store; :meth:`attach` it to an engine's events, :meth:`close` at the end."""

    def __init__(self, path: Path, *, retention: float = DEFAULT_RETENTION_S,
                 owner_of: Callable[[str], str | None] | None = None) -> None:
        self.path = Path(path)
        # a sandbox's tenant (None: the admin's; KeyError: unknown yet, not cached)
        self._owner_of = owner_of or (lambda sandbox_id: None)
        self._owners: dict[str, str] = {}  # sandbox id -> owner ('' the admin), cached
        self.retention = retention
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)  # sandboxes' output: root's only, also if it existed
        os.close(fd)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        if "owner" not in {r[1] for r in self._db.execute("PRAGMA table_info(entries)")} \
                and self._db.execute("SELECT 1 FROM sqlite_master WHERE name='entries'").fetchone():
            self._db.execute("ALTER TABLE entries ADD COLUMN owner TEXT NOT NULL DEFAULT ''")
        self._db.executescript(SCHEMA)
        self._db.execute("CREATE INDEX IF NOT EXISTS entries_owner ON entries(owner, seq)")
        if "owner" not in {r[1] for r in self._db.execute("PRAGMA table_info(deleted)")}:
            self._db.execute("ALTER TABLE deleted ADD COLUMN owner TEXT")  # an older logs.db
        self._lock = threading.Lock()  # one connection, used by the flush thread and readers
        row = self._db.execute("SELECT COALESCE(MAX(seq), 0), COALESCE(SUM(size), 0) "
                               "FROM entries").fetchone()
        self._seq, self._bytes = int(row[0]), int(row[1])
        self._owner_bytes: dict[str, int] = {  # counted from the rows: a restart keeps it
            o: int(n) for o, n in self._db.execute(
                "SELECT owner, SUM(size) FROM entries GROUP BY owner")}
        self._pending: deque[Entry] = deque()
        self._deleted: list[tuple[str, float, str | None]] = []  # id, when, its owner
        self._inflight: list[Entry] = []  # taken from the queue, being written
        self._inflight_deleted: list[tuple[str, float, str | None]] = []
        self.dropped = 0  # entries dropped before they were written (the queue was full)
        self._wake = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None
        self._unsubscribe: list[Any] = []
        self._forking: dict[str, str] = {}  # a fork's snapshot → the sandbox forked
        self._last_sweep = 0.0
        self._sweep_every = min(SWEEP_INTERVAL_S, max(retention, 1.0))
        self.closed = False

    # ---------------------------------------------------------------- writing

    def attach(self, events: Events) -> None:
        for kind, fn in ((CommandEnded, self._on_command), (StateChanged, self._on_state),
                         (SandboxEnded, self._on_ended), (SandboxStarted, self._on_started),
                         (SandboxDeleted, self._on_deleted), (Forking, self._on_forking)):
            self._unsubscribe.append(events.subscribe(kind, fn))

    def detach(self) -> None:
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe.clear()

    def _add(self, sandbox_id: str, kind: str, data: dict[str, Any]) -> None:
        if self.closed:
            return
        self._seq += 1
        self._pending.append((self._seq, sandbox_id, kind, time.time(),
                              json.dumps(data, ensure_ascii=False), self._owner(sandbox_id)))
        if len(self._pending) > MAX_PENDING:
            self._pending.popleft()
            self.dropped += 1
        self._wake.set()
        self._wake = asyncio.Event()
        if self._flusher is None or self._flusher.done():
            with contextlib.suppress(RuntimeError):  # no loop: written at close
                self._flusher = asyncio.get_running_loop().create_task(
                    self._flush_loop(), name="corral-logs")

    def _owner(self, sandbox_id: str) -> str:
        owner = self._owners.get(sandbox_id)
        if owner is None:
            try:
                owner = self._owner_of(sandbox_id) or ""
            except KeyError:  # not known yet: the admin's, asked again next time
                return ""
            self._remember_owner(sandbox_id, owner)
        return owner

    def _remember_owner(self, sandbox_id: str, owner: str) -> None:
        if len(self._owners) >= 4 * MAX_PENDING:  # a bounded cache
            self._owners.clear()
        self._owners[sandbox_id] = owner

    def owner_bytes(self, owner: str | None) -> int:
        """Bytes of log entries written for ``owner``'s sandboxes (None: the admin's)."""
        return self._owner_bytes.get(owner or "", 0)

    def event(self, sandbox_id: str, name: str, **fields: Any) -> None:
        self._add(sandbox_id, "event", {"event": name, **fields})

    def _on_command(self, ev: CommandEnded) -> None:
        self._add(ev.sandbox_id, "command", _command(ev))

    def _on_started(self, ev: SandboxStarted) -> None:
        # its owner, known now: its entries need no registry read on the loop to find it
        self._remember_owner(ev.sandbox_id, ev.tenant or "")
        source = self._forking.get(ev.snapshot) if ev.snapshot else None
        if source is not None:
            self.event(ev.sandbox_id, "forked", source=source)
        elif ev.snapshot:
            self.event(ev.sandbox_id, "restored", snapshot=ev.snapshot)
        self.event(ev.sandbox_id, "ready")

    def _on_forking(self, ev: Forking) -> None:
        if ev.done:
            self._forking.pop(ev.snapshot, None)
        else:
            self._forking[ev.snapshot] = ev.source

    def _on_state(self, ev: StateChanged) -> None:
        if ev.new in (SandboxState.STOPPED, SandboxState.FAILED):
            return  # SandboxEnded says it, with its kind
        self.event(ev.sandbox_id, ev.new.value, reason=ev.reason)

    def _on_ended(self, ev: SandboxEnded) -> None:
        self.event(ev.sandbox_id, _ended_event(ev.reason), state=ev.state.value,
                   reason=ev.reason)

    def _on_deleted(self, ev: SandboxDeleted) -> None:
        self.event(ev.sandbox_id, "deleted")
        self._deleted.append((ev.sandbox_id, time.time(), ev.tenant))
        self._owners.pop(ev.sandbox_id, None)

    async def _flush_loop(self) -> None:
        while not self.closed:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            if not self._pending and not self._deleted:
                if time.monotonic() - self._last_sweep < self._sweep_every:
                    continue
            await self._flush()

    def _take(self) -> tuple[list[Entry], list[tuple[str, float, str | None]]]:
        """What is queued, taken on the event loop (where entries are added): the
        writer thread never touches the queue. Readers still see the batch meanwhile."""
        batch, self._pending = list(self._pending), deque()
        deleted, self._deleted = self._deleted, []
        self._inflight, self._inflight_deleted = batch, deleted
        return batch, deleted

    async def _flush(self) -> None:
        batch, deleted = self._take()
        try:
            await asyncio.to_thread(self._write, batch, deleted)
        except (sqlite3.Error, OSError):  # a full disk: the batch is dropped, not retried
            log.exception("writing sandbox logs failed")
        finally:
            self._inflight, self._inflight_deleted = [], []

    def flush(self) -> None:
        """Write what is queued now, in this thread (tests; the loop uses :meth:`_flush`)."""
        try:
            self._write(*self._take())
        finally:
            self._inflight, self._inflight_deleted = [], []

    def _write(self, batch: list[Entry], deleted: list[tuple[str, float, str | None]]) -> None:
        """Write a batch, trim rings and the total, and sweep (bounded)."""
        with self._lock:
            per_kind: dict[tuple[str, str], int] = {}
            for entry in reversed(batch):  # past a ring, older ones never reach the disk
                key = (entry[1], entry[2])
                per_kind[key] = per_kind.get(key, 0) + 1
            rows = []
            seen: dict[tuple[str, str], int] = {}
            for seq, sid, kind, at, data, owner in batch:
                seen[(sid, kind)] = seen.get((sid, kind), 0) + 1
                if per_kind[(sid, kind)] - seen[(sid, kind)] < _ring(kind):
                    rows.append((seq, sid, kind, at, len(data), data, owner))
            db = self._db
            db.execute("BEGIN")
            try:
                db.executemany("INSERT INTO entries (seq, sandbox_id, kind, at, size, data, "
                               "owner) VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
                for r in rows:
                    self._bytes += r[4]
                    self._owner_bytes[r[6]] = self._owner_bytes.get(r[6], 0) + r[4]
                for sid, kind in per_kind:
                    self._remove(
                        "sandbox_id = ? AND kind = ? AND seq < (SELECT seq FROM entries WHERE "
                        "sandbox_id = ? AND kind = ? ORDER BY seq DESC LIMIT 1 OFFSET ?)",
                        (sid, kind, sid, kind, _ring(kind) - 1))
                db.executemany("INSERT OR REPLACE INTO deleted (sandbox_id, at, owner) "
                               "VALUES (?, ?, ?)", deleted)
                self._trim_owners({r[6] for r in rows})
                if time.monotonic() - self._last_sweep >= self._sweep_every:
                    self._sweep()
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                self._bytes = int(db.execute("SELECT COALESCE(SUM(size), 0) FROM entries")
                                  .fetchone()[0])
                self._owner_bytes = {o: int(n) for o, n in db.execute(
                    "SELECT owner, SUM(size) FROM entries GROUP BY owner")}
                raise

    def _trim_owners(self, written: set[str]) -> None:
        """Each owner that wrote back under :data:`MAX_OWNER_BYTES`, then the store under
        :data:`MAX_TOTAL_BYTES`, taking from the owner holding the most."""
        for owner in written:
            while self._owner_bytes.get(owner, 0) > MAX_OWNER_BYTES:
                if not self._remove_oldest(owner, self._owner_bytes[owner] - MAX_OWNER_BYTES):
                    break
        while self._bytes > MAX_TOTAL_BYTES and self._owner_bytes:
            owner = max(self._owner_bytes, key=self._owner_bytes.__getitem__)
            if not self._remove_oldest(owner, self._bytes - MAX_TOTAL_BYTES):
                break

    def _remove_oldest(self, owner: str, excess: int) -> int:
        n = max(1, min(500, excess // _TRIM_GUESS + 1))
        return self._remove(
            "seq IN (SELECT seq FROM entries WHERE owner = ? ORDER BY seq LIMIT ?)", (owner, n))

    def _remove(self, where: str, args: tuple[Any, ...]) -> int:
        gone = self._db.execute(f"DELETE FROM entries WHERE {where} RETURNING size, owner",
                                args).fetchall()
        for size, owner in gone:
            self._bytes -= size
            left = self._owner_bytes.get(owner, 0) - size
            if left > 0:
                self._owner_bytes[owner] = left
            else:
                self._owner_bytes.pop(owner, None)
        return len(gone)

    def _sweep(self) -> None:
        """Forget sandboxes deleted more than ``retention`` ago: a bounded batch a pass."""
        self._last_sweep = time.monotonic()
        cutoff = time.time() - self.retention
        gone = [sid for (sid,) in self._db.execute(
            "SELECT sandbox_id FROM deleted WHERE at < ? LIMIT 100", (cutoff,))]
        left = SWEEP_BATCH
        for sid in gone:
            left -= self._remove(
                "seq IN (SELECT seq FROM entries WHERE sandbox_id = ? LIMIT ?)", (sid, left))
            if left <= 0:
                self._last_sweep = 0.0  # more to do: the next flush goes on
                break
            self._db.execute("DELETE FROM deleted WHERE sandbox_id = ?", (sid,))

    # ---------------------------------------------------------------- reading

    def read(self, sandbox_id: str, after: int = 0, limit: int = MAX_READ) -> list[dict[str, Any]]:
        """Entries of a sandbox after ``after`` (a ``seq``), oldest first: written ones,
        then those still queued."""
        limit = max(1, min(limit, MAX_READ))
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, kind, at, data FROM entries WHERE sandbox_id = ? AND seq > ? "
                "ORDER BY seq LIMIT ?", (sandbox_id, after, limit)).fetchall()
            queued = [(e[0], e[2], e[3], e[4]) for e in (*self._inflight, *self._pending)
                      if e[1] == sandbox_id and e[0] > after]
        seen = {r[0] for r in rows}
        rows += [q for q in queued if q[0] not in seen]
        rows.sort()
        return [{"seq": seq, "kind": kind, "at": at, **json.loads(data)}
                for seq, kind, at, data in rows[:limit]]

    def known(self, sandbox_id: str) -> bool:
        """Whether anything of this sandbox is kept (a deleted one, within retention)."""
        if any(e[1] == sandbox_id for e in (*self._inflight, *self._pending)):
            return True
        with self._lock:
            return self._db.execute("SELECT 1 FROM entries WHERE sandbox_id = ? LIMIT 1",
                                    (sandbox_id,)).fetchone() is not None

    def deleted_owner(self, sandbox_id: str) -> tuple[bool, str | None]:
        """``(True, owner)`` if this sandbox was deleted and its logs are kept (owner
        None: the admin's), else ``(False, None)``."""
        for sid, _, owner in reversed([*self._inflight_deleted, *self._deleted]):
            if sid == sandbox_id:
                return True, owner
        with self._lock:
            row = self._db.execute("SELECT owner FROM deleted WHERE sandbox_id = ?",
                                   (sandbox_id,)).fetchone()
        return (True, row[0]) if row is not None else (False, None)

    async def wait(self, timeout: float) -> None:
        """Until something new is logged (or ``timeout`` seconds pass)."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    def stats(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
        return {"rows": rows, "bytes": self._bytes, "pending": len(self._pending),
                "dropped": self.dropped}

    async def close(self) -> None:
        """Write what is queued and close (idempotent)."""
        if self.closed:
            return
        self.detach()
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._flusher
        await self._flush()
        self.closed = True
        self._wake.set()
        with self._lock:
            self._db.close()


def _ring(kind: str) -> int:
    return MAX_COMMANDS if kind == "command" else MAX_EVENTS
