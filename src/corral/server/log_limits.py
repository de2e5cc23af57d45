"""The daemon's log, rate-limited: a flood of one kind of line becomes a count.

A client that can make the daemon log (a storm of refused connections makes asyncio log
``socket.accept() out of system resource`` with its traceback, thousands of times a
second) must not be able to fill the disk with it. :class:`RepeatFilter`, on the
daemon's log handler, lets through at most :data:`BURST` records of one kind (same
logger, level and message template) per :data:`WINDOW_S` seconds, then drops the rest
and says how many it dropped when the kind next gets through. The per-request access
log (``--log-format json``, :mod:`corral.server.accesslog`) is left whole: it is the
audit trail, one line per request the daemon served.
"""

from __future__ import annotations

import logging
import time

BURST = 20
WINDOW_S = 10.0
MAX_KINDS = 1024  # kinds remembered at once (the oldest windows are dropped first)
EXEMPT = ("corral.access",)


class RepeatFilter(logging.Filter):
    """Drops records of a kind past :data:`BURST` in a :data:`WINDOW_S` window."""

    def __init__(self, burst: int = BURST, window: float = WINDOW_S) -> None:
        super().__init__()
        self.burst = burst
        self.window = window
        self._kinds: dict[tuple[str, int, str], list[float]] = {}  # [start, passed, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name in EXEMPT:
            return True
        key = (record.name, record.levelno, str(record.msg))
        now = time.monotonic()
        kind = self._kinds.get(key)
        if kind is None or now - kind[0] >= self.window:
            dropped = int(kind[2]) if kind is not None else 0
            if kind is None and len(self._kinds) >= MAX_KINDS:
                self._kinds.pop(next(iter(self._kinds)))
            self._kinds.pop(key, None)
            self._kinds[key] = [now, 1, 0]
            if dropped:
                record.msg = f"{record.msg} [{dropped} more like this were not logged]"
            return True
        if kind[1] < self.burst:
            kind[1] += 1
            return True
        kind[2] += 1
        return False
