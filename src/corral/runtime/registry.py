"""The SQLite registry of sandboxes: the engine's memory across restarts.

WAL mode with ``synchronous=NORMAL``: a committed transaction survives a crash of the
process (the case that matters: ``kill -9`` of the daemon), at ~50 µs a write.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Iterable

from corral.schema import SandboxInfo, SandboxSpec, SandboxState

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
"""


class Registry:
    """Rows of sandboxes and their tags. One connection, used from one thread."""

    def __init__(self, path: Path) -> None:
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        self._db.close()

    def next_seq(self) -> int:
        row = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM sandboxes").fetchone()
        return int(row[0])

    def insert(self, sandbox_id: str, seq: int, spec: SandboxSpec, cgroup: str) -> SandboxInfo:
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

    def delete(self, sandbox_id: str) -> None:
        self._db.execute("DELETE FROM sandboxes WHERE id=?", (sandbox_id,))

    def get(self, sandbox_id: str) -> SandboxInfo | None:
        row = self._db.execute(
            "SELECT id, state, spec, created_at, started_at, ended_at, reason "
            "FROM sandboxes WHERE id=?",
            (sandbox_id,),
        ).fetchone()
        return _info(row) if row else None

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
        states = [s.value for s in states]
        if states:
            where.append(f"state IN ({','.join('?' * len(states))})")
            args.extend(states)
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY seq"
        return [_info(r) for r in self._db.execute(sql, args)]

    def live_rows(self) -> list[tuple[str, str, int | None, int | None, str]]:
        """(id, state, pid, pid_start, cgroup) of sandboxes not in a terminal state."""
        return list(
            self._db.execute(
                "SELECT id, state, pid, pid_start, cgroup FROM sandboxes "
                "WHERE state NOT IN ('stopped', 'failed')"
            )
        )

    def counts(self) -> dict[str, int]:
        return dict(self._db.execute("SELECT state, COUNT(*) FROM sandboxes GROUP BY state"))


def _info(row: tuple) -> SandboxInfo:
    sid, state, spec, created, started, ended, reason = row
    return SandboxInfo(
        id=sid,
        state=SandboxState(state),
        spec=SandboxSpec.model_validate(json.loads(spec)),
        created_at=created,
        started_at=started,
        ended_at=ended,
        reason=reason,
    )
