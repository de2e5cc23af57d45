"""The evaluation cache: finished episodes, keyed by everything that decides them.

A key is the SHA-256 of (policy hash, env spec, seed, episode index, corral version):
an unchanged policy evaluated again on the same seeds runs no sandbox at all, and any
change (one byte of the policy, an env argument, an upgrade of corral, whose runner
might compute returns differently) misses. Only finished episodes (status ``ok``) are
kept: timeouts and infrastructure failures depend on the machine, not the policy.

A cached return is only as good as the policy's determinism: the runner seeds
``random``, numpy's global generator and the action space, but a policy that draws
from ``os.urandom``, the clock or an unseeded generator would have its first result
served forever. So the cache also keeps a verdict per (policy, env, corral version):
the first evaluation that runs episodes re-runs one of them in a second sandbox and
compares the two trajectories (:func:`same_trajectory`). Records are read and written
only for a policy found deterministic; a policy found otherwise is run every time
(``EvalResult.deterministic`` says which), as it is with ``cache=False``.

One SQLite file (WAL, so several evaluations may share it), by default
``$XDG_CACHE_HOME/corral/eval-cache.sqlite`` (``~/.cache/...``).

Environment variables (read only here):

- ``CORRAL_EVAL_CACHE``: the cache file to use by default.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import corral
from corral.errors import InvalidArgument

SCHEMA = """
CREATE TABLE IF NOT EXISTS episodes (
    key TEXT PRIMARY KEY,
    record TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS policies (
    key TEXT PRIMARY KEY,
    deterministic INTEGER NOT NULL,
    created_at REAL NOT NULL
);
"""
BUSY_TIMEOUT_S = 30.0


def default_cache_path() -> Path:
    explicit = os.environ.get("CORRAL_EVAL_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "corral" / "eval-cache.sqlite"


def episode_key(policy_hash: str, env_key: str, seed: int, k: int) -> str:
    material = json.dumps([policy_hash, env_key, seed, k, corral.__version__])
    return hashlib.sha256(material.encode()).hexdigest()


def policy_key(policy_hash: str, env_key: str) -> str:
    """The key of a policy's determinism verdict on an env."""
    return episode_key(policy_hash, env_key, -1, -1)


def same_trajectory(a: Any, b: Any) -> bool | None:
    """Whether two runs of one episode (:class:`~corral.rl.EvalEpisode`) went the same
    way: the same status, return, steps and trajectory digest (and error, if any).
    ``None`` when they cannot tell (a timeout, an infrastructure failure, no digest)."""
    if a.status not in ("ok", "error") or b.status not in ("ok", "error"):
        return None
    if a.digest is None or b.digest is None:
        return None
    fields = ("status", "episode_return", "steps", "digest", "error")
    return all(getattr(a, f) == getattr(b, f) for f in fields)


class EpisodeCache:
    """Records of finished episodes in a SQLite file (created with its directory)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            # A commit per finished sandbox, on the evaluation's event loop: with WAL,
            # NORMAL syncs at checkpoints only (a power cut can lose the last records,
            # never the file), where FULL blocked every episode's loop on an fsync.
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)
            self._db.commit()
        except (OSError, sqlite3.Error) as exc:
            raise InvalidArgument(
                f"cannot use the evaluation cache {str(self.path)!r}: {exc}: pass cache=False, "
                "or another path (cache=PATH, CORRAL_EVAL_CACHE)") from exc

    def get_many(self, keys: Iterable[str]) -> dict[str, dict[str, Any]]:
        keys = list(keys)
        found: dict[str, dict[str, Any]] = {}
        for i in range(0, len(keys), 500):  # SQLite's bound-parameter limit
            chunk = keys[i:i + 500]
            marks = ",".join("?" * len(chunk))
            for key, record in self._db.execute(
                f"SELECT key, record FROM episodes WHERE key IN ({marks})", chunk
            ):
                found[key] = json.loads(record)
        return found

    def put_many(self, items: Iterable[tuple[str, dict[str, Any]]]) -> None:
        now = time.time()
        rows = [(key, json.dumps(record, sort_keys=True), now) for key, record in items]
        if rows:
            with self._db:
                self._db.executemany(
                    "INSERT OR REPLACE INTO episodes (key, record, created_at) VALUES (?, ?, ?)",
                    rows)

    def verdict(self, key: str) -> bool | None:
        """Whether the policy of ``key`` (:func:`policy_key`) was found deterministic;
        ``None`` if it was never checked."""
        row = self._db.execute("SELECT deterministic FROM policies WHERE key = ?",
                               (key,)).fetchone()
        return None if row is None else bool(row[0])

    def put_verdict(self, key: str, deterministic: bool) -> None:
        with self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO policies (key, deterministic, created_at) "
                "VALUES (?, ?, ?)", (key, int(deterministic), time.time()))

    def __len__(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM episodes").fetchone()[0]

    def close(self) -> None:
        self._db.close()
