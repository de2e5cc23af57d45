"""The evaluation cache: finished episodes, keyed by everything that decides them.

A key is the SHA-256 of (policy hash, env spec, seed, episode index, corral version):
an unchanged policy evaluated again on the same seeds runs no sandbox at all, and any
change (one byte of the policy, an env argument, an upgrade of corral, whose runner
might compute returns differently) misses. Only finished episodes (status ``ok``) are
kept: timeouts and infrastructure failures depend on the machine, not the policy.

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
)
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


class EpisodeCache:
    """Records of finished episodes in a SQLite file (created with its directory)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(SCHEMA)
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

    def __len__(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM episodes").fetchone()[0]

    def close(self) -> None:
        self._db.close()
