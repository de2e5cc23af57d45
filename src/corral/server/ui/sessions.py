"""The dashboard's logins: a random session id in an HttpOnly cookie, never the token.

A login exchanges the token typed into the form for a session kept in the daemon's
memory (``secrets.token_urlsafe``, 256 bits): the cookie holds only the session id,
and the token stays on the server, where :class:`~corral.server.ui.gate.UiGate` hands
it to the daemon's own guard on each of the session's requests (so a revoked token
ends the session at once, and a tenant token sees what the tenant may). Each session
has its own CSRF token, which every state-changing request must echo in a header.
Bounded: at most :data:`MAX_SESSIONS` (the least recently used give way), each
expiring after :data:`IDLE_TIMEOUT_S` unused or :data:`MAX_AGE_S` in all.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

COOKIE = "corral_session"
CSRF_HEADER = "x-csrf-token"
MAX_SESSIONS = 256
IDLE_TIMEOUT_S = 8 * 3600.0
MAX_AGE_S = 24 * 3600.0


@dataclass
class Session:
    """One browser's login: the token it proved, and its CSRF token."""

    token: str
    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    created: float = field(default_factory=time.monotonic)
    used: float = field(default_factory=time.monotonic)

    def expired(self, now: float) -> bool:
        return now - self.used > IDLE_TIMEOUT_S or now - self.created > MAX_AGE_S

    def csrf_ok(self, sent: str | None) -> bool:
        return sent is not None and hmac.compare_digest(sent.encode(), self.csrf.encode())


class Sessions:
    """The live sessions of one daemon, by id (see the module docstring)."""

    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        self.max_sessions = max_sessions
        self._by_id: OrderedDict[str, Session] = OrderedDict()

    def open(self, token: str) -> tuple[str, Session]:
        """A new session for ``token``: ``(its id, the session)``."""
        sid = secrets.token_urlsafe(32)
        session = self._by_id[sid] = Session(token)
        while len(self._by_id) > self.max_sessions:
            self._by_id.popitem(last=False)
        return sid, session

    def get(self, sid: str | None) -> Session | None:
        """The live session of that id (touching it), or None."""
        if not sid:
            return None
        session = self._by_id.get(sid)
        now = time.monotonic()
        if session is None or session.expired(now):
            self._by_id.pop(sid, None)
            return None
        session.used = now
        self._by_id.move_to_end(sid)
        return session

    def close(self, sid: str | None) -> None:
        if sid:
            self._by_id.pop(sid, None)

    def __len__(self) -> int:
        return len(self._by_id)


def cookie_header(sid: str, *, secure: bool) -> str:
    """``Set-Cookie`` for a session: HttpOnly, SameSite=Strict, only for ``/ui``."""
    flags = "; Secure" if secure else ""
    return f"{COOKIE}={sid}; Path=/ui; HttpOnly; SameSite=Strict{flags}"


def clear_cookie_header(*, secure: bool) -> str:
    flags = "; Secure" if secure else ""
    return f"{COOKIE}=; Path=/ui; Max-Age=0; HttpOnly; SameSite=Strict{flags}"
